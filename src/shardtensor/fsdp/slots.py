"""How a sharded-data-parallel unit cuts its parameters: which ones it manages, the tensor dim and
exact `torch.chunk` pieces of each (uneven and empty pieces included, never padded), and where every
piece sits in the unit's flat buffers.

`ParameterSlot` records that for one parameter; `cut_parameters` computes the slots of a unit and this
rank's pieces. The cut is decided once, at `fully_shard` time, from layouts alone; `unit` then owns the
buffers and moves data through them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..dtensor import DTensor
from ..layout import Layout
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from ..spec import DTensorSpec, contiguous_stride

__all__ = ["ParameterSlot", "cut_parameters", "managed_parameters", "unit_error"]


@dataclass(frozen=True, slots=True)
class ParameterSlot:
    """One managed parameter: where it is registered, how it is cut, where its elements sit.

    `unsharded_shape` is what the module computes with (the global shape, or the tensor-parallel
    local shape when the parameter was a DTensor on other mesh dims); `piece_sizes[c]` is the size
    on `dim` of data-parallel coordinate c's piece of it.
    """

    locations: tuple[tuple[nn.Module, str], ...]
    dim: int
    unsharded_shape: tuple[int, ...]
    piece_sizes: tuple[int, ...]
    unsharded_offset: int
    gathered_offsets: tuple[int, ...]  # per coordinate: first element of this parameter's piece
    sharded_spec: DTensorSpec
    unsharded_spec: DTensorSpec | None  # tensor-parallel parameters: their layout without the data-parallel dims

    @property
    def numel(self) -> int:
        return math.prod(self.unsharded_shape)

    def piece_shape(self, coordinate: int) -> tuple[int, ...]:
        shape = list(self.unsharded_shape)
        shape[self.dim] = self.piece_sizes[coordinate]
        return tuple(shape)

    def piece_numel(self, coordinate: int) -> int:
        return math.prod(self.piece_shape(coordinate))

    def piece_start(self, coordinate: int) -> int:
        return sum(self.piece_sizes[:coordinate])


def unit_error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"fully_shard: {problem}; {allowed}")


def managed_parameters(modules: Sequence[nn.Module], ignored: set[int], is_managed: Callable[[nn.Module], bool]):
    """(module, name, parameter) of every parameter under `modules`, skipping the parameters whose id is
    in `ignored` and the subtrees of modules already managed by another unit (`is_managed`)."""
    found = []

    def visit(module: nn.Module, top: bool) -> None:
        if not top and is_managed(module):
            return
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in ignored:
                found.append((module, name, parameter))
        for child in module.children():
            visit(child, False)

    for module in modules:
        visit(module, True)
    return found


def _lines_from_root(data_parallel: DeviceMesh, tensor_parallel: DeviceMesh) -> torch.Tensor | None:
    """The combined mesh's ranks without communication when both meshes are slices of one root mesh
    (`mesh["dp"]`, `mesh["tp"]`): the root's ranks over the data-parallel dims then the tensor-parallel
    ones, at this rank's coordinate on the others. None when they are not (then the lines are gathered)."""
    root = data_parallel._root
    if root is None or tensor_parallel._root is not root:
        return None
    kept = [root_dim for mesh in (data_parallel, tensor_parallel) for span in mesh._root_dims for root_dim in span]
    others = [root_dim for root_dim in range(root.ndim) if root_dim not in kept]
    coordinate = root.get_coordinate()
    ranks = root.mesh.permute(kept + others)[(Ellipsis, *(coordinate[root_dim] for root_dim in others))]
    return ranks.reshape(*data_parallel.shape, *tensor_parallel.shape).clone()


def combined_mesh(data_parallel: DeviceMesh, tensor_parallel: DeviceMesh) -> DeviceMesh:
    """The mesh with the data-parallel mesh dims first and the tensor-parallel ones after.

    Each rank knows only the two lines through it, so the ranks of the data-parallel line share
    their tensor-parallel lines once (one object all-gather at `fully_shard` time), unless both meshes
    were sliced from one root mesh, which holds every line.
    """
    if set(data_parallel.mesh.flatten().tolist()) & set(tensor_parallel.mesh.flatten().tolist()) != {data_parallel.get_rank()}:
        raise unit_error(
            f"the data-parallel mesh {data_parallel!r} and the mesh {tensor_parallel!r} of a DTensor parameter share "
            f"ranks other than this one",
            "shard with the mesh dims that the parameter's mesh does not use, e.g. mesh['dp'] after parallelize_module "
            "on mesh['tp']",
        )
    ranks = _lines_from_root(data_parallel, tensor_parallel)
    if ranks is None:
        lines = comm.all_gather_object(tensor_parallel.mesh.tolist(), data_parallel, None)
        ranks = torch.tensor(lines, dtype=torch.int64, device="cpu").view(*data_parallel.shape, *tensor_parallel.shape)
    names = None
    if data_parallel.mesh_dim_names is not None and tensor_parallel.mesh_dim_names is not None:
        names = data_parallel.mesh_dim_names + tensor_parallel.mesh_dim_names
    return DeviceMesh(data_parallel.device_type, ranks, mesh_dim_names=names)


