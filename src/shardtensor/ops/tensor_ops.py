"""Sharding rules for tensor ops: copies, fills, indexing, scatter/gather, sorting, masks, new_*.

Most rows keep a shard on every dim the op does not index, sort, flip or roll along; the dim it
works along must be whole (Replicate). Index tensors and masks may be plain torch tensors: these
rules accept them as Replicate (`accepts_plain_tensors`). A Partial passes through ops that only
pick or move elements (gather, index, tril), and through linear ones where that is exact. Rules
of ops that read index values declare them (`TensorOpRule(rows, indices)`), so that an index out
of range raises on every rank alike (`index_checks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layout import Layout, contiguous_stride
from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..rules import OpCall, Row, RowsRule
from .common import dim_argument
from .index_checks import IndexArgument, with_index_checks
from .registry import aten, pointwise, register_rule, same_layout

__all__ = ["TensorOpRule"]

R = Replicate()


class TensorOpRule(RowsRule):
    """Rows from a function; plain tensor arguments (indices, masks) join as Replicate inputs.

    `indices` declares the arguments holding index values: the local op checks them so that a bad
    value raises on every rank alike (`index_checks`).
    """

    accepts_plain_tensors = True

    def __init__(self, rows, indices: tuple[IndexArgument, ...] = ()):
        super().__init__(rows)
        self.indices = indices

    def rows_for_layouts(self, call, layouts):
        return only_matching_pieces(self.rows(call), layouts)

    def local_op(self, call, input_layouts, coordinate):
        return with_index_checks(None, call, input_layouts, self.indices) if self.indices else None


def only_matching_pieces(rows: list[Row], layouts) -> list[Row]:
    """Drop rows that shard two inputs alike unless their pieces surely match.

    A redistributed input gets `torch.chunk` pieces, so inputs co-sharded on a dim line up only
    when none carries other (uneven, explicit or reordered) pieces.
    """
    if all(layout.is_chunked() and layout.has_default_shard_order() for layout in layouts):
        return rows
    return [row for row in rows if sum(isinstance(p, Shard) for p in row.inputs) < 2]


def _partials(inputs: tuple, reduce_ops=REDUCE_OPS) -> list[Row]:
    """Pass-through Partial rows: `inputs` marks each input with True (Partial) or False (Replicate)."""
    return [Row((Partial(op),), tuple(Partial(op) if partial else R for partial in inputs)) for op in reduce_ops]


def copy_rows(call: OpCall) -> list[Row]:
    """copy_(self, src): the source moves to the destination's layout (broadcasting like pointwise)."""
    destination = call.inputs[0]
    if len(call.inputs) == 1:  # a 0-d plain source: a value, not a Partial summand
        return [Row((R,), (R,))] + [Row((Shard(d),), (Shard(d),)) for d in range(destination.ndim)]
    source = call.inputs[1]
    rows = [Row((R,), (R, R))]
    for dim in range(destination.ndim):
        source_dim = dim - (destination.ndim - source.ndim)
        spans = source_dim >= 0 and source.shape[source_dim] == destination.shape[dim]
        rows.append(Row((Shard(dim),), (Shard(dim), Shard(source_dim) if spans else R)))
    return rows + _partials((True, True))


def fill_rows(call: OpCall) -> list[Row]:
    """fill_/zero_: every rank writes the same value, which stays right for Partial(avg/max/min),
    and for sum/product only when it is their identity-absorbing zero (zero_)."""
    extra = (R,) * (len(call.inputs) - 1)  # fill_.Tensor with a DTensor value
    rows = [Row((R,), (R,) + extra)] + [Row((Shard(d),), (Shard(d),) + extra) for d in range(call.inputs[0].ndim)]
    value = 0 if call.op in (aten.zero_.default,) else call.argument("value")
    reduce_ops = REDUCE_OPS if value == 0 and not extra else ("avg", "max", "min")
    return rows + [Row((Partial(op),), (Partial(op),) + extra) for op in reduce_ops]


def index_select_rows(call: OpCall) -> list[Row]:
    """index_select(self, dim, index): shards of other dims stay; a sharded index shards `dim`."""
    dim = dim_argument(call)
    rows = [Row((R,), (R, R))]
    rows += [Row((Shard(d),), (Shard(d), R)) for d in range(call.inputs[0].ndim) if d != dim]
    if call.inputs[0].ndim and call.inputs[1].ndim:
        rows.append(Row((Shard(dim),), (R, Shard(0))))
    return rows + _partials((True, False))


def index_add_rows(call: OpCall) -> list[Row]:
    """index_add(self, dim, index, source): linear in (self, source) jointly, so Partial(sum) stays."""
    dim = dim_argument(call)
    rows = [Row((R,), (R, R, R))]
    rows += [Row((Shard(d),), (Shard(d), R, Shard(d))) for d in range(call.inputs[0].ndim) if d != dim]
    return rows + _partials((True, False, True), ("sum",))


