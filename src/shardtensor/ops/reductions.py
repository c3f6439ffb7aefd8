"""Sharding rules: reductions (sum, mean, prod, amax/amin, max/min, argmax/argmin, var/std, vector
norm, any/all, logsumexp) and scans along a dim (cumsum, cumprod, cummax/cummin, logcumsumexp).

A dim that is not reduced keeps its shard. Reducing a sharded dim gives a Partial output when the
shards' results combine exactly (sum -> P(sum), amax -> P(max), prod -> P(product), any -> P(max)
of bools); otherwise (indices, variances, logsumexp) the dim is gathered first. `mean` of a sharded
dim runs `sum / global count` on each shard, a P(sum) that is exact for uneven shards. An empty
shard of a max-like reduction counts as the reduce op's identity instead of raising on that rank
only (when the reduced dim is empty globally, every rank raises, as one device does). Partial
inputs pass through only linear-in-the-reduce-op reductions (sum of P(sum)); max, var, ... of a
Partial reduce it first. Median and mode need the whole reduced dim; `dist`, `histc`
(with an explicit range) and `trace` have their own small rules below.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import comm
from ..layout import Layout
from ..placement import NormPartial, Partial, Replicate, Shard
from ..rules import LocalCollective, OpCall, Row, ShardingRule, TensorMeta
from .common import dim_argument, normalized_dim
from .registry import aten, pointwise, register_rule
from .tensor_ops import TensorOpRule

__all__ = ["ReductionRule", "VectorNormRule", "ScanRule"]


def _tensor_outputs(call: OpCall) -> int:
    return len(call.op._schema.returns)


def _reduce_empty_as_identity(op, dims: tuple[int, ...], fill, mesh, tensor, *args, **kwargs):
    """`op` on a shard whose reduced `dims` may be empty: an empty shard reduces to the identity."""
    if any(tensor.shape[dim] == 0 for dim in dims):
        shape = [1 if dim in dims and size == 0 else size for dim, size in enumerate(tensor.shape)]
        tensor = tensor.new_full(shape, fill)
    return op(tensor, *args, **kwargs)


def _globally_empty(call: OpCall, reduced: tuple[int, ...]) -> bool:
    """Whether a reduced dim of the global input has no elements: then every shard is empty there
    too, and the op itself must run so that it raises on every rank as on one device (max() of an
    empty tensor), instead of each shard reading as the identity."""
    return any(call.inputs[0].shape[dim] == 0 for dim in reduced)


def _local_mean(count: int, mesh, tensor, dim=None, keepdim=False, *, dtype=None):
    """This shard's share of the mean: its sum over the reduced dims divided by the global count."""
    return aten.div.Scalar(aten.sum.dim_IntList(tensor, dim, keepdim, dtype=dtype), count)


