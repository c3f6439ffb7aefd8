"""Redistribute on real gloo ranks: exact values against the global tensor, and the collectives issued."""

import math

import pytest
import torch
from hypothesis import strategies as st
from helpers import layout_box
from spmd import draw_examples, example_note, spmd

from shardtensor import DTensor, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.layout import Layout
from shardtensor.placement import REDUCE_OPS, Partial, Replicate, Shard
from shardtensor.redistribute import CostModel, execute, plan, redistribute_local_tensor
from shardtensor.redistribute.planner import received_bytes

R = Replicate()


def _full(shape, seed=0):
    """The global tensor every rank builds alike: small integers in float64, so sums are exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=generator).to(torch.float64)


def _box(full, layout, coordinate):
    return layout_box(full, layout, coordinate)


def _partial_index(layout, coordinate):
    """(index, count): this coordinate's position among the ranks holding operands of one element."""
    index, count = 0, 1
    for mesh_dim in layout.partial_mesh_dims():
        index = index * layout.mesh_shape[mesh_dim] + coordinate[mesh_dim]
        count *= layout.mesh_shape[mesh_dim]
    return index, count


def _operand(full, layout, coordinate):
    """This rank's local tensor of `layout`, with rank-dependent Partial operands that reduce exactly."""
    value = _box(full, layout, coordinate)
    partials = [p for p in layout.placements if isinstance(p, Partial)]
    if not partials:
        return value.clone()
    reduce_op = partials[0].reduce_op
    index, count = _partial_index(layout, coordinate)
    holder = count - 1

    def noise(position):
        generator = torch.Generator().manual_seed(1000 + position)
        return torch.randint(-9, 10, value.shape, generator=generator).to(torch.float64)

    if reduce_op in ("sum", "avg"):
        scale = count if reduce_op == "avg" else 1
        if index != holder:
            return noise(index) * scale
        return (value - sum((noise(other) for other in range(holder)), torch.zeros_like(value))) * scale
    if reduce_op in ("max", "min"):
        direction = -1 if reduce_op == "max" else 1
        return value.clone() if index == holder else value + direction * (1 + noise(index).abs())
    factors = [2.0 if other % 2 == 0 else 0.5 for other in range(holder)]  # product of powers of two
    return value / math.prod(factors) if index == holder else torch.full_like(value, factors[index])


def _redistribute_and_check(mesh, source, target, full, *, observe=True):
    coordinate = tuple(mesh.get_coordinate())
    local = _operand(full, source, coordinate)
    with comm.observe() as records:
        result = redistribute_local_tensor(local, source, target, mesh)
    if target.partial_mesh_dims():
        replicated = target.with_placements([R] * len(target.mesh_shape))
        result = redistribute_local_tensor(result, target, replicated, mesh)
        target = replicated
    expected = _box(full, target, coordinate)
    assert result.shape == expected.shape, (source, target, coordinate)
    assert torch.equal(result, expected), (str(source), str(target), coordinate)
    if observe:
        assert [record.kind for record in records] == list(plan(source, target, 8).collectives)
    return records


def _on_every_mesh_dim(mesh, source_placement, target_placement, others=R):
    for mesh_dim in range(mesh.ndim):
        source = [others] * mesh.ndim
        target = [others] * mesh.ndim
        source[mesh_dim], target[mesh_dim] = source_placement, target_placement
        yield mesh_dim, source, target


