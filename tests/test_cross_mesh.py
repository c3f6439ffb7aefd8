"""Cross-mesh redistribute on a world of 4 gloo ranks: values, gradients and exact bytes per rank."""

import math

import pytest
import torch
from hypothesis import strategies as st
from helpers import layout_box
from spmd import draw_examples, example_note, spmd

from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.spec import DTensorSpec, contiguous_stride
from shardtensor.layout import Layout
from shardtensor.redistribute import hand_off

R = Replicate()

# (source mesh, target mesh) as rank arrays in a world of 4.
MESH_PAIRS = {
    "2x2-to-4-reordered": ([[0, 1], [2, 3]], [3, 1, 0, 2]),
    "4-to-2-of-the-same-world": ([0, 1, 2, 3], [2, 0]),
    "disjoint-hand-off": ([0, 1], [2, 3]),
    "same-size-other-order": ([0, 1, 2, 3], [2, 3, 0, 1]),
    "2-to-2x2": ([1, 3], [[0, 1], [2, 3]]),
}


def _full(shape):
    """The same global tensor on every rank: small integers in float64, so sums are exact."""
    generator = torch.Generator().manual_seed(17)
    return torch.randint(-50, 50, shape, generator=generator).to(torch.float64)


def _box(tensor, layout, coordinate):
    return layout_box(tensor, layout, coordinate).clone()


def _placement_lists(mesh_ndim, shape_ndim, *, partial=False):
    """A few placements per mesh: every Shard dim and Replicate on the first mesh dim."""
    choices = [Shard(dim) for dim in range(shape_ndim)] + [R] + ([Partial()] if partial else [])
    if mesh_ndim == 1:
        return [[choice] for choice in choices]
    return [[choice, other] for choice in choices for other in (Shard(shape_ndim - 1), R)]


def _make(full, mesh, placements, *, requires_grad=False, shard_sizes=None):
    """A DTensor on `mesh` built by every rank of the world; ranks outside the mesh hold no elements.

    A Partial(sum) mesh dim holds value / count on each of its ranks (exact for powers of two);
    `shard_sizes` ({mesh_dim: sizes}) gives pieces other than torch.chunk's.
    """
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        local = full.new_empty((0,) * full.ndim)
    else:
        count = math.prod(mesh.shape[mesh_dim] for mesh_dim in layout.partial_mesh_dims())
        local = _box(full, layout, coordinate) / count
    spec = DTensorSpec(mesh, layout, contiguous_stride(full.shape), full.dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def _expected_local(full, dtensor):
    coordinate = dtensor.device_mesh.get_coordinate()
    if coordinate is None:
        return full.new_empty((0,) * full.ndim)
    return _box(full, dtensor.sharding, coordinate)


def _missing_bytes(source, source_mesh, target, target_mesh, itemsize):
    """Bytes this rank must receive: its target box minus what its (reduced) source box holds."""
    target_coordinate = target_mesh.get_coordinate()
    if target_coordinate is None:
        return 0
    wanted = (target.local_offset(target_coordinate), target.local_shape(target_coordinate))
    held_numel = 0
    source_coordinate = source_mesh.get_coordinate()
    if source_coordinate is not None:
        held = (source.local_offset(source_coordinate), source.local_shape(source_coordinate))
        held_numel = 1
        for start_a, size_a, start_b, size_b in zip(held[0], held[1], wanted[0], wanted[1]):
            held_numel *= max(0, min(start_a + size_a, start_b + size_b) - max(start_a, start_b))
    return (math.prod(wanted[1]) - held_numel) * itemsize


def _check_move(source_mesh, target_mesh, source_placements, target_placements, shape, source_sizes=None):
    full = _full(shape)
    weights = _full(shape) * 3 + 1  # d(sum(out * weights)) / d(in) = weights
    source = _make(full, source_mesh, source_placements, requires_grad=True, shard_sizes=source_sizes)
    with comm.observe() as records:
        result = source.redistribute(target_mesh, target_placements)
    assert result.device_mesh == target_mesh and result.placements == tuple(target_placements)
    assert torch.equal(result.to_local(), _expected_local(full, result)), (source_placements, target_placements)
    reduced = source.sharding.with_placements([R if p.is_partial() else p for p in source_placements])
    moved = [record for record in records if record.kind == "batch_p2p"]
    # a rank of the target mesh outside the source mesh also receives whether the source requires grad (one byte)
    stand_in = source_mesh.get_coordinate() is None and target_mesh.get_coordinate() is not None
    assert sum(r.bytes_received for r in moved) == (
        _missing_bytes(reduced, source_mesh, result.sharding, target_mesh, 8) + stand_in
    )
    assert [record.kind for record in records if record.kind != "batch_p2p"] == (
        ["all_reduce"] if source.sharding.partial_mesh_dims() and source_mesh.get_coordinate() is not None else []
    )
    gradient = _make(weights, target_mesh, target_placements)
    with comm.observe() as records:
        torch.autograd.backward([result], [gradient])
    # The gradient comes back reduced (Partial read as Replicate); the leaf's `.grad` ends backward in the
    # leaf's own layout (gradients.py), Partial operands made locally: no more bytes.
    assert source.grad.device_mesh == source_mesh and source.grad.sharding == source.sharding
    assert sum(r.bytes_received for r in records) == _missing_bytes(result.sharding, target_mesh, reduced, source_mesh, 8)
    gradient_value = source.grad.redistribute(source_mesh, reduced.placements)
    assert torch.equal(gradient_value.to_local(), _expected_local(weights, gradient_value))


@pytest.mark.parametrize("pair", list(MESH_PAIRS), ids=list(MESH_PAIRS))
@pytest.mark.parametrize("shape", [(8, 4), (5, 7)])
@spmd(meshes=[(4,)])
def test_cross_mesh_values_gradients_and_bytes(mesh, pair, shape):
    source_ranks, target_ranks = MESH_PAIRS[pair]
    source_mesh, target_mesh = DeviceMesh("cpu", source_ranks), DeviceMesh("cpu", target_ranks)
    for source_placements in _placement_lists(source_mesh.ndim, len(shape), partial=True):
        for target_placements in _placement_lists(target_mesh.ndim, len(shape)):
            _check_move(source_mesh, target_mesh, source_placements, target_placements, shape)


@spmd(meshes=[(4,)])
def test_cross_mesh_uneven_and_empty_shards(mesh):
    source_mesh, target_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]]), DeviceMesh("cpu", [1, 0, 3])
    for shape in [(3, 2), (1, 5), (0, 3)]:
        _check_move(source_mesh, target_mesh, [Shard(0), Shard(0)], [Shard(0)], shape)
        _check_move(target_mesh, source_mesh, [Shard(1)], [Shard(1), Shard(0)], shape)
    # pieces other than torch.chunk's (an empty one among them) onto a smaller and a reordered mesh
    world, pair = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [2, 0])
    for target_mesh, target_placements in ((pair, [Shard(1)]), (pair, [Shard(0)]), (source_mesh, [Shard(1), Shard(0)])):
        _check_move(world, target_mesh, [Shard(0)], target_placements, (6, 4), source_sizes={0: [2, 0, 3, 1]})


