"""Making DTensors: `distribute_tensor`, `distribute_module` and the factories.

`distribute_tensor` sends each rank only its shard (one scatter per sharded mesh dim, then
broadcasts for replicated ones), so no rank holds more than the source tensor plus its shard.
Factories allocate only the local shard; `rand`/`randn` values do not depend on the mesh
(see `shardtensor.random`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch

from . import comm
from .dtensor import DTensor
from .from_local import check_dense
from .layout import Layout
from .mesh import DeviceMesh, current_mesh
from .placement import Placement, Replicate, Shard, check_partial_dtype
from .random import next_random_call, random_shard
from .spec import DTensorSpec, contiguous_stride

__all__ = [
    "distribute_tensor", "distribute_module", "zeros", "ones", "empty", "full", "rand", "randn", "linspace", "logspace",
]


def _mesh_and_placements(device_mesh, placements) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    return mesh, tuple(placements)


def _region(layout: Layout, coordinate: Sequence[int], mesh_dims: set[int]) -> tuple[list[int], list[int]]:
    """(offset, shape) of the part of the tensor a coordinate holds when only `mesh_dims` split it."""
    offset, shape = [], []
    for dim, order in enumerate(layout.shard_order):
        used = [mesh_dim for mesh_dim in order if mesh_dim in mesh_dims]
        index = 0
        for mesh_dim in used:
            index = index * layout.mesh_shape[mesh_dim] + coordinate[mesh_dim]
        span = 1
        for mesh_dim in order[len(used):]:
            span *= layout.mesh_shape[mesh_dim]
        pieces = layout.pieces[dim]
        offset.append(sum(pieces[: index * span]))
        shape.append(sum(pieces[index * span : (index + 1) * span]))
    return offset, shape


def _box(tensor: torch.Tensor, offset: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offset, shape)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous and its storage holds exactly its elements."""
    return tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _send_from_source(tensor: torch.Tensor, layout: Layout, mesh: DeviceMesh, coordinate, source: int) -> torch.Tensor:
    """This rank's shard of the tensor held at mesh coordinate (source, ..., source).

    Mesh dims are handled one at a time, sharded ones first: the ranks holding data along a mesh
    dim scatter pieces (or broadcast, for Replicate/Partial) to their peers. After the step on a
    mesh dim, every rank that matches the source on all later mesh dims holds its part.
    """
    shard_dims = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard)]
    order = shard_dims + [m for m in range(layout.mesh_ndim) if m not in shard_dims]
    current = tensor if all(c == source for c in coordinate) else None
    done: set[int] = set()
    for step, mesh_dim in enumerate(order):
        later = order[step + 1 :]
        if any(coordinate[m] != source for m in later):
            done.add(mesh_dim)
            continue
        holds_data = coordinate[mesh_dim] == source
        after = done | {mesh_dim}
        if isinstance(layout.placements[mesh_dim], Shard):
            pieces = None
            if holds_data:
                my_offset, _ = _region(layout, coordinate, done)
                pieces = []
                for peer_coordinate in range(layout.mesh_shape[mesh_dim]):
                    peer = list(coordinate)
                    peer[mesh_dim] = peer_coordinate
                    offset, shape = _region(layout, peer, after)
                    relative = [start - mine for start, mine in zip(offset, my_offset)]
                    pieces.append(_box(current, relative, shape))  # a view: scatter copies one at a time
            _, shape = _region(layout, coordinate, after)
            scatter = functools.partial(comm.scatter, pieces, mesh, mesh_dim, src=source, shape=tuple(shape),
                                        dtype=tensor.dtype)
            if holds_data and step == len(order) - 1 and all(piece.is_contiguous() for piece in pieces):
                # Every piece is sent from the caller's tensor as is (no copies in flight), so send them
                # all at once and make this rank's own shard (it must not alias the caller's tensor)
                # while they travel, instead of after.
                handle = scatter(async_op=True)
                current = pieces[coordinate[mesh_dim]].clone()
                handle.wait()
            else:
                current = scatter()
        else:
            if not holds_data:
                _, shape = _region(layout, coordinate, done)
                current = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            current = comm.broadcast(current.contiguous(), mesh, mesh_dim, src=source)
        done = after
    return current


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split a full tensor over a mesh; every rank gets its shard of the source rank's data.

    The source is the rank at coordinate `src_data_rank` along every mesh dim (as in PyTorch, a
    rank within each mesh dim's group; default 0). `src_data_rank=None` slices each rank's own
    `tensor` without communication. A Partial placement holds the value on coordinate 0 and the
    reduce op's identity elsewhere. The result is a leaf with `tensor.requires_grad`. On a rank
    outside the mesh the result has the global metadata and a local tensor without elements
    (shape `(0,) * ndim`), and no collective runs there.

    >>> x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])  # doctest: +SKIP
    >>> x.to_local()  # on rank 1 of 2
    tensor([[4., 5.], [6., 7.]])
    """
    if isinstance(tensor, DTensor):
        raise TypeError(
            "distribute_tensor takes a plain torch.Tensor, got a DTensor; use dtensor.redistribute(mesh, placements)"
        )
    check_dense(tensor, "distribute_tensor")
    mesh, placements = _mesh_and_placements(device_mesh, placements)
    layout = Layout.create(mesh.shape, placements, tensor.shape)
    check_partial_dtype(layout.placements, tensor.dtype, "distribute_tensor")
    coordinate = mesh.get_coordinate()
    data = tensor.detach()
    if data.device.type != mesh.device_type and not data.is_meta:
        data = data.to(mesh.device_type)  # as PyTorch: shards live on the mesh's device (a CPU tensor to CUDA)
    if coordinate is None:  # a rank outside the mesh takes no part and holds no elements
        local = data.new_empty((0,) * max(data.ndim, 1))
    elif src_data_rank is None or data.is_meta:  # a meta tensor has no data to send: slice it here
        local = _box(data, layout.local_offset(coordinate), layout.local_shape(coordinate)).contiguous()
    else:
        if not all(0 <= src_data_rank < size for size in layout.mesh_shape):
            raise ValueError(
                f"src_data_rank={src_data_rank} is not a coordinate on every dim of a mesh of shape "
                f"{layout.mesh_shape}; give 0 <= src_data_rank < {min(layout.mesh_shape)}, or None to use "
                f"each rank's own tensor"
            )
        local = _send_from_source(data, layout, mesh, coordinate, src_data_rank)
    if local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() or not _owns_its_storage(local):
        # never share storage with the caller's tensor, nor keep a larger buffer alive through a view
        local = local.clone(memory_format=torch.contiguous_format)
    local = layout.operand_of(local, mesh.get_coordinate())
    spec = DTensorSpec(mesh, layout, tuple(tensor.stride()), tensor.dtype)
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


def _hook(function: Callable, mesh: DeviceMesh, takes_inputs: bool) -> Callable:
    """`function` as a forward (pre-)hook: it takes (module, value, mesh), or (value, mesh) as PyTorch's
    older form. The form is read once here, not per call: torch.compile traces every call's hook."""
    if len(inspect.signature(function).parameters) == 2:
        if takes_inputs:
            return lambda hooked, inputs: function(inputs, mesh)
        return lambda hooked, inputs, outputs: function(outputs, mesh)
    if takes_inputs:
        return lambda hooked, inputs: function(hooked, inputs, mesh)
    return lambda hooked, inputs, outputs: function(hooked, outputs, mesh)


