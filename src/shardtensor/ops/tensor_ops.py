"""Sharding rules: tensor_ops family (being written; registers nothing yet)."""
