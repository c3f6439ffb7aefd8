"""Sharding rules: random ops on DTensors give the same global tensor on every mesh.

Each rank draws only the values of its own shard with `random.random_shard` (tile-based, keyed by
`manual_seed` and a per-call counter): the result depends on the seed, the call number and the
global shape, never on the mesh, the placements or the number of ranks. The rules keep the input's
layout (Replicate or Shard; a Partial input is reduced first, or gives Replicate for `*_like`) and
replace the local op (`ShardingRule.local_op`) by a draw of the shard's box of the global tensor.

Distributions with tensor parameters (`bernoulli(p)`, `normal(mean)`, dropout) are computed from
uniform or normal draws of the same global positions, so they too are mesh-independent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import Layout
from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule
from ..random import next_random_call, random_shard
from .common import on_shards
from .registry import aten, pointwise, register_rule
from .value_checks import ValueRange, with_value_checks


def _draw(kind: str, layout: Layout, coordinate: Sequence[int], parameters: tuple = ()):
    """A function `(mesh, dtype, device, out=None) -> this coordinate's box of the next global random tensor`.

    With `out` (the shard itself, for in-place ops) the values are written into it, so filling a
    shard needs no second shard; with `below`, the box is the bool mask `values < below`.
    """
    shape, offset, local_shape = layout.shape, layout.local_offset(coordinate), layout.local_shape(coordinate)

    def draw(mesh, dtype: torch.dtype, device: torch.device, out: torch.Tensor | None = None,
             below: float | None = None) -> torch.Tensor:
        seed, counter = next_random_call(mesh)
        return random_shard(kind, shape, offset, local_shape, seed=seed, counter=counter, dtype=dtype,
                            device=device, parameters=parameters, out=out, below=below)

    return draw


class _OneDraw(ShardingRule):
    """A random rule whose local op draws once per call (one number of the random counter)."""

    def random_calls(self, call: OpCall) -> int:
        return 1


def _layout_rows(call: OpCall, partial_output) -> list[Row]:
    """Replicate and Shard(dim) keep their layout; a Partial input becomes `partial_output` (None: no row)."""
    others = len(call.inputs) - 1
    placements = [Replicate()] + [Shard(dim) for dim in range(call.inputs[0].ndim)]
    rows = [Row((placement,), (placement,) * (1 + others)) for placement in placements]
    if partial_output is not None:
        rows += [Row((partial_output,), (Partial(op),) + (Replicate(),) * others) for op in REDUCE_OPS]
    return rows


class InPlaceRandom(_OneDraw):
    """`uniform_`, `normal_`, ...: overwrite the shard with its box of a global random tensor.

    A Partial input is reduced to Replicate first (the dispatcher writes the new value back).
    `kind` names the draw (`random.FILLS`); `parameters(call)` gives its arguments.
    """

    def __init__(self, kind: str, parameters):
        self.kind, self.parameters, self.__name__ = kind, parameters, f"in_place_{kind}"

    def rows(self, call: OpCall) -> list[Row]:
        return _layout_rows(call, None)

    def local_op(self, call, input_layouts, coordinate):
        draw = _draw(self.kind, input_layouts[0], coordinate, self.parameters(call))

        def fill(mesh, tensor, *args, **kwargs):
            return draw(mesh, tensor.dtype, tensor.device, out=tensor)

        return on_shards(call.op, fill)


class LikeRandom(_OneDraw):
    """`rand_like` & co: a new random tensor laid out like the input (a Partial input gives Replicate)."""

    def __init__(self, kind: str, parameters):
        self.kind, self.parameters, self.__name__ = kind, parameters, f"like_{kind}"

    def rows(self, call: OpCall) -> list[Row]:
        return _layout_rows(call, Replicate())

    def local_op(self, call, input_layouts, coordinate):
        layout = input_layouts[0]
        if any(isinstance(placement, Partial) for placement in layout.placements):
            layout = layout.with_placements([Replicate() if isinstance(p, Partial) else p for p in layout.placements])
        draw = _draw(self.kind, layout, coordinate, self.parameters(call))

        def like(mesh, *args, **kwargs):
            result = call.op(*args, **kwargs)  # the right dtype, device and local shape
            return draw(mesh, result.dtype, result.device, out=result)

        return on_shards(call.op, like)


class ThresholdRandom(_OneDraw):
    """Bernoulli draws as `uniform < p`, with `p` a number or a tensor lying like the output.

    `probability(tensor, args, kwargs)` picks p from the local arguments; the output has the dtype of
    `target(local_args)` and is written into it when the op is in place. `tensor_probability` names
    the argument holding a tensor p (None: p is a number): p outside [0, 1] raises on every rank, as
    torch's kernel raises (`uniform < p` alone would silently give 1 or 0).
    """

    def __init__(self, name: str, probability, in_place: bool, tensor_probability: str | None):
        self.probability, self.in_place, self.__name__ = probability, in_place, name
        self.tensor_probability = tensor_probability

    def rows(self, call: OpCall) -> list[Row]:
        return pointwise(call) if len(call.inputs) > 1 else _layout_rows(call, None)

    def local_op(self, call, input_layouts, coordinate):
        draw = _draw("rand", _output_layout(call, input_layouts), coordinate)

        def bernoulli(mesh, tensor, *args, **kwargs):
            probability = self.probability(tensor, args, kwargs)
            if isinstance(probability, torch.Tensor):
                values = draw(mesh, probability.dtype, tensor.device) < probability
            else:  # torch's own check of a number p, alike on every rank; then the float64 draws
                # compared tile by tile: a bool mask, never a float64 shard
                torch.empty(0, device=tensor.device).bernoulli_(probability)
                values = draw(mesh, torch.float64, tensor.device, below=probability)
            if self.in_place:
                return tensor.copy_(values)
            return values.to(tensor.dtype)

        if self.tensor_probability is None:
            return on_shards(call.op, bernoulli)
        probability_range = ValueRange(self.tensor_probability, 0.0, 1.0, "p")
        return with_value_checks(on_shards(call.op, bernoulli), call, input_layouts, [probability_range])


def _output_layout(call: OpCall, input_layouts: Sequence[Layout]) -> Layout:
    """The layout of an elementwise op's output: that of the input with the output's shape."""
    for meta, layout in zip(call.inputs, input_layouts):
        if meta.shape == call.inputs[0].shape:
            return layout
    return input_layouts[0]


class NativeDropout(_OneDraw):
    """`native_dropout(input, p, train)` -> (output, keep mask), the mask drawn as `uniform < 1 - p`.

    Dropout is linear in its input for a fixed mask, and every rank of a Partial mesh dim draws the
    same mask, so a Partial(sum) input stays Partial (the mask is Replicate there).
    """

    __name__ = "native_dropout"

    def random_calls(self, call: OpCall) -> int:
        return 0 if call.argument("train") is False else 1  # torch draws nothing in eval mode

    def rows(self, call: OpCall) -> list[Row]:
        placements = [Replicate()] + [Shard(dim) for dim in range(call.inputs[0].ndim)]
        rows = [Row((placement, placement), (placement,)) for placement in placements]
        return rows + [Row((Partial("sum"), Replicate()), (Partial("sum"),))]

    def local_op(self, call, input_layouts, coordinate):
        layout = input_layouts[0].with_placements(
            [Replicate() if isinstance(p, Partial) else p for p in input_layouts[0].placements]
        )
        draw = _draw("rand", layout, coordinate)

        def dropout(mesh, tensor, probability, train):
            if train is False:
                return tensor.clone(), torch.ones_like(tensor, dtype=torch.bool)
            keep = draw(mesh, torch.float64, tensor.device, below=1 - probability)  # compared tile by tile
            scale = 0.0 if probability >= 1 else 1 / (1 - probability)
            return tensor * keep * scale, keep

        return on_shards(call.op, dropout)


class NormalWithTensorMean(_OneDraw):
    """`normal(mean_tensor, std)`: `mean + std * randn` of the output's global positions."""

    __name__ = "normal_with_tensor_mean"

    def rows(self, call: OpCall) -> list[Row]:
        return _layout_rows(call, None)

    def local_op(self, call, input_layouts, coordinate):
        draw = _draw("randn", input_layouts[0], coordinate)

        def normal(mesh, mean, std=1.0, **kwargs):
            torch.empty(0, dtype=mean.dtype, device=mean.device).normal_(0.0, std)  # torch's check of std, every rank
            return mean + std * draw(mesh, mean.dtype, mean.device)

        return on_shards(call.op, normal)


