"""Sharding rules: reductions (sum, mean, prod, amax/amin, max/min, argmax/argmin, var/std, vector
norm, any/all, logsumexp) and scans along a dim (cumsum, cumprod, cummax/cummin, logcumsumexp).

A dim that is not reduced keeps its shard. Reducing a sharded dim gives a Partial output when the
shards' results combine exactly (sum -> P(sum), amax -> P(max), prod -> P(product), any -> P(max)
of bools); otherwise (indices, variances, logsumexp) the dim is gathered first. `mean` of a sharded
dim runs `sum / global count` on each shard, a P(sum) that is exact for uneven shards. An empty
shard of a max-like reduction counts as the reduce op's identity instead of raising on that rank
only. Partial inputs pass through only linear-in-the-reduce-op reductions (sum of P(sum)); max,
var, ... of a Partial reduce it first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from ..propagation import OpCall, Row, ShardingRule
from .registry import register_rule

__all__ = ["ReductionRule", "VectorNormRule", "ScanRule", "argument"]

aten = torch.ops.aten


def argument(call: OpCall, name: str):
    """The value of the op's argument `name` in `call` (its schema default when it was not given)."""
    for index, schema_argument in enumerate(call.op._schema.arguments):
        if schema_argument.name == name:
            if index < len(call.args) and not schema_argument.kwarg_only:
                return call.args[index]
            default = schema_argument.default_value if schema_argument.has_default_value() else None
            return call.kwarg(name, default)
    return None


def _tensor_outputs(call: OpCall) -> int:
    return len(call.op._schema.returns)


def _normalized_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def _fill_value(kind: str, dtype: torch.dtype):
    """An input value whose reduction is the identity of the output's reduce op."""
    if kind == "zero":
        return 0
    highest = kind == "highest"
    if dtype == torch.bool:
        return highest
    if dtype.is_floating_point:
        return math.inf if highest else -math.inf
    return torch.iinfo(dtype).max if highest else torch.iinfo(dtype).min


def _reduce_empty_as_identity(op, dims: tuple[int, ...], fill, mesh, tensor, *args, **kwargs):
    """`op` on a shard whose reduced `dims` may be empty: an empty shard reduces to the identity."""
    if any(tensor.shape[dim] == 0 for dim in dims):
        shape = [1 if dim in dims and size == 0 else size for dim, size in enumerate(tensor.shape)]
        tensor = tensor.new_full(shape, fill)
    return op(tensor, *args, **kwargs)


def _local_mean(count: int, mesh, tensor, dim=None, keepdim=False, *, dtype=None):
    """This shard's share of the mean: its sum over the reduced dims divided by the global count."""
    return aten.div.Scalar(aten.sum.dim_IntList(tensor, dim, keepdim, dtype=dtype), count)


@dataclass(frozen=True, slots=True)
class ReductionRule(ShardingRule):
    """A reduction over the dims named by its `dim` argument (all dims when absent, None or empty).

    `sharded_gives`: the Partial reduce op of the output when a reduced dim is sharded, or None
    when shards cannot be combined (that dim is gathered). `partial_passes`: the Partial input
    reduce op the output keeps (the reduction commutes with it), or None. `empty_fill`: for a
    reduction without identity (amax...), the value ("lowest", "highest", "zero") an empty shard
    is read as. `mean`: the local op is `sum / global count`.
    """

    sharded_gives: str | None = None
    partial_passes: str | None = None
    empty_fill: str | None = None
    mean: bool = False

    @property
    def __name__(self) -> str:
        return f"reduction(sharded_gives={self.sharded_gives}, partial_passes={self.partial_passes})"

    def reduced_dims(self, call: OpCall) -> tuple[int, ...]:
        ndim = call.inputs[0].ndim
        dims = argument(call, "dim")
        if dims is None or dims == ():
            return tuple(range(ndim))
        dims = (dims,) if isinstance(dims, int) else dims
        return tuple(sorted({_normalized_dim(dim, ndim) for dim in dims}))

    def combine(self, call: OpCall) -> tuple[str | None, str | None]:
        """(Partial of a sharded reduced dim, fill of an empty shard) for this call."""
        return self.sharded_gives, self.empty_fill

    def rows(self, call: OpCall) -> Sequence[Row]:
        reduced = self.reduced_dims(call)
        keepdim = bool(argument(call, "keepdim"))
        outputs = _tensor_outputs(call)
        sharded_gives, _ = self.combine(call)
        rows = [Row((Replicate(),) * outputs, (Replicate(),))]
        for dim in range(call.inputs[0].ndim):
            if dim not in reduced:
                output_dim = dim if keepdim else dim - len([other for other in reduced if other < dim])
                rows.append(Row((Shard(output_dim),) * outputs, (Shard(dim),)))
            elif sharded_gives is not None:
                rows.append(Row((Partial(sharded_gives),) * outputs, (Shard(dim),)))
        if self.partial_passes is not None:
            rows.append(Row((Partial(self.partial_passes),) * outputs, (Partial(self.partial_passes),)))
        return rows

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        reduced = self.reduced_dims(call)
        sharded = tuple(sorted({
            placement.dim for placement in input_layouts[0].placements
            if isinstance(placement, Shard) and placement.dim in reduced
        }))
        if not sharded:
            return None  # every reduced dim is whole on this rank: the op itself is right
        if self.mean:
            count = math.prod(call.inputs[0].shape[dim] for dim in reduced)
            return functools.partial(_local_mean, count)
        _, fill = self.combine(call)
        if fill is None:
            return None
        return functools.partial(_reduce_empty_as_identity, call.op, sharded, _fill_value(fill, call.inputs[0].dtype))