def _spanning_dims(call: OpCall, dim: int) -> list[int]:
    """Dims other than `dim` where every tensor input has the full size of the first one."""
    first = call.inputs[0]
    return [
        d for d in range(first.ndim)
        if d != dim and all(meta.ndim == first.ndim and meta.shape[d] == first.shape[d] for meta in call.inputs)
    ]


def gather_rows(call: OpCall) -> list[Row]:
    """gather(self, dim, index): out[i][j] = self[i][index[i][j]] (dim 1). Along `dim` the output
    follows the index with self whole; along another dim self must be sharded alike, since output
    row i reads self's global row i."""
    dim = dim_argument(call)
    rows = [Row((R,), (R, R))]
    rows += [Row((Shard(d),), (Shard(d), Shard(d))) for d in _spanning_dims(call, dim)]
    if dim < call.inputs[1].ndim:
        rows.append(Row((Shard(dim),), (R, Shard(dim))))
    return rows + _partials((True, False))


def scatter_rows(call: OpCall) -> list[Row]:
    """scatter*(self, dim, index, src): co-sharded on a dim where self, index and src agree.

    scatter_add is linear in (self, src): Partial(sum) stays when the index is replicated.
    """
    dim = dim_argument(call)
    inputs = len(call.inputs)
    rows = [Row((R,), (R,) * inputs)]
    rows += [Row((Shard(d),), (Shard(d),) * inputs) for d in _spanning_dims(call, dim)]
    if call.op in (aten.scatter_add.default, aten.scatter_add_.default) and inputs == 3:
        rows += _partials((True, False, True), ("sum",))
    return rows


