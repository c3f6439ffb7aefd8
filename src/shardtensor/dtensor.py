"""The `DTensor` class: a global tensor held as one local shard per rank of a mesh.

A DTensor is a `torch.Tensor` wrapper subclass whose metadata (shape, stride, dtype) are those of
the global tensor and whose data is `_local_tensor`, this rank's shard as described by a `Layout`.
Public torch calls on DTensors first reach `__torch_function__` (see `torch_function.py`: a fast
path for cached local ops; it also defines metadata reads and views on this class), and aten ops
`__torch_dispatch__` (see `dispatch.py`); the conversions `from_local`, `to_local`, `full_tensor`
and `redistribute` are autograd functions, so gradients flow through them with the layouts
PyTorch documents (a Partial gradient becomes Replicate).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import comm
from .checkpoint import CheckpointableMixin
from .layout import Layout
from .mesh import DeviceMesh, current_mesh
from .placement import Partial, Placement, Replicate, Shard
from .redistribute import redistribute_between, redistribute_local_tensor

__all__ = ["DTensor", "DTensorSpec", "contiguous_stride", "created_by_torch", "partial_from_replicate"]


@dataclass(frozen=True, slots=True)
class DTensorSpec:
    """Everything about a DTensor except its data: mesh, exact layout, global stride and dtype."""

    mesh: DeviceMesh
    layout: Layout
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements


_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def _mirror_math_bits(wrapper: torch.Tensor, local_tensor: torch.Tensor) -> None:
    """A DTensor whose shard is a conjugate or negative view (`x.conj()`) reports it as a tensor on
    one device would: `is_conj()` is true and `resolve_conj()` resolves it (before `view_as_real`)."""
    torch._C._set_conj(wrapper, local_tensor.is_conj())
    torch._C._set_neg(wrapper, local_tensor.is_neg())
_NO_KEYWORDS: dict = {}

# One object per distinct spec (bounded): dispatch plans are keyed by a spec's identity, so that a
# plan serves every DTensor with this metadata, new ones from `distribute_tensor` included.
_interned_specs: dict[DTensorSpec, DTensorSpec] = {}
_MAX_INTERNED_SPECS = 4096


def interned_spec(spec: DTensorSpec) -> DTensorSpec:
    """The one stored spec equal to `spec` (stored now if there is none)."""
    found = _interned_specs.get(spec)
    if found is None:
        if len(_interned_specs) >= _MAX_INTERNED_SPECS:
            _interned_specs.clear()
        _interned_specs[spec] = found = spec
    return found


def _torch_function(func, args, kwargs):
    """The first `__torch_function__` call imports `torch_function`, which then replaces
    `DTensor.__torch_function__` with its own (that module imports `dispatch`, which imports this one)."""
    from .torch_function import torch_function

    return torch_function(DTensor, func, (), args, kwargs)


class _CallState(threading.local):
    """Per thread: how deep public torch calls on DTensors are nested, and whether plain tensors
    torch creates inside the outermost one are read as Replicate."""

    depth = 0
    torch_created_replicate = False
    implicit_replication_depth = 0  # `shardtensor.experimental.implicit_replication()` blocks


_call_state = _CallState()


def _has_plain_tensor(values) -> bool:
    """Whether `values` (nested lists and tuples included) hold a plain tensor that is not 0-d."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if not isinstance(value, DTensor) and value.ndim > 0:
                return True
        elif isinstance(value, (list, tuple)) and _has_plain_tensor(value):
            return True
    return False


class outermost_call:
    """Marks a public torch call on DTensors (`__torch_function__`) while it runs; only the
    outermost one on this thread decides, from its own arguments, what `created_by_torch` says."""

    __slots__ = ("args", "kwargs", "outermost")

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs

    def __enter__(self) -> None:
        state = _call_state
        self.outermost = state.depth == 0
        if self.outermost:
            state.torch_created_replicate = not (
                _has_plain_tensor(self.args) or _has_plain_tensor(self.kwargs.values())
            )
        state.depth += 1

    def __exit__(self, *exception) -> None:
        state = _call_state
        state.depth -= 1
        if self.outermost:
            state.torch_created_replicate = False


