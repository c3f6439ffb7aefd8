"""Sharding rules for views and shape ops, written as dimension maps.

A view moves elements without computing, so its rule only says where a shard of each input dim
lands in the output: a *dimension map*, a tuple of `KeptDim`. An input dim missing from the map
cannot stay sharded: its row requires Replicate there and the engine redistributes first. Every
Partial passes through, since moving elements commutes with a reduction over ranks.

Merging and splitting dims (`view`) keeps a shard on the outermost dim of a group when each
rank's piece stays contiguous and whole: a piece of `p` rows of the input dim is `p * inner_in`
elements, i.e. `p * inner_in / inner_out` rows of the output dim. When that is not whole for
every piece size the input could have, the rule does not offer the row (never silently wrong).

A `*_copy` op (`view_copy`, `t_copy`, ...) reuses its view's rule (`COPY_OF_VIEW`) and copies the
local view out. Shape ops that compute (pads, diagonals written into zeros) are in `shape_ops`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from ..layout import Layout
from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule
from .common import normalized_dim
from .registry import RULES, aten, register_rule

__all__ = ["KeptDim", "ViewRule", "CopyOfView", "view_dim_map"]


@dataclass(frozen=True, slots=True)
class KeptDim:
    """A shard of `input_dim` stays a shard of `output_dim` (pieces scale by `inner_in / inner_out`)."""

    input_dim: int
    output_dim: int
    inner_in: int = 1
    inner_out: int = 1

    def always_whole(self) -> bool:
        return self.inner_in % self.inner_out == 0

    def whole(self, pieces: Sequence[int]) -> bool:
        return all(piece * self.inner_in % self.inner_out == 0 for piece in pieces)

    def local_size(self, piece: int) -> int:
        return piece * self.inner_in // self.inner_out


DimMap = Callable[[OpCall], Sequence[KeptDim]]


def view_dim_map(input_shape: Sequence[int], output_shape: Sequence[int]) -> tuple[KeptDim, ...]:
    """Group dims whose products match; the outermost dim of each group carries its shard.

    Size-1 dims belong to no group (they are new or removed), and so do all dims of an empty tensor.
    """
    if math.prod(input_shape) == 0:
        return ()
    input_dims = [dim for dim, size in enumerate(input_shape) if size != 1]
    output_dims = [dim for dim, size in enumerate(output_shape) if size != 1]
    kept, position_in, position_out = [], 0, 0
    while position_in < len(input_dims) and position_out < len(output_dims):
        first_in, first_out = input_dims[position_in], output_dims[position_out]
        product_in, product_out = input_shape[first_in], output_shape[first_out]
        position_in, position_out = position_in + 1, position_out + 1
        while product_in != product_out:
            if product_in < product_out:
                product_in *= input_shape[input_dims[position_in]]
                position_in += 1
            else:
                product_out *= output_shape[output_dims[position_out]]
                position_out += 1
        inner_in = product_in // input_shape[first_in]
        inner_out = product_out // output_shape[first_out]
        kept.append(KeptDim(first_in, first_out, inner_in, inner_out))
    return tuple(kept)


def _output_shape(call: OpCall) -> tuple[int, ...]:
    return call.global_output_metas()[0].shape


class ViewRule(ShardingRule):
    """Rows from a dimension map: Replicate, one Shard row per kept dim, and every Partial.

    `size_argument` names the argument that holds the output's global sizes (`view`'s `size`,
    `slice_backward`'s `input_sizes`); each coordinate gets its local sizes there. All tensor inputs
    (the list of `cat`) and all outputs (the list of `split`) share a row's placement. `partials`
    are the reduce ops that pass through: all of them for ops that only move elements or fill
    zeros, fewer for ops that add elements up (`unfold_backward`).
    """

    def __init__(self, dim_map: DimMap, *, size_argument: str | None = None, name: str = "",
                 partials: Sequence[str] = REDUCE_OPS):
        self.dim_map = dim_map
        self.size_argument = size_argument
        self.partials = tuple(partials)
        self.__name__ = name or dim_map.__name__

    def _rows(self, call: OpCall, kept: Sequence[KeptDim]) -> list[Row]:
        inputs = len(call.inputs)
        outputs = len([meta for meta in call.global_output_metas() if meta is not None])
        rows = [Row((Replicate(),) * outputs, (Replicate(),) * inputs)]
        rows += [Row((Shard(k.output_dim),) * outputs, (Shard(k.input_dim),) * inputs) for k in kept]
        return rows + [Row((Partial(op),) * outputs, (Partial(op),) * inputs) for op in self.partials]

    def rows(self, call: OpCall) -> list[Row]:
        """Metadata only: the rows that are right whatever the shard sizes."""
        return self._rows(call, [k for k in self.dim_map(call) if k.always_whole()])

    def rows_for_layouts(self, call: OpCall, layouts: Sequence[Layout]) -> list[Row]:
        """Also keep a split dim's shard when every piece the input can have splits into whole rows."""
        kept = list(self.dim_map(call))
        while True:
            keepable = {k.input_dim for k in kept}
            valid = [k for k in kept if k.always_whole() or _whole_in_every_target(k, layouts[0], keepable)]
            if len(valid) == len(kept):
                return self._rows(call, valid)
            kept = valid

    def local_arguments(self, call, input_layouts, coordinate):
        if self.size_argument is None:
            return None
        layout = input_layouts[0]
        local_shape = layout.local_shape(coordinate)
        sizes = list(_output_shape(call))
        for k in self.dim_map(call):
            if layout.shard_order[k.input_dim]:
                sizes[k.output_dim] = k.local_size(local_shape[k.input_dim])
        return call.with_arguments(**{self.size_argument: sizes})

    def shapes_follow_local_inputs(self, call: OpCall) -> bool:
        """The local sizes come from the input's local shape alone (subclasses reading offsets do not)."""
        rule = type(self)
        return rule.local_arguments is ViewRule.local_arguments and rule.local_shape_key is ShardingRule.local_shape_key


