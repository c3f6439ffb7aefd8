"""Random ops on DTensors: the global values depend on seed, call number and global shape only."""

import math

import torch
import torch.nn.functional as F
from helpers import documented_random
from spmd import spmd

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor

R = Replicate()
SHAPE = (6, 5)


def _draw(kind, counter=0, parameters=()):
    """The global tensor of random call `counter` after manual_seed(7): the same on every mesh."""
    return documented_random(kind, SHAPE, seed=7, counter=counter, parameters=parameters)


# (name, the op on a float64 zeros DTensor `x`, expected global tensor or None, strict: only this file's rules)
CASES = [
    ("uniform_", lambda x: x.uniform_(-2, 3), lambda: _draw("uniform_", parameters=(-2, 3)), True),
    ("normal_", lambda x: x.normal_(1.0, 2.0), lambda: _draw("normal_", parameters=(1.0, 2.0)), True),
    ("exponential_", lambda x: x.exponential_(0.5), lambda: _draw("exponential_", parameters=(0.5,)), True),
    ("random_", lambda x: x.random_(0, 10), lambda: _draw("random_", parameters=(0, 10)), True),
    ("bernoulli_", lambda x: x.bernoulli_(0.3), lambda: (_draw("rand") < 0.3).double(), True),
    ("rand_like", torch.rand_like, lambda: _draw("rand"), True),
    ("randn_like", torch.randn_like, lambda: _draw("randn"), True),
    ("randint_like", lambda x: torch.randint_like(x, 3, 9), lambda: _draw("random_", parameters=(3, 9)), True),
    ("kaiming_normal_", torch.nn.init.kaiming_normal_, lambda: _draw("normal_", parameters=(0, math.sqrt(2 / 5))), True),
    ("xavier_uniform_", torch.nn.init.xavier_uniform_,
     lambda: _draw("uniform_", parameters=(-math.sqrt(6 / 11), math.sqrt(6 / 11))), True),
    ("dropout", lambda x: F.dropout(x + 1, 0.5), lambda: (_draw("rand") < 0.5).double() * 2, True),
    ("trunc_normal_", lambda x: torch.nn.init.trunc_normal_(x, std=0.5, a=-0.6, b=0.6), None, False),
]


def _placement_lists(mesh):
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [R]]
    return [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [R, Shard(0)]]


@spmd()
def test_random_ops_give_one_global_tensor_for_every_mesh_and_placement(mesh):
    for name, operation, expected, strict in CASES:
        results = []
        for placements in _placement_lists(mesh):
            shardtensor.manual_seed(7)
            x = distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), mesh, placements)
            with torch.no_grad(), comm.observe() as records:
                if strict:
                    with shardtensor.strict_mode():
                        result = operation(x)
                else:
                    result = operation(x)
            if strict:
                assert list(records) == [], name  # each rank draws its own shard: no communication
            assert result.placements == x.placements, name
            results.append(result.full_tensor())
        assert all(torch.equal(result, results[0]) for result in results), name
        assert results[0].unique().numel() > 1, name
        if expected is not None:
            assert torch.equal(results[0], expected()), name
        else:  # trunc_normal_: the rejection loop redraws where needed, every rank alike
            assert results[0].abs().max() <= 0.6


@spmd(meshes=[(2,), (2, 2)])
def test_dropout_mask_is_the_same_in_forward_and_backward(mesh):
    shardtensor.manual_seed(3)
    full = torch.randn(8, 6)
    x = distribute_tensor(full, mesh, [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)).requires_grad_()
    y = F.dropout(x, 0.25)
    y.backward(distribute_tensor(torch.ones(8, 6), mesh, y.placements))
    kept = y.full_tensor() != 0
    assert torch.equal(x.grad.full_tensor() != 0, kept)
    assert torch.allclose(y.full_tensor()[kept], full[kept] / 0.75)
    # native_dropout: the kept mask is an output; a Partial input stays Partial.
    partial = shardtensor.DTensor.from_local(torch.ones(8, 6), mesh, [Partial()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        output, mask = torch.native_dropout(partial, 0.5, True)
    assert list(records) == [] and output.placements == partial.placements
    expected_mask = documented_random("rand", (8, 6), seed=3, counter=1) < 0.5  # call 1 after the seed, drawn in float64
    assert torch.equal(mask.full_tensor(), expected_mask)
    assert torch.equal(output.full_tensor(), expected_mask * 2.0 * mesh.size())


@spmd(meshes=[(4,)])
def test_statistics_of_a_large_draw_are_sane(mesh):
    shardtensor.manual_seed(0)
    x = shardtensor.zeros(256, 256, device_mesh=mesh, placements=[Shard(1)], dtype=torch.float64)
    normal = torch.randn_like(x).full_tensor()
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01
    uniform = x.uniform_(2, 4).full_tensor()
    assert abs(uniform.mean() - 3) < 0.01 and 2 <= uniform.min() and uniform.max() < 4
    assert abs(torch.bernoulli(torch.full_like(x, 0.2)).full_tensor().mean() - 0.2) < 0.01
    # Two calls draw different values; the same call after re-seeding draws the same ones.
    shardtensor.manual_seed(0)
    assert torch.equal(torch.randn_like(x).full_tensor(), normal)
    assert not torch.equal(torch.randn_like(x).full_tensor(), normal)
