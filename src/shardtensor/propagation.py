"""Sharding propagation: from an op's rule and its inputs' layouts to one decision, cached.

A rule describes an op along a single mesh dim as rows `[outputs..., inputs...]` of placements
(`Row`). For an N-D mesh the engine picks one row per mesh dim, choosing the row whose input
placements are cheapest to reach from where the inputs are (bytes moved, then number of
collectives, then the rule's own order), and builds the full input and output layouts. Decisions
are cached by (op, input layouts, dtypes, non-tensor arguments): the hot path is one dict lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .layout import Layout
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["Row", "TensorMeta", "OpCall", "Decision", "decide", "transition_cost", "clear_cache"]


@dataclass(frozen=True, slots=True)
class Row:
    """One way to compute an op along one mesh dim: a placement per output and per tensor input."""

    outputs: tuple[Placement, ...]
    inputs: tuple[Placement, ...]

    def __str__(self) -> str:
        outputs = ", ".join(str(p) for p in self.outputs)
        inputs = ", ".join(str(p) for p in self.inputs)
        return f"[{outputs} <- {inputs}]"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape, stride and dtype of a tensor argument or result."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class OpCall:
    """What a rule sees: the op, its tensor inputs' global metadata, and the remaining arguments.

    In `args`/`kwargs`, tensor arguments stand as their `TensorMeta`; `inputs` lists the DTensor
    arguments in the order the rule's rows name them (the flattened argument order).
    """

    op: object
    inputs: tuple[TensorMeta, ...]
    args: tuple
    kwargs: tuple[tuple[str, object], ...]

    def kwarg(self, name: str, default=None):
        for key, value in self.kwargs:
            if key == name:
                return value
        return default


Rule = Callable[[OpCall], Sequence[Row]]


@dataclass(frozen=True, slots=True)
class Decision:
    """Where each tensor input must be before the local op runs, and the layout of each output."""

    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout | None, ...]
    output_metas: tuple[TensorMeta | None, ...]
    rows: tuple[Row, ...]

    def moves_inputs(self, current: Sequence[Layout]) -> bool:
        return any(target != layout for target, layout in zip(self.input_layouts, current))


def transition_cost(layout: Layout, mesh_dim: int, target: Placement, itemsize: int) -> tuple[float, int]:
    """(bytes a rank moves, collectives) to change one mesh dim of `layout` to `target`.

    An estimate for choosing rows: it prices the single step on that mesh dim the way the planner
    does; the exact multi-step plan is left to the redistribute planner.
    """
    source = layout.placements[mesh_dim]
    if source == target:
        return 0.0, 0
    parts = layout.mesh_shape[mesh_dim]
    local_bytes = math.prod(max(pieces) if pieces else 0 for pieces in layout.pieces) * itemsize
    if isinstance(source, Replicate) and isinstance(target, (Shard, Partial)):
        return 0.0, 0
    if isinstance(source, Shard) and isinstance(target, Replicate):
        return float((parts - 1) * local_bytes), 1
    if isinstance(source, Shard) and isinstance(target, Shard):
        return local_bytes * (parts - 1) / parts, 1
    if isinstance(source, Partial) and isinstance(target, Replicate):
        return 2 * local_bytes * (parts - 1) / parts, 1
    if isinstance(source, Partial) and isinstance(target, Shard):
        return local_bytes * (parts - 1) / parts, 1
    # Partial(a) -> Partial(b) and Shard -> Partial go through Replicate.
    return float((parts - 1) * local_bytes) * 2, 2


def _choose_row(rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta], mesh_dim: int) -> Row:
    best, best_key = None, None
    for rank_in_rule, row in enumerate(rows):
        bytes_moved, collectives = 0.0, 0
        for layout, meta, target in zip(layouts, metas, row.inputs):
            moved, count = transition_cost(layout, mesh_dim, target, meta.dtype.itemsize)
            bytes_moved += moved
            collectives += count
        key = (bytes_moved, collectives, rank_in_rule)
        if best_key is None or key < best_key:
            best, best_key = row, key
        if bytes_moved == 0 and collectives == 0:
            break
    return best


def _output_layout(mesh_shape, placements, meta: TensorMeta, input_layouts: Sequence[Layout]) -> Layout:
    """Output layout; a sharded output dim takes exact pieces from an input dim split the same way."""
    layout = Layout.create(mesh_shape, placements, meta.shape)
    pieces = list(layout.pieces)
    for dim, order in enumerate(layout.shard_order):
        if not order:
            continue
        for source in input_layouts:
            match = next(
                (
                    source.pieces[source_dim]
                    for source_dim in range(source.ndim)
                    if source.shard_order[source_dim] == order and source.shape[source_dim] == meta.shape[dim]
                ),
                None,
            )
            if match is not None:
                pieces[dim] = match
                break
    return Layout(layout.mesh_shape, layout.placements, layout.shape, layout.shard_order, tuple(pieces))


_cache: dict = {}


def clear_cache() -> None:
    _cache.clear()


def decide(
    call: OpCall,
    layouts: Sequence[Layout],
    rule: Rule,
    output_metas: Callable[[OpCall], Sequence[TensorMeta | None]],
    cache_key: object | None,
) -> Decision:
    """Pick a row per mesh dim and build the decision; cached under `cache_key` when it is not None."""
    if cache_key is not None:
        cached = _cache.get(cache_key)
        if cached is not None:
            return cached
    rows = rule(call)
    if not rows:
        raise NotImplementedError(f"the sharding rule of {call.op} returned no way to compute it")
    mesh_shape = layouts[0].mesh_shape
    chosen = tuple(_choose_row(rows, layouts, call.inputs, mesh_dim) for mesh_dim in range(len(mesh_shape)))
    input_layouts = tuple(
        layout.with_placements([row.inputs[index] for row in chosen]) for index, layout in enumerate(layouts)
    )
    metas = tuple(output_metas(call))
    output_layouts = tuple(
        None
        if meta is None
        else _output_layout(mesh_shape, [row.outputs[index] for row in chosen], meta, input_layouts)
        for index, meta in enumerate(metas)
    )
    decision = Decision(input_layouts, output_layouts, metas, chosen)
    if cache_key is not None:
        _cache[cache_key] = decision
    return decision