def _whole_in_every_target(kept: KeptDim, layout: Layout, keepable: set[int]) -> bool:
    """Check every piece sizes the engine may give the input dim before the view runs.

    Mesh dims sharding this dim keep their pieces; a mesh dim sharding a dim the view cannot keep
    may move to this dim (re-chunking it); Replicate and Partial mesh dims stay as they are.
    """
    holders = [m for m, p in enumerate(layout.placements) if p == Shard(kept.input_dim)]
    movable = [m for m, p in enumerate(layout.placements) if isinstance(p, Shard) and p.dim not in keepable]
    for count in range(len(movable) + 1):
        for extra in itertools.combinations(movable, count):
            sharding = set(holders) | set(extra)
            placements = [Shard(kept.input_dim) if m in sharding else Replicate() for m in range(layout.mesh_ndim)]
            if not kept.whole(layout.with_placements(placements).pieces[kept.input_dim]):
                return False
    return True


# ---- dimension maps, one per op family ------------------------------------------------------------


def reshaped(call: OpCall) -> tuple[KeptDim, ...]:
    """view, _unsafe_view, squeeze, unsqueeze: inferred from the two shapes."""
    return view_dim_map(call.inputs[0].shape, _output_shape(call))


def permuted(call: OpCall) -> tuple[KeptDim, ...]:
    """transpose, permute, t: output dim `o` is input dim `order[o]`."""
    ndim = call.inputs[0].ndim
    if call.op == aten.permute.default:
        order = [normalized_dim(dim, ndim) for dim in call.argument("dims")]
    elif ndim == 0 or (call.op == aten.t.default and ndim < 2):  # transpose(scalar, 0, 0) is allowed
        order = list(range(ndim))
    else:
        first, second = (call.argument("dim0"), call.argument("dim1")) if call.op == aten.transpose.int else (0, 1)
        order = list(range(ndim))
        first, second = normalized_dim(first, ndim), normalized_dim(second, ndim)
        order[first], order[second] = order[second], order[first]
    return tuple(KeptDim(input_dim, output_dim) for output_dim, input_dim in enumerate(order))


def expanded(call: OpCall) -> tuple[KeptDim, ...]:
    """expand: a dim broadcast from size 1 cannot stay sharded; new leading dims come from nowhere."""
    input_shape = call.inputs[0].shape
    output_shape = _output_shape(call)
    offset = len(output_shape) - len(input_shape)
    return tuple(
        KeptDim(dim, dim + offset) for dim, size in enumerate(input_shape) if size == output_shape[dim + offset]
    )


