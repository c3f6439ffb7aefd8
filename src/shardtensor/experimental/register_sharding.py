"""`register_sharding`: users add or replace the sharding rule of an op.

The decorated function receives the op's arguments with every DTensor replaced by its global
`TensorMeta` (`shape`, `stride`, `dtype`, `ndim`), keyword arguments included (Tensor keyword
arguments too), and returns the acceptable strategies for ONE mesh dim, each a pair
`(output_placements, input_placements)`: a placement per tensor output (none for an op that
returns nothing) and a placement per argument (None for non-tensor arguments, a list for a list of
tensors; positional arguments first, then keyword arguments in the op's schema order). shardtensor
extends them to N-D meshes and picks the cheapest, like its own rules: they share one registry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..ops.registry import register_rule
from ..placement import Placement
from ..rules import OpCall, Row, ShardingRule, TensorMeta

__all__ = ["register_sharding"]


def _strategy_error(op, strategy, problem: str) -> ValueError:
    return ValueError(
        f"register_sharding for {op}: strategy {strategy!r} {problem}. Each strategy is a pair "
        f"(output_placements, input_placements): one Placement per tensor output, and one entry per "
        f"argument (a Placement for a DTensor, None for anything else, a list for a list of tensors)"
    )


def _schema_ordered_kwargs(op, kwargs: tuple[tuple[str, object], ...]) -> list[tuple[str, object]]:
    given = dict(kwargs)
    ordered = [(argument.name, given.pop(argument.name)) for argument in op._schema.arguments if argument.name in given]
    return ordered + list(given.items())


class UserShardingRule(ShardingRule):
    """Rows from a user's strategy function (see the module docstring)."""

    def __init__(self, strategies: Callable):
        self.strategies = strategies
        self.__name__ = getattr(strategies, "__name__", "register_sharding")

    def rows(self, call: OpCall) -> list[Row]:
        kwargs = _schema_ordered_kwargs(call.op, call.kwargs)
        arguments = list(call.args) + [value for _, value in kwargs]
        rows = []
        for strategy in self.strategies(*call.args, **dict(kwargs)):
            if not isinstance(strategy, (tuple, list)) or len(strategy) != 2:
                raise _strategy_error(call.op, strategy, "is not a pair")
            outputs, inputs = strategy
            outputs = [outputs] if isinstance(outputs, Placement) else list(outputs or [])
            rows.append(Row(tuple(p for p in outputs if p is not None), self._input_placements(call, arguments, inputs, strategy)))
        return rows

    @staticmethod
    def _input_placements(call: OpCall, arguments: list, inputs: Sequence, strategy) -> tuple[Placement, ...]:
        if len(inputs) > len(arguments):
            raise _strategy_error(call.op, strategy, f"names {len(inputs)} inputs for {len(arguments)} arguments")
        placements = []
        for argument, placement in zip(arguments, list(inputs) + [None] * (len(arguments) - len(inputs))):
            tensors = argument if isinstance(argument, (list, tuple)) else [argument]
            given = placement if isinstance(placement, (list, tuple)) else [placement] * len(tensors)
            for tensor, entry in zip(tensors, given):
                if isinstance(tensor, TensorMeta):
                    if not isinstance(entry, Placement):
                        raise _strategy_error(call.op, strategy, f"gives {entry!r} for a DTensor argument")
                    placements.append(entry)
        return tuple(placements)


def register_sharding(op) -> Callable[[Callable], Callable]:
    """Decorator: `op` (an OpOverload, or a list of them) gets the decorated strategy function as its
    sharding rule, replacing shardtensor's own rule if it has one.

    >>> @register_sharding(torch.ops.aten._softmax.default)  # doctest: +SKIP
    ... def softmax_rule(x, dim, half_to_float):
    ...     dim = dim % x.ndim
    ...     return [([Replicate()], [Replicate(), None, None])] + [
    ...         ([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != dim]
    """
    ops = list(op) if isinstance(op, (list, tuple)) else [op]
    for overload in ops:
        if not isinstance(overload, torch._ops.OpOverload):
            raise TypeError(
                f"register_sharding takes an op overload such as torch.ops.aten._softmax.default, got "
                f"{overload!r}; pick an overload of a packet with .default or .<overload name>"
            )

    def decorate(strategies: Callable) -> Callable:
        register_rule(ops, UserShardingRule(strategies), override=True)
        return strategies

    return decorate