# The vector norm of a sharded dim combines exactly for these orders (|x| >= 0, so 0 fills an empty max).
_NORM_COMBINE = {math.inf: ("max", "zero"), -math.inf: ("min", "highest"), 0: ("sum", None), 1: ("sum", None)}


@dataclass(frozen=True, slots=True)
class VectorNormRule(ReductionRule):
    """`linalg_vector_norm`: shards combine for ord inf/-inf (max/min) and 0/1 (sum); others gather."""

    @property
    def __name__(self) -> str:
        return "vector_norm"

    def combine(self, call: OpCall) -> tuple[str | None, str | None]:
        return _NORM_COMBINE.get(argument(call, "ord"), (None, None))


@dataclass(frozen=True, slots=True)
class ScanRule(ShardingRule):
    """A scan along `dim` (cumsum...): other dims keep their shards; the scanned dim is gathered."""

    partial_passes: str | None = None

    @property
    def __name__(self) -> str:
        return f"scan(partial_passes={self.partial_passes})"

    def rows(self, call: OpCall) -> Sequence[Row]:
        ndim = call.inputs[0].ndim
        scanned = _normalized_dim(argument(call, "dim"), ndim)
        outputs = _tensor_outputs(call)
        rows = [Row((Replicate(),) * outputs, (Replicate(),))]
        rows += [Row((Shard(dim),) * outputs, (Shard(dim),)) for dim in range(ndim) if dim != scanned]
        if self.partial_passes is not None:
            rows.append(Row((Partial(self.partial_passes),) * outputs, (Partial(self.partial_passes),)))
        return rows


_SUM = ReductionRule("sum", "sum")
_PRODUCT = ReductionRule("product", "product")
_MAX = ReductionRule("max", "max", empty_fill="lowest")
_MIN = ReductionRule("min", "min", empty_fill="highest")
_GATHER = ReductionRule()  # indices, variances, logsumexp: the shards' results do not combine exactly

_REDUCTIONS = [
    ([aten.sum.default, aten.sum.dim_IntList], _SUM),
    ([aten.nansum.default], ReductionRule("sum")),  # a P(sum) operand's NaN may cancel in the sum: reduce first
    ([aten.mean.default, aten.mean.dim], ReductionRule("sum", "sum", mean=True)),
    ([aten.prod.default, aten.prod.dim_int], _PRODUCT),
    ([aten.amax.default, aten.max.default], _MAX),
    ([aten.amin.default, aten.min.default], _MIN),
    ([aten.any.default, aten.any.dim, aten.any.dims], ReductionRule("max")),  # any of a bool P(max) is
    ([aten.all.default, aten.all.dim, aten.all.dims], ReductionRule("min")),  # fine, of a float P(max) not
    ([aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default], _GATHER),
    ([aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction], _GATHER),
    ([aten.logsumexp.default], _GATHER),
    ([aten.linalg_vector_norm.default], VectorNormRule()),
    ([aten.cumsum.default], ScanRule("sum")),
    ([aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default], ScanRule()),
]

for _ops, _rule in _REDUCTIONS:
    register_rule(_ops, _rule)