def _sharded_layout(parameter: torch.Tensor, mesh: DeviceMesh, dim: int) -> Layout:
    """The parameter's layout with the data-parallel mesh dims in front and `dim` split innermost on the last."""
    data_parallel_dims = mesh.ndim
    if isinstance(parameter, DTensor):
        inner = parameter.sharding
        shifted_order = tuple(tuple(mesh_dim + data_parallel_dims for mesh_dim in order) for order in inner.shard_order)
        layout = Layout(tuple(mesh.shape) + inner.mesh_shape, (Replicate(),) * data_parallel_dims + inner.placements,
                        inner.shape, shifted_order, inner.pieces)
    else:
        layout = Layout.create(mesh.shape, (Replicate(),) * data_parallel_dims, parameter.shape)
    return layout.transition(data_parallel_dims - 1, Shard(dim))


def _shard_dim(parameter, shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None, name: str) -> int:
    placement = shard_placement_fn(parameter) if shard_placement_fn is not None else None
    placement = Shard(0) if placement is None else placement
    if not isinstance(placement, Shard):
        raise unit_error(f"shard_placement_fn returned {placement!r} for parameter {name!r}",
                         "return Shard(dim) for a tensor dim of the parameter, or None for Shard(0)")
    if parameter.ndim == 0 or not -parameter.ndim <= placement.dim < parameter.ndim:
        raise unit_error(f"parameter {name!r} of shape {tuple(parameter.shape)} cannot be sharded with {placement!r}",
                         "0-d parameters cannot be sharded (list them in ignored_params); other parameters take "
                         "Shard(dim) with -ndim <= dim < ndim")
    return placement.dim % parameter.ndim


def cut_parameters(
    parameters: Iterable[tuple[torch.Tensor, list[tuple[nn.Module, str]]]],
    mesh: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
    compute_dtype: torch.dtype,
) -> tuple[list[ParameterSlot], list[torch.Tensor], tuple[int, ...]]:
    """The slot of each (parameter, its locations), this rank's piece of each (a contiguous copy), and
    the unit's segment sizes: the elements each data-parallel coordinate sends in the all-gather.

    The gathered buffer is coordinate-major (segment after segment), the unsharded buffer parameter-major.
    Collective for tensor-parallel parameters: one object all-gather per distinct mesh (`combined_mesh`).
    """
    shard_mesh_dim = mesh.ndim - 1
    size = mesh.size(shard_mesh_dim)
    this_coordinate = mesh.get_local_rank(shard_mesh_dim)
    meshes: dict[DeviceMesh, DeviceMesh] = {}
    layouts = []
    for parameter, locations in parameters:
        dim = _shard_dim(parameter, shard_placement_fn, locations[0][1])
        full_mesh = mesh
        if isinstance(parameter, DTensor):
            if parameter.device_mesh not in meshes:
                meshes[parameter.device_mesh] = combined_mesh(mesh, parameter.device_mesh)
            full_mesh = meshes[parameter.device_mesh]
        layout = _sharded_layout(parameter, mesh, dim)
        layouts.append((parameter, locations, dim, full_mesh, layout))
    segment_sizes = [0] * size
    unsharded_offset = 0
    pending_slots = []
    for parameter, locations, dim, full_mesh, layout in layouts:
        coordinate = full_mesh.get_coordinate()
        piece_sizes = tuple(layout.sizes_along(shard_mesh_dim, dim, coordinate))
        with torch.no_grad():
            whole = parameter.to_local() if isinstance(parameter, DTensor) else parameter.detach()
        unsharded_shape = tuple(whole.shape)
        gathered_offsets = []
        row = math.prod(unsharded_shape) // max(unsharded_shape[dim], 1) if unsharded_shape[dim] else 0
        for c in range(size):
            gathered_offsets.append(segment_sizes[c])
            segment_sizes[c] += piece_sizes[c] * row
        start = sum(piece_sizes[:this_coordinate])
        local = whole.narrow(dim, start, piece_sizes[this_coordinate]).clone(memory_format=torch.contiguous_format)
        sharded_spec = DTensorSpec(full_mesh, layout, contiguous_stride(layout.shape), parameter.dtype)
        unsharded_spec = None
        if isinstance(parameter, DTensor):
            unsharded_spec = DTensorSpec(parameter.device_mesh, parameter.sharding, tuple(parameter.stride()), compute_dtype)
        pending_slots.append((locations, dim, unsharded_shape, piece_sizes, unsharded_offset,
                              tuple(gathered_offsets), sharded_spec, unsharded_spec, local))
        unsharded_offset += math.prod(unsharded_shape)
    bases = [sum(segment_sizes[:c]) for c in range(size)]
    slots, pieces = [], []
    for locations, dim, shape, piece_sizes, offset, gathered, sharded_spec, unsharded_spec, local in pending_slots:
        absolute = tuple(base + relative for base, relative in zip(bases, gathered))
        slots.append(ParameterSlot(tuple(locations), dim, shape, piece_sizes, offset, absolute, sharded_spec, unsharded_spec))
        pieces.append(local)
    return slots, pieces, tuple(segment_sizes)