@dataclass(frozen=True, slots=True)
class ReductionRule(ShardingRule):
    """A reduction over the dims named by its `dim` argument (all dims when absent, None or empty).

    `sharded_gives`: the Partial reduce op of the outputs when a reduced dim is sharded (a tuple:
    one per output, as aminmax's (min, max)), or None when shards cannot be combined (that dim is
    gathered). `partial_passes`: the Partial input reduce ops the output keeps (the reduction
    commutes with them). `empty_fill`: for a reduction that refuses an empty input (amax...),
    the reduce op whose identity (`Partial.identity`) an empty shard is read as: "max" (the lowest
    value), "min" (the highest), "sum" (0, the identity of a max of absolute values). `mean`: the
    local op is `sum / global count`.
    """

    sharded_gives: str | tuple[str, ...] | None = None
    partial_passes: tuple[str, ...] = ()
    empty_fill: str | None = None
    mean: bool = False

    @property
    def __name__(self) -> str:
        return f"reduction(sharded_gives={self.sharded_gives}, partial_passes={self.partial_passes})"

    def reduced_dims(self, call: OpCall) -> tuple[int, ...]:
        ndim = call.inputs[0].ndim
        dims = call.argument("dim")
        if dims is None or dims == () or dims == []:  # `[]` is the schema's default of `amax(dim=[])`
            return tuple(range(ndim))
        dims = (dims,) if isinstance(dims, int) else dims
        return tuple(sorted({normalized_dim(dim, ndim) for dim in dims}))

    def combine(self, call: OpCall) -> tuple[str | None, str | None]:
        """(Partial of a sharded reduced dim, fill of an empty shard) for this call."""
        return self.sharded_gives, self.empty_fill

    def rows(self, call: OpCall) -> Sequence[Row]:
        reduced = self.reduced_dims(call)
        keepdim = bool(call.argument("keepdim"))
        outputs = _tensor_outputs(call)
        sharded_gives, _ = self.combine(call)
        rows = [Row((Replicate(),) * outputs, (Replicate(),))]
        for dim in range(call.inputs[0].ndim):
            if dim not in reduced:
                output_dim = dim if keepdim else dim - len([other for other in reduced if other < dim])
                rows.append(Row((Shard(output_dim),) * outputs, (Shard(dim),)))
            elif isinstance(sharded_gives, tuple):
                rows.append(Row(tuple(Partial(reduce_op) for reduce_op in sharded_gives), (Shard(dim),)))
            elif sharded_gives is not None:
                gives = sharded_gives if isinstance(sharded_gives, Partial) else Partial(sharded_gives)
                rows.append(Row((gives,) * outputs, (Shard(dim),)))
        rows += [Row((Partial(reduce_op),) * outputs, (Partial(reduce_op),)) for reduce_op in self.partial_passes]
        return rows

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        reduced = self.reduced_dims(call)
        sharded = tuple(sorted({
            placement.dim for placement in input_layouts[0].placements
            if isinstance(placement, Shard) and placement.dim in reduced
        }))
        if not sharded or _globally_empty(call, reduced):
            return None  # every reduced dim is whole on this rank, or empty everywhere: the op itself is right
        if self.mean:
            count = math.prod(call.inputs[0].shape[dim] for dim in reduced)
            return functools.partial(_local_mean, count)
        _, fill = self.combine(call)
        if fill is None:
            return None
        return functools.partial(_reduce_empty_as_identity, call.op, sharded, Partial(fill).identity(call.inputs[0].dtype))


def _norm_combine(order) -> tuple[Partial | None, str | None]:
    """(the Partial a p-norm over a sharded dim gives, the reduce op whose identity an empty shard
    reads as): a NormPartial for orders > 0 (the empty shard of inf reads as 0, the identity of a
    max of |x|), a count's sum for 0, a min for -inf; None for negative orders (gathered)."""
    order = 2.0 if order is None else order
    if order == -math.inf:
        return Partial("min"), "min"
    if order == 0:
        return Partial("sum"), None
    if order > 0:
        return NormPartial(order), "sum" if order == math.inf else None
    return None, None


@dataclass(frozen=True, slots=True)
class VectorNormRule(ReductionRule):
    """`linalg_vector_norm` (order argument `ord`) and `norm` (`p`, None meaning 2): a sharded dim
    gives the Partial of its order (`_norm_combine`), and the norm of a NormPartial of the same
    order is one again (no reduction: clip_grad_norm_'s norm of norms); negative orders gather."""

    order_argument: str = "ord"

    @property
    def __name__(self) -> str:
        return "vector_norm"

    def combine(self, call: OpCall) -> tuple[str | Partial | None, str | None]:
        return _norm_combine(call.argument(self.order_argument))

    def rows(self, call: OpCall) -> Sequence[Row]:
        rows = list(ReductionRule.rows(self, call))  # slots dataclass: no zero-argument super()
        gives, _ = self.combine(call)
        if isinstance(gives, NormPartial):
            rows.append(Row((gives,) * _tensor_outputs(call), (gives,)))
        return rows


