"""Sharding rules for lookups and indexed writes: bucketize/searchsorted/isin, index_fill/index_copy/
index_reduce, take/put, masked_scatter, the `_unsafe_masked_index` pair, and linalg_cross.

Rows name inputs by their schema argument (`_row`), so optional tensors (a searchsorted `sorter`,
an index_fill `value` tensor, `out=`) need no positional bookkeeping. As in `tensor_ops`, index
tensors may be plain torch tensors (they join as Replicate). Partial inputs pass where the op only
picks elements or is linear in them; a written value that every rank writes alike keeps only the
Partials it is exact for (see `_same_value_reduce_ops`).
"""

from __future__ import annotations

import numbers

import torch

from ..placement import REDUCE_OPS, Partial, Placement, Replicate, Shard
from ..rules import OpCall, Row
from .common import dim_argument
from .index_checks import IndexArgument
from .registry import aten, pointwise, register_rule
from .tensor_ops import TensorOpRule

__all__ = ["LOOKUP_VALUES"]

R = Replicate()


def _named_row(names: list[str], output: Placement, placements: dict[str, Placement]) -> Row:
    """A row whose inputs are named by schema argument: unnamed ones Replicate, `out=` like the output."""
    return Row((output,), tuple(placements.get(name, output if name == "out" else R) for name in names))


def _same_value_reduce_ops(value) -> list[str]:
    """Partials that stay exact when every rank writes `value` at the same places: avg, max and min
    always; sum only for 0 and product only for 0 or 1 (any other value would count once per rank).
    A tensor value (unknown here) keeps avg, max and min."""
    reduce_ops = ["avg", "max", "min"]
    if isinstance(value, numbers.Number):
        reduce_ops += ["sum"] * (value == 0) + ["product"] * (value in (0, 1))
    return reduce_ops


# The elementwise values argument of each lookup op; the table (boundaries, test_elements,
# sorted_sequence) is read whole. searchsorted.Tensor_out takes the fallback: with two tensor keyword
# arguments (sorter, out) dispatch's name-sorted keywords would hand the local op them swapped.
LOOKUP_VALUES = {aten.bucketize: "self", aten.isin: "elements", aten.searchsorted: "self"}


def lookup_rows(call: OpCall) -> list[Row]:
    """Each value is looked up in a whole table, so the values (and the output) shard any dim. A
    batched searchsorted sequence (and its sorter) shards its leading dims together with the values.
    A Python-number value (bucketize.Scalar...) gives a 0-d output: Replicate only."""
    names = call.input_names()
    values_name = LOOKUP_VALUES[call.op.overloadpacket]
    rows = [_named_row(names, R, {})]
    if values_name not in names:
        return rows
    values = call.inputs[names.index(values_name)]
    sequence = call.inputs[names.index("sorted_sequence")] if "sorted_sequence" in names else None
    for dim in range(values.ndim):
        placements = {values_name: Shard(dim)}
        if sequence is not None and sequence.ndim > 1 and dim < values.ndim - 1:
            placements.update(sorted_sequence=Shard(dim), sorter=Shard(dim))
        rows.append(_named_row(names, Shard(dim), placements))
    return rows


def _other_dims(call: OpCall) -> list[int]:
    """The dims of `self` an index op does not index along."""
    dim = dim_argument(call)
    return [other for other in range(call.inputs[0].ndim) if other != dim]


def index_fill_rows(call: OpCall) -> list[Row]:
    """index_fill(self, dim, index, value): self keeps shards of the other dims; a Partial self
    stays Partial where every rank writing `value` is exact."""
    names = call.input_names()
    rows = [_named_row(names, R, {})] + [_named_row(names, Shard(d), {"self": Shard(d)}) for d in _other_dims(call)]
    return rows + [_named_row(names, Partial(op), {"self": Partial(op)}) for op in _same_value_reduce_ops(call.argument("value"))]


# index_reduce's reduce argument -> the Partial of self and source it keeps (mean has none).
_INDEX_REDUCE_PARTIAL = {"amax": ("max",), "amin": ("min",), "prod": ("product",), "mean": ()}


def index_copy_rows(call: OpCall) -> list[Row]:
    """index_copy / index_reduce(self, dim, index, source): self and source shard together on a dim
    other than `dim`; `index` is Replicate. Picking elements (index_copy) passes every Partial of
    self and source; index_reduce passes the Partial its reduction is (amax: max, prod: product)."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    rows += [_named_row(names, Shard(d), {"self": Shard(d), "source": Shard(d)}) for d in _other_dims(call)]
    reduce = call.argument("reduce")
    reduce_ops = REDUCE_OPS if reduce is None else _INDEX_REDUCE_PARTIAL[reduce]
    return rows + [_named_row(names, Partial(op), {"self": Partial(op), "source": Partial(op)}) for op in reduce_ops]


def take_rows(call: OpCall) -> list[Row]:
    """take(self, index): self (indexed flat) is whole; the output has the index's shape and shards
    like it; a Partial self passes (elements are only picked)."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    if "index" in names:
        index = call.inputs[names.index("index")]
        rows += [_named_row(names, Shard(d), {"index": Shard(d)}) for d in range(index.ndim)]
    return rows + [_named_row(names, Partial(op), {"self": Partial(op)}) for op in REDUCE_OPS]