def created_by_torch(tensor: torch.Tensor) -> bool:
    """Whether a plain tensor mixed with DTensors in an aten op may be read as Replicate.

    True inside a public torch function called with DTensor arguments (the outermost such call on
    this thread) that got no plain tensor of its own except 0-d ones: a plain tensor that shows up
    then was created by torch from global metadata (a causal mask from sizes, a tolerance from a
    dtype) and is the same on every rank. A plain tensor the caller passed is refused, and so is
    everything in a call that got one (torch may derive new tensors from it, which carry this
    rank's data). Also true inside `shardtensor.experimental.implicit_replication()` (unchecked).
    """
    state = _call_state
    return state.torch_created_replicate or state.implicit_replication_depth > 0


def _dispatch(func, args, kwargs):
    """Bound to `dispatch.dispatch` when that module is imported (it imports this one, so this one
    imports it on first use instead of on every op)."""
    from .dispatch import dispatch

    return dispatch(func, args, kwargs)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _global_stride(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """A global stride with the local tensor's dim order (a transposed shard gives a transposed global)."""
    order = sorted(range(local.ndim), key=lambda dim: -local.stride(dim))
    stride, step = [0] * len(shape), 1
    for dim in reversed(order):
        stride[dim] = step
        step *= max(shape[dim], 1)
    return tuple(stride)


def without_partial(layout: Layout) -> Layout:
    """The same layout with every Partial made Replicate (where a gradient of a Partial lives)."""
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in layout.placements)
    return dataclasses.replace(layout, placements=placements)


def _identity(reduce_op: str, like: torch.Tensor) -> torch.Tensor:
    if reduce_op == "sum":
        return torch.zeros_like(like)
    if reduce_op == "product":
        return torch.ones_like(like)
    if like.dtype == torch.bool:
        return torch.full_like(like, reduce_op == "min")
    info = torch.finfo(like.dtype) if like.dtype.is_floating_point else torch.iinfo(like.dtype)
    extreme = -float("inf") if like.dtype.is_floating_point else info.min
    if reduce_op == "min":
        extreme = float("inf") if like.dtype.is_floating_point else info.max
    return torch.full_like(like, extreme)