def _aminmax_empty_as_identity(mesh, tensor, *, dim=None, keepdim=False):
    """aminmax of a shard whose reduced dim may be empty: +inf-like minimum, -inf-like maximum."""
    dims = tuple(range(tensor.ndim)) if dim is None else (normalized_dim(dim, tensor.ndim),)
    if not any(tensor.shape[reduced] == 0 for reduced in dims):
        return aten.aminmax.default(tensor, dim=dim, keepdim=keepdim)
    shape = [1 if reduced in dims and size == 0 else size for reduced, size in enumerate(tensor.shape)]
    highest = tensor.new_full(shape, Partial("min").identity(tensor.dtype))
    lowest = tensor.new_full(shape, Partial("max").identity(tensor.dtype))
    minimum = aten.aminmax.default(highest, dim=dim, keepdim=keepdim)[0]
    return minimum, aten.aminmax.default(lowest, dim=dim, keepdim=keepdim)[1]


@dataclass(frozen=True, slots=True)
class AminmaxRule(ReductionRule):
    """`aminmax` -> (min, max): a sharded reduced dim gives (P(min), P(max)); an empty shard reads
    as each output's identity."""

    @property
    def __name__(self) -> str:
        return "aminmax"

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        reduced = self.reduced_dims(call)
        if _globally_empty(call, reduced):
            return None
        if any(isinstance(p, Shard) and p.dim in reduced for p in input_layouts[0].placements):
            return _aminmax_empty_as_identity
        return None


def _local_dist(identity_of: str, mesh, self, other, p=2):
    """dist of two shards whose broadcast difference may be empty: then the identity of
    `identity_of` (dist(a, b, p) = vector norm of a - b over every dim: shards combine like the norm's)."""
    if math.prod(torch.broadcast_shapes(self.shape, other.shape)) == 0:
        dtype = torch.promote_types(self.dtype, other.dtype)
        return self.new_full((), Partial(identity_of).identity(dtype), dtype=dtype)
    return aten.dist.default(self, other, p)


class DistRule(ShardingRule):
    """dist(self, other, p): the inputs shard like a pointwise difference; a sharded dim gives the
    Partial of the p-norm (`_norm_combine`: a NormPartial for p > 0), negative p only Replicate."""

    __name__ = "dist"

    def rows(self, call: OpCall) -> Sequence[Row]:
        combined, _ = _norm_combine(call.argument("p"))
        rows = pointwise(call)
        if combined is None:
            return rows[:1]
        return rows[:1] + [Row((combined,), row.inputs) for row in rows[1:]]

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        _, identity_of = _norm_combine(call.argument("p"))
        return None if identity_of is None else functools.partial(_local_dist, identity_of)


def _agreed_on_every_shard(op, mesh_dims: tuple[int, ...], mesh, *args, **kwargs) -> bool:
    """`op` (equal, allclose) on this rank's shards, then the AND of every shard's answer over
    `mesh_dims`, so that every rank returns the same bool."""
    local = torch.tensor(op(*args, **kwargs), device=args[0].device)
    return bool(comm.all_reduce(local, mesh, mesh_dims, reduce_op="min").item())


def _unequal_shapes(mesh, *args, **kwargs) -> bool:
    return False


class AllElementsRule(ShardingRule):
    """equal / allclose -> a Python bool: the inputs shard alike (broadcasting like pointwise) or stay
    Replicate; sharded, each rank answers for its shards and one all_reduce(min) of a bool over the
    sharded mesh dims gives every rank the answer for the whole tensors. A Partial is reduced first.
    `equal` of tensors of different shapes is False wherever they lie: nothing moves. On a sub-mesh
    the ranks outside it get the answer too, sent by the mesh (`sub_mesh`; torch's DTensor instead
    all_reduces equal's answer over the whole world on every call, whatever the mesh)."""

    __name__ = "all_elements"
    returns_value = True

    def rows(self, call: OpCall) -> Sequence[Row]:
        # A sharded row ANDs every shard's answer: one all_reduce of a bool (declared per mesh dim;
        # the local op makes it one collective over all sharded mesh dims).
        agreement = (LocalCollective("all_reduce", 1),)
        return [Row((), row.inputs, agreement if index else ()) for index, row in enumerate(pointwise(call))]

    def rows_for_layouts(self, call: OpCall, layouts: Sequence[Layout]) -> Sequence[Row]:
        if not self._unequal_shapes(call):
            return self.rows(call)
        first, second = ({*layout.placements} for layout in layouts)
        return [Row((), (one, other)) for one in first for other in second]

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        if self._unequal_shapes(call):
            return _unequal_shapes
        sharded = tuple(
            mesh_dim for mesh_dim in range(len(input_layouts[0].mesh_shape))
            if any(isinstance(layout.placements[mesh_dim], Shard) for layout in input_layouts)
        )
        return functools.partial(_agreed_on_every_shard, call.op, sharded) if sharded else None

    @staticmethod
    def _unequal_shapes(call: OpCall) -> bool:
        return call.op == aten.equal.default and call.inputs[0].shape != call.inputs[1].shape