@spmd(meshes=[(4,)])
def test_same_size_other_order_lands_on_the_target_mesh(mesh):
    """PyTorch returns a result still on the source mesh here; ours is on the target mesh."""
    source_mesh, target_mesh = DeviceMesh("cpu", [0, 1, 2, 3]), DeviceMesh("cpu", [3, 2, 1, 0])
    full = _full((8, 3))
    result = _make(full, source_mesh, [Shard(0)]).redistribute(target_mesh, [Shard(0)])
    assert result.device_mesh == target_mesh
    assert torch.equal(result.to_local(), full[6 - 2 * torch.distributed.get_rank() :][:2])


@spmd(meshes=[(4,)])
def test_async_cross_mesh_is_correct_once_used(mesh):
    source_mesh, target_mesh = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [[3], [2]])
    full = _full((6, 5))
    result = _make(full, source_mesh, [Shard(1)]).redistribute(target_mesh, [Shard(0), R], async_op=True)
    assert torch.equal(result.to_local(), _expected_local(full, result))


@spmd(meshes=[(4,)])
def test_sub_mesh_redistribute_does_not_hang(mesh):
    """Every rank calls; ranks outside the sub-mesh take no part and hold no elements."""
    sub_mesh = DeviceMesh("cpu", [2, 1])
    full = _full((5, 4))
    dtensor = _make(full, sub_mesh, [Shard(0)])
    with comm.observe() as records:
        replicated = dtensor.redistribute(placements=[R])
        whole = dtensor.full_tensor()
    if sub_mesh.get_coordinate() is None:
        assert records == [] and replicated.to_local().numel() == 0 and whole.numel() == 0
    else:
        assert [record.kind for record in records] == ["all_gather", "all_gather"]
        assert torch.equal(replicated.to_local(), full) and torch.equal(whole, full)


def _two_stage_losses(batch, first, second):
    """Stage 0 computes `batch @ first`, stage 1 the loss `sum(tanh(.) @ second) ** 2` of it."""
    return (torch.tanh(batch @ first) @ second).pow(2).sum()


