"""Eight ranks (meshes 8, 2x2x2, 2x4, 4x2) and the 1x4 / 4x1 meshes of four ranks.

The ranks are simulated in the pytest process (`launch.simulate`, the same results as gloo ranks),
except one end-to-end run of the placement chains on eight real gloo processes (2x2x2).

2x4 and 4x2 (and 1x4 / 4x1) make a swap of mesh dims or of mesh sizes visible, which 2x2 cannot.
Every check is against the single-device value: `full_tensor()` equals the global tensor and each
rank's local tensor equals its `torch.chunk` piece (tests/helpers.py), computed without the library.
The default run is a small slice; SHARDTENSOR_TEST_EIGHT_RANKS_EXAMPLES=N runs N chains per mesh.
"""

import os
import random

import torch
from helpers import documented_random, exact_full, local_piece
from spmd import spmd

import shardtensor
from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardtensor.debug import CommDebugMode

R = Replicate()
EIGHT = [(8,), (2, 2, 2), (2, 4), (4, 2)]
FOUR_SKEWED = [(1, 4), (4, 1)]
CHAIN_EXAMPLES = int(os.environ.get("SHARDTENSOR_TEST_EIGHT_RANKS_EXAMPLES", "6"))
SLOW_MACHINE_TIMEOUT = 300.0  # eight processes on a two-core machine: a no-hang bound, not a time budget


def _check(dtensor, full, context):
    coordinate = dtensor.device_mesh.get_coordinate()
    expected = local_piece(full, dtensor.device_mesh.shape, dtensor.placements, coordinate)
    assert dtensor.to_local().shape == expected.shape, (context, dtensor.to_local().shape, expected.shape)
    assert torch.equal(dtensor.to_local(), expected), context
    assert torch.equal(dtensor.full_tensor(), full), context


def _random_chains(mesh_shape, count, seed):
    """Placement chains drawn with a fixed seed: shapes with uneven and empty dims, nested shards
    (one tensor dim on several mesh dims) and a Partial(sum) start."""
    generator = random.Random(seed)
    chains = []
    for _ in range(count):
        shape = tuple(generator.choice([0, 1, 3, 5, 8, 9]) for _ in range(generator.randint(1, 3)))
        choices = [R] + [Shard(dim) for dim in range(len(shape))]
        chain = [tuple(generator.choice(choices) for _ in mesh_shape) for _ in range(generator.randint(2, 4))]
        partial_start = generator.random() < 0.4
        chains.append((shape, chain, partial_start))
    return chains


def _partial_operand(full, mesh, placements):
    """Local tensor of `placements` with Partial(sum) on the Replicate mesh dims: the rank at
    index 0 along them holds its piece plus noise, the others hold minus their share of the noise."""
    coordinate = mesh.get_coordinate()
    partial_dims = [mesh_dim for mesh_dim, p in enumerate(placements) if p == R]
    index, count = 0, 1
    for mesh_dim in partial_dims:
        index, count = index * mesh.size(mesh_dim) + coordinate[mesh_dim], count * mesh.size(mesh_dim)
    piece = local_piece(full, mesh.shape, placements, coordinate)
    noise = torch.arange(piece.numel(), dtype=full.dtype).reshape(piece.shape)
    local = piece + noise * (count - 1) if index == 0 else -noise
    partial_placements = [Partial("sum") if p == R else p for p in placements]
    return DTensor.from_local(local, mesh, partial_placements, shape=full.shape,
                              stride=full.stride()), count > 1


@spmd(meshes=[(2, 2, 2)], timeout=SLOW_MACHINE_TIMEOUT, simulated=EIGHT + FOUR_SKEWED)
def test_random_placement_chains(mesh):
    for number, (shape, chain, partial_start) in enumerate(_random_chains(mesh.shape, CHAIN_EXAMPLES, seed=8)):
        full = exact_full(shape, seed=number)
        context = f"mesh {mesh.shape}, shape {shape}, chain {[[str(p) for p in step] for step in chain]}"
        dtensor = distribute_tensor(full, mesh, list(chain[0]))
        if partial_start:
            dtensor, has_partial = _partial_operand(full, mesh, chain[0])
            if has_partial:
                dtensor = dtensor.redistribute(mesh, list(chain[0]))
        _check(dtensor, full, context + " (start)")
        for placements in chain[1:]:
            dtensor = dtensor.redistribute(mesh, list(placements))
            _check(dtensor, full, context + f" (at {[str(p) for p in placements]})")


@spmd(meshes=[], simulated=[(2, 2, 2), (2, 4), (4, 2)])
def test_nested_shards_of_one_dim(mesh):
    full = exact_full((13, 6), seed=3)
    every_dim_on_zero = [Shard(0)] * mesh.ndim
    dtensor = distribute_tensor(full, mesh, every_dim_on_zero)
    _check(dtensor, full, "nested Shard(0)")
    for placements in ([Shard(1)] + [Shard(0)] * (mesh.ndim - 1), [R] * (mesh.ndim - 1) + [Shard(0)], every_dim_on_zero):
        dtensor = dtensor.redistribute(mesh, placements)
        _check(dtensor, full, [str(p) for p in placements])


