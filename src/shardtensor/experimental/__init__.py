"""Experimental public API, built on the core layers (never imported by them)."""

from .context_parallel import context_parallel, context_parallel_unshard, set_rotate_method
from .halo_map import halo_map
from .implicit_replication import implicit_replication
from .local_map import local_map
from .register_sharding import register_sharding

__all__ = [
    "context_parallel", "context_parallel_unshard", "set_rotate_method",
    "halo_map", "implicit_replication", "local_map", "register_sharding",
]
