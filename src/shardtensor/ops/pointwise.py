"""Elementwise ops: unary, binary with broadcasting, ternary, comparisons, casts and their backward ops.

Every op shards like `registry.pointwise` (Replicate, or Shard on an output dim that every spanning
input shards). On top of that, an op family may keep Partial inputs Partial where this is exact:

    family        Partial rows (one mesh dim)                 why
    linear        P(s) -> P(s)             s in sum, avg      f(a0 + a1) = f(a0) + f(a1)
    negation      linear, and P(max) <-> P(min)               -max(a_i) = min(-a_i)
    monotone      P(max) -> P(max), P(min) -> P(min)          f non-decreasing: max f(a_i) = f(max a_i)
    sum           P(s) + P(s) -> P(s); P(avg) + R -> P(avg)   P(sum) + R is NOT P(sum): R would be
                                                              added once per rank (PEER_BUGS #163193)
                  P(x) + c -> P(x), any x; c - P(max) -> P(min) c a Python number or 0-d plain tensor,
                                                              added on one operand of a P(sum)
    product       P(s) * R, R * P(s), P(s) * c -> P(s);       P * P needs one side reduced first
                  c > 0 keeps P(max)/P(min), c < 0 swaps them;
                  c = +-inf or NaN keeps none                 inf * (a0 + a1) != inf * a0 + inf * a1
                  (c a Python number or a 0-d plain tensor, whose sign dispatch reads next to a Partial)
    quotient      P(s) / R, P(s) / c -> P(s), c != 0          R / P is not linear in P
    linear first  backward ops: grad P(s), the rest R -> P(s) d(input) is linear in the incoming grad
    extremum      maximum/minimum(P(x), R) -> P(x);           monotone in each argument
                  maximum(P(max), P(max)) -> P(max)
    select        where(R, P(x), P(x)) -> P(x), any x         picks one operand elementwise
    cast          float -> wider float keeps P(sum)/P(avg)    see `_cast`
    comparison    none; plain tensors join as Replicate       one_hot compares with a plain arange
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import torch

from ..placement import Partial, Placement, Replicate
from ..rules import SIGN, TYPE_ONLY, UNREAD, OpCall, PlainTensor, Row, RowsRule, TensorMeta, scale_sign, schema_positions
from .registry import MissingOp, aten, pointwise, register_rule

__all__ = ["PARTIAL_FAMILIES", "ComparisonRule"]


LINEAR_REDUCE_OPS = ("sum", "avg")
EXTREME_REDUCE_OPS = ("max", "min")
_FLIPPED = {"max": "min", "min": "max"}

# A Partial row over the op's operands (DTensor inputs that are not `out=` tensors).
PartialRow = tuple[Placement, tuple[Placement, ...]]


def _operand_count(call: OpCall) -> int:
    return len(call.inputs) - _out_tensor_count(call.op)


@functools.cache
def _out_tensor_count(op) -> int:
    """Keyword-only arguments the op writes into (`out=`): they lie like the output, not operands."""
    return sum(
        1 for argument in op._schema.arguments
        if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
    )


def _scalars(call: OpCall) -> list:
    return [value for value in call.args if isinstance(value, numbers.Number) and not isinstance(value, bool)]


def _first_argument_is_dtensor(call: OpCall) -> bool:
    return isinstance(call.argument("self"), TensorMeta)


def _linear(call: OpCall) -> list[PartialRow]:
    if _operand_count(call) != 1:
        return []
    return [(Partial(op), (Partial(op),)) for op in LINEAR_REDUCE_OPS]


def _negation(call: OpCall) -> list[PartialRow]:
    rows = _linear(call)
    if _operand_count(call) == 1:
        rows += [(Partial(_FLIPPED[op]), (Partial(op),)) for op in EXTREME_REDUCE_OPS]
    return rows


def _monotone(call: OpCall) -> list[PartialRow]:
    """The first operand is Partial; tensor bounds (clamp) must be Replicate."""
    others = (Replicate(),) * (_operand_count(call) - 1)
    return [(Partial(op), (Partial(op),) + others) for op in EXTREME_REDUCE_OPS]


def _monotone_with_slope(call: OpCall) -> list[PartialRow]:
    """leaky_relu is non-decreasing only for a non-negative negative_slope."""
    slope = call.argument("negative_slope")
    return _monotone(call) if slope >= 0 else []


def _sum(call: OpCall) -> list[PartialRow]:
    operands = _operand_count(call)
    if operands == 2:
        rows = [(Partial(op), (Partial(op), Partial(op))) for op in LINEAR_REDUCE_OPS]
        # avg(a_i) + r = avg(a_i + r): a replicated summand commutes with averaging, not with summing.
        return rows + [(Partial("avg"), (Partial("avg"), Replicate())), (Partial("avg"), (Replicate(), Partial("avg")))]
    return _plus_scalar(call) if operands == 1 else []


# op -> by whether the DTensor is `self`: its coefficient (a sign, times alpha or not) and whether alpha
# scales the addend. add is self + alpha * other, sub self - alpha * other, rsub other - alpha * self.
_ADDEND_TERMS = {
    "add": {True: (1, False, True), False: (1, True, False)},
    "sub": {True: (1, False, True), False: (-1, True, False)},
    "rsub": {True: (-1, True, False), False: (1, False, True)},
}


def _plus_scalar(call: OpCall) -> list[PartialRow]:
    """One DTensor operand plus or minus a Python number or a 0-d plain tensor `s`, maybe times alpha.

    Linear rows: P(avg) adds `s` on every operand, P(sum) on the operand at coordinate 0 of its mesh
    dims only (`AddendRule.local_op`); a coefficient of the DTensor that is not finite keeps none (as
    a scale). P(max)/P(min) add `s` on every operand, swapped by a negative coefficient, for a finite
    addend (rounding is monotone, so max(a_i + s) = max(a_i) + s exactly; -inf + inf is NaN).
    """
    dtensor_is_self = _first_argument_is_dtensor(call)
    sign, alpha_scales_coefficient, alpha_scales_addend = _ADDEND_TERMS[call.op._opname.rstrip("_")][dtensor_is_self]
    alpha_sign = scale_sign(call.argument("alpha"))
    if not alpha_scales_coefficient:
        coefficient_sign = sign
    elif isinstance(alpha_sign, int):
        coefficient_sign = sign * alpha_sign
    else:  # None (not finite) or UNREAD (complex)
        coefficient_sign = alpha_sign
    addend = call.argument("other" if dtensor_is_self else "self")
    addend_signs = [addend.sign if isinstance(addend, PlainTensor) else scale_sign(addend)]
    if alpha_scales_addend:
        addend_signs.append(alpha_sign)
    if coefficient_sign is None:
        return []
    rows = [(Partial(op), (Partial(op),)) for op in LINEAR_REDUCE_OPS]
    if not isinstance(coefficient_sign, int) or coefficient_sign == 0 or not all(isinstance(s, int) for s in addend_signs):
        return rows
    return rows + [
        (Partial(_FLIPPED[op] if coefficient_sign < 0 else op), (Partial(op),)) for op in EXTREME_REDUCE_OPS
    ]


def _scaling_by_scalar(call: OpCall, dividing: bool = False) -> list[PartialRow]:
    """One DTensor operand scaled by a Python number or a 0-d plain tensor, or divided by one. A scale
    of inf or NaN, or a division by 0, makes each operand +-inf or NaN, which a reduction does not
    combine as the scaled value: the Partial is reduced first."""
    rows = [(Partial(op), (Partial(op),)) for op in LINEAR_REDUCE_OPS]
    scales = _scalars(call) + [value for value in call.args if isinstance(value, PlainTensor)]
    if len(scales) != 1:
        return rows
    # A 0-d plain tensor's sign was read by dispatch next to a Partial (else it is UNREAD).
    sign = scales[0].sign if isinstance(scales[0], PlainTensor) else scale_sign(scales[0])
    if sign is None or (dividing and sign == 0):
        return []
    if sign == UNREAD:  # linear rows only
        return rows
    if sign > 0:
        rows += [(Partial(op), (Partial(op),)) for op in EXTREME_REDUCE_OPS]
    elif sign < 0:
        rows += [(Partial(_FLIPPED[op]), (Partial(op),)) for op in EXTREME_REDUCE_OPS]
    return rows


def _product(call: OpCall) -> list[PartialRow]:
    operands = _operand_count(call)
    if operands == 2:
        return [
            row for op in LINEAR_REDUCE_OPS
            for row in ((Partial(op), (Partial(op), Replicate())), (Partial(op), (Replicate(), Partial(op))))
        ]
    return _scaling_by_scalar(call) if operands == 1 else []


def _quotient(call: OpCall) -> list[PartialRow]:
    if call.argument("rounding_mode") is not None or not _first_argument_is_dtensor(call):
        return []  # floor/trunc division is not linear; a DTensor divisor is not either
    operands = _operand_count(call)
    if operands == 2:
        return [(Partial(op), (Partial(op), Replicate())) for op in LINEAR_REDUCE_OPS]
    return _scaling_by_scalar(call, dividing=True) if operands == 1 else []


def _linear_in_first(call: OpCall) -> list[PartialRow]:
    """Backward ops: the input gradient is linear in the incoming gradient (the first operand)."""
    others = (Replicate(),) * (_operand_count(call) - 1)
    return [(Partial(op), (Partial(op),) + others) for op in LINEAR_REDUCE_OPS]


def _extremum(kept: str) -> Callable[[OpCall], list[PartialRow]]:
    def rows(call: OpCall) -> list[PartialRow]:
        if _operand_count(call) != 2:
            return []
        found = [(Partial(kept), (Partial(kept), Partial(kept)))]
        for op in EXTREME_REDUCE_OPS:
            found += [(Partial(op), (Partial(op), Replicate())), (Partial(op), (Replicate(), Partial(op)))]
        return found

    rows.__name__ = f"extremum_keeping_{kept}"
    return rows


def _select(call: OpCall) -> list[PartialRow]:
    if _operand_count(call) != 3:
        return []
    return [(Partial(op), (Replicate(), Partial(op), Partial(op))) for op in LINEAR_REDUCE_OPS + EXTREME_REDUCE_OPS]


def _lerp(call: OpCall) -> list[PartialRow]:
    """start + weight * (end - start) is linear in (start, end) for a replicated weight."""
    weight = (Replicate(),) * (_operand_count(call) - 2)
    if _operand_count(call) < 2:
        return []
    return [(Partial(op), (Partial(op), Partial(op)) + weight) for op in LINEAR_REDUCE_OPS]


def _addcmul(call: OpCall) -> list[PartialRow]:
    """self + value * t1 * t2 is linear in (self, t1) and in (self, t2)."""
    if _operand_count(call) != 3:
        return []
    return [
        row for op in LINEAR_REDUCE_OPS
        for row in (
            (Partial(op), (Partial(op), Partial(op), Replicate())),
            (Partial(op), (Partial(op), Replicate(), Partial(op))),
        )
    ]


def _addcdiv(call: OpCall) -> list[PartialRow]:
    """self + value * t1 / t2 is linear in (self, t1)."""
    if _operand_count(call) != 3:
        return []
    return [(Partial(op), (Partial(op), Partial(op), Replicate())) for op in LINEAR_REDUCE_OPS]


_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _cast(call: OpCall) -> list[PartialRow]:
    """`_to_copy`: every Partial survives a cast that changes nothing but device or layout.

    float -> wider float keeps every Partial: each operand widens exactly, so the wider reduction
    is at least as exact. Any float -> float cast keeps P(max)/P(min) (rounding is monotone, -inf
    stays -inf). Others do not: narrowing rounds every operand (errors add up over ranks), float
    -> int truncates each operand (trunc(0.5) + trunc(0.5) != trunc(1.0)), and the -inf identity
    of P(max) has no integer value.
    """
    source = call.inputs[0].dtype
    target = call.argument("dtype") or source
    every = LINEAR_REDUCE_OPS + EXTREME_REDUCE_OPS + ("product",)
    if target == source:
        kept = every
    elif source in _FLOAT_WIDTH and target in _FLOAT_WIDTH:
        kept = every if _FLOAT_WIDTH[target] > _FLOAT_WIDTH[source] else EXTREME_REDUCE_OPS
    else:
        kept = ()
    return [(Partial(op), (Partial(op),)) for op in kept]


def _no_partial(call: OpCall) -> list[PartialRow]:
    """Nonlinear: a Partial input is reduced (or reduce-scattered) first."""
    return []


_NONLINEAR = [
    aten.abs, aten.acos, aten.acosh, aten.asin, aten.atanh, aten.angle, aten.bitwise_not, aten.cos, aten.cosh,
    aten.digamma, aten.erfc, aten.erfinv, aten.frac, aten.i0, aten.isnan, aten.isinf, aten.isposinf,
    aten.isneginf, aten.isfinite, aten.lgamma, aten.log, aten.log10, aten.log1p, aten.log2, aten.logit,
    aten.nan_to_num, aten.reciprocal, aten.rsqrt, aten.sgn, aten.signbit, aten.sin, aten.sinc, aten.sqrt,
    aten.square, aten.tan, aten.gelu, aten.silu, aten.mish, aten.hardswish, aten.elu, aten.selu, aten.celu,
    aten.softplus, aten.logical_not, aten.threshold, aten.polygamma, aten.mvlgamma,
    aten.special_erfcx, aten.special_i0e, aten.special_i1, aten.special_i1e, aten.special_ndtr,
    aten.special_ndtri, aten.special_log_ndtr, aten.special_entr, aten.special_airy_ai, aten.special_bessel_j0,
    aten.special_bessel_j1, aten.special_bessel_y0, aten.special_bessel_y1, aten.special_modified_bessel_i0,
    aten.special_modified_bessel_i1, aten.special_modified_bessel_k0, aten.special_modified_bessel_k1,
    aten.special_scaled_modified_bessel_k0, aten.special_scaled_modified_bessel_k1,
    aten.special_spherical_bessel_j0,
    # binary
    aten.pow, aten.float_power, aten.remainder, aten.fmod, aten.floor_divide, aten.atan2, aten.hypot,
    aten.copysign, aten.nextafter, aten.xlogy, aten.special_xlog1py, aten.special_zeta, aten.logaddexp,
    aten.logaddexp2, aten.heaviside, aten.igamma, aten.igammac,
    aten.logical_and, aten.logical_or, aten.logical_xor, aten.special_chebyshev_polynomial_t,
    aten.special_chebyshev_polynomial_u, aten.special_chebyshev_polynomial_v, aten.special_chebyshev_polynomial_w,
    aten.special_shifted_chebyshev_polynomial_t, aten.special_shifted_chebyshev_polynomial_u,
    aten.special_shifted_chebyshev_polynomial_v, aten.special_shifted_chebyshev_polynomial_w,
    aten.special_hermite_polynomial_h, aten.special_hermite_polynomial_he, aten.special_laguerre_polynomial_l,
    aten.special_legendre_polynomial_p,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor, aten.bitwise_left_shift, aten.bitwise_right_shift,
    aten.__lshift__, aten.__rshift__, aten.__and__, aten.__or__, aten.__xor__,
]

_MONOTONE = [
    aten.relu, aten.exp, aten.exp2, aten.expm1, aten.sigmoid, aten.tanh, aten.floor, aten.ceil, aten.trunc,
    aten.fix, aten.round, aten.sign, aten.sinh, aten.atan, aten.asinh, aten.erf, aten.hardtanh,
    aten.hardsigmoid, aten.clamp, aten.clamp_min, aten.clamp_max,
]

_BACKWARD = [
    aten.threshold_backward, aten.sigmoid_backward, aten.tanh_backward, aten.gelu_backward,
    aten.silu_backward, aten.hardtanh_backward, aten.hardsigmoid_backward, aten.hardswish_backward,
    aten.leaky_relu_backward, aten.elu_backward, aten.softplus_backward, aten.mish_backward,
    aten.logit_backward, aten.log_sigmoid_backward,
]

# Scalar arguments whose value does not change a family's rows (`ShardingRule.value_keys`), so that
# `x * step_size` with a new step size every call reuses the cached decision: only the sign of a
# scale or alpha decides (it swaps P(max) and P(min)), and of an addend whether it is finite; `value`
# or `weight` does not.
_VALUE_KEYS = {
    "_sum": {"other": SIGN, "alpha": SIGN},  # a non-finite addend or alpha keeps fewer rows (`_plus_scalar`)
    "_product": {"other": SIGN},
    "_quotient": {"other": SIGN},
    "_monotone_with_slope": {"negative_slope": SIGN},
    "_monotone": {"min": TYPE_ONLY, "max": TYPE_ONLY, "min_val": TYPE_ONLY, "max_val": TYPE_ONLY},
    "_no_partial": {"exponent": TYPE_ONLY, "other": TYPE_ONLY},
    "_lerp": {"weight": TYPE_ONLY},
    "_addcmul": {"value": TYPE_ONLY},
    "_addcdiv": {"value": TYPE_ONLY},
}

# op packets -> their Partial rows; each packet's in-place variant (`add_`) shares the entry.
PARTIAL_FAMILIES: list[tuple[list, Callable[[OpCall], list[PartialRow]]]] = [
    (_NONLINEAR, _no_partial),
    (_MONOTONE, _monotone),
    ([aten.leaky_relu], _monotone_with_slope),
    ([aten.neg], _negation),
    ([aten.positive, aten.conj_physical, aten.deg2rad, aten.rad2deg], _linear),
    ([aten.add, aten.sub, aten.rsub], _sum),
    ([aten.mul], _product),
    ([aten.div, aten.true_divide], _quotient),
    ([aten.maximum, aten.fmax], _extremum("max")),
    ([aten.minimum, aten.fmin], _extremum("min")),
    ([aten.where], _select),
    ([aten.lerp], _lerp),
    ([aten.addcmul], _addcmul),
    ([aten.addcdiv], _addcdiv),
    ([aten._to_copy], _cast),
    (_BACKWARD, _linear_in_first),
    ([aten.ldexp], _linear_in_first),  # x * 2**e: linear in x for a replicated exponent e
]


def _elementwise_rule(partial_rows: Callable[[OpCall], list[PartialRow]]) -> Callable[[OpCall], list[Row]]:
    """Broadcast rows (Replicate and Shard) followed by the family's Partial rows; out= tensors lie
    like the output."""

    def rule(call: OpCall) -> list[Row]:
        rows = pointwise(call)
        outs = _out_tensor_count(call.op)
        for output, inputs in partial_rows(call):
            rows.append(Row((output,), inputs + (output,) * outs))
        return rows

    rule.__name__ = f"pointwise_{partial_rows.__name__.lstrip('_')}"
    return rule


class AddendRule(RowsRule):
    """The sum family's rule: `P(sum) + s` of a Python number or 0-d plain tensor `s` stays P(sum), its
    local op adding `s` only at coordinate 0 of every P(sum) mesh dim (a zero of its type elsewhere,
    which keeps the result dtype), as torch's DTensor does; no collective. The local op reads `s` from
    each call's arguments, so plans serve every value (`local_op_reads_values`)."""

    local_op_reads_values = True

    def __init__(self, rows, value_keys, adds_on_one_rank: bool = True):
        super().__init__(rows, value_keys)
        self.adds_on_one_rank = adds_on_one_rank

    def rows(self, call: OpCall) -> list[Row]:
        rows = super().rows(call)
        if self.adds_on_one_rank or _operand_count(call) != 1:
            return rows
        return [row for row in rows if row.inputs[0] != Partial("sum")]

    @functools.cached_property
    def rule_for_lists(self) -> AddendRule:
        """A multi-tensor op cannot run a local op per element: its elements reduce a P(sum) first."""
        return AddendRule(self._rows, self.value_keys, adds_on_one_rank=False)

    def local_op(self, call: OpCall, input_layouts, coordinate) -> Callable | None:
        if not self.adds_on_one_rank or _operand_count(call) != 1:
            return None
        placements = input_layouts[0].placements
        if all(index == 0 for placement, index in zip(placements, coordinate) if placement == Partial("sum")):
            return None
        return functools.partial(_without_addend, call.op, "other" if _first_argument_is_dtensor(call) else "self")


