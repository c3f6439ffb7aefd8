"""Ops that write: which arguments an op mutates, and how the new value reaches a DTensor.

An in-place or `out=` op whose input had to move ran on a redistributed copy: `write_back` stores
the copy's new value into the DTensor's own shard. An op that resizes what it writes (`addbmm_` of
a broadcast `self`, an empty `out=`) gets its functional result (`write_resized`). In-place views
(`squeeze_`, `t_`) give a DTensor a new spec (`inplace_view`). A view of a moved copy (`y[:, 0]` of a
tensor sharded along dim 1) knows its source: a write into it is stored into the tensor it views
(`write_through`), and a read of it after that tensor was written first copies its new value in
(`CopySource.refresh`).

The functions take the DTensor class as an argument where they must tell DTensors from plain
tensors: this layer is below the class (`dtensor.py`), which passes itself through its hooks.
"""

from __future__ import annotations

import torch
from torch._C import _increment_version
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten

from .layout import Layout
from .modes import implicit_communication_error, is_explicit
from .placement import Shard
from .redistribute import redistribute_local_tensor

__all__ = [
    "written_arguments", "written", "mutated", "writes", "returns_view", "CopySource", "copy_source",
    "mark_views_of_copies", "written_copy_sources", "write_through", "write_back", "write_resized", "inplace_view",
]

_written_positions: dict[object, tuple[tuple[int, str], ...]] = {}
_returns_view_by_op: dict = {}


def written_arguments(op) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the op writes to (`self` of `add_`, `out` of `add.out`)."""
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
    return bool(written_arguments(op))


def written(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments, plain or DTensor, that the op writes to."""
    mutated_values = []
    for index, name in written_arguments(op):
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
    """What a view of a moved copy views: the storage its base had when the view was taken
    (`base_local`, in `base_layout`; itself inside another copy when the base was a view of one:
    `base_source`) and the copy of its value that the view aliases (`copy`, in `layout`).

    On one device such a view shares its base's storage, so the copy must follow it both ways: a write
    into the view writes the copy, which `write_through` stores into the base's storage; a read of the
    view after the base was written reads the base's current value, which `refresh` (run on every read of
    the view's shard, `DTensor._local_tensor`) copies in first. The base was written when the version
    counter of its wrapper (an op on it, or on any of its views: they share it), of its shard (a write
    through `to_local()`) or the generation of the copy the base lies in has moved since the last refresh.
    Like a view on one device, it keeps following the storage it views when the base is given other data
    (`x.data = ...`)."""

    __slots__ = ("base", "base_local", "base_layout", "base_source", "mesh", "copy", "layout", "generation", "seen")
    live = 0  # how many exist: while none does, list plans skip looking for views of copies

    def __init__(self, base, copy: torch.Tensor, layout: Layout):
        CopySource.live += 1  # first: `__del__` runs even if the rest raises
        self.base, self.base_local, self.base_layout = base, base._local_tensor, base.sharding
        self.base_source, self.mesh = base._view_of_copy, base.device_mesh
        self.copy, self.layout = copy, layout
        self.generation = 0  # bumped whenever the copy gets new values from its base: what copies of it read
        self.seen = self._versions()

    def __del__(self):
        CopySource.live -= 1

    def _versions(self) -> tuple[int, int, int]:
        source = self.base_source
        return self.base._version, self.base_local._version, 0 if source is None else source.generation

    def needs_refresh(self) -> bool:
        """Whether the next read copies the base's new value in (a collective): the base was written since."""
        return (self.base_source is not None and self.base_source.needs_refresh()) or self._versions() != self.seen

    def refresh(self) -> None:
        """Copy the base's current value into the copy if the base was written since the last time
        (every view of the copy sees it): one redistribute of the base's shard, as the view op did."""
        if self.base_source is not None:  # the storage the base lies in first
            self.base_source.refresh()
        versions = self._versions()
        if versions == self.seen:
            return
        if is_explicit():
            raise implicit_communication_error(
                "a read of a view of a redistributed copy", [self.base], [self.layout],
                "its base was written since the view was taken, and the copy must get the base's new value",
            )
        if self.mesh.get_coordinate() is not None:
            with torch.no_grad():
                self.copy.copy_(redistribute_local_tensor(self.base_local, self.base_layout, self.layout, self.mesh))
        self.generation += 1
        self.seen = versions


