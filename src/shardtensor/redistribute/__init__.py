"""Redistribute: move a tensor from one layout to another on the same mesh, by a cheapest plan.

The planner (`planner.py`) turns (source layout, target layout, item size) into frozen steps; the
executor (`executor.py`) runs them through `comm`. Printing a plan explains it:

    >>> from shardtensor.layout import Layout
    >>> from shardtensor.placement import Replicate, Shard
    >>> source = Layout.create((2, 2), [Shard(0), Shard(1)], (8, 8))
    >>> print(explain(source, source.with_placements([Shard(1), Shard(0)]), 4))  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from ..layout import Layout
from .executor import execute
from .planner import DEFAULT_COST_MODEL, CostModel, Plan, Step, plan

__all__ = ["redistribute_local_tensor", "explain", "execute", "plan", "Plan", "Step", "CostModel"]


def redistribute_local_tensor(local: torch.Tensor, source: Layout, target: Layout, mesh, *, async_op: bool = False):
    """This rank's shard of `target`, from its shard `local` of `source` (plan + execute).

    With `async_op=True` returns a handle whose `wait()` returns the tensor.
    """
    return execute(local, plan(source, target, local.element_size()), mesh, async_op=async_op)


def explain(source: Layout, target: Layout, itemsize: int, cost_model: CostModel = DEFAULT_COST_MODEL) -> str:
    """The plan from `source` to `target` in words: steps, collectives, bytes, cost, lower bound."""
    return str(plan(source, target, itemsize, cost_model))
