"""Sharding rules: views family (being written; registers nothing yet)."""
