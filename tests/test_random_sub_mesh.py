"""Random calls on a sub-mesh keep the random counter the same on every rank of the world.

Ranks outside a DTensor's mesh reach its random ops too (with empty shards): they take the call's
number of the counter without drawing. So after dropout on ranks [1, 3] of 4, the next random call on
any mesh gives every rank the numbers of the same call: values stay a function of seed, call number
and global shape, checked against the single-device reference (`helpers.documented_random`).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import documented_random, with_fallback_draws
from spmd import spmd

import shardtensor
from shardtensor import DeviceMesh, Replicate, Shard, comm, distribute_tensor
from shardtensor.ops.registry import RULES
from shardtensor.rules import ShardingRule

R = Replicate()
aten = torch.ops.aten
SEED = 13
SHAPE = (6, 5)


def _draw(kind, counter, parameters=()):
    return documented_random(kind, SHAPE, seed=SEED, counter=counter, parameters=parameters)


def _attention(x, dropout_p):
    """Attention over Replicate ones on `x`'s mesh (on CPU, with dropout, torch's math path and its
    `bernoulli_`: the CPU flash kernel has no dropout)."""
    ones = distribute_tensor(torch.ones(1, 2, 3, 4, dtype=torch.float64), x.device_mesh, [R] * x.device_mesh.ndim)
    return F.scaled_dot_product_attention(ones, ones, ones, dropout_p=dropout_p)


def _attention_reference(counter, dropout_p):
    """Attention on one device; with dropout, torch's math path (the one CPU takes) keeping the
    elements where the float64 uniform draws of the attention weights' shape are below 1 - dropout_p."""
    ones = torch.ones(1, 2, 3, 4, dtype=torch.float64)
    if dropout_p == 0:
        return F.scaled_dot_product_attention(ones, ones, ones)
    keep = documented_random("rand", (1, 2, 3, 3), seed=SEED, counter=counter) < 1 - dropout_p
    return aten._scaled_dot_product_attention_math(ones, ones, ones, dropout_p=dropout_p, dropout_mask=keep)[0]


# (name, a random op on `x` (float64 zeros of SHAPE on the sub-mesh), how many random calls it makes,
# its global result when its first call is call number `counter`)
CASES = [
    ("dropout", lambda x: F.dropout(x + 1, 0.5), 1, lambda counter: (_draw("rand", counter) < 0.5).double() * 2),
    ("native_dropout mask", lambda x: torch.native_dropout(x + 1, 0.5, True)[1], 1,
     lambda counter: _draw("rand", counter) < 0.5),
    ("native_dropout in eval mode", lambda x: torch.native_dropout(x + 1, 0.5, False)[0], 0,
     lambda counter: torch.ones(SHAPE, dtype=torch.float64)),
    ("normal_", lambda x: x.normal_(1.0, 2.0), 1, lambda counter: _draw("normal_", counter, (1.0, 2.0))),
    ("bernoulli", lambda x: torch.bernoulli(x + 0.3), 1, lambda counter: (_draw("rand", counter) < 0.3).double()),
    ("bernoulli into out=", lambda x: torch.bernoulli(x + 0.3, out=torch.empty_like(x)), 1,
     lambda counter: (_draw("rand", counter) < 0.3).double()),
    ("normal with a tensor mean into out=", lambda x: torch.normal(x, 2.0, out=torch.empty_like(x)), 1,
     lambda counter: 2.0 * _draw("randn", counter)),
    ("rand_like", torch.rand_like, 1, lambda counter: _draw("rand", counter)),
    ("randn_like", torch.randn_like, 1, lambda counter: _draw("randn", counter)),
    ("normal with a tensor mean", lambda x: torch.normal(x, 2.0), 1, lambda counter: 2.0 * _draw("randn", counter)),
    ("uniform_ then randint_like", lambda x: torch.randint_like(x.uniform_(), 3, 9), 2,
     lambda counter: _draw("random_", counter + 1, (3, 9))),
    ("rand factory", lambda x: shardtensor.rand(*SHAPE, device_mesh=x.device_mesh, placements=x.placements,
                                                dtype=torch.float64), 1, lambda counter: _draw("rand", counter)),
    ("poisson (replicate fallback)", lambda x: torch.poisson(x + 2), 1, lambda counter: with_fallback_draws(
        lambda: torch.poisson(torch.full(SHAPE, 2.0, dtype=torch.float64)), seed=SEED, counter=counter)),
    ("attention with dropout", lambda x: _attention(x, 0.5), 1, lambda counter: _attention_reference(counter, 0.5)),
    ("attention without dropout", lambda x: _attention(x, 0.0), 0, lambda counter: _attention_reference(counter, 0.0)),
]


def _sub_meshes(mesh):
    """Sub-meshes leaving some ranks of the world out: of 4 ranks in a line, or of a 2 x 2 world."""
    if mesh.ndim == 1:
        return [DeviceMesh("cpu", [1, 3]), DeviceMesh("cpu", [0, 1, 2]), DeviceMesh("cpu", [2])]
    return [DeviceMesh("cpu", [1, 3]), DeviceMesh("cpu", [[0], [2]])]


