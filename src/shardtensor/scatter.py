"""`scatter_tensor`: split a tensor that only one rank holds over a mesh (PhysicsNeMo ShardTensor's call).

`distribute_tensor` takes a tensor of the full shape on every rank. Here only `global_src` holds the
data (data loaded by one process) and the others pass None: the source's shape and dtype are broadcast
as one small object, then one scatter over the whole mesh (`comm.scatter` over its flattened mesh dims)
sends each rank exactly its shard, so a rank other than the source never holds more than its shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from . import comm
from .api import _box
from .dtensor import DTensor
from .from_local import check_dense
from .layout import Layout
from .mesh import DeviceMesh
from .placement import Placement, check_partial_dtype
from .spec import DTensorSpec, contiguous_stride

__all__ = ["scatter_tensor"]


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> DTensor:
    """The DTensor of `tensor`, held by global rank `global_src` only, laid out by `placements`.

    Every rank of the mesh calls it; ranks other than `global_src` pass None (a tensor they pass is
    not read). Each rank receives only its shard (uneven shards exact: `torch.chunk`'s), in one
    scatter over the mesh; the source's shape and dtype are broadcast first (a small object), and
    `global_shape` and `dtype`, when given, are checked against them on every rank. A rank outside
    the mesh takes no part and must pass `global_shape` and `dtype`; it gets a shard without
    elements. The result is a leaf that requires grad if `requires_grad`.

    >>> x = scatter_tensor(torch.arange(6.0) if rank == 0 else None, 0, mesh, [Shard(0)])  # doctest: +SKIP
    >>> x.to_local()  # on rank 1 of 2
    tensor([3., 4., 5.])
    """
    placements = tuple(placements)
    ranks = mesh.mesh.flatten().tolist()
    if type(global_src) is not int or global_src not in ranks:
        raise ValueError(
            f"scatter_tensor: global_src={global_src!r} is not a global rank of {mesh!r}; pass the global "
            f"rank (an int among {ranks}) that holds the tensor"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return _outside_mesh(mesh, placements, global_shape, dtype, requires_grad)
    mesh_dims = 0 if mesh.ndim == 1 else tuple(range(mesh.ndim))
    source = ranks.index(global_src)
    is_source = mesh.get_rank() == global_src
    described = comm.broadcast_object(_described(tensor, mesh, placements) if is_source else None, mesh, mesh_dims,
                                      src=source)
    if isinstance(described, str):  # the source's tensor was refused: every rank raises its message
        raise ValueError(described)
    shape, source_dtype = described
    _check_given(shape, source_dtype, global_shape, dtype, global_src)
    layout = Layout.create(mesh.shape, placements, shape)
    pieces = None
    if is_source:
        data = tensor.detach()
        if data.device.type != mesh.device_type:
            data = data.to(mesh.device_type)
        pieces = [_box(data, layout.local_offset(where), layout.local_shape(where)) for where in _coordinates(mesh)]
    local = comm.scatter(pieces, mesh, mesh_dims, src=source, shape=layout.local_shape(coordinate), dtype=source_dtype)
    if is_source:  # the source's own piece is a view of the caller's tensor
        local = local.clone(memory_format=torch.contiguous_format)
    local = layout.operand_of(local, coordinate)
    spec = DTensorSpec(mesh, layout, contiguous_stride(shape), source_dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def _described(tensor, mesh: DeviceMesh, placements) -> tuple[tuple[int, ...], torch.dtype] | str:
    """(shape, dtype) of the source's tensor, or the message every rank raises when it is refused."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor):
        return (f"scatter_tensor: the source rank {mesh.get_rank()} passed {type(tensor).__name__}; the rank "
                f"global_src must pass the plain torch.Tensor to scatter (the other ranks pass None)")
    try:
        check_dense(tensor, "scatter_tensor")
        layout = Layout.create(mesh.shape, placements, tensor.shape)
        check_partial_dtype(layout.placements, tensor.dtype, "scatter_tensor")
    except (TypeError, ValueError) as error:
        return str(error)
    return tuple(tensor.shape), tensor.dtype


def _check_given(shape, source_dtype, global_shape, dtype, global_src: int) -> None:
    if global_shape is not None and tuple(global_shape) != tuple(shape):
        raise ValueError(
            f"scatter_tensor: global_shape={tuple(global_shape)} but the tensor on global_src={global_src} has "
            f"shape {tuple(shape)}; pass the source's shape, or None to take it from the source"
        )
    if dtype is not None and dtype != source_dtype:
        raise ValueError(
            f"scatter_tensor: dtype={dtype} but the tensor on global_src={global_src} has dtype {source_dtype}; "
            f"pass the source's dtype, or None to take it from the source"
        )


def _outside_mesh(mesh, placements, global_shape, dtype, requires_grad) -> DTensor:
    """A rank outside the mesh cannot hear the source: it must be told the shape and dtype."""
    if global_shape is None or dtype is None:
        raise ValueError(
            f"scatter_tensor: rank {mesh.get_rank()} is not in {mesh!r}, so it cannot receive the source's "
            f"shape and dtype; pass global_shape and dtype on ranks outside the mesh"
        )
    layout = Layout.create(mesh.shape, placements, global_shape)
    local = torch.empty((0,) * max(len(layout.shape), 1), dtype=dtype, device=mesh.device_type)
    spec = DTensorSpec(mesh, layout, contiguous_stride(layout.shape), dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def _coordinates(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Every mesh coordinate, row-major: the order of the flattened mesh dims `comm.scatter` uses."""
    return list(itertools.product(*(range(size) for size in mesh.shape)))
