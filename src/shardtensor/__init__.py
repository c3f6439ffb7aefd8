"""shardtensor: distributed tensors for PyTorch, with `torch.distributed.tensor`'s public names.

>>> from shardtensor import init_device_mesh, distribute_tensor, Shard  # doctest: +SKIP
>>> mesh = init_device_mesh("cpu", (2,))  # doctest: +SKIP
>>> distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])  # doctest: +SKIP
"""

# The one place the version is written: pyproject.toml reads this literal (dynamic version).
__version__ = "0.1.0"

from .api import distribute_module, distribute_tensor, empty, full, linspace, logspace, ones, rand, randn, zeros
from .dtensor import DTensor
from .mesh import DeviceMesh, init_device_mesh
from .modes import explicit_communication, strict_mode, trusted_indices
from .placement import NormPartial, Partial, Placement, Replicate, Shard
from .random import manual_seed
from .scatter import scatter_tensor

__all__ = [
    "DTensor",
    "DeviceMesh",
    "init_device_mesh",
    "Shard",
    "Replicate",
    "Partial",
    "NormPartial",
    "Placement",
    "distribute_tensor",
    "distribute_module",
    "scatter_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "linspace",
    "logspace",
    "rand",
    "randn",
    "manual_seed",
    "strict_mode",
    "explicit_communication",
    "trusted_indices",
]
