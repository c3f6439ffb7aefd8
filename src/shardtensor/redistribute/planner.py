"""Redistribute planner: the cheapest sequence of single-mesh-dim steps between two layouts.

States are `Layout`s (placements, shard order and exact pieces). A step changes one mesh dim:

    from -> to          collective        why
    S(a) -> R           all_gather
    S(a) -> S(b)        all_to_all        also S(a) -> S(a) with other pieces (a re-split)
    R    -> S(b)        slice             local: keep this coordinate's piece
    P    -> R           all_reduce
    P    -> S(b)        reduce_scatter
    R    -> P           make_partial      local, internal: only towards a Partial target
    P(x) -> P(y)        -                 not direct: reduce first
    any  -> any         relabel           on a mesh dim of size 1 the local tensor does not change
    P..P -> R..R        all_reduce        several Partial mesh dims at once, over their flattened
    P..P -> S..S(b)     reduce_scatter    sub-mesh: reaches the lower bound where a reduction per mesh
                                          dim moves more (e.g. 1.5x for (P,P)->(R,R)); a P(sum)/P(avg)
                                          mix sums and divides by the avg mesh dims' ranks
    S(a)..S(a) -> R..R  all_gather        mesh dims that shard one tensor dim innermost (a suffix of
                                          its shard order), over their sub-mesh flattened in shard
                                          order, whose row-major peers hold consecutive pieces: the
                                          bytes of one gather per mesh dim in one collective
    Neither flattened collective on a slice of the world (`CostModel.flattened_groups`): it would run
    as one collective per mesh dim, so those steps are planned.
    all mesh dims       batch_p2p         straight to the target, no Partial on either side: every
                                          rank receives exactly the target elements it lacks

A source may mix Partial reduce ops only where they commute (`Partial.commutes_with`: P(sum) with
P(avg)), and such a mix reduces in one collective too (`flattened_partial`); any other mix has no
one value, and reducing it is refused. Only the innermost mesh dim of a nested shard may move
(`Layout.transition` checks it). A new split of a tensor dim whose shard order becomes a prefix of
the target's takes the target's pieces, so explicit uneven targets are reached exactly.

Cost model (alpha-beta, `CostModel`): a step costs `latency_us` per collective plus
`bytes / bytes_per_us`, where bytes are the **most bytes any one rank receives in that step** (the
rank that finishes last). Sizes are exact per rank, uneven and empty pieces included (`bounds.py`). `plan`
runs an exact shortest path (A* with an admissible heuristic: latency plus missing bytes) and caches per
(source, target, itemsize, cost model); each plan carries `bounds.lower_bound_bytes` to print itself against.
Shortcuts before the search (one step at the estimate, a collective then a local step) and, in it, neighbours
dropped unpriced (and unbuilt: `moves.neighbors` gives each move's placements, shard order and pieces) when
one rank's bytes show they cannot beat a known single step, return the search's plan (tests/test_planner.py
compares them with the search without them).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
from dataclasses import replace

from ..layout import Layout
from ..placement import Partial, Placement, Replicate, Shard
from .bounds import busiest_rank, coordinate_of, lower_bound_bytes, missing_at, missing_between, most_missing, shard_shapes
from .moves import flattened_gathers, flattened_reductions, gathered_is, moves, neighbors
from .steps import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, DEFAULT_COST_MODEL, EXCHANGE, LOCAL_STEPS, MAKE_PARTIAL, PER_MESH_DIM_COST_MODEL,
    REDUCE_SCATTER, RELABEL, SLICE, CostModel, Plan, Step, received_bytes,
)

__all__ = [
    "CostModel", "DEFAULT_COST_MODEL", "PER_MESH_DIM_COST_MODEL", "Plan", "Step", "plan", "received_bytes", "LOCAL_STEPS",
]


# A search that expands this many layouts has gone wrong (typical plans expand a few dozen).
_MAX_EXPANDED_STATES = 200_000
# Each new plan is logged at DEBUG (see `shardtensor.log`); cached plans log nothing.
_logger = logging.getLogger("shardtensor.redistribute")


def _collective(source: Placement, target: Placement, group_size: int) -> str:
    if group_size == 1:
        return RELABEL
    if isinstance(source, Replicate):
        return SLICE if isinstance(target, Shard) else MAKE_PARTIAL
    if isinstance(source, Shard):
        return ALL_GATHER if isinstance(target, Replicate) else ALL_TO_ALL
    return ALL_REDUCE if isinstance(target, Replicate) else REDUCE_SCATTER


def _step_bytes(before: Layout, after: Layout, collective: str, group_size: int, itemsize: int) -> int:
    """The most bytes any rank receives in one step."""
    if collective in LOCAL_STEPS:
        return 0
    if collective in (ALL_GATHER, ALL_TO_ALL, EXCHANGE):
        return most_missing(before, after) * itemsize
    # a reduction's bytes grow with the rank's piece after it: the largest piece is the busiest rank
    largest = ((0,), (max(map(math.prod, shard_shapes(after))) if any(after.shard_order) else after.numel,))
    return received_bytes(collective, group_size, largest, largest, itemsize)


def _make_step(before: Layout, after: Layout, mesh_dim: int, itemsize: int, cost_model: CostModel) -> Step:
    source, target = before.placements[mesh_dim], after.placements[mesh_dim]
    group_size = before.mesh_shape[mesh_dim]
    collective = _collective(source, target, group_size)
    bytes_per_rank = _step_bytes(before, after, collective, group_size, itemsize)
    return Step(
        mesh_dim, source, target, collective, group_size, bytes_per_rank,
        cost_model.step_cost(collective, bytes_per_rank), before, after,
    )


def _flattened_step(before: Layout, after: Layout, mesh_dims: tuple[int, ...], itemsize: int,
                    cost_model: CostModel) -> Step:
    if isinstance(before.placements[mesh_dims[0]], Shard):
        collective = ALL_GATHER
    else:
        collective = ALL_REDUCE if isinstance(after.placements[mesh_dims[0]], Replicate) else REDUCE_SCATTER
    group_size = math.prod(before.mesh_shape[mesh_dim] for mesh_dim in mesh_dims)
    bytes_per_rank = _step_bytes(before, after, collective, group_size, itemsize)
    return Step(
        mesh_dims, tuple(before.placements[m] for m in mesh_dims), tuple(after.placements[m] for m in mesh_dims),
        collective, group_size, bytes_per_rank, cost_model.step_cost(collective, bytes_per_rank), before, after,
    )


def _exchange_step(before: Layout, after: Layout, itemsize: int, cost_model: CostModel) -> Step:
    bytes_per_rank = most_missing(before, after) * itemsize
    return Step(
        None, before.placements, after.placements, EXCHANGE, math.prod(before.mesh_shape), bytes_per_rank,
        cost_model.step_cost(EXCHANGE, bytes_per_rank), before, after,
    )


def _exchange_allowed(state: Layout, target: Layout) -> bool:
    """An exchange moves elements, not operands: neither side may hold Partial mesh dims."""
    return math.prod(state.mesh_shape) > 1 and not _has_partial(state) and not _has_partial(target)


def _has_partial(layout: Layout) -> bool:
    for placement in layout.placements:
        if isinstance(placement, Partial):
            return True
    return False


# ---- search --------------------------------------------------------------------------------------


def _remaining_cost(state: Layout, target: Layout, itemsize: int, cost_model: CostModel) -> float:
    """Admissible estimate of the cost from `state` to `target` (never above the true cost).

    Partial mesh dims that must be reduced need at least one collective (a flattened one may
    reduce them all; without `flattened_groups`, one each). Shard mesh dims that must move need a
    collective per tensor dim they shard (a flattened all_gather may move all of one tensor dim's;
    without `flattened_groups`, one per mesh dim), unless one exchange moves them all. Bytes: the
    lower bound of what the busiest rank must still receive. Local steps are not counted.
    """
    latency, partial_moves = _remaining_latency(state, target, cost_model)
    # with Partial mesh dims to reduce, the lower bound also counts the reduction's bytes
    missing = lower_bound_bytes(state, target, itemsize) if partial_moves else most_missing(state, target) * itemsize
    return latency + missing / cost_model.bytes_per_us


@functools.lru_cache(maxsize=65536)
def _remaining_latency(state: Layout, target: Layout, cost_model: CostModel) -> tuple[float, int]:
    """The latency part of `_remaining_cost`, and how many reductions it counts."""
    return _latency_between(state.mesh_shape, state.placements, state.shard_order, target, cost_model)


def _latency_between(mesh_shape, placements, shard_order, target: Layout, cost_model: CostModel) -> tuple[float, int]:
    """`_remaining_latency` from a layout's placements and shard order alone (a move not yet built)."""
    partial_moves = 0
    moving_dims = set()
    for mesh_dim, current in enumerate(placements):
        if mesh_shape[mesh_dim] == 1:
            continue
        if isinstance(current, Partial) and current != target.placements[mesh_dim]:
            partial_moves = partial_moves + 1 if not cost_model.flattened_groups else 1
        elif isinstance(current, Shard) and _shard_must_move(shard_order[current.dim], target, mesh_dim, current.dim):
            moving_dims.add(current.dim)
    shard_moves = len(moving_dims)
    least = cost_model.least_latency_us
    latency = partial_moves * least
    if shard_moves:
        latency += min(shard_moves * least, cost_model.latency_of(EXCHANGE))
    return latency, partial_moves