def _index_layout(call: OpCall) -> tuple[dict[int, int], int] | None:
    """For index.Tensor/index_put: {non-indexed self dim: result dim}, and the result's ndim.

    None for boolean masks (their result size depends on the data).
    """
    self_meta = call.inputs[0]
    indices = call.argument("indices")
    index_metas = [index for index in indices if index is not None]
    if any(getattr(index, "dtype", None) in (torch.bool, torch.uint8) for index in index_metas):
        return None
    indexed = [position for position, index in enumerate(indices) if index is not None]
    broadcast_ndim = max((len(getattr(index, "shape", ())) for index in index_metas), default=0)
    kept = [dim for dim in range(self_meta.ndim) if dim not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    mapping = {}
    for rank, dim in enumerate(kept):
        if adjacent and dim < indexed[0]:
            mapping[dim] = dim
        elif adjacent:
            mapping[dim] = dim - len(indexed) + broadcast_ndim
        else:
            mapping[dim] = broadcast_ndim + rank
    return mapping, len(kept) + broadcast_ndim


def index_rows(call: OpCall) -> list[Row]:
    """x[index tensors]: dims not indexed keep their shard; index tensors are Replicate."""
    indices = (R,) * (len(call.inputs) - 1)
    rows = [Row((R,), (R,) + indices)]
    layout = _index_layout(call)
    if layout is not None:
        rows += [Row((Shard(out),), (Shard(dim),) + indices) for dim, out in layout[0].items()]
    return rows + _partials((True,) + (False,) * len(indices))


def index_put_rows(call: OpCall) -> list[Row]:
    """index_put(self, indices, values): a dim not indexed keeps its shard when values either span
    it (sharded alike) or broadcast along it (Replicate)."""
    indices = (R,) * (len(call.inputs) - 2)
    rows = [Row((R,), (R,) + indices + (R,))]
    layout = _index_layout(call)
    if layout is None:
        return rows
    mapping, result_ndim = layout
    self_meta, values = call.inputs[0], call.inputs[-1]
    for dim, out in mapping.items():
        value_dim = out - (result_ndim - values.ndim)
        if value_dim < 0 or values.shape[value_dim] == 1:
            rows.append(Row((Shard(dim),), (Shard(dim),) + indices + (R,)))
        elif values.shape[value_dim] == self_meta.shape[dim]:
            rows.append(Row((Shard(dim),), (Shard(dim),) + indices + (Shard(value_dim),)))
    return rows


def masked_fill_rows(call: OpCall) -> list[Row]:
    """masked_fill: elementwise; a Partial stays where every rank writing the same value is exact."""
    rows = pointwise(call)
    value = call.argument("value")
    if len(call.inputs) == 2 and not isinstance(value, torch.Tensor) and value is not None:
        reduce_ops = ["avg", "max", "min"] + ["sum"] * (value == 0) + ["product"] * (value in (0, 1))
        rows += _partials((True, False), reduce_ops)
    return rows


def _along_dim(outputs: int, removes_dim: Callable[[OpCall], bool]):
    """sort/topk/kthvalue: each output keeps shards of the other dims (shifted if `dim` goes)."""

    def rows(call: OpCall) -> list[Row]:
        dim = dim_argument(call)
        shift = removes_dim(call)
        result = [Row((R,) * outputs, (R,))]
        for d in range(call.inputs[0].ndim):
            if d != dim:
                out = d - 1 if shift and d > dim else d
                result.append(Row((Shard(out),) * outputs, (Shard(d),)))
        return result

    return rows


def flip_roll_rows(call: OpCall) -> list[Row]:
    """flip(self, dims), roll(self, shifts, dims): dims moved along stay whole; roll with no dims
    rolls the flattened tensor, so everything stays whole."""
    dims = list(call.argument("dims"))
    ndim = call.inputs[0].ndim
    moved = {dim % ndim for dim in dims} if dims else set(range(ndim))
    rows = [Row((R,), (R,))] + [Row((Shard(d),), (Shard(d),)) for d in range(ndim) if d not in moved]
    return rows + _partials((True,))


class TriangleRule(RowsRule):
    """tril/triu: every dim may stay sharded; each rank shifts `diagonal` by its shard's offsets."""

    def __init__(self):
        super().__init__(self._triangle_rows)

    @staticmethod
    def _triangle_rows(call: OpCall) -> list[Row]:
        rows = [Row((R,), (R,))] + [Row((Shard(d),), (Shard(d),)) for d in range(call.inputs[0].ndim)]
        return rows + _partials((True,))

    def local_arguments(self, call, input_layouts, coordinate):
        offsets = input_layouts[0].local_offset(coordinate)
        return call.with_arguments(diagonal=call.argument("diagonal") + offsets[-2] - offsets[-1])


class NewFactoryRule(RowsRule):
    """new_zeros/new_empty/new_ones/new_full/new_empty_strided: a fresh tensor of a global size.

    Its placement follows `self` where `self` is sharded on a dim the new tensor has (so that e.g.
    the backward of index_select builds its zeros where the gradient lives); each rank allocates
    only its shard. A Partial `self` gives Replicate: new values are not summands.
    """

    def __init__(self):
        super().__init__(self._factory_rows)

    @staticmethod
    def _factory_rows(call: OpCall) -> list[Row]:
        out_ndim = len(call.argument("size"))
        rows = [Row((R,), (R,))]
        rows += [Row((Shard(d) if d < out_ndim else R,), (Shard(d),)) for d in range(call.inputs[0].ndim)]
        return rows + [Row((R,), (Partial(op),)) for op in REDUCE_OPS]

    def local_arguments(self, call, input_layouts, coordinate):
        size = list(call.argument("size"))
        placements = [p if isinstance(p, Shard) and p.dim < len(size) else R for p in input_layouts[0].placements]
        local_size = list(Layout.create(input_layouts[0].mesh_shape, placements, size).local_shape(coordinate))
        if call.op == aten.new_empty_strided.default:
            return call.with_arguments(size=local_size, stride=list(contiguous_stride(local_size)))
        return call.with_arguments(size=local_size)


# What the index arguments index, with the range the op accepts on one device.
_ALONG_DIM = (IndexArgument("index", error=RuntimeError),)  # gather/scatter: 0 <= index < size(dim)
_SELECTED = (IndexArgument("index"),)  # index_select
_PER_POSITION = (IndexArgument("indices", dim="position", negative=True),)  # x[i, j], index_put

TENSOR_OP_RULES: list[tuple[list, object]] = [
    ([aten.copy_.default], TensorOpRule(copy_rows)),
    ([aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default], TensorOpRule(fill_rows)),
    ([aten.detach_.default], same_layout),
    ([aten.index_select.default], TensorOpRule(index_select_rows, _SELECTED)),
    ([aten.index_add.default, aten.index_add_.default], TensorOpRule(index_add_rows)),
    ([aten.gather.default], TensorOpRule(gather_rows, _ALONG_DIM)),
    ([aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_.src,
      aten.scatter_.value, aten.scatter_add.default, aten.scatter_add_.default, aten.scatter_reduce.two,
      aten.scatter_reduce_.two], TensorOpRule(scatter_rows, _ALONG_DIM)),
    ([aten.index.Tensor], TensorOpRule(index_rows, _PER_POSITION)),
    ([aten.index_put.default, aten.index_put_.default], TensorOpRule(index_put_rows, _PER_POSITION)),
    ([aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor],
     TensorOpRule(masked_fill_rows)),
    ([aten.sort.default, aten.sort.stable], _along_dim(2, lambda call: False)),
    ([aten.topk.default], _along_dim(2, lambda call: False)),
    ([aten.kthvalue.default], _along_dim(2, lambda call: not call.argument("keepdim"))),
    ([aten.flip.default, aten.roll.default], TensorOpRule(flip_roll_rows)),
    ([aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default], TriangleRule()),
    ([aten.new_zeros.default, aten.new_empty.default, aten.new_ones.default, aten.new_full.default,
      aten.new_empty_strided.default], NewFactoryRule()),
]

for tensor_ops, tensor_rule in TENSOR_OP_RULES:
    register_rule(tensor_ops, tensor_rule)
