"""Tensor ops on DTensors (copy_, fills, indexing, scatter/gather, sorting, masks, tril, flip, roll):
single-device results forward and backward, with rules only (strict mode) and plain index tensors."""

import torch
from helpers import index_agreement
from spmd import spmd
from test_views import check, check_both_shardings, placements_for

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.dispatch import fallback_counts


ROWS = torch.tensor([4, 0, 2, 0])
GATHER_INDEX = torch.tensor([[0, 3], [2, 2], [1, 0], [3, 1], [0, 0]])
MASK = torch.tensor([True, False, True, False, True])[:, None]

CASES = [
    lambda x: x.index_select(0, ROWS),
    lambda x: x.index_select(1, ROWS[:2] % 4),
    lambda x: x.gather(1, GATHER_INDEX),
    lambda x: x.scatter(1, GATHER_INDEX[:, :1], x[:, :1] * 3),
    lambda x: x.scatter_add(1, GATHER_INDEX, x[:, 1:3]),
    lambda x: x.scatter_reduce(1, GATHER_INDEX, x[:, :2], "sum"),
    lambda x: x.scatter(1, GATHER_INDEX, 2.0) * x,
    lambda x: x[ROWS],
    lambda x: x[:, ROWS[:3] % 4],
    lambda x: x[ROWS[:2], ROWS[1:3]],
    lambda x: x.index_put((ROWS[:2],), x[1:3] * 2),
    lambda x: x.index_put((ROWS[:2],), x[1, :1] * 2, accumulate=True),
    lambda x: x.masked_fill(MASK, 0.5),
    lambda x: x.masked_fill(MASK, torch.tensor(-1.0, dtype=torch.float64)),
    lambda x: x.sort(1, descending=True)[0],
    lambda x: x.topk(2, dim=1)[0],
    lambda x: x.kthvalue(2, dim=1)[0],
    lambda x: x.kthvalue(2, dim=1, keepdim=True)[0],
    lambda x: x.tril(),
    lambda x: x.triu(1),
    lambda x: x.tril(-1).t(),
    lambda x: x.flip(1),
    lambda x: x.roll(1, 1),
    lambda x: x.clone().detach() * x,
]


@spmd()
def test_tensor_ops_forward_and_backward(mesh):
    full = torch.randn(5, 4)
    for function in CASES:
        check_both_shardings(mesh, full, function)


@spmd(meshes=[(2,), (4,)])
def test_explicit_uneven_shards(mesh):
    full = torch.randn(5, 4)
    sizes = {0: [4, 1]} if mesh.size() == 2 else {0: [0, 3, 1, 1]}
    for case in (CASES[1], CASES[2], CASES[11], CASES[13], CASES[17], CASES[21]):
        check(mesh, full, [Shard(0)], case, shard_sizes=sizes)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_local_rules_issue_no_collective(mesh):
    full = torch.randn(8, 6)
    x = distribute_tensor(full, mesh, placements_for(mesh, 0, 0))
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [x.index_select(1, ROWS % 6), x.gather(1, torch.zeros(8, 2, dtype=torch.long)), x[:, ROWS % 6], x.masked_fill(full > 0, 0.0), x.sort(1)[0],
                   x.tril(1), x.triu(-2), x.flip(1), x.roll(2, 1)]
    # gather's plain (Replicate) index is sliced to the rows of x, so its shards differ: the agreement runs.
    assert list(records) == index_agreement(mesh)
    expected = [full.index_select(1, ROWS % 6), full.gather(1, torch.zeros(8, 2, dtype=torch.long)),
                full[:, ROWS % 6], full.masked_fill(full > 0, 0.0), full.sort(1)[0], full.tril(1), full.triu(-2),
                full.flip(1), full.roll(2, 1)]
    for result, reference in zip(results, expected):
        assert result.placements == x.placements
        assert torch.equal(result.full_tensor(), reference)


@spmd()
def test_copy_moves_only_the_source(mesh):
    full = torch.randn(5, 4)
    destination = distribute_tensor(torch.zeros(5, 4), mesh, placements_for(mesh, 0, 1))
    local = destination.to_local()
    for placements in ([Replicate()] * mesh.ndim, placements_for(mesh, 1, 0), placements_for(mesh, 0, 1)):
        source = distribute_tensor(full, mesh, placements)
        with shardtensor.strict_mode():
            destination.copy_(source)
        assert destination.placements == tuple(placements_for(mesh, 0, 1))
        assert destination.to_local().data_ptr() == local.data_ptr()
        assert torch.equal(destination.full_tensor(), full)
    with shardtensor.strict_mode():
        destination.copy_(distribute_tensor(full[0], mesh, [Replicate()] * mesh.ndim))  # broadcast source
    assert torch.equal(destination.full_tensor(), full[0].expand(5, 4))


@spmd()
def test_in_place_ops_peers_refuse(mesh):
    """PEER_BUGS: masked_fill_.Scalar (#152249), detach_ (#167917), select.int (#147724) have rules."""
    full = torch.randn(5, 4)
    x = distribute_tensor(full, mesh, placements_for(mesh, 0, 1))
    before = sum(fallback_counts.values())
    with shardtensor.strict_mode():
        x.masked_fill_(MASK, 3.0)
        x.detach_()
        selected = x.select(1, 2).full_tensor().clone()
        x.zero_()
        y = distribute_tensor(full, mesh, placements_for(mesh, 1))
        y.fill_(2.0)
    assert sum(fallback_counts.values()) == before
    assert torch.equal(selected, full.masked_fill(MASK, 3.0)[:, 2])
    assert torch.equal(x.full_tensor(), torch.zeros(5, 4)) and x.placements == tuple(placements_for(mesh, 0, 1))
    assert torch.equal(y.full_tensor(), torch.full((5, 4), 2.0))


@spmd(meshes=[(2,), (2, 2)])
def test_partials_stay_where_exact(mesh):
    local = torch.arange(12.0).reshape(3, 4)
    partial = DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)
    total = local * mesh.size()
    with shardtensor.strict_mode(), comm.observe() as records:
        zeroed = partial.masked_fill(MASK[:3], 0.0)
        picked = partial.index_select(1, ROWS[:2] % 4)
        lower = partial.tril()
    assert list(records) == []
    for result in (zeroed, picked, lower):
        assert result.placements == (Partial(),) * mesh.ndim
    assert torch.equal(zeroed.full_tensor(), total.masked_fill(MASK[:3], 0.0))
    assert torch.equal(picked.full_tensor(), total.index_select(1, ROWS[:2] % 4))
    assert torch.equal(lower.full_tensor(), total.tril())
    filled = partial.masked_fill(MASK[:3], 1.0)  # 1 on every rank would sum to the rank count: reduced first
    assert filled.placements != (Partial(),) * mesh.ndim
    assert torch.equal(filled.full_tensor(), total.masked_fill(MASK[:3], 1.0))
    zeros = partial.new_zeros((2, 3))
    assert zeros.placements == (Replicate(),) * mesh.ndim and torch.equal(zeros.full_tensor(), torch.zeros(2, 3))