def copy_source(base, local: torch.Tensor, layout: Layout | None) -> CopySource | None:
    """The source of a view op's outputs whose input `base` ran as `local` (moved to `layout`, or None
    where it stayed): a new copy, the copy `base` itself views, or None (a view of the base's own shard)."""
    if layout is not None and local is not base._local_tensor:
        return CopySource(base, local, layout)
    return base._view_of_copy


def mark_views_of_copies(dtensor_class: type, result, source: CopySource | None):
    """A view op whose input had to move (or was itself a view of a copy) returns a view of the
    moved copy, not of the input: give it the copy's source, so that writes into it reach the input
    (`write_through`) and reads of it see the input's writes (`CopySource.refresh`)."""
    if source is None:
        return result
    for output in tree_flatten(result)[0]:
        if isinstance(output, dtensor_class):
            output._view_of_copy = source
    return result


def written_copy_sources(dtensor_class: type, op, args: tuple, kwargs: dict) -> list[CopySource]:
    """The sources of the views of copies that the op writes, refreshed: after the op, `write_through`
    them. Raises where storing the copies back would undo a write of the same call (`_overlap_error`)."""
    targets = mutated(dtensor_class, op, args, kwargs)
    sources = []
    for dtensor in targets:
        source = dtensor._view_of_copy
        if source is not None and source not in sources:
            source.refresh()
            sources.append(source)
    if sources and len(targets) > 1:
        _check_no_overlap(op, targets)
    return sources


def _check_no_overlap(op, targets: list) -> None:
    """A copy is stored back whole, so the call must write no storage it reaches (its base's, and the
    storages under that) through another copy or directly: `_foreach_add_([y[:, 0], y[:, 1]], 1)` on
    `y` sharded along dim 1 takes two copies of `y`, and storing the second would undo the first's write."""
    reached: dict[int, tuple] = {}  # storage -> (the source whose store reaches it, None: written directly; target)
    for dtensor in targets:
        source = dtensor._view_of_copy
        storages = [dtensor._local_tensor.untyped_storage()._cdata]
        below = source
        while below is not None:
            storages.append(below.base_local.untyped_storage()._cdata)
            below = below.base_source
        for storage in storages:
            other, other_dtensor = reached.setdefault(storage, (source, dtensor))
            if other is not source:
                raise _overlap_error(op, other_dtensor, dtensor)


def _overlap_error(op, first, second) -> RuntimeError:
    return RuntimeError(
        f"{op} writes into two tensors (placements {list(first.placements)} and {list(second.placements)}) that "
        f"reach the same DTensor, at least one through a view of a redistributed copy of it (a view op whose input "
        f"had to move, e.g. select or indexing along a sharded dim): the copy is stored back whole, which would "
        f"undo the other write. Write them in separate calls (one call per tensor), or redistribute the base to a "
        f"layout the view op keeps (often Replicate) before taking views"
    )


def write_through(op, sources: list[CopySource]) -> None:
    """Store each written copy into its base's storage (from the copy's layout: no communication from
    Replicate), then that storage into its own base's if it lies in a copy too. The base's version
    counter moves, so that its other copies refresh before they are read again."""
    while sources:
        for source in sources:
            _store(op, source.base_local, source.base_layout, source.copy, source.layout, source.mesh)
            source.generation += 1
            _increment_version((source.base,))
        sources = [source.base_source for source in sources if source.base_source is not None]


def write_back(op, dtensor, local: torch.Tensor, layout: Layout, mesh) -> None:
    """An in-place op ran on a redistributed copy: store the new value into the DTensor's own shard."""
    _store(op, dtensor._local_tensor, dtensor.sharding, local, layout, mesh)


def _store(op, target: torch.Tensor, target_layout: Layout, local: torch.Tensor, layout: Layout, mesh) -> None:
    """Store `local` (in `layout`) into the shard `target` (in `target_layout`, which may be Partial)."""
    kept = target_layout.without_partial()
    coordinate = mesh.get_coordinate()
    if tuple(local.shape) != layout.local_shape(coordinate):
        raise NotImplementedError(f"{op} changed the shape of a DTensor in place; this is not supported")
    value = redistribute_local_tensor(local, layout, kept, mesh) if layout != kept else local
    target.copy_(target_layout.operand_of(value, coordinate))


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