def _sharded(mesh):
    return [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)


def _same_on_every_rank(value, world):
    everyone = comm.all_gather_object(value, world, None)
    assert all(torch.equal(other, value) for other in everyone), everyone


def _check_world_calls(world, counter):
    """The next four random calls on the whole world, the first being call number `counter`: equal
    to the single-device reference, and Replicate results equal on every rank."""
    replicated = shardtensor.rand(4, device_mesh=world, placements=[R] * world.ndim, dtype=torch.float64).to_local()
    assert torch.equal(replicated, documented_random("rand", (4,), seed=SEED, counter=counter))
    _same_on_every_rank(replicated, world)
    zeros = distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), world, _sharded(world))
    assert torch.equal(zeros.normal_().full_tensor(), _draw("normal_", counter + 1))
    dropped = F.dropout(distribute_tensor(torch.ones(SHAPE, dtype=torch.float64), world, _sharded(world)), 0.5)
    assert torch.equal(dropped.full_tensor(), (_draw("rand", counter + 2) < 0.5).double() * 2)
    like = torch.randn_like(distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), world, [R] * world.ndim))
    assert torch.equal(like.to_local(), _draw("randn", counter + 3))
    _same_on_every_rank(like.to_local(), world)


@spmd(meshes=[(4,), (2, 2)])
def test_random_calls_after_a_random_op_on_a_sub_mesh_agree_on_every_rank(mesh):
    for sub_mesh in _sub_meshes(mesh):
        inside = sub_mesh.get_coordinate() is not None
        for name, operation, calls, expected in CASES:
            note = f"{name} on sub-mesh {sub_mesh.mesh.tolist()}"
            shardtensor.manual_seed(SEED)
            for repeat in range(2):  # the second call runs from the cached plan on the sub-mesh's ranks
                x = distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), sub_mesh, _sharded(sub_mesh))
                with torch.no_grad(), comm.observe() as records:
                    result = operation(x)
                full = result.full_tensor()
                if inside:
                    assert torch.equal(full, expected(repeat * calls)), (note, repeat)
                else:  # no data and no communication, only the counter moves
                    assert records == [] and result.to_local().numel() == 0 and full.numel() == 0, note
            _check_world_calls(mesh, 2 * calls)


def test_every_rule_of_a_random_op_says_how_many_random_calls_it_makes():
    """Ranks outside the mesh take `random_calls` numbers without running the local op: a rule of an op
    torch tags random that kept the default (0) would leave them behind the mesh's ranks."""
    seeded = {op: rule for op, rule in RULES.items() if torch.Tag.nondeterministic_seeded in op.tags}
    assert aten.bernoulli.out in seeded and aten.native_dropout.default in seeded
    silent = [op for op, rule in seeded.items() if type(rule).random_calls is ShardingRule.random_calls]
    assert silent == []


@spmd(meshes=[(2, 2)])
def test_a_random_op_on_each_rank_s_own_row_of_a_2d_mesh(mesh):
    """Every rank is in one row ([0, 1] or [2, 3]) and outside the other: dropout on its own row
    takes call 0 everywhere, so both rows hold the same global mask and the world stays in step."""
    rows = [DeviceMesh("cpu", list(ranks)) for ranks in mesh.mesh.tolist()]  # built on every rank, in order
    own_row = next(row for row in rows if row.get_coordinate() is not None)
    shardtensor.manual_seed(SEED)
    x = distribute_tensor(torch.ones(SHAPE, dtype=torch.float64), own_row, [Shard(1)])
    dropped = F.dropout(x, 0.5).full_tensor()
    assert torch.equal(dropped, (_draw("rand", 0) < 0.5).double() * 2)
    _check_world_calls(mesh, 1)


@pytest.mark.parametrize("first", ["dropout", "rand factory"])
@spmd(meshes=[(4,), (2, 2)])
def test_without_manual_seed_a_first_call_on_a_sub_mesh_seeds_the_whole_world(mesh, first):
    """The seed is drawn on global rank 0 and shared with every rank at the first random call, made here
    on a sub-mesh: its outside ranks take it too, so later calls on the world agree."""
    shardtensor.random._seed = None
    torch.manual_seed(100 + torch.distributed.get_rank())  # different default generators per rank
    sub_mesh = DeviceMesh("cpu", [1, 3])
    operation = dict((name, operation) for name, operation, _, _ in CASES)[first]
    operation(distribute_tensor(torch.zeros(SHAPE, dtype=torch.float64), sub_mesh, [Shard(0)]))
    assert len(set(comm.all_gather_object(shardtensor.random._seed, mesh, None))) == 1
    replicated = shardtensor.rand(4, device_mesh=mesh, placements=[R] * mesh.ndim).to_local()
    _same_on_every_rank(replicated, mesh)
