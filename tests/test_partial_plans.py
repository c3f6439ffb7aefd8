"""Plans from Partial sources over several mesh dims run and give the single-device sum.

Operands are small integers in float64, so every summation order gives the exact sum. Each case runs
the plan that moves the fewest bytes (flattened reduce_scatters over several mesh dims, then
gathers) and the default plan, and checks the collectives issued are the plan's.
"""

import itertools
import math

import torch
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard
from shardtensor.layout import Layout
from shardtensor.redistribute import execute, plan
from shardtensor.redistribute.explanation import fewest_bytes_plan

P, R = Partial(), Replicate()

# (source placements, target placements) per mesh shape; targets hold no Partial.
CASES = {
    (2, 2): [
        ([P, P], [Shard(0), R]),  # one reduce_scatter over both mesh dims, then all_gather on mesh dim 1
        ([P, P], [Shard(1), Shard(0)]),
        ([P, Shard(0)], [Shard(1), R]),
        ([P, P], [R, R]),
    ],
    (2, 1, 2): [
        ([P, Shard(0), P], [R, R, R]),
        ([P, Shard(0), P], [Shard(1), R, Shard(0)]),
        ([P, P, P], [Shard(0), R, Shard(1)]),
    ],
    (1, 2, 2): [
        ([Shard(1), P, P], [R, Shard(0), R]),
        ([R, P, P], [R, Shard(1), Shard(0)]),
        ([P, P, P], [R, Shard(0), Shard(0)]),
    ],
}


def _operand(shape, partial_coordinate) -> torch.Tensor:
    """The operand held at one coordinate of the Partial mesh dims (the same on their replicas)."""
    generator = torch.Generator().manual_seed(1000 + sum(c * 10**i for i, c in enumerate(partial_coordinate)))
    return torch.randint(-50, 50, shape, generator=generator).double()


def _box(tensor, layout, coordinate):
    for dim, (start, length) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        tensor = tensor.narrow(dim, start, length)
    return tensor.contiguous()


def _check_case(mesh, source_placements, target_placements, shape, choose_plan):
    source = Layout.create(tuple(mesh.shape), source_placements, shape)
    target = source.with_placements(target_placements)
    partial_dims = source.partial_mesh_dims()
    coordinate = tuple(mesh.get_coordinate())
    mine = _operand(shape, tuple(coordinate[m] for m in partial_dims))
    total = sum(
        _operand(shape, partial_coordinate)
        for partial_coordinate in itertools.product(*(range(mesh.shape[m]) for m in partial_dims))
    )
    chosen = choose_plan(source, target)
    with shardtensor.comm.observe() as records:
        result = execute(_box(mine, source, coordinate), chosen, mesh)
    message = f"mesh {tuple(mesh.shape)} shape {shape}: {source_placements} -> {target_placements}\n{chosen}"
    assert torch.equal(result, _box(total, target, coordinate)), message
    assert [record.kind for record in records] == list(chosen.collectives), message
    return chosen


@spmd(meshes=[(2, 2), (2, 1, 2), (1, 2, 2)])
def test_partial_sources_reach_the_exact_sum_with_the_fewest_bytes_and_the_default_plans(mesh):
    flattened = 0
    for source_placements, target_placements in CASES[tuple(mesh.shape)]:
        for shape in [(8, 12), (5, 7)]:
            fewest = _check_case(mesh, source_placements, target_placements, shape,
                                 lambda source, target: fewest_bytes_plan(source, target, 8))
            flattened += any(isinstance(step.mesh_dim, tuple) for step in fewest.steps)
            _check_case(mesh, source_placements, target_placements, shape,
                        lambda source, target: plan(source, target, 8))
    assert flattened > 0  # the cases exercise reductions over several mesh dims at once


@spmd(meshes=[(2, 2)])
def test_partial_partial_to_shard_replicate_on_a_dtensor_moves_the_bound(mesh):
    """The issue's 2x2 row at a size where bytes decide over latency: two collectives (a
    reduce_scatter, then a reduction or gather of the rest) instead of one all_reduce moving 1.5x;
    each rank receives exactly the lower bound."""
    shape = (512, 512)
    coordinate = tuple(mesh.get_coordinate())
    operand = _operand(shape, coordinate)
    total = sum(_operand(shape, other) for other in itertools.product(range(2), range(2)))
    dtensor = DTensor.from_local(operand, mesh, [P, P])
    with shardtensor.comm.observe() as records:
        result = dtensor.redistribute(mesh, [Shard(0), R])
    assert torch.equal(result.full_tensor(), total)
    assert len(records) == 2 and records[0].kind == "reduce_scatter"
    received = sum(record.bytes_received for record in records)
    layout = Layout.create((2, 2), [P, P], shape)
    assert received == plan(layout, layout.with_placements([Shard(0), R]), 8).lower_bound_bytes == math.prod(shape) * 8