def _with_out(call: OpCall, rows: list[Row]) -> list[Row]:
    """The rows of a one-input op, with its `out=` tensor (if given) placed like the output."""
    if len(call.inputs) == 1:
        return rows
    return [Row(row.outputs, row.inputs + row.outputs) for row in rows]


def histc_rows(call: OpCall) -> list[Row]:
    """histc(self, bins, min, max): each element falls in one bin, so shards' histograms sum to the
    whole one (P(sum)), but only for an explicit range: min == max takes it from the data."""
    rows = [Row((Replicate(),), (Replicate(),))]
    if call.argument("min") < call.argument("max"):
        rows += [Row((Partial("sum"),), (Shard(dim),)) for dim in range(call.inputs[0].ndim)]
    return _with_out(call, rows)


class HistogramRule(ShardingRule):
    """histogram(self, bins, *, range, weight, density) -> (hist, bin_edges): like histc, the shards'
    counts sum to the whole (P(sum) hist, Replicate edges, weight sharded with self) when the edges
    do not depend on the data (a bins tensor, or an explicit range) and nothing is normalized
    (density=False); otherwise Replicate only."""

    __name__ = "histogram"
    accepts_plain_tensors = True  # a plain bins tensor is the same edges on every rank

    def rows(self, call: OpCall) -> Sequence[Row]:
        names = call.input_names()
        rows = [Row((Replicate(), Replicate()), (Replicate(),) * len(names))]
        edges_known = isinstance(call.argument("bins"), TensorMeta) or call.argument("range") is not None
        if edges_known and not call.argument("density"):
            for dim in range(call.inputs[0].ndim):
                inputs = tuple(Shard(dim) if name in ("self", "weight") else Replicate() for name in names)
                rows.append(Row((Partial("sum"), Replicate()), inputs))
        return rows

    def global_outputs(self, call: OpCall) -> list[TensorMeta]:
        """histogram has no meta kernel: (bins,) counts and (bins + 1,) edges of self's dtype."""
        bins = call.argument("bins")
        count = bins.shape[0] - 1 if isinstance(bins, TensorMeta) else bins
        dtype = call.inputs[0].dtype
        return [TensorMeta((count,), (1,), dtype), TensorMeta((count + 1,), (1,), dtype)]


def trace_rows(call: OpCall) -> list[Row]:
    """trace is linear: a P(sum)/P(avg) input passes; a sharded matrix is gathered (no offset rule)."""
    return [Row((Replicate(),), (Replicate(),))] + [Row((Partial(op),), (Partial(op),)) for op in ("sum", "avg")]


def renorm_rows(call: OpCall) -> list[Row]:
    """renorm(self, p, dim, maxnorm) rescales each slice along `dim` by its own norm over the other
    dims: `dim` may stay sharded, the others must be whole."""
    dim = dim_argument(call)
    return _with_out(call, [Row((Replicate(),), (Replicate(),)), Row((Shard(dim),), (Shard(dim),))])


def segment_reduce_rows(call: OpCall) -> list[Row]:
    """segment_reduce / _segment_reduce_backward: segments run along `axis`; the tensors with the
    data's shape (data, grad, output, out=) shard together on a dim after `axis`; the segment
    lengths/offsets (which span the dims up to `axis`) stay Replicate."""
    axis = call.argument("axis")
    data = call.inputs[0]
    axis = normalized_dim(axis, data.ndim)
    segments = {"lengths", "offsets", "indices"}
    names = call.input_names()
    rows = [Row((Replicate(),), (Replicate(),) * len(names))]
    for dim in range(axis + 1, data.ndim):
        rows.append(Row((Shard(dim),), tuple(Replicate() if name in segments else Shard(dim) for name in names)))
    return rows