# ---- every transition type ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source_placement, target_placement, collective",
    [
        (Shard(0), R, "all_gather"),
        (Shard(1), R, "all_gather"),
        (Shard(0), Shard(1), "all_to_all"),
        (Shard(1), Shard(0), "all_to_all"),
        (R, Shard(0), None),
        (R, Shard(1), None),
        (Partial(), R, "all_reduce"),
        (Partial(), Shard(0), "reduce_scatter"),
        (Partial(), Shard(1), "reduce_scatter"),
    ],
)
@pytest.mark.parametrize("shape", [(8, 4), (5, 7), (0, 3)])
@spmd()
def test_single_mesh_dim_transitions(mesh, shape, source_placement, target_placement, collective):
    full = _full(shape)
    for mesh_dim, source, target in _on_every_mesh_dim(mesh, source_placement, target_placement):
        source_layout = Layout.create(mesh.shape, source, shape)
        records = _redistribute_and_check(mesh, source_layout, source_layout.with_placements(target), full)
        group_size = mesh.shape[mesh_dim]
        assert [record.kind for record in records] == ([collective] if collective and group_size > 1 else [])


@pytest.mark.parametrize("reduce_op", REDUCE_OPS)
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_every_partial_reduce_op(mesh, reduce_op):
    full = _full((5, 7), seed=3)
    partial = Partial(reduce_op)
    for target_placement in [R, Shard(0), Shard(1)]:
        for _, source, target in _on_every_mesh_dim(mesh, partial, target_placement):
            layout = Layout.create(mesh.shape, source, (5, 7))
            _redistribute_and_check(mesh, layout, layout.with_placements(target), full)
    if mesh.ndim == 2:
        layout = Layout.create(mesh.shape, [partial, partial], (5, 7))
        for target in [[R, R], [Shard(0), Shard(1)], [Shard(1), Shard(1)]]:
            _redistribute_and_check(mesh, layout, layout.with_placements(target), full)


@pytest.mark.parametrize("reduce_op", REDUCE_OPS)
@spmd(meshes=[(2,), (2, 2)])
def test_replicate_to_partial_holds_identity_operands(mesh, reduce_op):
    full = _full((4, 3))
    source = Layout.create(mesh.shape, [R] * mesh.ndim, (4, 3))
    target = source.with_placements([Partial(reduce_op)] + [R] * (mesh.ndim - 1))
    records = _redistribute_and_check(mesh, source, target, full)
    assert records == []
    local = redistribute_local_tensor(full.clone(), source, target, mesh)
    first = mesh.get_coordinate()[0] == 0
    identity = {"sum": torch.zeros_like(full), "product": torch.ones_like(full)}.get(reduce_op, full)
    assert torch.equal(local, full if first else identity)


@spmd(meshes=[(2,), (2, 2)])
def test_partial_to_another_partial_goes_through_replicate(mesh):
    full = _full((4, 6))
    source = Layout.create(mesh.shape, [Partial("sum")] + [R] * (mesh.ndim - 1), (4, 6))
    _redistribute_and_check(mesh, source, source.with_placements([Partial("max")] + [R] * (mesh.ndim - 1)), full)


# ---- nested shards and two mesh dims ----------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 8), (5, 7), (3, 2)])
@pytest.mark.parametrize(
    "source, target",
    [
        ([Shard(0), Shard(0)], [R, Shard(0)]),
        ([R, Shard(0)], [Shard(0), Shard(0)]),
        ([Shard(0), Shard(1)], [Shard(1), Shard(0)]),
        ([Shard(0), R], [R, Shard(0)]),
        ([Shard(0), Shard(0)], [Shard(1), Shard(1)]),
        ([Shard(1), Shard(0)], [R, R]),
        ([Partial(), Shard(0)], [Shard(0), Shard(1)]),
    ],
)
@spmd(meshes=[(2, 2)])
def test_two_mesh_dim_changes(mesh, shape, source, target):
    full = _full(shape, seed=7)
    layout = Layout.create(mesh.shape, source, shape)
    _redistribute_and_check(mesh, layout, layout.with_placements(target), full)


@spmd(meshes=[(2, 2)])
def test_non_default_shard_order_both_ways(mesh):
    full = _full((7, 3))
    default = Layout.create(mesh.shape, [Shard(0), Shard(0)], (7, 3))
    reversed_order = Layout.create(mesh.shape, [Shard(0), Shard(0)], (7, 3), shard_order=[(1, 0), ()])
    _redistribute_and_check(mesh, default, reversed_order, full)
    _redistribute_and_check(mesh, reversed_order, default, full)
    _redistribute_and_check(mesh, reversed_order, default.with_placements([R, R]), full)