def repeated(call: OpCall) -> tuple[KeptDim, ...]:
    """repeat: dims repeated once keep their shard (the local repeat is the global one)."""
    repeats = call.argument("repeats")
    offset = len(repeats) - call.inputs[0].ndim
    return tuple(KeptDim(dim, dim + offset) for dim in range(call.inputs[0].ndim) if repeats[dim + offset] == 1)


def _all_but(ndim: int, removed: int, *, shift: int = 0) -> tuple[KeptDim, ...]:
    """Every dim except `removed`; dims after it move by `shift` (-1 when it disappears, +1 when added)."""
    return tuple(KeptDim(dim, dim + shift if dim > removed else dim) for dim in range(ndim) if dim != removed)


def split_along(call: OpCall) -> tuple[KeptDim, ...]:
    """split, split_with_sizes, cat: the dim cut or joined must be whole on every rank."""
    ndim = call.inputs[0].ndim
    return _all_but(ndim, normalized_dim(call.argument("dim"), ndim))


def removed_dim(call: OpCall) -> tuple[KeptDim, ...]:
    """unbind, select: the dim disappears, later dims move up."""
    ndim = call.inputs[0].ndim
    return _all_but(ndim, normalized_dim(call.argument("dim"), ndim), shift=-1)


def stacked(call: OpCall) -> tuple[KeptDim, ...]:
    """stack: a new dim at `dim`; input dims from `dim` on move down one."""
    ndim = call.inputs[0].ndim
    new_dim = normalized_dim(call.argument("dim"), ndim + 1)
    return tuple(KeptDim(dim, dim + 1 if dim >= new_dim else dim) for dim in range(ndim))


def select_backward_map(call: OpCall) -> tuple[KeptDim, ...]:
    """select_backward(grad, input_sizes, dim, index): the selected dim comes back."""
    new_dim = normalized_dim(call.argument("dim"), len(call.argument("input_sizes")))
    return tuple(KeptDim(dim, dim + 1 if dim >= new_dim else dim) for dim in range(call.inputs[0].ndim))


def slice_backward_map(call: OpCall) -> tuple[KeptDim, ...]:
    """slice_backward(grad, input_sizes, dim, ...): the sliced dim is rebuilt whole (Replicate)."""
    ndim = call.inputs[0].ndim
    return _all_but(ndim, normalized_dim(call.argument("dim"), ndim))


def unfolded(call: OpCall) -> tuple[KeptDim, ...]:
    """unfold(self, dimension, size, step): windows of `dimension` overlap shards, so it is Replicate;
    the other dims keep their place (the window dim is a new last dim)."""
    ndim = call.inputs[0].ndim
    return tuple(KeptDim(dim, dim) for dim in range(ndim) if dim != normalized_dim(call.argument("dimension"), ndim))


def unfold_backward_map(call: OpCall) -> tuple[KeptDim, ...]:
    """unfold_backward(grad, input_sizes, dim, size, step): the unfolded dim and the window dim are
    summed back into the input's dim (Replicate); the other dims keep their place."""
    ndim = len(call.argument("input_sizes"))
    return tuple(KeptDim(dim, dim) for dim in range(ndim) if dim != normalized_dim(call.argument("dim"), ndim))


def nothing_kept(call: OpCall) -> tuple[KeptDim, ...]:
    """as_strided addresses storage directly: only a whole (Replicate) tensor is safe."""
    return ()


def identity_map(call: OpCall) -> tuple[KeptDim, ...]:
    return tuple(KeptDim(dim, dim) for dim in range(call.inputs[0].ndim))


