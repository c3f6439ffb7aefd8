"""Redistribute: move a tensor from one layout to another, by a cheapest plan (or across meshes).

The planner (`planner.py`) turns (source layout, target layout, item size) into frozen steps, priced
with the per-rank geometry and lower bound of `bounds.py`; the executor (`executor.py`) runs them
through `comm`; `explanation.py` puts a plan in words. Printing a plan explains it:

    >>> from shardtensor.layout import Layout
    >>> from shardtensor.placement import Replicate, Shard
    >>> source = Layout.create((2, 2), [Shard(0), Shard(1)], (8, 8))
    >>> print(explain(source, source.with_placements([Shard(1), Shard(0)]), 4))  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from ..layout import Layout
from .cross_mesh import (
    HandOff,
    empty_shard,
    hand_off,
    redistribute_across_meshes,
    redistribute_across_meshes_with_requires_grad,
)
from .executor import PendingRedistribute, cost_model_for, execute
from .explanation import explain_plan
from .planner import DEFAULT_COST_MODEL, CostModel, Plan, Step, plan

__all__ = [
    "is_relabel", "redistribute_local_tensor", "cost_model_for", "redistribute_between", "explain", "execute", "plan",
    "hand_off", "redistribute_across_meshes_with_requires_grad",
    "Plan", "Step", "CostModel", "HandOff",
]


def is_relabel(source: Layout, target: Layout, itemsize: int) -> bool:
    """Whether a move from `source` to `target` leaves every local tensor as it is: the same layout,
    or one that differs only on mesh dims of size 1 (as every layout of a one-rank mesh does)."""
    return source == target or plan(source, target, itemsize).relabels_only


def redistribute_local_tensor(local: torch.Tensor, source: Layout, target: Layout, mesh, *, async_op: bool = False):
    """This rank's shard of `target`, from its shard `local` of `source` (plan + execute).

    With `async_op=True` returns a handle whose `wait()` returns the tensor.
    """
    return execute(local, plan(source, target, local.element_size(), cost_model_for(mesh)), mesh, async_op=async_op)


def redistribute_between(local: torch.Tensor, source: Layout, source_mesh, target: Layout, target_mesh,
                         *, async_op: bool = False):
    """This rank's local tensor of `target` on `target_mesh`, from its local tensor of `source` on `source_mesh`.

    Same mesh: a plan through the mesh's collectives; a rank outside the mesh takes no part and
    gets a tensor without elements. Different meshes: `redistribute_across_meshes`, which every
    rank of the world must call.
    """
    if source_mesh != target_mesh:
        return redistribute_across_meshes(local, source, source_mesh, target, target_mesh, async_op=async_op)
    if source_mesh.get_coordinate() is None:
        empty = empty_shard(local, target.ndim)
        return PendingRedistribute.done(empty) if async_op else empty
    return redistribute_local_tensor(local, source, target, source_mesh, async_op=async_op)


def explain(source: Layout, target: Layout, itemsize: int, cost_model: CostModel = DEFAULT_COST_MODEL) -> str:
    """The plan from `source` to `target` in words: steps, collectives, bytes, cost, lower bound (and
    the fewest-bytes plan when this one moves more than the bound)."""
    return explain_plan(plan(source, target, itemsize, cost_model), cost_model)
