"""Ops that write: which arguments an op mutates, and how the new value reaches a DTensor.

An in-place or `out=` op whose input had to move ran on a redistributed copy: `write_back` stores
the copy's new value into the DTensor's own shard. An op that resizes what it writes (`addbmm_` of
a broadcast `self`, an empty `out=`) gets its functional result (`write_resized`). In-place views
(`squeeze_`, `t_`) give a DTensor a new spec (`inplace_view`). A view of a moved copy (`y[:, 0]` of a
tensor sharded along dim 1) knows its source, and a write into it is stored into the tensor it views
(`write_through`).

The functions take the DTensor class as an argument where they must tell DTensors from plain
tensors: this layer is below the class (`dtensor.py`), which passes itself through its hooks.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten

from .layout import Layout
from .placement import Shard
from .redistribute import redistribute_local_tensor

__all__ = [
    "written", "mutated", "writes", "returns_view", "CopySource", "copy_source", "mark_views_of_copies",
    "written_copy_sources", "write_through", "write_back", "write_resized", "inplace_view",
]

_written_positions: dict[object, tuple[tuple[int, str], ...]] = {}
_returns_view_by_op: dict = {}


def _written_arguments(op) -> tuple[tuple[int, str], ...]:
    positions = _written_positions.get(op)
    if positions is None:
        positions = tuple(
            (index, argument.name)
            for index, argument in enumerate(op._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        _written_positions[op] = positions
    return positions


def writes(op) -> bool:
    """Whether the op writes to any of its arguments (in-place, `out=`)."""
    return bool(_written_arguments(op))


def written(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments, plain or DTensor, that the op writes to."""
    mutated_values = []
    for index, name in _written_arguments(op):
        value = args[index] if index < len(args) else kwargs.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        mutated_values.extend(item for item in values if isinstance(item, torch.Tensor))
    return mutated_values


def mutated(dtensor_class: type, op, args: tuple, kwargs: dict) -> list:
    """DTensor arguments that the op writes to (`self` of `add_`, `out=` of `add.out`)."""
    return [value for value in written(op, args, kwargs) if isinstance(value, dtensor_class)]


def returns_view(op) -> bool:
    """Whether the op's result aliases an input (`diagonal`, `view`, `as_strided`, ...).

    `_unsafe_view` returns a view its schema does not declare: `kron(..., out=out)` writes through
    `out._unsafe_view(...)`, and such a write must not be lost in a moved copy.
    """
    known = _returns_view_by_op.get(op)
    if known is None:
        known = op is torch.ops.aten._unsafe_view.default or any(
            returned.alias_info is not None and not returned.alias_info.is_write for returned in op._schema.returns
        )
        _returns_view_by_op[op] = known
    return known


class CopySource:
    """What a view of a moved copy views: the DTensor `base` and the copy of its value that the view
    aliases (`copy`, in `layout`). A write into the view writes the copy, which `write_through` stores
    into the base. Once the base was written otherwise, the copy is stale, and writing it back would
    undo that write: the base's version counter (which autograd shares among a tensor and its views)
    tells, read below autograd, where the op writing the view has not counted its own write yet.
    The base keeps its live copies (weakly), so that a write through one refreshes the others."""

    __slots__ = ("base", "copy", "layout", "base_local", "version", "__weakref__")

    def __init__(self, base, copy: torch.Tensor, layout: Layout):
        self.base, self.copy, self.layout = base, copy, layout
        self.base_local, self.version = base._local_tensor, base._version
        copies = base.__dict__.get("_live_copies")
        if copies is None:
            copies = base._live_copies = weakref.WeakSet()
        copies.add(self)

    def written_through(self) -> None:
        """The copy was stored into the base by an op that counts one write when it returns."""
        self.base_local, self.version = self.base._local_tensor, self.base._version + 1

    def is_current(self) -> bool:
        return self.base._local_tensor is self.base_local and self.base._version == self.version

    def is_current_but_for(self, written: CopySource) -> bool:
        """Whether this copy equalled the base before the write through `written` (sharing its version)."""
        return self.base_local is written.base_local and self.version == written.version


def copy_source(base, local: torch.Tensor, layout: Layout | None) -> CopySource | None:
    """The source of a view op's outputs whose input `base` ran as `local` (moved to `layout`, or None
    where it stayed): a new copy, the copy `base` itself views, or None (a view of the base's own shard)."""
    if layout is not None and local is not base._local_tensor:
        return CopySource(base, local, layout)
    return base._view_of_copy


def mark_views_of_copies(dtensor_class: type, result, source: CopySource | None):
    """A view op whose input had to move (or was itself a view of a copy) returns a view of the
    moved copy, not of the input: give it the copy's source, so that writes into it reach the input
    (`write_through`). Reading it is exact."""
    if source is None:
        return result
    for output in tree_flatten(result)[0]:
        if isinstance(output, dtensor_class):
            output._view_of_copy = source
    return result


