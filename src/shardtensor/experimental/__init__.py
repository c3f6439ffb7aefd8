"""Experimental public API, built on the core layers (never imported by them)."""

from .implicit_replication import implicit_replication
from .local_map import local_map
from .register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