@dataclass(frozen=True, slots=True)
class ScanRule(ShardingRule):
    """A scan along `dim` (cumsum...): other dims keep their shards; the scanned dim is gathered."""

    partial_passes: tuple[str, ...] = ()

    @property
    def __name__(self) -> str:
        return f"scan(partial_passes={self.partial_passes})"

    def rows(self, call: OpCall) -> Sequence[Row]:
        ndim = call.inputs[0].ndim
        scanned = normalized_dim(call.argument("dim"), ndim)
        outputs = _tensor_outputs(call)
        rows = [Row((Replicate(),) * outputs, (Replicate(),))]
        rows += [Row((Shard(dim),) * outputs, (Shard(dim),)) for dim in range(ndim) if dim != scanned]
        rows += [Row((Partial(reduce_op),) * outputs, (Partial(reduce_op),)) for reduce_op in self.partial_passes]
        return rows


_LINEAR = ("sum", "avg")  # a sum of averages is the average of sums: P(sum) and P(avg) pass
_SUM = ReductionRule("sum", _LINEAR)
_PRODUCT = ReductionRule("product", ("product",))
_MAX = ReductionRule("max", ("max",), empty_fill="max")
_MIN = ReductionRule("min", ("min",), empty_fill="min")
_GATHER = ReductionRule()  # indices, variances, logsumexp: the shards' results do not combine exactly

_REDUCTIONS = [
    ([aten.sum.default, aten.sum.dim_IntList], _SUM),
    ([aten.nansum.default], ReductionRule("sum")),  # a P(sum) operand's NaN may cancel in the sum: reduce first
    ([aten.mean.default, aten.mean.dim], ReductionRule("sum", _LINEAR, mean=True)),
    ([aten.prod.default, aten.prod.dim_int], _PRODUCT),
    ([aten.amax.default, aten.max.default], _MAX),
    ([aten.amin.default, aten.min.default], _MIN),
    ([aten.any.default, aten.any.dim, aten.any.dims], ReductionRule("max")),  # any of a bool P(max) is
    ([aten.all.default, aten.all.dim, aten.all.dims], ReductionRule("min")),  # fine, of a float P(max) not
    ([aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default], _GATHER),
    ([aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction], _GATHER),
    ([aten.logsumexp.default], _GATHER),
    ([aten.hash_tensor.default], _GATHER),  # an xor of the shards' hashes: no such Partial
    ([aten.linalg_vector_norm.default], VectorNormRule()),
    ([aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype],
     VectorNormRule(order_argument="p")),
    ([aten.count_nonzero.default, aten.count_nonzero.dim_IntList], ReductionRule("sum")),
    ([aten.aminmax.default], AminmaxRule(("min", "max"))),
    # values and indices of the middle / most frequent element: no partial form, the dim is gathered
    ([aten.median.default, aten.median.dim, aten.nanmedian.default, aten.nanmedian.dim, aten.mode.default], _GATHER),
    ([aten.dist.default], DistRule()),
    ([aten.histc.default, aten.histc.out], histc_rows),
    ([aten.histogram.bin_ct, aten.histogram.bins_tensor], HistogramRule()),
    ([aten.trace.default], trace_rows),
    ([aten.renorm.default, aten.renorm_.default, aten.renorm.out], renorm_rows),
    ([aten.equal.default, aten.allclose.default], AllElementsRule()),
    # segment lengths/offsets may be plain tensors (Replicate)
    ([aten.segment_reduce.default, aten._segment_reduce_backward.default], TensorOpRule(segment_reduce_rows)),
    ([aten.cumsum.default], ScanRule(_LINEAR)),
    ([aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default], ScanRule()),
]

for _ops, _rule in _REDUCTIONS:
    register_rule(_ops, _rule)
