"""The step-level cost of a rule's rows, to choose one row per mesh dim.

A row's cost is for the step, not only the op (`row_cost`): moving the inputs (`transition_cost`),
the collectives the rule's local op issues itself (`Row.collectives`), and what an output layout nobody
asked for forces later (a Shard on a mesh dim where no input stays sharded must be gathered again, a
Partial that the data does not imply must be reduced: `_follows_the_data`). `choose_rows` takes the
cheapest row per mesh dim (bytes moved, then collectives, then bytes moved now, then the rule's own
order); when that choice moves a nested-sharded input, the redistribute planner prices the best few
combinations exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from .layout import Layout, example_size
from .placement import Partial, Placement, Replicate, Shard
from .redistribute.planner import plan as plan_redistribute
from .rules import LocalCollective, Row, TensorMeta

__all__ = ["transition_cost", "row_cost", "choose_rows"]


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


def _collective_cost(collective: LocalCollective, parts: int) -> float:
    """Bytes a rank moves for a declared in-op collective over `parts` ranks (like `comm.CommRecord`)."""
    if collective.kind == "all_reduce":
        return 2 * collective.bytes * (parts - 1) / parts
    if collective.kind == "all_gather":
        return float(collective.bytes * (parts - 1))
    return float(collective.bytes * (parts - 1) / parts)


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


def _follows_the_data(row: Row, layouts: Sequence[Layout], mesh_dim: int) -> tuple[bool, bool]:
    """(a Shard output follows the data, the Partial outputs do) along `mesh_dim`.

    A Shard output follows the data when some input that the row leaves where it is is sharded
    there. Partial outputs do when no input must be communicated to get there and either some
    input stays sharded (a sum over a sharded dim, a matmul of matching shards) or there are no
    more Partial outputs than Partial inputs staying (a Partial scaled, cast, padded or summed).
    Keeping a Partial by gathering another input only postpones the reduction and pays the gather
    on top; a Partial that fans out into several Partial outputs (a LayerNorm backward giving input
    and weight gradients) needs a reduction for each instead of one now.
    """
    staying = [
        layout.placements[mesh_dim] for layout, target in zip(layouts, row.inputs) if layout.placements[mesh_dim] == target
    ]
    sharded = any(isinstance(placement, Shard) for placement in staying)
    moves_data = any(transition_cost(layout, mesh_dim, target, 1)[1] for layout, target in zip(layouts, row.inputs))
    partial_in = sum(isinstance(placement, Partial) for placement in staying)
    partial_out = sum(isinstance(placement, Partial) for placement in row.outputs)
    partial = not moves_data and (sharded or partial_out <= partial_in)
    return sharded, partial


def _forced_later(
    row: Row, output_metas: Sequence[TensorMeta], mesh_dim: int, parts: int, follows: tuple[bool, bool]
) -> tuple[float, int]:
    """What an output layout nobody asked for costs later, estimated as undoing it once.

    A Shard output on a mesh dim where no input stays sharded (a Partial reduce-scattered over the
    batch, a Replicate input sliced, the only sharded input moved to another dim) leaves the rest of
    the step to run sharded on a dim the program never chose: its consumers gather it (an
    all_gather) or their gradients arrive sharded. Partial outputs that do not follow the data
    must be reduced (an all_reduce each). Outputs that follow the data cost nothing here.
    """
    shard_follows, partial_follows = follows
    bytes_moved, collectives = 0.0, 0
    for placement, meta in zip(row.outputs, output_metas):
        full_bytes = _numel(meta) * meta.dtype.itemsize
        if isinstance(placement, Partial) and not partial_follows:
            bytes_moved += 2 * full_bytes * (parts - 1) / parts
            collectives += 1
        elif isinstance(placement, Shard) and not shard_follows:
            bytes_moved += full_bytes * (parts - 1) / parts
            collectives += 1
    return bytes_moved, collectives


def row_cost(
    row: Row, layouts: Sequence[Layout], metas: Sequence[TensorMeta], output_metas: Sequence[TensorMeta | None],
    mesh_dim: int,
) -> tuple[int, int, int]:
    """(bytes a rank moves, collectives, bytes moved now) for the step when the op computes `row`
    on `mesh_dim`: moving the inputs there and the local op's own collectives (now), and what the
    output forces later. Rows that cost the same overall prefer to communicate later (a Partial
    scaled by a number stays Partial), so that explicit-communication programs keep running."""
    parts = layouts[0].mesh_shape[mesh_dim] if layouts else 1
    bytes_moved, collectives = 0.0, 0
    for layout, meta, target in zip(layouts, metas, row.inputs):
        moved, count = transition_cost(layout, mesh_dim, target, meta.dtype.itemsize)
        bytes_moved += moved
        collectives += count
    if parts > 1:
        for collective in row.collectives:
            bytes_moved += _collective_cost(collective, parts)
            collectives += 1
    now = bytes_moved
    if parts > 1:
        tensor_outputs = [meta for meta in output_metas if meta is not None]  # rows name tensor outputs only
        follows = _follows_the_data(row, layouts, mesh_dim)
        later, count = _forced_later(row, tensor_outputs, mesh_dim, parts, follows)
        bytes_moved += later
        collectives += count
    return round(bytes_moved), collectives, round(now)  # rounded: equal paths priced in two ways tie exactly


def _ranked_rows(
    rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta],
    output_metas: Sequence[TensorMeta | None], mesh_dim: int,
) -> list[Row]:
    """The rows by estimated step cost on one mesh dim, cheapest first (ties: the one communicating
    later, then the rule's order)."""
    keyed = [
        (*row_cost(row, layouts, metas, output_metas, mesh_dim), rank_in_rule, row)
        for rank_in_rule, row in enumerate(rows)
    ]
    keyed.sort(key=lambda entry: entry[:4])
    return [entry[4] for entry in keyed]


def _planned_cost(rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta]) -> float:
    """What the redistribute planner charges (us) to move every input to the rows' placements."""
    total = 0.0
    for index, (layout, meta) in enumerate(zip(layouts, metas)):
        target = layout.with_placements([row.inputs[index] for row in rows])
        if target != layout:
            total += plan_redistribute(layout, target, meta.dtype.itemsize).total_cost_us
    return total


