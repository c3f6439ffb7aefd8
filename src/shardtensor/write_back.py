"""Ops that write: which arguments an op mutates, and how the new value reaches a DTensor.

An in-place or `out=` op whose input had to move ran on a redistributed copy: `write_back` stores
the copy's new value into the DTensor's own shard. An op that resizes what it writes (`addbmm_` of
a broadcast `self`, an empty `out=`) gets its functional result (`write_resized`). In-place views
(`squeeze_`, `t_`) give a DTensor a new spec (`inplace_view`). A view of a moved copy is marked, and
writing into it raises instead of being silently lost.

The functions take the DTensor class as an argument where they must tell DTensors from plain
tensors: this layer is below the class (`dtensor.py`), which passes itself through its hooks.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten

from .layout import Layout
from .placement import Shard
from .redistribute import redistribute_local_tensor

__all__ = [
    "written", "mutated", "writes", "returns_view", "mark_views_of_copies", "refuse_writes_into_views_of_copies",
    "write_back", "write_resized", "inplace_view",
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


def mark_views_of_copies(dtensor_class: type, result):
    """A view op whose input had to move returns a view of the moved copy, not of the input: mark it.

    Reading it is exact; writing into it in place would never reach the input, so such writes raise
    (`refuse_writes_into_views_of_copies`) instead of being silently lost.
    """
    for output in tree_flatten(result)[0]:
        if isinstance(output, dtensor_class):
            output._view_of_copy = True
    return result


def refuse_writes_into_views_of_copies(op, mutated_dtensors: list) -> None:
    for dtensor in mutated_dtensors:
        if dtensor._view_of_copy:
            raise RuntimeError(
                f"{op} writes in place into a DTensor that is a view of a redistributed copy (a view op "
                f"whose input had to move, e.g. through the replicate fallback): the write would not reach "
                f"the tensor it views. Placements of the view: {list(dtensor.placements)}. Redistribute the "
                f"base tensor to a layout the view op keeps (often Replicate) before taking the view, or "
                f"write with an out-of-place op and copy_ into the base"
            )


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
