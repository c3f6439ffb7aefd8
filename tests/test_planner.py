"""Redistribute planner without processes: costs by hand, paths, caching, pieces, Partial rules."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtensor.layout import Layout
from shardtensor.placement import Partial, Replicate, Shard
from shardtensor.redistribute import CostModel, explain, plan
from shardtensor.redistribute.planner import DEFAULT_COST_MODEL, LOCAL_STEPS

R = Replicate()


def _kinds(result):
    return [step.collective for step in result.steps]


def _check_chain(result):
    """Steps connect source to target, each a real single-mesh-dim transition."""
    state = result.source
    for step in result.steps:
        assert step.before == state
        if step.mesh_dim is not None:
            changed = step.mesh_dim if isinstance(step.mesh_dim, tuple) else (step.mesh_dim,)
            for mesh_dim, (before, after) in enumerate(zip(state.placements, step.after.placements)):
                assert before == after or mesh_dim in changed
        state = step.after
    assert state == result.target
    assert result.total_bytes >= result.lower_bound_bytes


# ---- costs by hand ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, target, collective, elements",
    [
        ([Shard(0)], [R], "all_gather", 3 * 2 * 8),  # 3 peers' 2x8 rows
        ([Shard(0)], [Shard(1)], "all_to_all", 3 * 2 * 2),  # keeps its own 2x2 block
        ([Partial()], [R], "all_reduce", 2 * (64 - 16)),  # reduce_scatter + all_gather
        ([Partial()], [Shard(0)], "reduce_scatter", 3 * 16),  # its 2x8 rows from 3 peers
        ([R], [Shard(1)], "slice", 0),
        ([R], [Partial("max")], "make_partial", 0),
    ],
)
def test_single_step_costs_by_hand(source, target, collective, elements):
    layout = Layout.create((4,), source, (8, 8))
    result = plan(layout, layout.with_placements(target), 4)
    assert _kinds(result) == [collective]
    step = result.steps[0]
    assert (step.mesh_dim, step.group_size, step.bytes_per_rank) == (0, 4, elements * 4)
    expected_cost = DEFAULT_COST_MODEL.local_step_us if collective in LOCAL_STEPS else 20.0 + elements * 4 / 1000.0
    assert step.cost_us == pytest.approx(expected_cost)
    assert result.total_bytes == result.lower_bound_bytes == elements * 4


def test_uneven_gather_counts_the_rank_with_the_empty_shard():
    # 5 rows on 4 ranks: pieces 2, 2, 1, 0; the last rank receives all 5 x 7 elements.
    layout = Layout.create((4,), [Shard(0)], (5, 7))
    result = plan(layout, layout.with_placements([R]), 2)
    assert result.total_bytes == result.lower_bound_bytes == 35 * 2


def test_cost_model_is_overridable_and_changes_the_choice():
    # (S0,S0)->(R,S0) on 1024x1024: one exchange at the lower bound; without exchanges, three
    # single-mesh-dim collectives moving 2.5 quarters or, when latency dominates, one all_gather
    # over both mesh dims moving 3 (then a slice).
    source = Layout.create((2, 2), [Shard(0), Shard(0)], (1024, 1024))
    target = source.with_placements([R, Shard(0)])
    quarter = 256 * 1024 * 4
    exchange = plan(source, target, 4)
    no_exchange = plan(source, target, 4, CostModel(exchange_latency_us=1e9))
    latency_bound = plan(source, target, 4, CostModel(exchange_latency_us=1e9, latency_us=1e6))
    assert exchange.collectives == ("batch_p2p",) and exchange.total_bytes == exchange.lower_bound_bytes == 2 * quarter
    assert len(no_exchange.collectives) == 3 and no_exchange.total_bytes == 5 * quarter // 2
    assert latency_bound.collectives == ("all_gather",) and latency_bound.total_bytes == 3 * quarter
    assert latency_bound.steps[0].mesh_dim == (0, 1)
    for result in [exchange, no_exchange, latency_bound]:
        _check_chain(result)


@pytest.mark.parametrize(
    "source, target, single_dim_ratio",
    [
        ([Shard(0), Shard(1)], [Shard(1), Shard(0)], 2.0),
        ([Shard(0), Shard(0)], [R, Shard(0)], 1.5),
    ],
)
def test_exchange_beats_single_mesh_dim_plans_on_large_tensors(source, target, single_dim_ratio):
    layout = Layout.create((2, 2), source, (1024, 1024))
    best = plan(layout, layout.with_placements(target), 4)
    single_dim = plan(layout, layout.with_placements(target), 4, CostModel(exchange_latency_us=1e9, latency_us=1e6))
    assert best.total_bytes == best.lower_bound_bytes
    assert single_dim.total_bytes == single_dim_ratio * best.lower_bound_bytes


def test_simple_changes_keep_single_mesh_dim_collectives():
    for source, target in [([Shard(0), R], [R, R]), ([Shard(0), Shard(1)], [R, R]), ([Shard(0), R], [Shard(1), R])]:
        layout = Layout.create((2, 2), source, (1024, 1024))
        result = plan(layout, layout.with_placements(target), 4)
        assert "batch_p2p" not in result.collectives and result.total_bytes == result.lower_bound_bytes


def test_same_layout_is_an_empty_plan():
    layout = Layout.create((2, 2), [Shard(0), Partial()], (6, 6))
    result = plan(layout, layout, 4)
    assert result.steps == () and result.total_bytes == 0 and result.lower_bound_bytes == 0


def test_plans_are_cached_per_layouts_and_itemsize():
    layout = Layout.create((2, 2), [Shard(0), Shard(1)], (16, 16))
    target = layout.with_placements([Shard(1), Shard(0)])
    assert plan(layout, target, 4) is plan(layout, target, 4)
    assert plan(layout, target, 2) is not plan(layout, target, 4)
    assert plan(layout, target, 2).total_bytes * 2 == plan(layout, target, 4).total_bytes


def test_first_call_plans_on_fresh_shapes_move_every_missing_element():
    """Planning latency is measured in bench/bench_redistribute.py; here fresh shapes plan correctly."""
    for size in range(100, 110):  # new shapes, so nothing is cached
        source = Layout.create((2, 2), [Shard(0), Shard(1)], (size, size))
        result = plan(source, source.with_placements([Shard(1), Shard(0)]), 4)
        assert result.steps and result.total_bytes >= result.lower_bound_bytes > 0


def test_explain_lists_steps_totals_and_lower_bound():
    source = Layout.create((2, 2), [Shard(0), Shard(1)], (8, 8))
    text = explain(source, source.with_placements([Shard(1), Shard(0)]), 4)
    assert "mesh dim" in text and "all_gather" in text and "lower bound" in text
    result = plan(source, source.with_placements([Shard(1), Shard(0)]), 4)
    above_bound = result.total_bytes > result.lower_bound_bytes  # then a line with the fewest-bytes plan
    assert len(text.splitlines()) == 2 + len(result.steps) + above_bound


# ---- shard order and nesting ---------------------------------------------------------------------


def test_only_the_innermost_mesh_dim_of_a_nested_shard_moves():
    source = Layout.create((2, 2), [Shard(0), Shard(0)], (8, 8))
    result = plan(source, source.with_placements([R, Shard(0)]), 4)
    _check_chain(result)
    # mesh dim 0 is the outer split of dim 0: it moves after mesh dim 1, or with it in one all_gather
    # over both, flattened in shard order
    assert result.steps[0].mesh_dim in (1, (0, 1))


@pytest.mark.parametrize(
    "mesh_shape, source, order, target, mesh_dims, shape, elements",
    [
        ((2, 2), [Shard(0), Shard(0)], [(0, 1), ()], [R, R], (0, 1), (8, 8), 6 * 8),
        ((2, 2), [Shard(0), Shard(0)], [(1, 0), ()], [R, R], (1, 0), (8, 8), 6 * 8),
        ((2, 2), [Shard(0), Shard(0)], [(0, 1), ()], [R, R], (0, 1), (7, 5), 6 * 5),  # pieces 2, 2, 2, 1
        ((2, 2, 2), [Shard(0), Shard(0), Shard(0)], [(0, 1, 2), ()], [R, R, R], (0, 1, 2), (16, 4), 14 * 4),
        ((2, 2, 2), [Shard(0), R, Shard(0)], [(0, 2), ()], [R, R, R], (0, 2), (16, 4), 12 * 4),
        ((2, 2, 2), [Shard(0), Shard(0), Shard(0)], [(0, 1, 2), ()], [Shard(0), R, R], (1, 2), (16, 4), 6 * 4),
        ((2, 1, 2), [Shard(1), Shard(1), Shard(1)], [(), (2, 1, 0)], [R, R, R], (2, 1, 0), (3, 9), 3 * 7),  # pieces 3, 2, 2, 2
    ],
)
def test_nested_shards_of_one_dim_gather_in_one_collective_over_their_shard_order(
        mesh_shape, source, order, target, mesh_dims, shape, elements):
    """A suffix of a tensor dim's shard order gathers in one all_gather over those mesh dims flattened
    outermost first (row-major, peer i holds piece i), exactly what one gather per mesh dim moves."""
    layout = Layout.create(mesh_shape, source, shape, shard_order=order)
    result = plan(layout, layout.with_placements(target), 4)
    assert [(step.mesh_dim, step.collective) for step in result.steps] == [(mesh_dims, "all_gather")], str(result)
    assert result.steps[0].group_size == math.prod(mesh_shape[mesh_dim] for mesh_dim in mesh_dims)
    assert result.total_bytes == result.lower_bound_bytes == elements * 4
    _check_chain(result)


def test_non_default_shard_order_is_reached_and_left():
    default = Layout.create((2, 2), [Shard(0), Shard(0)], (8, 8))
    reversed_order = Layout.create((2, 2), [Shard(0), Shard(0)], (8, 8), shard_order=[(1, 0), ()])
    there = plan(default, reversed_order, 4)
    back = plan(reversed_order, default, 4)
    assert there.steps and back.steps
    _check_chain(there)
    _check_chain(back)


def test_swapping_two_mesh_dims_reaches_the_target():
    source = Layout.create((2, 2), [Shard(0), Shard(1)], (8, 8))
    result = plan(source, source.with_placements([Shard(1), Shard(0)]), 4)
    _check_chain(result)
    assert result.lower_bound_bytes == 4 * 4 * 4  # off-diagonal ranks swap one 4x4 block


# ---- explicit pieces -----------------------------------------------------------------------------


def test_transition_with_pieces_splits_as_told_and_checks_them():
    layout = Layout.create((4,), [R], (5, 7))
    split = layout.transition(0, Shard(0), pieces=(3, 1, 0, 1))
    assert split.pieces[0] == (3, 1, 0, 1)
    resplit = split.transition(0, Shard(0), pieces=(2, 1, 1, 1))
    assert resplit.pieces[0] == (2, 1, 1, 1) and resplit.shard_order[0] == (0,)
    with pytest.raises(ValueError, match="do not split the pieces"):
        layout.transition(0, Shard(0), pieces=(3, 1, 0))
    with pytest.raises(ValueError, match="pieces apply to a Shard"):
        layout.transition(0, R, pieces=(5,))


def test_uneven_source_to_even_target_is_one_all_to_all_at_the_lower_bound():
    uneven = Layout.create((4,), [Shard(0)], (5, 7), shard_sizes={0: [3, 1, 0, 1]})
    even = Layout.create((4,), [Shard(0)], (5, 7))
    for source, target in [(uneven, even), (even, uneven)]:
        result = plan(source, target, 4)
        assert _kinds(result) == ["all_to_all"]
        assert result.total_bytes == result.lower_bound_bytes
        _check_chain(result)


def test_explicit_nested_target_pieces_are_reached_exactly():
    replicated = Layout.create((2, 2), [R, R], (8, 3))
    target = replicated.transition(0, Shard(0), pieces=(3, 5)).transition(1, Shard(0), pieces=(3, 0, 1, 4))
    result = plan(replicated, target, 4)
    assert _kinds(result) == ["slice", "slice"]
    assert result.steps[-1].after.pieces == ((3, 0, 1, 4), (3,))
    back = plan(target, Layout.create((2, 2), [Shard(0), Shard(0)], (8, 3)), 4)
    _check_chain(back)


# ---- Partial rules -------------------------------------------------------------------------------


def test_partial_to_another_reduce_op_goes_through_replicate():
    source = Layout.create((2,), [Partial("sum")], (4,))
    result = plan(source, source.with_placements([Partial("max")]), 4)
    assert _kinds(result) == ["all_reduce", "make_partial"]


def test_shard_to_partial_gathers_first():
    source = Layout.create((2,), [Shard(0)], (4,))
    assert _kinds(plan(source, source.with_placements([Partial("sum")]), 4)) == ["all_gather", "make_partial"]


@pytest.mark.parametrize(
    "mesh_shape, source, target, collective",
    [
        ((2, 2), [Partial(), Partial()], [R, R], "all_reduce"),  # 2 * 3/4 of the tensor, not 2 * (1/2 + 1/2)
        ((2, 2), [Partial(), Partial()], [Shard(0), Shard(0)], "reduce_scatter"),
        ((2, 2, 2), [Partial(), Shard(1), Partial()], [R, Shard(1), R], "all_reduce"),
        ((2, 1, 2), [Partial(), Partial(), Partial()], [Shard(1), Partial(), Shard(1)], "reduce_scatter"),
    ],
)
def test_several_partial_mesh_dims_reduce_in_one_flattened_collective(mesh_shape, source, target, collective):
    layout = Layout.create(mesh_shape, source, (64, 64))
    result = plan(layout, layout.with_placements(target), 4)
    assert result.collectives == (collective,) and isinstance(result.steps[0].mesh_dim, tuple)
    assert result.total_bytes == result.lower_bound_bytes
    assert "mesh dims (0, 2)" in str(result) or "mesh dims (0, 1)" in str(result)
    _check_chain(result)


def test_partial_partial_to_shard_replicate_reaches_the_bound_on_large_tensors():
    # one all_reduce would move 1.5x the bound; two collectives reach it
    source = Layout.create((2, 2), [Partial(), Partial()], (2048, 2048))
    result = plan(source, source.with_placements([Shard(0), R]), 4)
    assert len(result.collectives) == 2 and result.total_bytes == result.lower_bound_bytes
    _check_chain(result)


def test_kept_partial_mesh_dim_is_not_reduced():
    source = Layout.create((2, 2), [Partial(), Shard(0)], (8, 8))
    result = plan(source, source.with_placements([Partial(), Shard(1)]), 4)
    assert _kinds(result) == ["all_to_all"]


def test_bad_requests_teach():
    source = Layout.create((2,), [Shard(0)], (4, 4))
    with pytest.raises(ValueError, match="mesh shapes differ"):
        plan(source, Layout.create((4,), [Shard(0)], (4, 4)), 4)
    with pytest.raises(ValueError, match="tensor shapes differ"):
        plan(source, Layout.create((2,), [Shard(0)], (4, 5)), 4)
    mixed = Layout.create((2, 2), [Partial("sum"), Partial("max")], (4, 4))
    with pytest.raises(ValueError, match="mixes Partial reduce ops"):
        plan(mixed, mixed.with_placements([R, R]), 4)


def test_partial_sum_and_avg_mesh_dims_reduce_together():
    """P(sum) and P(avg) commute, so a layout may mix them, and one collective reduces them all: a
    sum over the flattened mesh dims divided by the avg mesh dims' ranks, at the lower bound (torch
    DTensor reduces per mesh dim: an all_reduce each, 1.33x the bound on 2x2, 1.71x on 2x2x2)."""
    for mesh_shape in [(2, 2), (2, 2, 2)]:
        mixed = Layout.create(mesh_shape, [Partial("sum"), Partial("avg"), Partial("sum")][: len(mesh_shape)], (64, 64))
        for target, collective in [([R] * len(mesh_shape), "all_reduce"), ([Shard(0)] * len(mesh_shape), "reduce_scatter")]:
            result = plan(mixed, mixed.with_placements(target), 4)
            mesh_dims = tuple(range(len(mesh_shape)))
            assert [(step.collective, step.mesh_dim) for step in result.steps] == [(collective, mesh_dims)], str(result)
            assert result.total_bytes == result.lower_bound_bytes, str(result)
            assert f"{collective} (group {2 ** len(mesh_shape)}, sum / 2)" in str(result)
    mixed = Layout.create((2, 2, 2), [Partial("sum"), Partial("avg"), Partial("sum")], (8, 8))
    with pytest.raises(ValueError, match=r"may mix Partial\('sum'\) with Partial\('avg'\)"):
        plan(mixed.with_placements([Partial("avg"), Partial("max"), R]), mixed.with_placements([R, R, R]), 4)


def test_size_one_mesh_dims_only_relabel():
    source = Layout.create((1, 2), [Shard(0), Partial()], (4, 4))
    result = plan(source, source.with_placements([Shard(1), R]), 4)
    assert sorted(_kinds(result)) == ["all_reduce", "relabel"]


# ---- properties over random layouts ------------------------------------------------------------


MESH_SHAPES = [(4,), (2, 2), (2, 1, 2), (3,)]


@st.composite
def layout_pairs(draw, mesh_shapes=MESH_SHAPES, partial_source=False):
    """A source layout and a target of the same tensor on one of `mesh_shapes`; with `partial_source`,
    the source is Partial on at least one mesh dim."""
    mesh_shape = draw(st.sampled_from(mesh_shapes))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    choices = [R, Partial("sum")] + [Shard(dim) for dim in range(len(shape))]
    source_placements = draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape), max_size=len(mesh_shape)))
    if partial_source:
        source_placements[draw(st.integers(0, len(mesh_shape) - 1))] = Partial("sum")
    target_placements = draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape), max_size=len(mesh_shape)))
    source = Layout.create(mesh_shape, source_placements, shape)
    return source, source.with_placements(target_placements)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(layout_pairs(), st.sampled_from([1, 4]))
def test_every_plan_reaches_its_target_above_the_lower_bound(pair, itemsize):
    source, target = pair
    result = plan(source, target, itemsize)
    _check_chain(result)
    assert all(step.bytes_per_rank == 0 for step in result.steps if step.collective in LOCAL_STEPS)
    assert all(step.collective == "relabel" for step in result.steps if step.group_size == 1)


def test_the_optimum_is_no_worse_than_every_two_step_path():
    """Brute force: on a 2x2 mesh no plan of at most two steps beats the planner."""
    shape = (6, 5)
    choices = [R, Shard(0), Shard(1)]
    for source_placements, target_placements in itertools.product(itertools.product(choices, repeat=2), repeat=2):
        source = Layout.create((2, 2), source_placements, shape)
        target = source.with_placements(target_placements)
        best = plan(source, target, 4).total_cost_us
        for first_dim, second_dim in itertools.product(range(2), repeat=2):
            for first, second in itertools.product(choices, repeat=2):
                try:
                    middle = source.transition(first_dim, first)
                    end = middle.transition(second_dim, second)
                except ValueError:
                    continue
                if end == target:
                    cost = plan(source, middle, 4).total_cost_us + plan(middle, end, 4).total_cost_us
                    assert best <= cost + 1e-9


def test_a_star_finds_the_same_optimum_as_an_uninformed_search(monkeypatch):
    """The heuristic is admissible: Dijkstra (heuristic 0) never finds a cheaper plan, nested
    shard orders and Partial sources included (the cases where the heuristic prunes most)."""
    from shardtensor.redistribute import planner

    shape = (16, 9)
    choices = [R, Shard(0), Shard(1)]
    sources = [[Shard(0), Shard(0), R], [Shard(1), R, Shard(0)], [Partial(), Partial(), R], [Partial(), Shard(0), Shard(0)],
               [Shard(0), Shard(0), Shard(0)], [Shard(0), Shard(1), Shard(0)]]
    pairs = []
    for source_placements in sources:
        source = Layout.create((2, 2, 2), source_placements, shape)
        pairs += [(source, source.with_placements(target)) for target in itertools.product(choices, repeat=3)]
    informed = [plan(source, target, 4).total_cost_us for source, target in pairs]
    planner._cached_plan.cache_clear()
    monkeypatch.setattr(planner, "_remaining_cost", lambda *arguments: 0.0)
    uninformed = [plan(source, target, 4).total_cost_us for source, target in pairs]
    planner._cached_plan.cache_clear()
    assert informed == pytest.approx(uninformed, abs=1e-9)


def test_shortcuts_return_exactly_the_plan_of_the_search(monkeypatch):
    """One step at the bound, and a collective then a local step under the bound, skip the search, and
    neighbours whose lower bound reaches the cheapest single step are not priced: the same steps as the
    search finds (ties included), on 2-D and 3-D meshes, Partial sources, three cost models."""
    from shardtensor.redistribute import planner

    models = [DEFAULT_COST_MODEL, planner.PER_MESH_DIM_COST_MODEL, CostModel(latency_us=1.0, exchange_latency_us=1.5)]
    pairs = []
    for mesh_shape, shape, choices, count in [((2, 2), (6, 5), [R, Shard(0), Shard(1), Partial()], 3),
                                              ((2, 2), (64, 33), [R, Shard(0), Shard(1)], 3),  # bytes decide
                                              ((2, 1, 2), (5,), [R, Shard(0), Partial()], 3),
                                              ((2, 2, 2), (16, 9), [R, Shard(0), Shard(1)], 1)]:
        for source_placements in itertools.product(choices, repeat=len(mesh_shape)):
            source = Layout.create(mesh_shape, source_placements, shape)
            for target_placements in itertools.product(choices, repeat=len(mesh_shape)):
                pairs += [(source, source.with_placements(target_placements), model) for model in models[:count]]
    planner._cached_plan.cache_clear()
    shortcut = [plan(source, target, 4, model) for source, target, model in pairs]
    planner._cached_plan.cache_clear()
    monkeypatch.setattr(planner, "_at_most", lambda cost, bound: False)
    monkeypatch.setattr(planner, "_beyond", lambda upper, bound: False)
    searched = [plan(source, target, 4, model) for source, target, model in pairs]
    planner._cached_plan.cache_clear()
    assert shortcut == searched


# ---- Partial sources over several mesh dims: brute force and the lower bound ---------------------


def _all_steps(state, target, itemsize, cost_model):
    """Every step a plan could take, a superset of the planner's moves: any placement on one mesh
    dim, a reduction over every ordered set of two or more Partial mesh dims to R or any Shard, and
    a gather over every ordered set of two or more mesh dims sharding one tensor dim whose peers,
    row-major, hold consecutive pieces at every coordinate (`_consecutive_pieces`)."""
    from shardtensor.redistribute import planner

    for mesh_dim, current in enumerate(state.placements):
        options = [R] + [Shard(dim) for dim in range(state.ndim)]
        if current == R and isinstance(target.placements[mesh_dim], Partial):
            options.append(target.placements[mesh_dim])
        for placement in options:
            if placement != current:
                try:
                    after = state.transition(mesh_dim, placement)
                except ValueError:
                    continue
                yield planner._make_step(state, after, mesh_dim, itemsize, cost_model)
    moving = [
        mesh_dim for mesh_dim, placement in enumerate(state.placements)
        if isinstance(placement, Partial) and state.mesh_shape[mesh_dim] > 1 and target.placements[mesh_dim] != placement
    ]
    for count in range(2, len(moving) + 1):
        for mesh_dims in itertools.permutations(moving, count):
            for placement in [R] + [Shard(dim) for dim in range(state.ndim)]:
                after = state
                for mesh_dim in mesh_dims:
                    after = after.transition(mesh_dim, placement)
                yield planner._flattened_step(state, after, mesh_dims, itemsize, cost_model)
    for dim in range(state.ndim):
        sharding = [mesh_dim for mesh_dim, placement in enumerate(state.placements) if placement == Shard(dim)]
        for count in range(2, len(sharding) + 1):
            for mesh_dims in itertools.permutations(sharding, count):
                if sum(state.mesh_shape[mesh_dim] > 1 for mesh_dim in mesh_dims) < 2:
                    continue
                if not _consecutive_pieces(state, mesh_dims, dim):
                    continue
                after = state
                try:
                    for mesh_dim in reversed(mesh_dims):
                        after = after.transition(mesh_dim, R)
                except ValueError:  # a mesh dim of size 1 sharding in between stays: relabel it first
                    continue
                yield planner._flattened_step(state, after, mesh_dims, itemsize, cost_model)
    if planner._exchange_allowed(state, target):
        yield planner._exchange_step(state, target, itemsize, cost_model)


def _consecutive_pieces(state, mesh_dims, dim):
    """Whether at every coordinate the peers along `mesh_dims`, row-major, hold back-to-back intervals
    of tensor dim `dim`: their concatenation in peer order is then the gathered piece."""
    for coordinate in itertools.product(*(range(size) for size in state.mesh_shape)):
        end = None
        for positions in itertools.product(*(range(state.mesh_shape[mesh_dim]) for mesh_dim in mesh_dims)):
            peer = list(coordinate)
            for mesh_dim, position in zip(mesh_dims, positions):
                peer[mesh_dim] = position
            start = state.local_offset(peer)[dim]
            if end is not None and start != end:
                return False
            end = start + state.local_shape(peer)[dim]
    return True


def _brute_force_cost(source, target, itemsize, cost_model):
    """Dijkstra over `_all_steps`, no heuristic: the cheapest cost of any plan."""
    import heapq

    best, counter = {source: 0.0}, itertools.count()
    frontier = [(0.0, next(counter), source)]
    while frontier:
        cost, _, state = heapq.heappop(frontier)
        if state == target:
            return cost
        if cost > best[state]:
            continue
        for step in _all_steps(state, target, itemsize, cost_model):
            if cost + step.cost_us < best.get(step.after, float("inf")) - 1e-12:
                best[step.after] = cost + step.cost_us
                heapq.heappush(frontier, (cost + step.cost_us, next(counter), step.after))
    return float("inf")


BYTES_FIRST = CostModel(latency_us=0.0, exchange_latency_us=0.0)
AVG = Partial("avg")
PARTIAL_SOURCES_3D = {
    (2, 2, 2): [[Partial(), Shard(0), Partial()], [Shard(1), Partial(), Partial()], [Partial(), Partial(), Partial()],
                [Partial(), AVG, Partial()], [AVG, Shard(0), Partial()]],
    (2, 1, 2): [[Partial(), Shard(0), Partial()], [Partial(), Partial(), Shard(1)], [AVG, Partial(), Partial()]],
}


@pytest.mark.parametrize("mesh_shape", sorted(PARTIAL_SOURCES_3D), ids=str)
def test_partial_sources_on_small_3d_meshes_get_the_brute_force_optimum(mesh_shape):
    """The planner's plan costs what the cheapest of all plans costs (exhaustive search over a
    superset of its moves), under the default cost model and when bytes alone decide; and it is
    never below its lower bound."""
    for source_placements in PARTIAL_SOURCES_3D[mesh_shape]:
        source = Layout.create(mesh_shape, source_placements, (4, 6))
        targets = [list(target) for target in itertools.product([R, Shard(0), Shard(1)], repeat=3)]
        targets.append([Partial(), R, Shard(1)])
        for target_placements in targets:
            target = source.with_placements(target_placements)
            where = f"mesh {mesh_shape} shape (4, 6): {source_placements} -> {target_placements}"
            _assert_brute_force_optimum(source, target, where)


SHARD_SOURCES_3D = {
    (2, 2, 2): [([Shard(0), Shard(0), Shard(0)], None), ([Shard(0), R, Shard(0)], None),
                ([Shard(0), Shard(0), Shard(0)], [(2, 0, 1), ()]), ([Shard(0), Shard(1), Shard(0)], None)],
    (2, 1, 2): [([Shard(0), Shard(0), Shard(0)], None), ([Shard(0), Shard(0), Shard(0)], [(0, 2, 1), ()])],
}


@pytest.mark.parametrize("mesh_shape", sorted(SHARD_SOURCES_3D), ids=str)
@pytest.mark.parametrize("shape", [(4, 6), (7, 5)], ids=str)
def test_nested_shard_sources_on_small_3d_meshes_get_the_brute_force_optimum(mesh_shape, shape):
    """Gathers over several mesh dims included (the brute force tries every ordered set of mesh dims
    whose pieces are consecutive, not only the planner's shard-order suffixes), even and uneven."""
    for source_placements, order in SHARD_SOURCES_3D[mesh_shape]:
        source = Layout.create(mesh_shape, source_placements, shape, shard_order=order)
        for target_placements in itertools.product([R, Shard(0), Shard(1)], repeat=3):
            target = source.with_placements(target_placements)
            where = f"mesh {mesh_shape} shape {shape}: {source} -> {list(map(str, target_placements))}"
            _assert_brute_force_optimum(source, target, where)


def _assert_brute_force_optimum(source, target, where: str) -> None:
    """Under both cost models the plan costs what the brute force finds, and never less than its bound."""
    for cost_model in [DEFAULT_COST_MODEL, BYTES_FIRST]:
        result = plan(source, target, 4, cost_model)
        message = f"{where}\n{result}"
        assert result.total_cost_us == pytest.approx(_brute_force_cost(source, target, 4, cost_model), abs=1e-9), message
        assert result.total_bytes >= result.lower_bound_bytes, message


@pytest.mark.parametrize(
    "mesh_shape, source, target, shape, itemsize, plan_bytes",
    [  # the issue's rows: the plan is at its (exact) bound
        ((4, 2), [Partial(), Shard(0)], [Shard(1), R], (64, 64), 4, 8192),
        ((2, 2, 2), [Partial(), Shard(0), Partial()], [R, R, R], (64, 64), 4, 20480),
        ((2, 2), [Partial(), Partial()], [Shard(0), R], (64, 64), 4, 16384),
        ((4, 2), [Partial(), Partial()], [Shard(0), R], (64, 64), 4, 16384),
    ],
)
def test_the_issue_rows_reach_their_bound_when_bytes_decide(mesh_shape, source, target, shape, itemsize, plan_bytes):
    layout = Layout.create(mesh_shape, source, shape)
    result = plan(layout, layout.with_placements(target), itemsize, BYTES_FIRST)
    assert result.total_bytes == result.lower_bound_bytes == plan_bytes, str(result)


def test_a_plan_above_its_bound_explains_the_fewest_bytes_plan():
    layout = Layout.create((2, 2), [Partial(), Partial()], (64, 64))
    text = explain(layout, layout.with_placements([Shard(0), R]), 4)
    assert "total 24576 bytes/rank" in text and "lower bound 16384 bytes/rank (1.50x)" in text
    assert "fewest bytes: 16384 bytes/rank in 2 collective(s)" in text


PARTIAL_MESH_SHAPES = [(2, 2, 2), (2, 1, 2), (2, 2), (4, 2), (3, 2)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(layout_pairs(PARTIAL_MESH_SHAPES, partial_source=True), st.sampled_from([1, 2, 4]))
def test_no_plan_from_a_partial_source_is_below_its_bound(pair, itemsize):
    source, target = pair
    for cost_model in [DEFAULT_COST_MODEL, BYTES_FIRST]:
        result = plan(source, target, itemsize, cost_model)
        assert result.total_bytes >= result.lower_bound_bytes, (
            f"shape {source.shape} mesh {source.mesh_shape}: {list(map(str, source.placements))} -> "
            f"{list(map(str, target.placements))}, {itemsize}-byte items\n{result}"
        )
