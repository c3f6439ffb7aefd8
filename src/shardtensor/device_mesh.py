"""Alias of `shardtensor.mesh` under PyTorch's module name (`torch.distributed.device_mesh`)."""

from .mesh import DeviceMesh, init_device_mesh

__all__ = ["init_device_mesh", "DeviceMesh"]
