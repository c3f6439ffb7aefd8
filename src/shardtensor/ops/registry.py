"""The one registry of sharding rules: `RULES[op] = rule`, each op registered exactly once.

A rule maps an `OpCall` (global metadata of the op's DTensor inputs and its other arguments) to
rows `[outputs <- inputs]` of placements for one mesh dim; `propagation.decide` extends them to
N-D meshes and picks the cheapest. Here live the registry and the generic rules that op families
reuse: ops that keep their input's layout, `*_like` factories, and the broadcast rows of
elementwise ops (the elementwise family itself is `ops/pointwise.py`). Replicate rows come first:
moving Replicate to Shard is free, so on a tie the rule's order keeps a Replicate input where it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..propagation import OpCall, Row, RowsRule, ShardingRule, clear_cache

__all__ = ["RULES", "register_rule", "same_layout", "like_factory", "pointwise"]

aten = torch.ops.aten

RULES: dict[torch._ops.OpOverload, ShardingRule] = {}


def register_rule(ops: Iterable, rule, *, override: bool = False) -> None:
    """Register `rule` (a `ShardingRule`, or a function from `OpCall` to rows) for each op.

    A packet (`aten.add`) stands for its overloads that return one Tensor. Registering an op that
    has a rule is an error unless `override=True` (what `experimental.register_sharding` does).
    """
    if not isinstance(rule, ShardingRule):
        rule = RowsRule(rule)
    for op in ops:
        overloads = [op]
        if isinstance(op, torch._ops.OpOverloadPacket):
            overloads = [getattr(op, name) for name in op.overloads()]
            overloads = [overload for overload in overloads if _returns_one_tensor(overload)]
        for overload in overloads:
            if overload in RULES and not override:
                raise RuntimeError(
                    f"{overload} is registered twice (already as {RULES[overload].__name__}, now as "
                    f"{rule.__name__}); each op has exactly one rule (replace one on purpose with "
                    f"shardtensor.experimental.register_sharding)"
                )
            RULES[overload] = rule
    clear_cache()  # decisions made with a replaced rule must not be reused


def _returns_one_tensor(overload) -> bool:
    """Skips the TorchScript scalar overloads (`aten.add.int`) and list comparisons (`eq.int_list`)."""
    returns = overload._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


def _row(output, first_input, inputs: int) -> Row:
    """A row for a one-input op; an `out=` tensor (a second input) lies like the output."""
    return Row((output,), (first_input,) + (output,) * (inputs - 1))


def same_layout(call: OpCall) -> list[Row]:
    """The output lies exactly like the input: any placement, Partial included, passes through."""
    inputs = len(call.inputs)
    placements = [Replicate()] + [Shard(dim) for dim in range(call.inputs[0].ndim)]
    placements += [Partial(op) for op in REDUCE_OPS]
    return [_row(placement, placement, inputs) for placement in placements]


def like_factory(call: OpCall) -> list[Row]:
    """`zeros_like` & co: a new value per shard; a Partial input gives a Replicate output.

    `ones_like(P(sum))` must not stay Partial: every rank's ones would sum to the rank count.
    """
    inputs = len(call.inputs)
    rows = [_row(Replicate(), Replicate(), inputs)]
    rows += [_row(Shard(dim), Shard(dim), inputs) for dim in range(call.inputs[0].ndim)]
    return rows + [_row(Replicate(), Partial(op), inputs) for op in REDUCE_OPS]


def pointwise(call: OpCall) -> list[Row]:
    """Elementwise with broadcasting: shard an output dim where every input that spans it is sharded.

    An input broadcast along a dim (missing or of size 1) is Replicate there. No Partial rows: a
    nonlinear op (or a Partial plus a scalar, which would add the scalar once per rank) needs the
    reduced value first.
    """
    out_ndim = max(meta.ndim for meta in call.inputs)
    out_shape = [1] * out_ndim
    for meta in call.inputs:
        for dim, size in enumerate(meta.shape):
            position = dim + out_ndim - meta.ndim
            out_shape[position] = max(out_shape[position], size)
    rows = [Row((Replicate(),), (Replicate(),) * len(call.inputs))]
    for dim in range(out_ndim):
        inputs = []
        for meta in call.inputs:
            input_dim = dim - (out_ndim - meta.ndim)
            spans = input_dim >= 0 and meta.shape[input_dim] == out_shape[dim]
            inputs.append(Shard(input_dim) if spans else Replicate())
        rows.append(Row((Shard(dim),), tuple(inputs)))
    return rows


_SAME_LAYOUT = [aten.detach, aten.alias, aten.clone, aten.contiguous]
_LIKE_FACTORIES = [aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like]

register_rule(_SAME_LAYOUT, same_layout)
register_rule(_LIKE_FACTORIES, like_factory)
