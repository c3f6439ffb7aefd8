"""Alias of `shardtensor.placement` under PyTorch's module name (`torch.distributed.tensor.placement_types`)."""

from .placement import NormPartial, Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial", "NormPartial"]
