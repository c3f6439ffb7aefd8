"""Sharding rules: random_ops family (being written; registers nothing yet)."""