# Rows per mesh dim whose combinations the planner prices when the per-mesh-dim estimate moves data.
_CANDIDATES_PER_MESH_DIM = 2


def _with_example_sizes(meta: TensorMeta | None) -> TensorMeta | None:
    if meta is None:
        return None
    return TensorMeta(tuple(map(example_size, meta.shape)), tuple(map(example_size, meta.stride)), meta.dtype)


def choose_rows(
    rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta],
    output_metas: Sequence[TensorMeta | None],
) -> tuple[Row, ...]:
    """One row per mesh dim: the per-mesh-dim estimate's best, unless an input is sharded on one
    tensor dim by several mesh dims (nested) and that choice moves data. Then the estimate cannot
    see the order constraints, and the redistribute planner prices the combinations of each mesh
    dim's top candidates exactly (slower: a planner search per input and combination).

    Symbolic sizes (torch.compile's dynamic shapes) are priced at the traced example's sizes: any row is
    right for every size, and comparing symbolic costs would guard the graph on the sizes."""
    if any(layout.is_symbolic for layout in layouts):
        layouts = [layout.with_example_sizes() for layout in layouts]
        metas = [_with_example_sizes(meta) for meta in metas]
        output_metas = [_with_example_sizes(meta) for meta in output_metas]
    ranked = [
        _ranked_rows(rows, layouts, metas, output_metas, mesh_dim) for mesh_dim in range(len(layouts[0].mesh_shape))
    ]
    greedy = tuple(candidates[0] for candidates in ranked)
    nested = any(len(order) > 1 for layout in layouts for order in layout.shard_order)
    if not nested or all(
        layout.with_placements([row.inputs[index] for row in greedy]) == layout for index, layout in enumerate(layouts)
    ):
        return greedy
    best, best_cost = greedy, _planned_cost(greedy, layouts, metas)
    for combination in itertools.product(*(candidates[:_CANDIDATES_PER_MESH_DIM] for candidates in ranked)):
        if combination == greedy:
            continue
        try:
            cost = _planned_cost(combination, layouts, metas)
        except ValueError:  # a target the planner cannot reach (two Partials of different reduce ops)
            continue
        if cost < best_cost:
            best, best_cost = combination, cost
    return best
