"""Sharding rules per op family, collected in one registry (`ops.registry.RULES`)."""