def partial_from_replicate(local: torch.Tensor, layout: Layout, mesh: DeviceMesh) -> torch.Tensor:
    """Turn a shard that holds the value into a Partial operand for `layout`.

    Along each Partial mesh dim, coordinate 0 keeps the value and the others hold the reduce op's
    identity (`avg` keeps the value everywhere), so that reducing gives the value back exactly.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # a rank outside the mesh holds no elements
        return local
    for mesh_dim, placement in enumerate(layout.placements):
        if isinstance(placement, Partial) and placement.reduce_op != "avg" and coordinate[mesh_dim] != 0:
            return _identity(placement.reduce_op, local)
    return local


class DTensor(CheckpointableMixin, torch.Tensor):
    """A distributed tensor: global metadata on the wrapper, this rank's shard in `_local_tensor`.

    Build one with `distribute_tensor`, `DTensor.from_local` or a factory (`shardtensor.zeros`, ...).

    >>> mesh = init_device_mesh("cpu", (2,))  # doctest: +SKIP
    >>> x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])  # doctest: +SKIP
    >>> x.to_local()  # doctest: +SKIP
    tensor([0., 1., 2.])   # on rank 0
    """

    _local_value: torch.Tensor | None
    _pending: object | None = None  # an async redistribute's result to wait for (`_wrap` leaves it unset)
    _spec: DTensorSpec

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs)

    @staticmethod
    def __new__(cls, local_tensor, spec: DTensorSpec, *, requires_grad: bool = False, pending=None):
        if isinstance(local_tensor, DTensor):
            raise TypeError("the local tensor of a DTensor must be a plain torch.Tensor, got a DTensor")
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.layout.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        wrapper._local_value = None if pending is not None else local_tensor
        wrapper._pending = pending
        wrapper._spec = interned_spec(spec)
        if local_tensor.is_conj() or local_tensor.is_neg():
            _mirror_math_bits(wrapper, local_tensor)
        return wrapper

    @classmethod
    def _wrap(cls, local_tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
        """`DTensor(local_tensor, spec)` for an op's output on the hot path: no checks, positional
        arguments (about 1 us cheaper per output than keywords)."""
        wrapper = _make_wrapper_subclass(
            cls, spec.layout.shape, spec.stride, None, None, spec.dtype, local_tensor.layout, local_tensor.device
        )
        wrapper._local_value = local_tensor
        wrapper._spec = spec
        if local_tensor.is_conj() or local_tensor.is_neg():
            _mirror_math_bits(wrapper, local_tensor)
        return wrapper

    # ---- metadata --------------------------------------------------------------------------------

    @property
    def _local_tensor(self) -> torch.Tensor:
        """This rank's shard; waits here for an async redistribute that produced it."""
        if self._pending is not None:
            self._local_value = self._pending.wait()
            self._pending = None
        return self._local_value

    def _take_value_of(self, other: DTensor) -> None:
        """Become `other` in place (its shard and spec): how in-place views such as `squeeze_` land."""
        self._local_value, self._pending, self._spec = other._local_tensor, None, other._spec

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.layout.placements

    @property
    def sharding(self) -> Layout:
        """The exact `Layout`: placements, shard order and every rank's shard sizes (uneven included)."""
        return self._spec.layout

    def __repr__(self) -> str:
        sizes = _uneven_sizes_text(self._spec.layout)
        return (
            f"DTensor(local_tensor={self._local_tensor!r}, device_mesh={self._spec.mesh!r}, "
            f"placements={self.placements!r}{sizes})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or _NO_KEYWORDS)

    # ---- conversions -----------------------------------------------------------------------------

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        shard_sizes: str | Mapping[int, Sequence[int]] | None = None,
    ) -> DTensor:
        """Make a DTensor from every rank's local shard (differentiable; no data moves by default).

        Shard sizes: with `shape`, the shards are the `torch.chunk` split of `shape` (or
        `shard_sizes={mesh_dim: sizes}` if given too) and this rank's shape is checked against it.
        Without `shape`, a Shard placement makes every rank share its local shape once
        (`all_gather_object`), so uneven shards are exact (`shard_sizes="infer"`, the default);
        `shard_sizes="chunk"` skips that and assumes equal local shapes, as PyTorch does;
        `shard_sizes={mesh_dim: sizes}` gives them explicitly. `run_check=True` checks shapes,
        dtypes and placements on all ranks (raising the same error everywhere) and broadcasts
        Replicate data from coordinate 0 of each mesh dim.

        On a rank outside the mesh the result holds a local tensor without elements (as after
        `distribute_tensor`) and no collective runs there; its global shape comes from `shape` if
        given, else from `shard_sizes` and the local tensor as if every shard had its shape.

        >>> x = DTensor.from_local(torch.ones(rank + 1, 2), mesh, [Shard(0)])  # doctest: +SKIP
        >>> x.shape  # with 2 ranks: 1 + 2 rows
        torch.Size([3, 2])
        """
        if isinstance(local_tensor, DTensor):
            raise TypeError("from_local takes this rank's plain local tensor, got a DTensor; use redistribute")
        mesh = device_mesh if device_mesh is not None else current_mesh()
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        placements = tuple(placements)
        layout = _from_local_layout(local_tensor, mesh, placements, shape, shard_sizes, run_check)
        global_stride = tuple(stride) if stride is not None else _global_stride(local_tensor, layout.shape)
        spec = DTensorSpec(mesh, layout, global_stride, local_tensor.dtype)
        return _FromLocal.apply(local_tensor, spec, run_check)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable).

        The gradient of the result is read with `grad_placements` (default: this DTensor's).

        >>> x.to_local()  # doctest: +SKIP
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        return _ToLocal.apply(self, None if grad_placements is None else tuple(grad_placements))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable; gathers as needed).

        >>> distribute_tensor(torch.arange(4), mesh, [Shard(0)]).full_tensor()  # doctest: +SKIP
        tensor([0, 1, 2, 3])
        """
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
    ) -> DTensor:
        """The same global tensor under other placements (differentiable).

        Targets may be Shard or Replicate (a mesh dim already Partial may stay so). The gradient
        goes back to this DTensor's layout, with Partial read as Replicate. With `async_op=True`
        the result returns at once and waits for its data on first use.

        `device_mesh` may be another mesh (other shape, rank order or ranks; docs/redistribute.md):
        every rank of the world must call, and ranks outside the target mesh get a local tensor
        without elements. On a rank outside this DTensor's mesh, a same-mesh redistribute is a
        no-op giving such a tensor (so `full_tensor()` is empty there, as in PyTorch).

        >>> x.redistribute(placements=[Replicate()])  # doctest: +SKIP
        """
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh != self.device_mesh:
            return _Redistribute.apply(self, mesh, _cross_mesh_target(self, mesh, placements), async_op)
        if placements is None:
            placements = self.placements
        target = self.sharding.with_placements(tuple(placements))
        for mesh_dim, (old, new) in enumerate(zip(self.placements, target.placements)):
            if isinstance(new, Partial) and new != old:
                raise ValueError(
                    f"redistribute target placements[{mesh_dim}] = {new!r}, but the source has {old!r} "
                    f"there; only Shard(dim) and Replicate() targets are allowed (a Partial is the "
                    f"result of an op, not a layout one can move data into). Given placements "
                    f"{tuple(placements)!r} from {self.placements!r}"
                )
        if target == self.sharding:
            target = self.sharding  # keep exact pieces and shard order: no communication
        return _Redistribute.apply(self, mesh, target, async_op)


def _cross_mesh_target(dtensor: DTensor, mesh: DeviceMesh, placements) -> Layout:
    """The target layout on another mesh: Shard and Replicate only (Partial sources are reduced first)."""
    if placements is None:
        raise ValueError(
            f"redistribute to another mesh needs placements for it: this DTensor lives on "
            f"{dtensor.device_mesh!r} with {dtensor.placements!r}, the target mesh is {mesh!r}; pass "
            f"one Shard(dim) or Replicate() per mesh dim of the target mesh"
        )
    target = Layout.create(mesh.shape, tuple(placements), dtensor.shape)
    if target.partial_mesh_dims():
        raise ValueError(
            f"redistribute to another mesh takes Shard(dim) and Replicate() targets only, got "
            f"{tuple(placements)!r} for {mesh!r}; a Partial source is reduced on its own mesh first"
        )
    return target


def _uneven_sizes_text(layout: Layout) -> str:
    if layout.is_chunked():
        return ""
    by_mesh_dim = {
        order[0]: list(pieces) for pieces, order in zip(layout.pieces, layout.shard_order) if len(order) == 1
    }
    nested = any(len(order) > 1 for order in layout.shard_order)
    if nested:
        return f", pieces={layout.pieces}"
    return f", shard_sizes={by_mesh_dim}"


# ---- from_local layout ---------------------------------------------------------------------------


def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(size) for size in mesh_shape)))


def _from_local_layout(local, mesh, placements, shape, shard_sizes, run_check) -> Layout:
    mesh_shape = tuple(mesh.shape)
    if len(placements) != len(mesh_shape):
        # Layout.create raises the full message; do it before any collective so that every rank fails alike.
        Layout.create(mesh_shape, placements, local.shape)
    if mesh.get_coordinate() is None:
        return _outside_layout(local, mesh_shape, placements, shape, shard_sizes)
    coordinate = tuple(mesh.get_coordinate())
    gathered = None
    if run_check or (shape is None and shard_sizes in (None, "infer") and any(isinstance(p, Shard) for p in placements)):
        mine = (tuple(local.shape), local.dtype, placements)
        gathered = dict(zip(_coordinates(mesh_shape), comm.all_gather_object(mine, mesh, None)))
    if gathered is not None:
        _check_gathered(gathered, mesh_shape, placements)
    if shape is not None:
        mapping = None if shard_sizes in (None, "infer", "chunk") else shard_sizes
        layout = Layout.create(mesh_shape, placements, shape, shard_sizes=mapping)
        checked = gathered if gathered is not None else {coordinate: tuple(local.shape)}
        for where, entry in checked.items():
            local_shape = entry[0] if gathered is not None else entry
            if tuple(local_shape) != layout.local_shape(where):
                raise ValueError(
                    f"from_local: the local tensor at mesh coordinate {where} has shape {tuple(local_shape)}, "
                    f"but shape={tuple(shape)} with placements {placements!r} gives that coordinate "
                    f"{layout.local_shape(where)}; pass the global shape that the shards add up to, or "
                    f"omit shape to infer it from the local shapes"
                )
        return layout
    if shard_sizes == "chunk" or not any(isinstance(p, Shard) for p in placements):
        return _chunk_layout(local, mesh_shape, placements)
    if shard_sizes in (None, "infer"):
        return Layout.from_local_shapes(mesh_shape, placements, {where: entry[0] for where, entry in gathered.items()})
    return _explicit_layout(local, mesh_shape, placements, shard_sizes, coordinate)


def _outside_layout(local, mesh_shape, placements, shape, shard_sizes) -> Layout:
    """The layout on a rank outside the mesh, which cannot ask the mesh's ranks for their shapes."""
    mapping = None if shard_sizes in (None, "infer", "chunk") else shard_sizes
    if shape is not None:
        return Layout.create(mesh_shape, placements, shape, shard_sizes=mapping)
    if mapping is not None:
        return _explicit_layout(local, mesh_shape, placements, mapping, None)
    return _chunk_layout(local, mesh_shape, placements)