class SliceRule(ViewRule):
    """slice: other dims keep their shard; the sliced dim too, each rank slicing its own piece.

    The result is unevenly sharded (exact pieces come from the engine's per-coordinate evaluation).
    """

    def __init__(self):
        super().__init__(identity_map, name="slice")

    def local_arguments(self, call, input_layouts, coordinate):
        layout = input_layouts[0]
        dim = normalized_dim(call.argument("dim"), layout.ndim)
        start, end, step = call.argument("start"), call.argument("end"), call.argument("step")
        if not layout.shard_order[dim]:
            return None
        start, end, step = slice(start, end, step).indices(layout.shape[dim])
        end = max(end, start)
        offset = layout.local_offset(coordinate)[dim]
        piece_end = offset + layout.local_shape(coordinate)[dim]
        first = start + -(-max(offset - start, 0) // step) * step
        local_end = min(end, piece_end) - offset
        local_start = min(first - offset, max(local_end, 0))
        return call.with_arguments(dim=dim, start=local_start, end=max(local_end, local_start), step=step)


class SqueezeRule(ViewRule):
    """squeeze: removes the dims of global size 1 only (a shard of one row is not a size-1 dim)."""

    def __init__(self):
        super().__init__(reshaped, name="squeeze")

    def local_op(self, call, input_layouts, coordinate):
        shape = call.inputs[0].shape
        requested = call.argument("dim")
        requested = range(len(shape)) if requested is None else requested
        requested = [requested] if isinstance(requested, int) else requested
        dims = [dim % len(shape) for dim in requested if shape[dim] == 1] if shape else []
        return lambda mesh, local, *arguments: aten.squeeze.dims(local, dims)


class DiagonalRule(ViewRule):
    """diagonal(self, offset, dim1, dim2): other dims keep their shard; a shard of dim1 or dim2 becomes
    a shard of the new last dim, each rank shifting `offset` by its piece's offsets (as tril/triu do).

    The result is a view of the local shard, so in-place writes through it (the backward of
    `linalg.qr` halves a diagonal in place) reach the input. Only one of dim1/dim2 may stay sharded:
    a rank holding a block of rows and columns would hold a diagonal piece no placement describes.
    """

    def __init__(self):
        super().__init__(self._kept, name="diagonal")

    @staticmethod
    def _diagonal_dims(call: OpCall) -> tuple[int, int, int]:
        ndim = call.inputs[0].ndim
        offset = call.argument("offset")
        return offset, normalized_dim(call.argument("dim1"), ndim), normalized_dim(call.argument("dim2"), ndim)

    def _kept(self, call: OpCall) -> tuple[KeptDim, ...]:
        """The other dims in order, then dim1 (and dim2, see `rows_for_layouts`) onto the last dim."""
        ndim = call.inputs[0].ndim
        _, dim1, dim2 = self._diagonal_dims(call)
        others = [dim for dim in range(ndim) if dim not in (dim1, dim2)]
        kept = [KeptDim(dim, position) for position, dim in enumerate(others)]
        return tuple(kept + [KeptDim(dim1, len(others)), KeptDim(dim2, len(others))])

    def rows_for_layouts(self, call: OpCall, layouts: Sequence[Layout]) -> list[Row]:
        _, dim1, dim2 = self._diagonal_dims(call)
        # Offer one diagonal dim only: the one the input is sharded on (dim1 when it is both).
        dropped = dim1 if not layouts[0].shard_order[dim1] and layouts[0].shard_order[dim2] else dim2
        return self._rows(call, [k for k in self._kept(call) if k.input_dim != dropped])

    def rows(self, call: OpCall) -> list[Row]:
        _, dim1, dim2 = self._diagonal_dims(call)
        return self._rows(call, [k for k in self._kept(call) if k.input_dim != dim2])

    def local_arguments(self, call, input_layouts, coordinate):
        offset, dim1, dim2 = self._diagonal_dims(call)
        offsets = input_layouts[0].local_offset(coordinate)
        return call.with_arguments(offset=offset + offsets[dim1] - offsets[dim2], dim1=dim1, dim2=dim2)


class CopyOfView(ShardingRule):
    """A `*_copy` op (`view_copy`, `t_copy`, ...): the rule of its view, and a copy of the local view.

    The view's rule sees the call as the view's (`to_view` rewrites the call where the schemas
    differ: `narrow_copy` is a `slice`); each rank runs the view on its shard and copies the result
    out contiguously, so the output never aliases the input.
    """

    def __init__(self, view_op, to_view: Callable[[OpCall], OpCall] | None = None):
        self.view_op = view_op
        self.view_rule = RULES[view_op]
        self.to_view = to_view
        self.__name__ = f"copy of {view_op}"

    def _view_call(self, call: OpCall) -> OpCall:
        if self.to_view is not None:
            return self.to_view(call)
        return dataclasses.replace(call, op=self.view_op)

    def rows(self, call):
        return self.view_rule.rows(self._view_call(call))

    def rows_for_layouts(self, call, layouts):
        return self.view_rule.rows_for_layouts(self._view_call(call), layouts)

    def local_arguments(self, call, input_layouts, coordinate):
        view_call = self._view_call(call)
        arguments = self.view_rule.local_arguments(view_call, input_layouts, coordinate)
        if arguments is None and self.to_view is not None:
            return view_call.args, dict(view_call.kwargs)
        return arguments

    def local_op(self, call, input_layouts, coordinate):
        view = self.view_rule.local_op(self._view_call(call), input_layouts, coordinate)
        view_op = self.view_op

        def copy_of_view(mesh, *args, **kwargs):
            result = view_op(*args, **kwargs) if view is None else view(mesh, *args, **kwargs)
            return tree_map(lambda tensor: tensor.clone(memory_format=torch.contiguous_format), result)

        return copy_of_view


def narrow_as_slice(call: OpCall) -> OpCall:
    """narrow_copy(self, dim, start, length) is slice(self, dim, start, start + length)."""
    dim, start, length = call.argument("dim"), call.argument("start"), call.argument("length")
    start = start % call.inputs[0].shape[normalized_dim(dim, call.inputs[0].ndim)] if start < 0 else start
    return dataclasses.replace(call, op=aten.slice.Tensor, args=(call.argument("self"), dim, start, start + length, 1),
                               kwargs=())


VIEW_RULES: list[tuple[list, ShardingRule]] = [
    ([aten.view.default, aten._unsafe_view.default], ViewRule(reshaped, size_argument="size")),
    ([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims], SqueezeRule()),
    ([aten.unsqueeze.default], ViewRule(reshaped)),
    ([aten.transpose.int, aten.permute.default, aten.t.default], ViewRule(permuted)),
    ([aten.expand.default], ViewRule(expanded, size_argument="size")),
    ([aten.repeat.default], ViewRule(repeated)),
    (
        [aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default, aten.unsafe_split.Tensor,
         aten.unsafe_split_with_sizes.default],
        ViewRule(split_along),
    ),
    ([aten.unbind.int, aten.select.int], ViewRule(removed_dim)),
    ([aten.stack.default], ViewRule(stacked)),
    ([aten.slice.Tensor], SliceRule()),
    ([aten.select_backward.default], ViewRule(select_backward_map, size_argument="input_sizes")),
    ([aten.slice_backward.default], ViewRule(slice_backward_map, size_argument="input_sizes")),
    ([aten.as_strided.default], ViewRule(nothing_kept)),
    ([aten.diagonal.default], DiagonalRule()),
    ([aten.unfold.default], ViewRule(unfolded)),
    # Overlapping windows add up in the backward: only the Partials that commute with a sum.
    ([aten.unfold_backward.default], ViewRule(unfold_backward_map, size_argument="input_sizes", partials=("sum", "avg"))),
]

for view_ops, view_rule in VIEW_RULES:
    register_rule(view_ops, view_rule)

# Each `*_copy` op and the view whose rule it reuses.
COPY_OF_VIEW = {
    aten.alias_copy.default: aten.alias.default,
    aten.detach_copy.default: aten.detach.default,
    aten.view_copy.default: aten.view.default,
    aten.squeeze_copy.default: aten.squeeze.default,
    aten.squeeze_copy.dim: aten.squeeze.dim,
    aten.squeeze_copy.dims: aten.squeeze.dims,
    aten.unsqueeze_copy.default: aten.unsqueeze.default,
    aten.t_copy.default: aten.t.default,
    aten.transpose_copy.int: aten.transpose.int,
    aten.permute_copy.default: aten.permute.default,
    aten.expand_copy.default: aten.expand.default,
    aten.split_copy.Tensor: aten.split.Tensor,
    aten.split_with_sizes_copy.default: aten.split_with_sizes.default,
    aten.unbind_copy.int: aten.unbind.int,
    aten.select_copy.int: aten.select.int,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.diagonal_copy.default: aten.diagonal.default,
    aten.unfold_copy.default: aten.unfold.default,
    aten.as_strided_copy.default: aten.as_strided.default,
}

for copy_op, view_op in COPY_OF_VIEW.items():
    register_rule([copy_op], CopyOfView(view_op))
register_rule([aten.narrow_copy.default], CopyOfView(aten.slice.Tensor, narrow_as_slice))