# ---- explicit uneven pieces ------------------------------------------------------------------------


@spmd(meshes=[(4,)])
def test_explicit_uneven_source_pieces(mesh):
    full = _full((5, 7), seed=11)
    uneven = Layout.create(mesh.shape, [Shard(0)], (5, 7), shard_sizes={0: [3, 1, 0, 1]})
    for target in [uneven.with_placements([R]), uneven.with_placements([Shard(1)]), Layout.create((4,), [Shard(0)], (5, 7))]:
        _redistribute_and_check(mesh, uneven, target, full)
    replicated = Layout.create(mesh.shape, [R], (5, 7))
    _redistribute_and_check(mesh, replicated, uneven, full)
    even = Layout.create(mesh.shape, [Shard(0)], (5, 7))
    records = _redistribute_and_check(mesh, even, uneven, full)
    assert [record.kind for record in records] == ["all_to_all"]


@spmd(meshes=[(2, 2)])
def test_explicit_nested_target_pieces(mesh):
    full = _full((8, 3))
    replicated = Layout.create(mesh.shape, [R, R], (8, 3))
    target = replicated.transition(0, Shard(0), pieces=(3, 5)).transition(1, Shard(0), pieces=(3, 0, 1, 4))
    _redistribute_and_check(mesh, replicated, target, full)
    _redistribute_and_check(mesh, target, Layout.create(mesh.shape, [Shard(1), Shard(0)], (8, 3)), full)


# ---- exchange over the whole mesh ------------------------------------------------------------------

EXCHANGE_ONLY = CostModel(exchange_latency_us=0.0, latency_us=1e6)


@pytest.mark.parametrize("shape", [(8, 8), (5, 7), (1, 3), (0, 2)])
@pytest.mark.parametrize(
    "source, target",
    [
        ([Shard(0), Shard(1)], [Shard(1), Shard(0)]),
        ([Shard(0), Shard(0)], [R, Shard(0)]),
        ([R, Shard(0)], [Shard(1), Shard(1)]),
        ([Shard(0), R], [R, Shard(0)]),
        ([Shard(1), Shard(0)], [R, R]),
    ],
)
@spmd(meshes=[(2, 2)])
def test_exchange_moves_exactly_the_missing_elements(mesh, shape, source, target):
    full = _full(shape, seed=5)
    coordinate = tuple(mesh.get_coordinate())
    source_layout = Layout.create(mesh.shape, source, shape)
    target_layout = source_layout.with_placements(target)
    exchange = plan(source_layout, target_layout, 8, EXCHANGE_ONLY)
    assert exchange.collectives == ("batch_p2p",)
    for async_op in [False, True]:
        with comm.observe() as records:
            result = execute(_box(full, source_layout, coordinate).clone(), exchange, mesh, async_op=async_op)
            result = result.wait() if async_op else result
        assert torch.equal(result, _box(full, target_layout, coordinate))
        held = (source_layout.local_offset(coordinate), source_layout.local_shape(coordinate))
        wanted = (target_layout.local_offset(coordinate), target_layout.local_shape(coordinate))
        missing_bytes = received_bytes("batch_p2p", 4, held, wanted, 8)
        assert sum(record.bytes_received for record in records) == missing_bytes
        assert all(record.kind == "batch_p2p" for record in records)


# ---- bytes and async -------------------------------------------------------------------------------


