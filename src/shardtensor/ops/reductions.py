"""Sharding rules: reductions family (being written; registers nothing yet)."""