@spmd(meshes=[(4,)], timeout=120)
def test_a_hand_off_requires_grad_as_the_source_does_whatever_the_stand_in_says(mesh):
    """Stage 1 (ranks 2, 3) passes a stand-in for stage 0's activations; its requires_grad, left at the
    default or set, does not decide: the result requires grad on every rank exactly when stage 0's
    source does, so the backward runs on both sides (a stand-in without requires_grad left stage 0
    waiting for its gradient; one with it sent a gradient to a frozen stage 0 that never took it)."""
    stages = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]
    stage = torch.distributed.get_rank() // 2
    generator = torch.Generator().manual_seed(5)
    batch, first, second = (torch.randn(shape, generator=generator, dtype=torch.float64)
                            for shape in ((8, 4), (4, 6), (6, 3)))
    for frozen_first_stage, asynchronous in ((False, False), (True, False), (False, True), (True, True)):
        weights = [value.clone().requires_grad_(not (frozen_first_stage and index == 0))
                   for index, value in enumerate((first, second))]
        _two_stage_losses(batch, *weights).backward()
        if stage == 0:
            weight = distribute_tensor(first, stages[0], [Shard(1)]).requires_grad_(not frozen_first_stage)
            activations = distribute_tensor(batch, stages[0], [R]) @ weight
        else:
            weight = distribute_tensor(second, stages[1], [R]).requires_grad_()
            stand_in = torch.empty(0, 6, dtype=torch.float64, requires_grad=frozen_first_stage)  # the wrong way round
            activations = DTensor.from_local(stand_in, stages[0], [Shard(1)], shape=(8, 6), stride=(6, 1))
        # the answer comes with the data, so with grad mode on an asynchronous move is waited too
        received = activations.redistribute(stages[1], [Shard(0)], async_op=asynchronous)
        assert received.requires_grad is not frozen_first_stage
        if stage == 1:
            (received.tanh() @ weight).pow(2).sum().full_tensor().backward()
        elif not frozen_first_stage:
            torch.autograd.backward([received], [torch.zeros_like(received)])
        expected = weights[stage].grad
        assert (weight.grad is None) if expected is None else torch.allclose(weight.grad.full_tensor(), expected)


def test_hand_off_sends_each_target_element_once_and_spreads_replicas():
    source = Layout.create((2, 2), [R, Shard(0)], (8, 2))
    target = Layout.create((4,), [Shard(0)], (8, 2))
    moves = hand_off(source, (0, 1, 2, 3), target, (3, 2, 1, 0))
    assert sum(transfer.numel for transfer in moves.transfers) == 16
    # rows 0-3 are on ranks 0 and 2, rows 4-7 on 1 and 3: ranks 2 and 1 keep theirs, replicas share the rest
    assert {(t.sender, t.receiver) for t in moves.transfers} == {(0, 3), (2, 2), (1, 1), (3, 0)}
    assert moves.received_bytes(3, 4) == 2 * 2 * 4 and "point-to-point" in str(moves)


def test_hand_off_refuses_partial_layouts():
    partial = Layout.create((2,), [Partial()], (4,))
    with pytest.raises(ValueError, match="reduce the Partial mesh dims first"):
        hand_off(partial, (0, 1), Layout.create((2,), [R], (4,)), (2, 3))


# ---- property: random cross-mesh moves ---------------------------------------------------------------

# Meshes of a world of 4 as rank arrays: full 1-D and 2x2 meshes in several rank orders, sub-meshes of 2.
RANDOM_MESHES = [
    [0, 1, 2, 3], [3, 1, 0, 2], [[0, 1], [2, 3]], [[2, 0], [3, 1]], [[3, 2], [1, 0]], [0, 1], [3, 1], [2, 0],
]


@st.composite
def _cross_mesh_moves(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    source_ranks, target_ranks = draw(st.lists(st.sampled_from(RANDOM_MESHES), min_size=2, max_size=2, unique_by=str))
    shards = [Shard(dim) for dim in range(len(shape))]

    def placements(ranks, choices):
        mesh_ndim = 2 if isinstance(ranks[0], list) else 1
        return draw(st.lists(st.sampled_from(choices), min_size=mesh_ndim, max_size=mesh_ndim))

    source_placements = placements(source_ranks, shards + [R, Partial()])
    target_placements = placements(target_ranks, shards + [R])
    return shape, source_ranks, target_ranks, source_placements, target_placements


@pytest.mark.parametrize("moves", [draw_examples(_cross_mesh_moves(), 40)], ids=["random-moves"])
@spmd(meshes=[(4,)])
def test_random_cross_mesh_moves_preserve_values_and_gradients(mesh, moves):
    meshes = {}
    for shape, source_ranks, target_ranks, source_placements, target_placements in moves:
        for ranks in (source_ranks, target_ranks):
            meshes.setdefault(str(ranks), DeviceMesh("cpu", ranks))
        move = (shape, source_ranks, target_ranks, source_placements, target_placements)
        with example_note(mesh, move):
            _check_move(meshes[str(source_ranks)], meshes[str(target_ranks)], source_placements, target_placements, shape)
