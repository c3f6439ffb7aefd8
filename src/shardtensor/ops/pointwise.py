"""Sharding rules: pointwise family (being written; registers nothing yet)."""