def _shard_must_move(order: tuple[int, ...], target: Layout, mesh_dim: int, dim: int) -> bool:
    """Whether `mesh_dim`, which shards tensor dim `dim` in the shard order `order`, must move at least
    once to reach `target`.

    Only the innermost mesh dim of a shard order can leave it, so while `mesh_dim` stays, the
    mesh dims before it (and its own position) stay too: if that prefix differs from the
    target's, `mesh_dim` has to move. This counts the nested re-orderings that placements alone
    do not show (e.g. (S0, S0) with order (0, 1) -> the same placements with order (1, 0)).
    """
    depth = order.index(mesh_dim) + 1
    return order[:depth] != target.shard_order[dim][:depth]


def _plan_error(source: Layout, target: Layout, problem: str, allowed: str) -> ValueError:
    return ValueError(f"cannot plan a redistribute from {source} to {target}: {problem}. {allowed}")


def _check(source: Layout, target: Layout) -> None:
    if source.mesh_shape != target.mesh_shape:
        raise _plan_error(
            source, target, f"mesh shapes differ ({source.mesh_shape} vs {target.mesh_shape})",
            "Both layouts must be on the same mesh; build the target with source.with_placements(...).",
        )
    if source.shape != target.shape:
        raise _plan_error(
            source, target, f"tensor shapes differ ({source.shape} vs {target.shape})",
            "A redistribute keeps the global shape; reshape separately.",
        )
    source_ops = {placement for placement in source.placements if isinstance(placement, Partial)}
    if len(source_ops) < 2:  # one reduce op (or none) always has one value
        return
    reduced_ops = {
        placement
        for mesh_dim, placement in enumerate(source.placements)
        if isinstance(placement, Partial) and target.placements[mesh_dim] != placement
    }
    commuting = all(first.commutes_with(second) for first in source_ops for second in source_ops)
    if reduced_ops and not commuting:
        raise _plan_error(
            source, target, f"the source mixes Partial reduce ops {sorted(map(str, source_ops))}",
            "Their reduction order is ambiguous: a layout may mix Partial('sum') with Partial('avg') "
            "(both linear), otherwise it holds one reduce op. To pick the order you mean, reduce the "
            "local tensor over the first mesh dim yourself (shardtensor.comm.all_reduce(x.to_local(), "
            "mesh, mesh_dim, reduce_op=...)) and rebuild it with DTensor.from_local, Replicate() there.",
        )


