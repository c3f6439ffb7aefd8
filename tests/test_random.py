"""rand/randn give one global tensor for a seed and shape, whatever the mesh and placements."""

import torch
from helpers import documented_random
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard, comm
from shardtensor.random import BLOCK_SIZE, random_shard


def test_a_box_of_the_random_tensor_equals_the_same_box_of_the_full_one():
    shape = (3, BLOCK_SIZE // 2 + 5)  # tiles of 2 x 32768: the box below crosses tile edges
    full = documented_random("randn", shape, seed=5, counter=2, dtype=torch.float32)
    assert torch.equal(random_shard("randn", shape, (0, 0), shape, seed=5, counter=2, dtype=torch.float32, device="cpu"), full)
    box = random_shard("randn", shape, (1, 7), (2, 1000), seed=5, counter=2, dtype=torch.float32, device="cpu")
    assert torch.equal(box, full[1:3, 7:1007])
    other = random_shard("randn", shape, (0, 0), shape, seed=5, counter=3, dtype=torch.float32, device="cpu")
    assert not torch.equal(full, other)


def test_a_mask_below_a_threshold_is_the_comparison_of_the_same_draws():
    """Dropout's and bernoulli's keep masks: the float64 uniform draws compared tile by tile give
    exactly the mask of the whole draw, for any box, without holding a float64 box."""
    shape = (3, BLOCK_SIZE // 2 + 5)
    full = random_shard("rand", shape, (0, 0), shape, seed=5, counter=2, dtype=torch.float64, device="cpu")
    for offset, local_shape in (((0, 0), shape), ((1, 7), (2, 1000)), ((0, 3), (3, BLOCK_SIZE // 2))):
        mask = random_shard("rand", shape, offset, local_shape, seed=5, counter=2, dtype=torch.float64, device="cpu", below=0.3)
        rows, columns = (slice(start, start + length) for start, length in zip(offset, local_shape))
        assert mask.dtype == torch.bool and torch.equal(mask, full[rows, columns] < 0.3)
    scalar = random_shard("rand", (), (), (), seed=1, counter=0, dtype=torch.float64, device="cpu", below=0.5)
    assert torch.equal(scalar, random_shard("rand", (), (), (), seed=1, counter=0, dtype=torch.float64, device="cpu") < 0.5)


def _placement_lists(mesh):
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [Replicate()]]
    return [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [Replicate(), Shard(0)]]


@spmd()
def test_rand_and_randn_do_not_depend_on_mesh_or_placements(mesh):
    shape = (5, BLOCK_SIZE // 4 + 3)
    for kind, factory in [("rand", shardtensor.rand), ("randn", shardtensor.randn)]:
        expected = documented_random(kind, shape, seed=11, counter=0)
        for placements in _placement_lists(mesh):
            shardtensor.manual_seed(11)
            dtensor = factory(*shape, device_mesh=mesh, placements=placements, dtype=torch.float64)
            assert torch.equal(dtensor.full_tensor(), expected), (kind, placements)
    shardtensor.manual_seed(11)
    first = shardtensor.rand(4, device_mesh=mesh).full_tensor()
    second = shardtensor.rand(4, device_mesh=mesh).full_tensor()
    assert not torch.equal(first, second)


@spmd(meshes=[(2,), (2, 2)])
def test_without_manual_seed_all_ranks_share_one_seed(mesh):
    shardtensor.random._seed = None
    torch.manual_seed(torch.distributed.get_rank())  # different default generators per rank
    value = shardtensor.rand(6, device_mesh=mesh, placements=[Replicate()] * mesh.ndim).to_local()
    everyone = comm.all_gather_object(value, mesh)
    assert all(torch.equal(value, other) for other in everyone)
