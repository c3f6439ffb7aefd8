"""A world that does not exist: one rank of a fake process group (no communication) running on fake tensors
(shapes, no data), with a live-bytes counter on top.

torch's fake process group (`dist.init_process_group("fake", ...)`, any world size) completes every
collective at once without touching data; `FakeTensorMode` gives tensors shapes, dtypes and storages
sizes but no memory. What fake tensors cannot answer is a value: `ShapeOnly` answers every read of a
scalar (`.item()`, a bool test) with zero (False), so value checks pass and the program goes on as if
every value were valid. Ops whose tensor inputs are all real tensors made outside the forecast (the
mesh's rank arithmetic) run for real: those are metadata, not data.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from ..mesh import DeviceMesh, init_device_mesh
from ..process_groups import release_process_groups
from .memory import LiveBytes

__all__ = ["ShapeOnly", "fake_world"]

_aten = torch.ops.aten
# Reads of one value (`.item()`, `int(t)`, `bool(t)`, ...): answered with zero (False).
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default}
_BOOLEAN_READS = {_aten.is_nonzero.default}


class ShapeOnly(LiveBytes):
    """`LiveBytes` over fake tensors: scalar reads answer zero, ops on real tensors alone run for real."""

    def _run(self, func, args, kwargs):
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        if tensors and not any(isinstance(tensor, FakeTensor) for tensor in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _BOOLEAN_READS:
            return False
        if func in _SCALAR_READS:
            return _zero_of(tensors[0].dtype)
        return func(*args, **kwargs)

    def _add(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, FakeTensor):
            super()._add(tensor)


def _zero_of(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0


def _world_error(problem: str) -> RuntimeError:
    return RuntimeError(
        f"forecast: {problem}. A forecast runs as one rank of a fake world it creates itself, so it needs a "
        "process without a default process group: run it in a fresh process (`python -m shardtensor.forecast`) "
        "or call torch.distributed.destroy_process_group() first."
    )


@contextlib.contextmanager
def fake_world(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str], rank: int):
    """Yield (mesh, mode): `rank`'s mesh in a fake world of prod(mesh_shape) ranks and the entered
    `ShapeOnly` mode over a `FakeTensorMode`; the world is destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    world_size = math.prod(mesh_shape)
    if dist.is_initialized():
        raise _world_error(f"a default process group exists already (world of {dist.get_world_size()})")
    if not 0 <= rank < world_size:
        raise ValueError(f"forecast: rank {rank} is outside the world of {world_size} ranks of mesh {tuple(mesh_shape)}; "
                         f"choose a rank in [0, {world_size})")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh: DeviceMesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))
        with FakeTensorMode(allow_non_fake_inputs=True), ShapeOnly() as mode, warnings.catch_warnings():
            # comparing storages by data pointer (distribute_tensor) is harmless on fake tensors
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield mesh, mode
    finally:
        release_process_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