def _without_addend(op, name: str, mesh, *args, **kwargs):
    """`op` with its scalar argument `name` replaced by a zero of its type (dtype and device)."""
    position = schema_positions(op)[name][0]
    value = args[position] if position < len(args) else kwargs[name]
    zero = torch.zeros_like(value) if isinstance(value, torch.Tensor) else type(value)(0)
    if position < len(args):
        args = args[:position] + (zero,) + args[position + 1:]
    else:
        kwargs = {**kwargs, name: zero}
    return op(*args, **kwargs)


def _with_in_place(packets: list) -> list:
    """The packets and the in-place packets (`abs_` of `abs`) this torch has."""
    names = [packet.__name__ + "_" for packet in packets if not isinstance(packet, MissingOp)]
    return packets + [getattr(aten, name) for name in names if hasattr(torch.ops.aten, name)]


def _two_outputs(call: OpCall) -> list[Row]:
    """`log_sigmoid_forward` (output, buffer) and `frexp` (mantissa, exponent): both outputs are
    elementwise in the input (`frexp.Tensor_out` takes this rule through `registry.register_variants`)."""
    return [Row(row.outputs * 2, row.inputs) for row in pointwise(call)]


class ComparisonRule(RowsRule):
    """Comparisons also take plain tensors, as Replicate: torch's `one_hot` on a tensor subclass
    compares it with a plain `arange(num_classes)`, which is the same on every rank.

    PyTorch refuses plain non-scalar tensors next to DTensors in every op; we keep that refusal for
    all other ops and make this one exception so that `one_hot` works. A user comparing a DTensor
    with a plain tensor must pass the same tensor on every rank (not checked: that needs a collective).
    """

    accepts_plain_tensors = True


_COMPARISONS = [aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge]

for _packets, _partial_rows in PARTIAL_FAMILIES:
    _rule_class = AddendRule if _partial_rows is _sum else RowsRule
    register_rule(_with_in_place(_packets), _rule_class(_elementwise_rule(_partial_rows), _VALUE_KEYS.get(_partial_rows.__name__)))
register_rule(_with_in_place(_COMPARISONS), ComparisonRule(_elementwise_rule(_no_partial)))
register_rule([aten.log_sigmoid_forward.default, aten.frexp.Tensor], _two_outputs)