def _arguments(*names_and_defaults):
    """`parameters(call)`: the op's arguments of these names, each default where the call has None."""

    def parameters(call: OpCall) -> tuple:
        values = [call.argument(name) for name, _ in names_and_defaults]
        return tuple(default if value is None else value for value, (_, default) in zip(values, names_and_defaults))

    return parameters


def _random_range(call: OpCall) -> tuple:
    """`random_.from(from, to)`, `random_.to(to)`, `random_()`: torch's own `random_` arguments."""
    if call.op == aten.random_.to:
        return (call.argument("to"),)
    if call.op == aten.random_.default:
        return ()
    low, high = call.argument("from"), call.argument("to")
    return (low,) if high is None else (low, high)


def _randint_range(call: OpCall) -> tuple:
    """`randint_like(self, high)` or `randint_like(self, low, high)` as `random_(low, high)`."""
    if call.op == aten.randint_like.low_dtype:
        return (call.argument("low"), call.argument("high"))
    return (0, call.argument("high"))


_IN_PLACE = {
    aten.uniform_.default: ("uniform_", _arguments(("from", 0.0), ("to", 1.0))),
    aten.normal_.default: ("normal_", _arguments(("mean", 0.0), ("std", 1.0))),
    aten.exponential_.default: ("exponential_", _arguments(("lambd", 1.0))),
    aten.log_normal_.default: ("log_normal_", _arguments(("mean", 1.0), ("std", 2.0))),
    aten.cauchy_.default: ("cauchy_", _arguments(("median", 0.0), ("sigma", 1.0))),
    aten.geometric_.default: ("geometric_", _arguments(("p", None))),
    aten.random_.default: ("random_", _random_range),
    aten.random_.to: ("random_", _random_range),
    getattr(aten.random_, "from"): ("random_", _random_range),
}
_LIKE = {
    aten.rand_like.default: ("rand", lambda call: ()),
    aten.randn_like.default: ("randn", lambda call: ()),
    aten.randint_like.default: ("random_", _randint_range),
    aten.randint_like.low_dtype: ("random_", _randint_range),
}
_BERNOULLI = {  # op: (probability from (local self, other local args), in place, the argument of a tensor p)
    aten.bernoulli_.float: (lambda tensor, args, kwargs: args[0] if args else kwargs.get("p", 0.5), True, None),
    aten.bernoulli_.Tensor: (lambda tensor, args, kwargs: args[0] if args else kwargs["p"], True, "p"),
    aten.bernoulli.default: (lambda tensor, args, kwargs: tensor, False, "self"),
    aten.bernoulli.p: (lambda tensor, args, kwargs: args[0] if args else kwargs.get("p", 0.5), False, None),
}

for _op, (_kind, _parameters) in _IN_PLACE.items():
    register_rule([_op], InPlaceRandom(_kind, _parameters))
for _op, (_kind, _parameters) in _LIKE.items():
    register_rule([_op], LikeRandom(_kind, _parameters))
for _op, (_probability, _in_place, _tensor_probability) in _BERNOULLI.items():
    _rule = ThresholdRandom(f"bernoulli_{_op._overloadname}", _probability, _in_place, _tensor_probability)
    register_rule([_op], _rule)
register_rule([aten.native_dropout.default], NativeDropout())
register_rule([aten.normal.Tensor_float], NormalWithTensorMean())
register_rule([aten.native_dropout_backward.default], pointwise)