@spmd(meshes=[(4,)])
def test_bytes_match_the_plan_on_even_shapes(mesh):
    full = _full((8, 8)).to(torch.float32)
    for source_placement, target_placement in [(Shard(0), R), (Shard(0), Shard(1)), (Partial(), Shard(0))]:
        source = Layout.create(mesh.shape, [source_placement], (8, 8))
        target = source.with_placements([target_placement])
        local = _operand(full, source, tuple(mesh.get_coordinate())).to(torch.float32)
        with comm.observe() as records:
            redistribute_local_tensor(local, source, target, mesh)
        (record,) = records
        assert record.group_size == 4
        assert record.bytes_received == plan(source, target, 4).total_bytes


@spmd(meshes=[(2,), (2, 2)])
def test_async_redistribute_is_correct_once_waited(mesh):
    full = _full((6, 5))
    source = Layout.create(mesh.shape, [Shard(0)] * mesh.ndim, (6, 5))
    target = source.with_placements([Shard(1)] + [R] * (mesh.ndim - 1))
    coordinate = tuple(mesh.get_coordinate())
    handle = redistribute_local_tensor(_box(full, source, coordinate).clone(), source, target, mesh, async_op=True)
    assert torch.equal(handle.wait(), _box(full, target, coordinate))
    same = redistribute_local_tensor(_box(full, source, coordinate).clone(), source, source, mesh, async_op=True)
    assert torch.equal(same.wait(), _box(full, source, coordinate))


# ---- property: random chains ----------------------------------------------------------------------


@st.composite
def _chains(draw, mesh_shape):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    choices = [R] + [Shard(dim) for dim in range(len(shape))]
    length = draw(st.integers(2, 4))
    placements = [
        tuple(draw(st.lists(st.sampled_from(choices), min_size=len(mesh_shape), max_size=len(mesh_shape))))
        for _ in range(length)
    ]
    if draw(st.booleans()):
        partial = Partial(draw(st.sampled_from(REDUCE_OPS)))
        placements[0] = tuple(partial if placement == R else placement for placement in placements[0])
    return shape, placements


@pytest.mark.parametrize("chains", [draw_examples(_chains((4,)), 40)], ids=["random-chains"])
@spmd(meshes=[(4,)])
def test_random_chains_on_four_ranks(mesh, chains):
    _run_chains(mesh, chains)


@pytest.mark.parametrize("chains", [draw_examples(_chains((2, 2)), 40)], ids=["random-chains"])
@spmd(meshes=[(2, 2)])
def test_random_chains_on_a_two_by_two_mesh(mesh, chains):
    _run_chains(mesh, chains)


def _run_chains(mesh, chains):
    for number, (shape, placements_chain) in enumerate(chains):
        with example_note(mesh, (shape, placements_chain)):
            full = _full(shape, seed=number)
            coordinate = tuple(mesh.get_coordinate())
            layout = Layout.create(mesh.shape, placements_chain[0], shape)
            local = _operand(full, layout, coordinate)
            for placements in placements_chain[1:]:
                target = layout.with_placements(placements)
                local = redistribute_local_tensor(local, layout, target, mesh)
                layout = target
            local = redistribute_local_tensor(local, layout, layout.with_placements([R] * mesh.ndim), mesh)
            assert torch.equal(local, full), (shape, [list(map(str, p)) for p in placements_chain])


# ---- flattened reductions over several mesh dims ---------------------------------------------------


@pytest.mark.parametrize("reduce_op", ["sum", "max"])
@pytest.mark.parametrize("shape", [(8, 4), (5, 7), (1, 3)])
@spmd(meshes=[(2, 2)])
def test_flattened_reductions_are_exact_and_single_collectives(mesh, shape, reduce_op):
    full = _full(shape, seed=13)
    source = Layout.create(mesh.shape, [Partial(reduce_op), Partial(reduce_op)], shape)
    for target_placements in [[R, R], [Shard(0), Shard(0)], [Shard(1), Shard(1)]]:
        target = source.with_placements(target_placements)
        assert plan(source, target, 8).collectives in (("all_reduce",), ("reduce_scatter",))
        records = _redistribute_and_check(mesh, source, target, full)
        assert [(record.mesh_dim, record.group_size) for record in records] == [((0, 1), 4)]
        busiest = plan(source, target, 8).total_bytes  # the plan counts the busiest rank
        assert records[0].bytes_received == busiest if shape == (8, 4) else records[0].bytes_received <= busiest