def written_copy_sources(dtensor_class: type, op, args: tuple, kwargs: dict) -> list[CopySource]:
    """The sources of the views of copies that the op writes: after it, `write_through` them.
    A stale one (its base written since the view was taken) raises instead of losing that write."""
    sources = []
    for dtensor in mutated(dtensor_class, op, args, kwargs):
        source = dtensor._view_of_copy
        if source is None:
            continue
        if not source.is_current():
            raise RuntimeError(
                f"{op} writes in place into a DTensor that is a view of a redistributed copy of its base (a view "
                f"op whose input had to move, e.g. select or indexing along a sharded dim), and the base was "
                f"written since the view was taken: writing the copy back would undo that write. Placements of "
                f"the view: {list(dtensor.placements)}, of the base: {list(source.base.placements)}. Take the view "
                f"again after writing the base, or redistribute the base to a layout the view op keeps (often "
                f"Replicate) first"
            )
        sources.append(source)
    return sources


def write_through(op, sources: list[CopySource]) -> None:
    """Store each written copy into its base (its own shard, from the copy's layout: no communication
    from Replicate), then into the base's own base if the base is itself a view of a copy."""
    while sources:
        for source in sources:
            base, mesh = source.base, source.base.device_mesh
            write_back(op, base, source.copy, source.layout, mesh)
            for other in list(base._live_copies):  # the views of the base's other copies read the new value
                if other is not source and other.is_current_but_for(source):
                    other.copy.copy_(redistribute_local_tensor(base._local_tensor, base.sharding, other.layout, mesh))
                    other.written_through()
            source.written_through()
        sources = [source.base._view_of_copy for source in sources if source.base._view_of_copy is not None]


def write_back(op, dtensor, local: torch.Tensor, layout: Layout, mesh) -> None:
    """An in-place op ran on a redistributed copy: store the new value into the DTensor's own shard."""
    target = dtensor.sharding.without_partial()
    coordinate = mesh.get_coordinate()
    if tuple(local.shape) != layout.local_shape(coordinate):
        raise NotImplementedError(f"{op} changed the shape of a DTensor in place; this is not supported")
    value = redistribute_local_tensor(local, layout, target, mesh) if layout != target else local
    dtensor._local_tensor.copy_(dtensor.sharding.operand_of(value, coordinate))


def write_resized(dtensor_class: type, op, args: tuple, kwargs: dict, dtensor_args: tuple, dtensor_kwargs: dict,
                  functional_op):
    """An in-place or `out=` op that resizes what it writes (`addbmm_` of a broadcast `self`, an empty
    `out=`): run `functional_op` and give its results (in the written tensors' dtypes, and their
    placements where these fit) to them, as torch's resize and copy do. A plain tensor gets the full value."""
    out_names = {argument.name for argument in op._schema.arguments
                 if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write}
    functional_kwargs = {name: value for name, value in dtensor_kwargs.items() if name not in out_names}
    results = tree_flatten(functional_op(*dtensor_args, **functional_kwargs))[0]
    targets = written(op, args, kwargs)
    for target, value in zip(targets, results):
        if value.dtype != target.dtype:
            value = torch.ops.aten._to_copy.default(value, dtype=target.dtype)
        if isinstance(target, dtensor_class):
            placements = target.placements  # kept where they fit the new shape
            if any(isinstance(placement, Shard) and placement.dim >= value.ndim for placement in placements):
                placements = value.sharding.without_partial().placements
            value = value.redistribute(target.device_mesh, placements)
            target._take_value_of(value)
            _set_wrapper_sizes(target, tuple(value.shape), value._spec.stride)
        else:
            target.resize_(value.shape).copy_(value.full_tensor())
    if not op._schema.returns:
        return None
    return targets[0] if len(op._schema.returns) == 1 else tuple(targets)


def _set_wrapper_sizes(dtensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Give a DTensor's wrapper new sizes without dispatching (as `return_and_correct_aliasing` does
    for `squeeze_`): its shape and strides are what torch code reads next."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.resize_.default(dtensor, shape)
            torch.ops.aten.as_strided_.default(dtensor, shape, stride)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def inplace_view(op, args: tuple, kwargs: dict):
    """`squeeze_`, `unsqueeze_`, `transpose_`, `t_`...: change a DTensor's shape in place.

    Runs the out-of-place view through its own rule, then gives the DTensor that result's shard and
    spec, and its wrapper the new sizes (matmul of a vector ends in `squeeze_(0)`).
    """
    # The packet picks the overload: `transpose_.default` corresponds to `transpose.int`.
    out_of_place = getattr(torch.ops.aten, op._schema.name.split("::")[1].rstrip("_"))
    view = out_of_place(*args, **kwargs)
    dtensor = args[0]
    dtensor._take_value_of(_resharded_where_gathered(view, dtensor.placements))
    return return_and_correct_aliasing(op, args, kwargs, dtensor)


def _resharded_where_gathered(view, placements: tuple):
    """The view with each mesh dim it left Replicate sharded again as the DTensor was (where that
    Shard fits the new shape): a local slice, so an in-place view keeps its tensor's sharding
    (`out` of a vector matmul stays sharded through `unsqueeze_(0)`, `mm.out` and `squeeze_(0)`)."""
    kept = tuple(
        before if placement.is_replicate() and isinstance(before, Shard) and before.dim < view.ndim else placement
        for placement, before in zip(view.placements, placements)
    )
    return view if kept == view.placements else view.redistribute(view.device_mesh, kept)
