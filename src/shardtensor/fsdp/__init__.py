"""Sharded data parallel (FSDP2's `fully_shard`) on shardtensor DTensors, with exact uneven shards.

Modules: `policies` (mixed precision, offload), `slots` (how a unit cuts its parameters), `reduction`
(a unit's gradients, reduce-scattered), `unit` (one unit's parameters and flat buffers), `hooks`
(forward/backward hooks, prefetching), `api` (`fully_shard`, `FSDPModule`).
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
]
