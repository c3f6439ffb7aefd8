"""Point-to-point transfers between global ranks: `send`, `recv`, and `batch_p2p` of `PointToPoint` operations."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..mesh import DeviceMesh
from .handles import CommHandle, _identity
from .peers import MeshDims, _names
from .records import _record
from .c10d import refuse_point_to_point
from .wire import _nbytes, _wire

__all__ = ["send", "recv", "PointToPoint", "batch_p2p"]


def send(tensor: torch.Tensor, dst_global_rank: int) -> None:
    """Send `tensor` to global rank `dst_global_rank` (blocking)."""
    refuse_point_to_point("send")
    buffer = _wire(tensor.contiguous())
    _record("send", None, 2, _nbytes(buffer), 0)
    dist.send(buffer, dst=dst_global_rank)


def recv(shape: Sequence[int], dtype: torch.dtype, src_global_rank: int, *, device: str | torch.device) -> torch.Tensor:
    """Receive a tensor of `shape` and `dtype` from global rank `src_global_rank` (blocking) into a buffer on
    `device`: the receiver's device for that data, which the backend must reach (gloo: cpu, nccl: cuda)."""
    refuse_point_to_point("recv")
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    _record("recv", None, 2, 0, _nbytes(buffer))
    dist.recv(_wire(buffer), src=src_global_rank)
    return buffer


@dataclasses.dataclass(frozen=True, slots=True)
class PointToPoint:
    """One operation for `batch_p2p`: kind "send" or "recv", the tensor (a buffer for recv), the global peer."""

    kind: str
    tensor: torch.Tensor
    peer: int

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"PointToPoint kind must be 'send' or 'recv', got {self.kind!r}")


def batch_p2p(operations: Sequence[PointToPoint], *, async_op: bool = False, mesh: DeviceMesh | None = None,
              mesh_dim: MeshDims | None = None):
    """Run sends and receives together (no ordering deadlocks); returns the received tensors in order.

    With `mesh` and `mesh_dim` (a mesh dim, or a tuple of them), the caller says every peer lies along
    that mesh dim through this rank (a halo or a ring over mesh dim 1): the record holds the mesh dim
    and its names, as a collective's does, instead of None (peers anywhere: a cross-mesh move).
    """
    if not operations:
        return _identity([], async_op)
    refuse_point_to_point("batch_p2p")
    operations = [
        dataclasses.replace(operation, tensor=operation.tensor.contiguous()) if operation.kind == "send" else operation
        for operation in operations
    ]
    for operation in operations:
        if operation.kind == "recv" and not operation.tensor.is_contiguous():
            raise ValueError("batch_p2p: a recv buffer must be contiguous; allocate it with torch.empty(shape)")
    c10d_operations = [
        dist.P2POp(dist.isend if operation.kind == "send" else dist.irecv, _wire(operation.tensor), operation.peer)
        for operation in operations
    ]
    sent = sum(_nbytes(operation.tensor) for operation in operations if operation.kind == "send")
    received = sum(_nbytes(operation.tensor) for operation in operations if operation.kind == "recv")
    mesh_dim, names = _along(mesh, mesh_dim)
    _record("batch_p2p", mesh_dim, 2, sent, received, names)
    works = dist.batch_isend_irecv(c10d_operations)
    results = [operation.tensor for operation in operations if operation.kind == "recv"]
    if async_op:
        return CommHandle(works, lambda: results)
    for work in works:
        work.wait()
    return results


def _along(mesh: DeviceMesh | None, mesh_dim: MeshDims | None) -> tuple:
    """(mesh dim, mesh dim names) of a point-to-point record: None and None without a mesh; a tuple of
    mesh dims for several, one index for one."""
    if mesh is None:
        return None, None
    indices = tuple(mesh._mesh_dim_index(name) for name in (mesh_dim if isinstance(mesh_dim, tuple) else (mesh_dim,)))
    return (indices[0] if len(indices) == 1 else indices), _names(mesh, indices)