@spmd(meshes=[(2, 2)])
def test_comm_flattened_peers_follow_the_order_given(mesh):
    rank = torch.distributed.get_rank()
    for mesh_dims in [(0, 1), (1, 0)]:
        gathered = comm.all_gather(torch.tensor([rank]), mesh, mesh_dims, dim=0, sizes=[1] * 4)
        expected = mesh.mesh if mesh_dims == (0, 1) else mesh.mesh.T
        assert gathered.tolist() == expected.flatten().tolist()
        total = comm.all_reduce(torch.tensor([float(rank)]), mesh, mesh_dims, reduce_op="sum")
        assert total.item() == 6.0


@spmd(meshes=[(2,)])
def test_redistribute_forward_and_backward_dtypes(mesh):
    """`forward_dtype` casts before the forward collective, `backward_dtype` is the gradient collective's
    dtype; the gradient comes back in the input's dtype (PyTorch's DTensor.redistribute keywords)."""
    from shardtensor import distribute_tensor

    full = torch.arange(16, dtype=torch.float64).view(4, 4) / 3
    weight = torch.linspace(-1, 1, 16, dtype=torch.float64).view(4, 4)
    sent = {}
    for forward_dtype, backward_dtype in ((None, None), (torch.float32, None), (torch.float32, torch.float16)):
        source = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        with comm.observe() as forward:
            moved = source.redistribute(mesh, [Shard(1)], forward_dtype=forward_dtype, backward_dtype=backward_dtype)
        assert moved.dtype == (forward_dtype or torch.float64)
        assert torch.equal(moved.full_tensor(), full.to(moved.dtype))
        sharded_weight = distribute_tensor(weight.to(moved.dtype), mesh, [Shard(1)])
        with comm.observe() as backward:
            (moved * sharded_weight).sum().backward()
        assert source.grad.dtype == torch.float64 and source.grad.placements == (Shard(0),)
        expected = weight.to(moved.dtype).to(backward_dtype or torch.float64).double()
        assert torch.equal(source.grad.full_tensor(), expected)
        sent[forward_dtype, backward_dtype] = [record.bytes_sent for record in forward + backward]
    assert sent[None, None] == [32, 32]  # one all_to_all each way: half of a 2x4 float64 shard
    assert sent[torch.float32, None] == [16, 32] and sent[torch.float32, torch.float16] == [16, 8]


# ---- flattened gathers over several mesh dims ------------------------------------------------------

S0 = Shard(0)
# (source placements, source shard order or None, target placements, the gather's mesh dims) per mesh
FLATTENED_GATHERS = {
    (2, 2): [
        ([S0, S0], None, [R, R], (0, 1)),
        ([S0, S0], [(1, 0), ()], [R, R], (1, 0)),  # flattened in shard order: mesh dim 1 outermost
        ([S0, S0], None, [R, S0], (0, 1)),  # small tensors: one gather then a slice beats an exchange
        ([Shard(1), Shard(1)], None, [R, R], (0, 1)),
    ],
    (2, 2, 2): [
        ([S0, S0, S0], None, [R, R, R], (0, 1, 2)),
        ([S0, R, S0], None, [R, R, R], (0, 2)),  # over the planes of mesh dim 1
        ([S0, S0, S0], None, [S0, R, R], (1, 2)),  # the inner two of three splits
        ([S0, S0, S0], [(2, 0, 1), ()], [R, R, R], (2, 0, 1)),
    ],
    (2, 1, 2): [
        ([S0, S0, S0], None, [R, R, R], (0, 1, 2)),  # the mesh dim of size 1 between moves with them
        ([S0, S0, S0], [(2, 1, 0), ()], [R, R, R], (2, 1, 0)),
    ],
}


