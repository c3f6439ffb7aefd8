"""Sharding rules for FFTs, complex views and conjugation.

An FFT mixes every element along the dims it transforms and none across the others, so a shard
on a dim that is not transformed stays a shard (input, output and `out=` alike) and a transformed
dim must be Replicate. `_fft_r2c` and `_fft_c2r` change the size of the last transformed dim,
which is Replicate anyway; `last_dim_size` of `_fft_c2r` is a global size that is also the local
one. FFTs are linear, so Partial(sum) and Partial(avg) pass through. A rank whose shard is empty
(a dim smaller than the mesh) does not call the FFT library, which rejects empty batches.

    op                                  Shard rows                       Partial rows
    _fft_c2c, _fft_r2c, _fft_c2r        S(d) -> S(d), d not transformed  sum, avg (linear)
    view_as_real                        S(d) -> S(d), every d            sum, avg (real-linear)
    view_as_complex                     S(d) -> S(d), not the last dim   sum, avg
    _conj                               every placement passes           every one: conj is a ring map
    _neg_view                           every Shard                      sum, avg; max <-> min
    _conj_physical                      elementwise                      sum, avg
    complex(real, imag)                 elementwise                      P(s), P(s) -> P(s), s in sum, avg
    polar(abs, angle)                   elementwise                      none (nonlinear)

`resolve_conj`, `resolve_neg`, `real` and `imag` do not reach dispatch: torch decomposes them
into `clone`, `view_as_real` and `select`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule
from .pointwise import LINEAR_REDUCE_OPS
from .common import empty_shard_results, one_input_row
from .registry import aten, pointwise, register_rule, same_layout

__all__ = ["FftRule", "fft_rows", "view_as_real_rows", "view_as_complex_rows"]


_FLIPPED = {"max": "min", "min": "max"}


def _kept_dim_rows(call: OpCall, kept_dims, partial_ops=LINEAR_REDUCE_OPS) -> list[Row]:
    """Replicate, then S(d) -> S(d) for each kept dim, then the Partials that pass unchanged."""
    inputs = len(call.inputs)
    rows = [one_input_row(Replicate(), Replicate(), inputs)]
    rows += [one_input_row(Shard(dim), Shard(dim), inputs) for dim in kept_dims]
    return rows + [one_input_row(Partial(op), Partial(op), inputs) for op in partial_ops]


def _transformed_dims(call: OpCall) -> set[int]:
    ndim = call.inputs[0].ndim
    dims = call.argument("dim")
    return {dim % ndim for dim in dims}


def fft_rows(call: OpCall) -> list[Row]:
    """`_fft_c2c`, `_fft_r2c`, `_fft_c2r`: shard any dim the transform does not act on."""
    transformed = _transformed_dims(call)
    return _kept_dim_rows(call, [dim for dim in range(call.inputs[0].ndim) if dim not in transformed])


def _fft_of_empty_shard(op) -> Callable:
    """The op on a shard without elements, without calling the FFT library: MKL rejects an empty
    batch ("Inconsistent configuration parameters") where the whole tensor is fine, and an error on
    the ranks with empty shards only would leave the others waiting in their next collective."""

    def run(mesh, local, *args, out=None, **kwargs):
        if out is not None:
            return out.resize_(empty_shard_results(op, (local, *args), kwargs).shape)
        return empty_shard_results(op, (local, *args), kwargs)

    return run


class FftRule(ShardingRule):
    """`fft_rows`; a coordinate whose input shard is empty computes its (empty) output shape only."""

    __name__ = "fft_rows"

    def rows(self, call: OpCall) -> list[Row]:
        return fft_rows(call)

    def local_op(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]) -> Callable | None:
        if math.prod(input_layouts[0].local_shape(coordinate)) == 0:
            return _fft_of_empty_shard(call.op)
        return None


def view_as_real_rows(call: OpCall) -> list[Row]:
    """(..., ) complex -> (..., 2) real: every dim keeps its shard; the new last dim is whole."""
    return _kept_dim_rows(call, range(call.inputs[0].ndim))


def view_as_complex_rows(call: OpCall) -> list[Row]:
    """(..., 2) real -> (...) complex: the last dim (real and imaginary parts) must be Replicate."""
    return _kept_dim_rows(call, range(call.inputs[0].ndim - 1))


def negative_view_rows(call: OpCall) -> list[Row]:
    """`_neg_view`: linear, and -max(a_i) = min(-a_i)."""
    rows = _kept_dim_rows(call, range(call.inputs[0].ndim))
    return rows + [one_input_row(Partial(_FLIPPED[op]), Partial(op), len(call.inputs)) for op in _FLIPPED]


def _elementwise(partial_ops) -> Callable[[OpCall], list[Row]]:
    """Broadcast rows of `registry.pointwise`, then P(s) on every operand -> P(s) for `partial_ops`
    (an `out=` tensor, the last input, lies like the output)."""

    def rows(call: OpCall) -> list[Row]:
        result = pointwise(call)
        inputs = len(call.inputs)
        result += [Row((Partial(op),), (Partial(op),) * inputs) for op in partial_ops]
        return result

    rows.__name__ = f"elementwise_partial_{'_'.join(partial_ops) or 'none'}"
    return rows


_FFTS = [aten._fft_c2c, aten._fft_r2c, aten._fft_c2r]

register_rule(_FFTS, FftRule())
register_rule([aten.view_as_real.default], view_as_real_rows)
register_rule([aten.view_as_complex.default], view_as_complex_rows)
register_rule([aten._conj.default], same_layout)
register_rule([aten._neg_view.default], negative_view_rows)
# complex(a0 + a1, b0 + b1) = complex(a0, b0) + complex(a1, b1); conj is real-linear.
register_rule([aten.complex, aten._conj_physical], _elementwise(LINEAR_REDUCE_OPS))
register_rule([aten.polar], _elementwise(()))