def plan(source: Layout, target: Layout, itemsize: int, cost_model: CostModel = DEFAULT_COST_MODEL) -> Plan:
    """The cheapest plan from `source` to `target` for items of `itemsize` bytes (cached).

    >>> from shardtensor.layout import Layout
    >>> from shardtensor.placement import Shard, Replicate
    >>> source = Layout.create((4,), [Shard(0)], (8, 8))
    >>> [step.collective for step in plan(source, source.with_placements([Replicate()]), 4).steps]
    ['all_gather']
    """
    if source.is_symbolic or target.is_symbolic:
        return _symbolic_plan(source, target, int(itemsize), cost_model)
    return _cached_plan(source, target, int(itemsize), cost_model)


def _symbolic_plan(source: Layout, target: Layout, itemsize: int, cost_model: CostModel) -> Plan:
    """A plan between layouts with symbolic sizes (torch.compile's dynamic shapes): the plan of the traced
    example's sizes (its steps are right for every size; comparing symbolic costs would guard the graph
    on the sizes), its steps' layouts given the symbolic sizes. Costs and bytes stay the example's."""
    example = _cached_plan(source.with_example_sizes(), target.with_example_sizes(), itemsize, cost_model)
    steps: list[Step] = []
    for index, step in enumerate(example.steps):
        before = source if index == 0 else steps[-1].after
        after = target if index == len(example.steps) - 1 else step.after.with_shape(source.shape)
        steps.append(replace(step, before=before, after=after))
    return replace(example, source=source, target=target, steps=tuple(steps))


