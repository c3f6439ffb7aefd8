"""Sharding rules: nn family (being written; registers nothing yet)."""