def _replicate_parameters(module: torch.nn.Module, mesh: DeviceMesh) -> None:
    for name, parameter in list(module._parameters.items()):
        if parameter is not None and not isinstance(parameter, DTensor):
            replicated = distribute_tensor(parameter.data, mesh, [Replicate()] * mesh.ndim)
            module.register_parameter(name, torch.nn.Parameter(replicated, parameter.requires_grad))
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[name] = distribute_tensor(buffer, mesh, [Replicate()] * mesh.ndim)


def distribute_module(
    module: torch.nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, torch.nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable | None = None,
    output_fn: Callable | None = None,
) -> torch.nn.Module:
    """Make a module's parameters and buffers DTensors, and optionally hook its inputs/outputs.

    `partition_fn(name, submodule, mesh)` runs on every submodule to distribute its parameters;
    whatever it leaves as a plain tensor (everything, without `partition_fn`) is replicated.
    `input_fn(module, inputs, mesh)` and `output_fn(module, outputs, mesh)` become forward
    pre-/post-hooks. Returns the module, changed in place.

    >>> model = distribute_module(torch.nn.Linear(4, 4), mesh)  # doctest: +SKIP
    >>> model.weight.placements
    (Replicate(),)
    """
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module was already applied to this module; apply it once")
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, mesh)
        _replicate_parameters(submodule, mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(_hook(input_fn, mesh, takes_inputs=True))
    if output_fn is not None:
        module.register_forward_hook(_hook(output_fn, mesh, takes_inputs=False))
    module._distribute_module_applied = True
    return module


# ---- factories -----------------------------------------------------------------------------------


def _normalize_size(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(length, int) and length >= 0 for length in size):
        raise ValueError(f"size must be non-negative ints, given as *size or one sequence; got {size!r}")
    return tuple(size)


def _factory(make_local: Callable, size, requires_grad, dtype, layout, device_mesh, placements) -> DTensor:
    if layout != torch.strided:
        raise NotImplementedError(f"DTensor factories support layout=torch.strided only, got {layout}")
    shape = _normalize_size(size)
    mesh, placements = _mesh_and_placements(device_mesh, placements)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    shard_layout = Layout.create(mesh.shape, placements, shape)
    coordinate = mesh.get_coordinate()
    device = torch.device(mesh.device_type)
    if coordinate is None:  # a rank outside the mesh holds no elements
        local = torch.empty((0,) * max(len(shape), 1), dtype=dtype, device=device)
    else:
        local = make_local(shard_layout, tuple(coordinate), dtype, device)
    local = shard_layout.operand_of(local, coordinate)
    spec = DTensorSpec(mesh, shard_layout, contiguous_stride(shape), dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def full(size, fill_value, *, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """A DTensor filled with `fill_value`, allocating only the local shard.

    >>> full((4, 2), 7.0, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """

    def make_local(shard_layout, coordinate, dtype, device):
        return torch.full(shard_layout.local_shape(coordinate), fill_value, dtype=dtype, device=device)

    return _factory(make_local, (size,), requires_grad, dtype, layout, device_mesh, placements)


def zeros(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """A DTensor of zeros, allocating only the local shard.

    >>> zeros(4, 2, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    return full(_normalize_size(size), 0, requires_grad=requires_grad, dtype=dtype, layout=layout, device_mesh=device_mesh, placements=placements)


def ones(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """A DTensor of ones, allocating only the local shard.

    >>> ones(4, 2, device_mesh=mesh, placements=[Replicate()])  # doctest: +SKIP
    """
    return full(_normalize_size(size), 1, requires_grad=requires_grad, dtype=dtype, layout=layout, device_mesh=device_mesh, placements=placements)


def empty(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """An uninitialized DTensor, allocating only the local shard.

    >>> empty(4, 2, device_mesh=mesh, placements=[Shard(1)])  # doctest: +SKIP
    """

    def make_local(shard_layout, coordinate, dtype, device):
        return torch.empty(shard_layout.local_shape(coordinate), dtype=dtype, device=device)

    return _factory(make_local, size, requires_grad, dtype, layout, device_mesh, placements)


def _random_factory(kind: str, size, requires_grad, dtype, layout, device_mesh, placements) -> DTensor:
    mesh = device_mesh if device_mesh is not None else current_mesh()
    seed, counter = next_random_call(mesh)

    def make_local(shard_layout, coordinate, dtype, device):
        return random_shard(
            kind,
            shard_layout.shape,
            shard_layout.local_offset(coordinate),
            shard_layout.local_shape(coordinate),
            seed=seed,
            counter=counter,
            dtype=dtype,
            device=device,
        )

    return _factory(make_local, size, requires_grad, dtype, layout, mesh, placements)


def rand(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """Uniform [0, 1) values, the same global tensor on any mesh (seed: `shardtensor.manual_seed`).

    >>> rand(4, 4, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    return _random_factory("rand", size, requires_grad, dtype, layout, device_mesh, placements)


def randn(*size, requires_grad=False, dtype=None, layout=torch.strided, device_mesh=None, placements=None) -> DTensor:
    """Standard normal values, the same global tensor on any mesh (seed: `shardtensor.manual_seed`).

    >>> randn(4, 4, device_mesh=mesh, placements=[Shard(1)])  # doctest: +SKIP
    """
    return _random_factory("randn", size, requires_grad, dtype, layout, device_mesh, placements)


def _number(name: str, value):
    """A start or end point: a number, or a 0-dim tensor (a DTensor too) read as its number."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{name} must be a number or a 0-dimensional tensor, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    return value


def _spaced(function, start, end, steps, extra: dict, requires_grad, dtype, layout, device_mesh, placements) -> DTensor:
    """`linspace` and `logspace`: each rank computes the whole 1-D range and keeps its piece, since torch
    rounds a range by its position in the whole (a piece computed as a range of its own differs in
    the last bit); the range's `steps` elements are held only while the factory runs."""
    start, end = _number("start", start), _number("end", end)
    if dtype is None:  # torch's choice: the default dtype, its complex peer for complex points
        dtype = function(start, end, 0, **extra, device="meta").dtype

    def make_local(shard_layout, coordinate, dtype, device):
        values = function(start, end, steps, **extra, dtype=dtype, device=device)
        piece = values.narrow(0, shard_layout.local_offset(coordinate)[0], shard_layout.local_shape(coordinate)[0])
        return piece if piece.numel() == values.numel() else piece.clone()

    return _factory(make_local, (steps,), requires_grad, dtype, layout, device_mesh, placements)


def linspace(start, end, steps, *, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None,
             placements=None) -> DTensor:
    """`steps` evenly spaced values from `start` to `end`, the values of `torch.linspace` on one device.

    >>> linspace(0.0, 1.0, 5, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    return _spaced(torch.linspace, start, end, steps, {}, requires_grad, dtype, layout, device_mesh, placements)


def logspace(start, end, steps, base=10.0, *, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None,
             placements=None) -> DTensor:
    """`steps` values from `base ** start` to `base ** end`, the values of `torch.logspace` on one device.

    >>> logspace(0.0, 3.0, 4, base=2.0, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    extra = {"base": base}
    return _spaced(torch.logspace, start, end, steps, extra, requires_grad, dtype, layout, device_mesh, placements)