def _step_between(state: Layout, after: Layout, mesh_dim, itemsize: int, cost_model: CostModel) -> Step:
    if mesh_dim is None:
        return _exchange_step(state, after, itemsize, cost_model)
    if isinstance(mesh_dim, tuple):
        return _flattened_step(state, after, mesh_dim, itemsize, cost_model)
    return _make_step(state, after, mesh_dim, itemsize, cost_model)


def _steps_onto(source: Layout, target: Layout, flattened_groups: bool, exchange: bool = True):
    """The neighbours of `source` (as `moves.neighbors` gives them) that can be `target`: one mesh dim's move
    to the target's placement where only that mesh dim differs, a flattened collective when several
    differ, the exchange. Cheaper than every neighbour: most moves go elsewhere."""
    differing = [mesh_dim for mesh_dim in range(source.mesh_ndim) if source.placements[mesh_dim] != target.placements[mesh_dim]]
    for mesh_dim in differing if len(differing) == 1 else range(source.mesh_ndim) if not differing else ():
        current, wanted = source.placements[mesh_dim], target.placements[mesh_dim]
        if isinstance(current, Shard) and isinstance(wanted, Replicate) and differing:  # a gather: no layout to build
            order = source.shard_order[current.dim]
            if order[-1] == mesh_dim and gathered_is(source, current.dim, len(order) - 1, target):
                yield mesh_dim, target
            continue
        for placement, pieces in moves(source, target, mesh_dim, only=wanted):
            if placement == target.placements[mesh_dim]:
                yield mesh_dim, source.transition(mesh_dim, placement, pieces=pieces)
    if flattened_groups and len(differing) > 1:
        yield from flattened_reductions(source, target, frozenset(differing))
        yield from flattened_gathers(source, target, frozenset(differing))
    if exchange and _exchange_allowed(source, target):
        yield None, target


def _cheapest_step_onto(source: Layout, target: Layout, neighbors, itemsize: int, cost_model: CostModel) -> Step | None:
    """The cheapest single step among `neighbors` of `source` that lands on `target` (None if none does)."""
    best = None
    for mesh_dim, after in neighbors:
        if mesh_dim is None and best is not None and best.collective in (ALL_GATHER, ALL_TO_ALL) and (
                cost_model.latency_of(best.collective) <= cost_model.latency_of(EXCHANGE)):
            continue  # the exchange moves the same bytes (the most missing) and starts no sooner
        if after is target or after == target:
            step = _step_between(source, after, mesh_dim, itemsize, cost_model)
            if best is None or step.cost_us < best.cost_us:
                best = step
    return best


def _at_most(cost: float, bound: float) -> bool:
    return cost <= bound * (1 + 1e-12)