@spmd(meshes=[], simulated=EIGHT + FOUR_SKEWED)
def test_op_families_match_single_device(mesh):
    a_full, b_full = exact_full((8, 6), seed=1), exact_full((6, 5), seed=2)
    last = mesh.ndim - 1
    row = [Shard(0)] + [R] * last
    column_last = [R] * last + [Shard(1)]
    a = distribute_tensor(a_full, mesh, row)
    a_other = distribute_tensor(a_full, mesh, column_last)
    b = distribute_tensor(b_full, mesh, [R] * last + [Shard(0)])
    cases = {
        "pointwise add of differently sharded": (a + a_other, a_full + a_full),
        "pointwise mul, broadcast row": (a * distribute_tensor(a_full[0], mesh, [R] * mesh.ndim), a_full * a_full[0]),
        "pointwise where": (torch.where(a > 0, a, a_other * 2), torch.where(a_full > 0, a_full, a_full * 2)),
        "matmul": (a @ b, a_full @ b_full),
        "matmul sharded contraction": (a_other @ distribute_tensor(b_full, mesh, [R] * last + [Shard(0)]), a_full @ b_full),
        "sum over sharded dim": (a.sum(0), a_full.sum(0)),
        "sum over both dims": (a_other.sum(), a_full.sum()),
        "amax": (a_other.amax(1), a_full.amax(1)),
        "mean": (a.mean(0), a_full.mean(0)),
        "transpose": (a.t(), a_full.t()),
        "reshape across the sharded dim": (a.reshape(4, 12), a_full.reshape(4, 12)),
        "view flat": (a_other.reshape(-1), a_full.reshape(-1)),
        "permute 3-d": (distribute_tensor(a_full.reshape(2, 4, 6), mesh, [Shard(1)] + [Shard(2)] * last).permute(2, 0, 1),
                        a_full.reshape(2, 4, 6).permute(2, 0, 1)),
    }
    for name, (result, expected) in cases.items():
        assert torch.equal(result.full_tensor(), expected), (mesh.shape, name)


@spmd(meshes=[], simulated=[(8,)])
def test_cross_mesh_moves(mesh):
    full = exact_full((9, 8), seed=4)
    world = torch.arange(8)
    moves = [
        ("8 -> 2x2x2 reordered", DeviceMesh("cpu", world.flip(0).reshape(2, 2, 2)), [Shard(0), R, Shard(1)]),
        ("2x4 -> 4x2 transposed ranks", DeviceMesh("cpu", world.reshape(2, 4).t()), [Shard(1), Shard(0)]),
        ("hand-off to ranks 4..7", DeviceMesh("cpu", world[4:]), [Shard(0)]),
        ("back to 2x4", DeviceMesh("cpu", world.reshape(2, 4)), [Shard(0), Shard(0)]),
    ]
    dtensor = distribute_tensor(full, mesh, [Shard(0)])
    for name, target_mesh, placements in moves:
        dtensor = dtensor.redistribute(target_mesh, placements)
        coordinate = target_mesh.get_coordinate()
        if coordinate is None:
            assert dtensor.to_local().numel() == 0, name
        else:
            _check(dtensor, full, name)


@spmd(meshes=[], simulated=[(8,), (2, 2, 2), (2, 4)])
def test_random_ops_match_the_single_device_tensor(mesh):
    shape = (9, 5)
    for counter, placements in enumerate([[Shard(0)] * mesh.ndim, [R] * (mesh.ndim - 1) + [Shard(1)],
                                           [Shard(1)] + [Shard(0)] * (mesh.ndim - 1)]):
        if counter == 0:
            shardtensor.manual_seed(21)
        dtensor = shardtensor.rand(*shape, device_mesh=mesh, placements=placements)
        expected = documented_random("rand", shape, seed=21, counter=counter, dtype=torch.float32)
        _check(dtensor, expected, (mesh.shape, [str(p) for p in placements]))
    target = distribute_tensor(torch.zeros(shape), mesh, [Shard(0)] + [Shard(1)] * (mesh.ndim - 1))
    target.uniform_()
    _check(target, documented_random("rand", shape, seed=21, counter=3, dtype=torch.float32), "uniform_ in place")


@spmd(meshes=[], simulated=[(2, 2, 2)])
def test_from_local_on_a_sliced_mesh_learns_shapes_in_one_all_gather_per_mesh_dim(mesh):
    """A 2x2 slice of the 2x2x2 world does not span the world: the fixed-size records of the local shapes
    are gathered along each of its mesh dims (no group over the slice is made), in row-major order."""
    plane = init_device_mesh("cpu", mesh.shape, mesh_dim_names=("a", "b", "c"))["b", "c"]
    row, column = plane.get_coordinate()
    sizes = [[1, 3], [0, 2]]  # rows per coordinate: neither torch.chunk's split nor equal along any mesh dim
    flat = [size for line in sizes for size in line]
    full = exact_full((sum(flat), 4), seed=mesh.get_coordinate()[0])  # each plane its own tensor
    start = sum(flat[: 2 * row + column])
    with CommDebugMode() as mode:
        dtensor = DTensor.from_local(full[start : start + sizes[row][column]], plane, [Shard(0), Shard(0)])
    assert mode.get_comm_counts() == {"all_gather": 2}
    assert dtensor.sharding.pieces[0] == tuple(flat)
    assert torch.equal(dtensor.full_tensor(), full)
