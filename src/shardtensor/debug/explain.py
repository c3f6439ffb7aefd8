"""Explain a redistribute before running it: the planner's steps, bytes, cost and lower bound.

    >>> from shardtensor.debug.explain import explain_redistribute
    >>> from shardtensor.layout import Layout
    >>> from shardtensor import Shard
    >>> layout = Layout.create((2, 2), [Shard(0), Shard(1)], (1024, 1024))
    >>> plan = explain_redistribute(layout, [Shard(1), Shard(0)], itemsize=4)  # doctest: +ELLIPSIS
    redistribute [S(0), S(1)] shape=(1024, 1024) mesh=(2, 2)  ->  [S(1), S(0)], 4-byte items: 1 step(s)
    ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from ..dtensor import DTensor
from ..layout import Layout
from ..placement import Placement
from ..redistribute import CostModel, HandOff, Plan, hand_off, plan
from ..redistribute.explanation import explain_plan
from ..redistribute.planner import DEFAULT_COST_MODEL

__all__ = ["explain_redistribute"]


def _itemsize_error(itemsize) -> ValueError:
    return ValueError(
        f"explain_redistribute of a Layout needs the item size in bytes (a Layout has no dtype), got "
        f"itemsize={itemsize!r}; pass e.g. itemsize=4 for float32, or pass the DTensor itself"
    )


def explain_redistribute(
    dtensor_or_layout: DTensor | Layout,
    placements: Sequence[Placement],
    *,
    itemsize: int | None = None,
    device_mesh=None,
    cost_model: CostModel = DEFAULT_COST_MODEL,
    file: TextIO | None = None,
) -> Plan | tuple[Plan | None, HandOff]:
    """Print (to `file`, default stdout) and return the plan `redistribute(placements)` would run.

    Each step shows its mesh dim, from -> to, collective, group size, bytes the busiest rank
    receives and estimated cost; then the total and the lower bound of bytes any plan must move,
    and, for a plan above the bound, the plan moving the fewest bytes with its cost. `itemsize` defaults to the DTensor's element size. For a DTensor and another
    `device_mesh`, returns (the plan reducing Partial mesh dims on the source mesh or None, the
    point-to-point `HandOff`) and prints both. Nothing is communicated.
    """
    if isinstance(dtensor_or_layout, DTensor):
        source = dtensor_or_layout.sharding
        itemsize = dtensor_or_layout.element_size() if itemsize is None else itemsize
        source_mesh = dtensor_or_layout.device_mesh
    elif isinstance(dtensor_or_layout, Layout):
        if device_mesh is not None:
            raise ValueError("a Layout has no mesh: explain a cross-mesh move on the DTensor itself")
        source, source_mesh = dtensor_or_layout, None
    else:
        raise TypeError(f"explain_redistribute takes a DTensor or a Layout, got {type(dtensor_or_layout).__name__}")
    if not isinstance(itemsize, int) or itemsize <= 0:
        raise _itemsize_error(itemsize)
    output = sys.stdout if file is None else file
    if device_mesh is None or device_mesh == source_mesh:
        result = plan(source, source.with_placements(tuple(placements)), itemsize, cost_model)
        print(explain_plan(result, cost_model), file=output)
        return result
    reduced = source.without_partial()
    reduction = plan(source, reduced, itemsize, cost_model) if reduced != source else None
    target = Layout.create(device_mesh.shape, tuple(placements), source.shape)
    moves = hand_off(reduced, _ranks(source_mesh), target, _ranks(device_mesh))
    if reduction is not None:
        print(reduction, file=output)
    print(moves, file=output)
    return reduction, moves


def _ranks(mesh) -> tuple[int, ...]:
    return tuple(mesh.mesh.flatten().tolist())