def _collective_then_local_step(source: Layout, target: Layout, direct: Step | None, estimate: float, itemsize: int,
                                cost_model: CostModel) -> tuple[Step, Step] | None:
    """One collective onto the target with one mesh dim made Replicate, then that mesh dim's local step
    (a slice, or make_partial), when no plan is cheaper, else None. E.g. (S0,R)->(R,S0): all_gather, slice.

    Bound: `estimate` counts collectives alone, so a plan with a local step costs at least `estimate +
    local_step_us`; one with two collectives at least two latencies plus the bytes part of the estimate,
    which is no less when the estimate counts at most one latency; one step costs `direct`. A candidate
    at that bound, strictly below `direct`, is what the search returns (the target pops first on ties).
    """
    latency, _ = _remaining_latency(source, target, cost_model)
    least = cost_model.least_latency_us
    local = cost_model.local_step_us
    if latency > least or local > least:
        return None
    bound = estimate + local
    best = None
    witness = coordinate_of(source.mesh_shape, busiest_rank(source, target))
    first_latency = min(least, cost_model.latency_of(EXCHANGE))
    for mesh_dim in range(source.mesh_ndim):
        wanted = target.placements[mesh_dim]
        if wanted == source.placements[mesh_dim] or isinstance(wanted, Replicate):
            continue
        if isinstance(wanted, Shard) and target.shard_order[wanted.dim][-1] != mesh_dim:
            continue
        middle = target.transition(mesh_dim, Replicate())
        # no step onto the middle fits the bound when one rank lacks too much of it (a cheap lower bound)
        lacking = missing_at(source, middle, witness) * itemsize / cost_model.bytes_per_us
        if not _at_most(first_latency + lacking + local, bound):
            continue
        # every rank's middle shard holds its target shard: an exchange onto it moves the estimate's bytes
        # or more, so it is over the bound when its latency is (and pricing it visits every rank)
        exchange = cost_model.latency_of(EXCHANGE) <= latency
        onto_middle = _steps_onto(source, middle, cost_model.flattened_groups, exchange)
        first = _cheapest_step_onto(source, middle, onto_middle, itemsize, cost_model)
        if first is None or first.collective in LOCAL_STEPS:
            continue
        # the middle is the target with `mesh_dim` made Replicate: its one step back is local (a slice, or
        # make_partial), the cheapest step onto the target
        last = _make_step(middle, target, mesh_dim, itemsize, cost_model)
        cost = first.cost_us + last.cost_us
        if _at_most(cost, bound) and (direct is None or cost < direct.cost_us) and (best is None or cost < best[0]):
            best = (cost, first, last)
    return best[1:] if best is not None else None


def _priced_out(upper: float, cost: float, state: Layout, mesh_dim, placements, order, pieces, target: Layout,
                rank: tuple[int, ...], itemsize: int, cost_model: CostModel) -> bool:
    """Whether the step from `state` to the layout of `placements`, `order` and `pieces` (reached at `cost`)
    plus the rest of any plan to `target` costs at least `upper`, neither side Partial, from a lower bound
    cheaper than pricing (and than building that layout): each part's latency, and the elements one rank
    (at `rank`) receives in the step and still lacks after it. The busiest rank of the whole move is the
    witness: a step that sends it elements it does not keep (an all_gather before a slice) is priced out
    by them. The rest's latency is added only when the bytes fall short."""
    if mesh_dim is None or isinstance(mesh_dim, tuple):
        collective = ALL_GATHER
    else:
        collective = _collective(state.placements[mesh_dim], placements[mesh_dim], state.mesh_shape[mesh_dim])
    mesh_shape = state.mesh_shape
    received = missing_between(mesh_shape, state.shard_order, state.pieces, order, pieces, rank)
    reached = cost + cost_model.step_cost(collective, received * itemsize)
    lacking = missing_between(mesh_shape, order, pieces, target.shard_order, target.pieces, rank)
    rest = lacking * itemsize / cost_model.bytes_per_us
    if _beyond(upper, reached + rest):
        return True
    latency, _ = _latency_between(mesh_shape, placements, order, target, cost_model)
    return _beyond(upper, reached + (latency + rest))


