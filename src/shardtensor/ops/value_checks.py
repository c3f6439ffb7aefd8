"""Value checks that every rank agrees on: a kernel that refuses some input values raises on every rank, or on none.

Some kernels check the values they get (binary_cross_entropy: input and target in [0, 1]; bernoulli:
probabilities in [0, 1]). On shards, only the rank holding a bad value would raise, and the others would
wait in their next collective; where a rule computes the values itself (bernoulli as `uniform < p`), no
rank would raise and the result would be silently wrong. So a rule declares which arguments must lie
in a closed range (`ValueRange`), and its local op checks them first: one flag per argument, and when
some checked argument is not Replicate on a mesh dim, ONE small all_reduce(max) of the flags over
exactly those mesh dims (`agreement.py`, which the index checks of `index_checks.py` share). Every
rank then raises the same error before running the kernel, or none does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..layout import Layout
from ..rules import OpCall, schema_positions
from .agreement import start_agreement, varying_mesh_dims

__all__ = ["ValueRange", "with_value_checks"]


@dataclass(frozen=True, slots=True)
class ValueRange:
    """The schema argument `name` must hold values in [low, high] (NaN lies outside); `what` names it
    in the error, as torch's kernel does ("input", "target", "p")."""

    name: str
    low: float
    high: float
    what: str


def _value_error(op, value_range: ValueRange) -> str:
    return (
        f"{op}: all elements of {value_range.what} (`{value_range.name}`) should be between {value_range.low} and "
        f"{value_range.high} (NaN is not allowed). Every rank raises this, whichever rank's shard holds the value: "
        f"fix the values (e.g. clamp them to [{value_range.low}, {value_range.high}]) before the op"
    )


def _fetch(op, name: str, args: tuple, kwargs: dict):
    position, positional, _ = schema_positions(op)[name]
    return args[position] if positional and position < len(args) else kwargs.get(name)


def _outside(value, value_range: ValueRange) -> int:
    """1 when some element of `value` lies outside the range (or is NaN), else 0."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return 0
    inside = (value >= value_range.low) & (value <= value_range.high)
    return 0 if bool(inside.all()) else 1


def with_value_checks(
    local_op: Callable | None, call: OpCall, input_layouts: Sequence[Layout], ranges: Sequence[ValueRange]
) -> Callable | None:
    """`local_op` (None: the op itself) preceded by the checks of `ranges` on real shards.

    The agreement runs over the mesh dims on which some checked argument is not Replicate; with
    every checked argument Replicate the check is local only (every rank sees the same values).
    """
    names = call.input_names()
    checked = [value_range for value_range in ranges if value_range.name in names]
    if not checked:
        return local_op
    mesh_dims = varying_mesh_dims([input_layouts[names.index(value_range.name)] for value_range in checked])
    op = call.op

    def compute(mesh, *args, **kwargs):
        return op(*args, **kwargs) if local_op is None else local_op(mesh, *args, **kwargs)

    def run_checked(mesh, *args, **kwargs):
        if mesh is None:  # meta tensors: no values to check
            return compute(mesh, *args, **kwargs)
        values = [_fetch(op, value_range.name, args, kwargs) for value_range in checked]
        flags = [_outside(value, value_range) for value, value_range in zip(values, checked)]
        if mesh_dims:
            device = next(value.device for value in values if isinstance(value, torch.Tensor))
            flags = start_agreement(flags, mesh, mesh_dims, device).wait().tolist()
        for flag, value_range in zip(flags, checked):
            if flag:
                raise RuntimeError(_value_error(op, value_range))
        return compute(mesh, *args, **kwargs)

    return run_checked