@pytest.mark.parametrize("shape", [(8, 4), (7, 5), (1, 3), (0, 2)], ids=str)
@spmd(meshes=[(2, 2), (2, 1, 2)], timeout=300.0, simulated=[(2, 2, 2)])
def test_flattened_gathers_are_exact_single_collectives(mesh, shape):
    """Nested shards of one tensor dim gather in one all_gather over their mesh dims, uneven and empty
    pieces included; each rank receives exactly the target elements it lacks."""
    full = _full(shape, seed=17)
    coordinate = tuple(mesh.get_coordinate())
    for source_placements, order, target_placements, mesh_dims in FLATTENED_GATHERS[tuple(mesh.shape)]:
        source = Layout.create(mesh.shape, source_placements, shape, shard_order=order)
        target = source.with_placements(target_placements)
        chosen = plan(source, target, 8)
        message = f"{source} -> {target}\n{chosen}"
        assert [step.mesh_dim for step in chosen.steps if step.collective == "all_gather"] == [mesh_dims], message
        with CommDebugMode() as comm_mode:
            records = _redistribute_and_check(mesh, source, target, full)
        assert comm_mode.get_comm_counts() == {"all_gather": 1}, message
        (record,) = records
        assert (record.mesh_dim, record.group_size) == (mesh_dims, math.prod(mesh.shape[m] for m in mesh_dims)), message
        held = (source.local_offset(coordinate), source.local_shape(coordinate))
        gathered = chosen.steps[0].after
        wanted = (gathered.local_offset(coordinate), gathered.local_shape(coordinate))
        assert record.bytes_received == received_bytes("all_gather", record.group_size, held, wanted, 8), message
        assert record.bytes_received <= chosen.total_bytes, message


@spmd(meshes=[(2, 2), (2, 2, 2)], timeout=300.0)
def test_nested_shards_gather_in_one_collective_on_dtensors_and_async(mesh):
    """HSDP / 2-D FSDP weights: every mesh dim shards dim 0, gathered before use in one all_gather, as
    torch's DTensor needs one per mesh dim; the async redistribute gives the same values."""
    full = _full((7, 6), seed=19)
    nested = distribute_tensor(full, mesh, [S0] * mesh.ndim)
    with CommDebugMode() as comm_mode:
        replicated = nested.redistribute(mesh, [R] * mesh.ndim)
        waited = nested.redistribute(mesh, [R] * mesh.ndim, async_op=True).to_local()
    assert comm_mode.get_comm_counts() == {"all_gather": 2}  # one per redistribute
    assert torch.equal(replicated.to_local(), full) and torch.equal(waited, full)
    assert isinstance(replicated, DTensor) and replicated.placements == (R,) * mesh.ndim



@pytest.mark.parametrize(
    "shape, reduction, mesh_dims",
    [((8, 4), "reduce_scatter", (1, 2, 0)), ((7, 5), "all_reduce", (1, 2))],  # the new split of dim 0 is innermost
    ids=str,
)
@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_a_reduction_then_one_flattened_gather(mesh, shape, reduction, mesh_dims):
    """(P, S0, S0) -> (R, R, R): the Partial mesh dim reduces (scattering dim 0 as the innermost split
    when that is cheapest), then all of dim 0's splits gather in one all_gather, over all 8 ranks in
    the order (1, 2, 0) that makes their pieces consecutive."""
    full = _full(shape, seed=23)
    source = Layout.create(mesh.shape, [Partial(), S0, S0], shape)
    with CommDebugMode() as comm_mode:
        records = _redistribute_and_check(mesh, source, source.with_placements([R, R, R]), full)
    assert comm_mode.get_comm_counts() == {reduction: 1, "all_gather": 1}
    assert [(record.kind, record.mesh_dim) for record in records] == [(reduction, 0), ("all_gather", mesh_dims)]