def _beyond(upper: float, bound: float) -> bool:
    """Whether a path whose cost is at least `bound` cannot beat a plan of cost `upper` (it would pop
    after the target, which pops first among equal estimates)."""
    return upper <= bound


@functools.lru_cache(maxsize=4096)
def _cached_plan(source: Layout, target: Layout, itemsize: int, cost_model: CostModel) -> Plan:
    _check(source, target)
    if source == target:  # nothing to move (the search would pop the source as the target)
        return _logged(Plan(source, target, itemsize, (), lower_bound_bytes(source, target, itemsize)))
    estimate = _remaining_cost(source, target, itemsize, cost_model)
    onto = _steps_onto(source, target, cost_model.flattened_groups)
    direct = _cheapest_step_onto(source, target, onto, itemsize, cost_model)
    if direct is not None and _at_most(direct.cost_us, estimate):  # no plan is cheaper: the search would return it too
        return _logged(Plan(source, target, itemsize, (direct,), lower_bound_bytes(source, target, itemsize)))
    two = _collective_then_local_step(source, target, direct, estimate, itemsize, cost_model)
    if two is not None:
        return _logged(Plan(source, target, itemsize, two, lower_bound_bytes(source, target, itemsize)))
    # a plan known to reach the target (the cheapest single step) bounds the search: a neighbour whose
    # lower bound is not below it would pop after the target, so it is not priced (`_priced_out`)
    upper = direct.cost_us if direct is not None and not _has_partial(source) and not _has_partial(target) else None
    witness = coordinate_of(source.mesh_shape, busiest_rank(source, target)) if upper is not None else ()
    best = {source: 0.0}
    arrival: dict[Layout, Step] = {}
    counter = itertools.count()
    # among entries of equal estimate the target pops first: its cost is then optimal, and the entries
    # left could only tie it, never replace it (a step replaces an arrival only when strictly cheaper)
    frontier = [(estimate, True, 0.0, next(counter), source)]
    expanded = 0
    while frontier:
        _, _, cost, _, state = heapq.heappop(frontier)
        if state is target:  # the search pushes the target itself
            break
        if cost > best[state]:
            continue
        expanded += 1
        if expanded > _MAX_EXPANDED_STATES:
            raise _plan_error(source, target, f"search expanded {expanded} layouts", "This is a bug; please report it.")
        exchange = _exchange_allowed(state, target)
        for mesh_dim, placements, order, pieces in neighbors(state, target, cost_model.flattened_groups, exchange):
            lands = pieces == target.pieces and order == target.shard_order and placements == target.placements
            if upper is not None and not lands and _priced_out(
                    upper, cost, state, mesh_dim, placements, order, pieces, target, witness, itemsize, cost_model):
                continue
            after = target if lands else Layout(state.mesh_shape, placements, state.shape, order, pieces)
            if best.get(after, math.inf) <= cost:
                continue
            if lands and state is source and direct is not None and direct.mesh_dim == mesh_dim:
                step = direct  # the shortcut priced this step already
            else:
                step = _step_between(state, after, mesh_dim, itemsize, cost_model)
            new_cost = cost + step.cost_us
            if new_cost < best.get(after, math.inf):
                best[after] = new_cost
                arrival[after] = step
                # nothing remains at the target (the estimate there is 0)
                estimate = new_cost if lands else new_cost + _remaining_cost(after, target, itemsize, cost_model)
                heapq.heappush(frontier, (estimate, not lands, new_cost, next(counter), after))
    if target not in best:
        raise _plan_error(
            source, target, "the target is unreachable",
            "A Partial target mesh dim is reachable only from the same Partial or from Replicate.",
        )
    steps = []
    state = target
    while state != source:
        step = arrival[state]
        steps.append(step)
        state = step.before
    return _logged(Plan(source, target, itemsize, tuple(reversed(steps)), lower_bound_bytes(source, target, itemsize)))


def _logged(result: Plan) -> Plan:
    if _logger.isEnabledFor(logging.DEBUG):
        _logger.debug("planned %s", result)
    return result