def put_rows(call: OpCall) -> list[Row]:
    """put(self, index, source, accumulate): self is whole. Without accumulate the op picks
    elements (every Partial of self and source passes); with accumulate it is linear in (self,
    source), and shards of index and source (same shape) add their parts to a P(sum) self."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    if not call.argument("accumulate"):
        return rows + [_named_row(names, Partial(op), {"self": Partial(op), "source": Partial(op)}) for op in REDUCE_OPS]
    rows += [_named_row(names, Partial(op), {"self": Partial(op), "source": Partial(op)}) for op in ("sum", "avg")]
    if "index" in names and "source" in names:
        index, source = call.inputs[names.index("index")], call.inputs[names.index("source")]
        if index.shape == source.shape:
            rows += [
                _named_row(names, Partial("sum"), {"self": Partial("sum"), "index": Shard(d), "source": Shard(d)})
                for d in range(index.ndim)
            ]
    return rows


def masked_scatter_rows(call: OpCall) -> list[Row]:
    """masked_scatter(self, mask, source): the n-th True of the whole mask takes source's n-th
    element, so shards would need the counts before them: only Replicate, or Partials passing
    through (elements are only picked)."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    return rows + [_named_row(names, Partial(op), {"self": Partial(op), "source": Partial(op)}) for op in REDUCE_OPS]


def masked_scatter_backward_rows(call: OpCall) -> list[Row]:
    """masked_scatter_backward(grad, mask, sizes): the source's gradient, linear in grad."""
    names = call.input_names()
    return [_named_row(names, R, {})] + [_named_row(names, Partial(op), {"grad_output": Partial(op)}) for op in ("sum", "avg")]


def _index_shape_dims(call: OpCall, names: list[str], sharded: tuple[str, ...]) -> list[int]:
    """Dims of the broadcast index shape that every tensor named in `sharded` spans in full, when
    `indices` index every dim of self (then the output has the index shape); else none."""
    indices = call.argument("indices")
    if any(index is None for index in indices) or len(indices) != call.inputs[0].ndim:
        return []
    metas = [meta for name, meta in zip(names, call.inputs) if name in sharded]
    shape = torch.broadcast_shapes(*(meta.shape for meta in metas))
    return [
        dim for dim in range(len(shape))
        if all(meta.ndim == len(shape) and meta.shape[dim] == shape[dim] for meta in metas)
    ]


def masked_index_rows(call: OpCall) -> list[Row]:
    """_unsafe_masked_index(self, mask, indices, fill) = where(mask, self[indices], fill): self is
    whole, mask and indices shard with the output; a Partial self passes where writing `fill` on
    every rank is exact."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    for dim in _index_shape_dims(call, names, ("mask", "indices")):
        rows.append(_named_row(names, Shard(dim), {"mask": Shard(dim), "indices": Shard(dim)}))
    return rows + [_named_row(names, Partial(op), {"self": Partial(op)}) for op in _same_value_reduce_ops(call.argument("fill"))]


def masked_index_put_rows(call: OpCall) -> list[Row]:
    """_unsafe_masked_index_put_accumulate(self, mask, indices, values): adds the masked values into
    self, linear in (self, values); shards of mask, indices and values add their parts to P(sum)."""
    names = call.input_names()
    rows = [_named_row(names, R, {})]
    rows += [_named_row(names, Partial(op), {"self": Partial(op), "values": Partial(op)}) for op in ("sum", "avg")]
    for dim in _index_shape_dims(call, names, ("mask", "indices", "values")):
        placements = {"self": Partial("sum"), "mask": Shard(dim), "indices": Shard(dim), "values": Shard(dim)}
        rows.append(_named_row(names, Partial("sum"), placements))
    return rows


def cross_rows(call: OpCall) -> list[Row]:
    """linalg_cross(self, other, dim): pointwise with broadcasting except along the 3-vector `dim`;
    bilinear, so a Partial in one operand passes when the other is Replicate."""
    names = call.input_names()
    output_ndim = max(meta.ndim for meta in call.inputs)
    cross_dim = call.argument("dim") % output_ndim
    rows = [row for row in pointwise(call) if row.outputs[0] != Shard(cross_dim)]
    for op in ("sum", "avg"):
        rows += [_named_row(names, Partial(op), {"self": Partial(op)}), _named_row(names, Partial(op), {"other": Partial(op)})]
    return rows


# take/put index the flattened self; negative values count from the end.
_FLAT_INDEX = (IndexArgument("index", dim=None, negative=True),)
# searchsorted's sorter indexes the last dim of sorted_sequence (sharded with it when batched).
_SORTER = (IndexArgument("sorter", indexes="sorted_sequence", dim=-1, error=RuntimeError),)

INDEXING_RULES: list[tuple] = [
    ([aten.bucketize.Tensor, aten.bucketize.Scalar, aten.bucketize.Tensor_out, aten.isin.Tensor_Tensor,
      aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor, aten.isin.Tensor_Tensor_out], lookup_rows),
    # not searchsorted.Tensor_out: see `LOOKUP_VALUES`
    ([aten.searchsorted.Tensor, aten.searchsorted.Scalar], lookup_rows, _SORTER),
    ([aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, aten.index_fill_.int_Scalar,
      aten.index_fill_.int_Tensor], index_fill_rows),
    ([aten.index_copy.default, aten.index_copy_.default, aten.index_copy.out, aten.index_reduce.default,
      aten.index_reduce_.default, aten.index_reduce.out], index_copy_rows),
    ([aten.take.default, aten.take.out], take_rows, _FLAT_INDEX),
    ([aten.put.default, aten.put_.default], put_rows, _FLAT_INDEX),
    ([aten.masked_scatter.default, aten.masked_scatter_.default], masked_scatter_rows),
    ([aten.masked_scatter_backward.default], masked_scatter_backward_rows),
    ([aten._unsafe_masked_index.default], masked_index_rows),
    ([aten._unsafe_masked_index_put_accumulate.default], masked_index_put_rows),
    ([aten.linalg_cross.default, aten.linalg_cross.out], cross_rows),
]

for indexing_ops, indexing_rows, *index_arguments in INDEXING_RULES:
    register_rule(indexing_ops, TensorOpRule(indexing_rows, *index_arguments))