def _check_gathered(gathered, mesh_shape, placements) -> None:
    """Compare what every rank sent; all ranks see the same data, so all raise the same error."""
    first_coordinate, (first_shape, first_dtype, first_placements) = next(iter(gathered.items()))
    for where, (local_shape, dtype, their_placements) in gathered.items():
        if dtype != first_dtype or their_placements != first_placements or len(local_shape) != len(first_shape):
            raise ValueError(
                f"from_local(run_check): ranks disagree: mesh coordinate {first_coordinate} has a local tensor "
                f"of shape {first_shape}, dtype {first_dtype}, placements {first_placements!r}, and mesh "
                f"coordinate {where} has shape {local_shape}, dtype {dtype}, placements {their_placements!r}; "
                f"every rank must pass the same dtype, number of dims and placements"
            )
    Layout.from_local_shapes(
        mesh_shape,
        placements,
        {where: entry[0] for where, entry in gathered.items()},
    )


def _chunk_layout(local, mesh_shape, placements) -> Layout:
    """PyTorch's assumption: every shard has this rank's local shape."""
    shape = list(local.shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            if not -local.ndim <= placement.dim < local.ndim:
                Layout.create(mesh_shape, placements, local.shape)  # raises the out-of-range message
            shape[placement.dim % local.ndim] *= mesh_shape[mesh_dim]
    return Layout.create(mesh_shape, placements, shape)


def _explicit_layout(local, mesh_shape, placements, shard_sizes, coordinate) -> Layout:
    if isinstance(shard_sizes, str) or not isinstance(shard_sizes, Mapping):
        raise ValueError(
            f"from_local: shard_sizes={shard_sizes!r} is not understood; use 'infer' (default), 'chunk', "
            f"or a mapping {{mesh_dim: sizes}}"
        )
    shape = list(_chunk_layout(local, mesh_shape, placements).shape)
    for mesh_dim, sizes in shard_sizes.items():
        placement = placements[mesh_dim] if isinstance(mesh_dim, int) and 0 <= mesh_dim < len(placements) else None
        if isinstance(placement, Shard):
            shape[placement.dim % local.ndim] = sum(sizes)
    layout = Layout.create(mesh_shape, placements, shape, shard_sizes=shard_sizes)
    if coordinate is not None and layout.local_shape(coordinate) != tuple(local.shape):
        raise ValueError(
            f"from_local: shard_sizes={dict(shard_sizes)!r} gives mesh coordinate {coordinate} a shard of shape "
            f"{layout.local_shape(coordinate)}, but its local tensor has shape {tuple(local.shape)}"
        )
    return layout


# ---- autograd functions --------------------------------------------------------------------------


def _gradient_to(grad: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """The local shard of a DTensor gradient moved to `spec`'s layout with Partial read as Replicate."""
    if not isinstance(grad, DTensor):
        raise TypeError(f"expected the gradient of a DTensor to be a DTensor, got {type(grad).__name__}")
    target = without_partial(spec.layout)
    if grad.sharding == target:
        return grad._local_tensor
    return redistribute_local_tensor(grad._local_tensor, grad.sharding, target, spec.mesh)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, spec, run_check):
        ctx.spec = spec
        if spec.mesh.get_coordinate() is None:
            return DTensor(local.new_empty((0,) * max(local.ndim, 1)), spec)
        if run_check:
            for mesh_dim, placement in enumerate(spec.placements):
                if isinstance(placement, Replicate):
                    local = comm.broadcast(local.contiguous(), spec.mesh, mesh_dim, src=0)
        else:
            local = local.view_as(local)
        return DTensor(local, spec)

    @staticmethod
    def backward(ctx, grad):
        if ctx.spec.mesh.get_coordinate() is None:
            return None, None, None  # the local tensor was not used: no gradient
        return _gradient_to(grad, ctx.spec), None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtensor, grad_placements):
        ctx.spec = dtensor._spec
        ctx.grad_placements = grad_placements
        local = dtensor._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        layout = spec.layout
        if ctx.grad_placements is not None:
            layout = layout.with_placements(ctx.grad_placements)
        coordinate = spec.mesh.get_coordinate()
        if coordinate is not None and tuple(grad.shape) != layout.local_shape(coordinate):
            raise ValueError(
                f"to_local backward: the local gradient has shape {tuple(grad.shape)}, but placements "
                f"{layout.placements!r} expect {layout.local_shape(coordinate)} at mesh coordinate {tuple(coordinate)}"
            )
        grad_spec = DTensorSpec(spec.mesh, layout, _global_stride(grad, layout.shape), grad.dtype)
        return DTensor(grad, grad_spec), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtensor, mesh, target, async_op):
        ctx.spec = dtensor._spec
        source = dtensor._spec
        spec = DTensorSpec(mesh, target, source.stride, source.dtype)
        if mesh == source.mesh and target == source.layout:
            return DTensor(dtensor._local_tensor, spec)
        local = dtensor._local_tensor
        result = redistribute_between(local, source.layout, source.mesh, target, mesh, async_op=async_op)
        if isinstance(result, torch.Tensor):
            return DTensor(result, spec)
        return DTensor(local, spec, pending=result)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        target = without_partial(spec.layout)
        if isinstance(grad, DTensor) and (grad.device_mesh != spec.mesh or spec.mesh.get_coordinate() is None):
            local = redistribute_between(grad._local_tensor, grad.sharding, grad.device_mesh, target, spec.mesh)
        else:
            local = _gradient_to(grad, spec)
        grad_spec = DTensorSpec(spec.mesh, target, spec.stride, grad.dtype)
        return DTensor(local, grad_spec), None, None, None
