"""Sharding rules: matrix family (being written; registers nothing yet)."""
