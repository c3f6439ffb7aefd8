"""Reductions and scans on DTensors: Partial outputs where exact, gathers where not, empty shards,
Partial inputs, and backward, all against one device."""

import pytest
import torch
from helpers import partial_and_value
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.placement import NormPartial


# (reduction over dim 0 or all dims, Partial reduce op (or Partial) of its output when dim 0 is sharded)
PARTIAL_CASES = [
    (lambda x: x.sum(0), "sum"),
    (lambda x: x.sum((0, 1), keepdim=True, dtype=torch.float32), "sum"),
    (lambda x: x.mean(0), "sum"),  # local sum / global count: exact with uneven shards
    (lambda x: x.mean(), "sum"),
    (lambda x: x.prod(0), "product"),
    (lambda x: x.amax(0), "max"),
    (lambda x: x.amin(0, keepdim=True), "min"),
    (lambda x: x.amax(), "max"),  # no dim: every dim (the schema's default is an empty list)
    (lambda x: x.amin(dim=()), "min"),
    (lambda x: x.max(), "max"),
    (lambda x: x.min(), "min"),
    (lambda x: (x > 0.3).any(0), "max"),
    (lambda x: (x > -1.5).all(), "min"),
    (lambda x: torch.linalg.vector_norm(x, float("inf"), dim=0), NormPartial(float("inf"))),
    (lambda x: torch.linalg.vector_norm(x, -float("inf")), "min"),
    (lambda x: torch.linalg.vector_norm(x, 0, dim=0), "sum"),  # a count of nonzeros
    (lambda x: torch.linalg.vector_norm(x, 1, dim=(0, 1)), NormPartial(1)),
    (lambda x: torch.linalg.vector_norm(x, dim=0), NormPartial(2)),
    (lambda x: torch.linalg.vector_norm(x, 3), NormPartial(3)),
    (lambda x: x.norm(p=2.5, dim=0), NormPartial(2.5)),
]


def _partial(reduce_op) -> Partial:
    return reduce_op if isinstance(reduce_op, Partial) else Partial(reduce_op)


@pytest.mark.parametrize("case", range(len(PARTIAL_CASES)))
@spmd()
def test_reducing_a_sharded_dim_gives_an_exact_partial(mesh, case):
    reduction, reduce_op = PARTIAL_CASES[case]
    full = torch.randn(5, 3, dtype=torch.float64)  # 5 rows on 4 ranks: pieces 2, 2, 1, 0 (one empty shard)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        result = reduction(x)
    assert list(records) == []
    if mesh.size() > 1:
        assert result.placements == (_partial(reduce_op),) * mesh.ndim
    torch.testing.assert_close(result.full_tensor(), reduction(full))


# Reductions whose shards do not combine: a sharded reduced dim is gathered, other dims stay sharded.
GATHER_CASES = [
    lambda x: x.argmax(0),
    lambda x: x.argmin(),
    lambda x: x.max(0),
    lambda x: x.min(0, keepdim=True),
    lambda x: x.var(0),
    lambda x: x.std((0, 1), correction=0),
    lambda x: torch.var_mean(x, 0, correction=2),
    lambda x: torch.std_mean(x, 0),
    lambda x: x.logsumexp(0),
    lambda x: torch.linalg.vector_norm(x, -2, dim=0),  # negative orders do not combine
]


def _values(result):
    return [result] if isinstance(result, torch.Tensor) else list(result)


@pytest.mark.parametrize("case", range(len(GATHER_CASES)))
@spmd()
def test_reductions_that_need_the_whole_dim(mesh, case):
    reduction = GATHER_CASES[case]
    full = torch.randn(3, 4, dtype=torch.float64)  # 3 rows on 4 ranks: one empty shard (PyTorch hangs on max)
    with shardtensor.strict_mode():
        reduced = reduction(distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim))
        for result, reference in zip(_values(reduced), _values(reduction(full))):
            torch.testing.assert_close(result.full_tensor(), reference)


# Reducing a dim that is not sharded: local, the other dim keeps its shard (dim 1 -> output dim 0).
LOCAL_CASES = [
    (lambda x: x.sum(1), 0),
    (lambda x: x.mean(-1, keepdim=True), 0),
    (lambda x: x.max(1), 0),
    (lambda x: x.argmin(1), 0),
    (lambda x: x.var(1), 0),
    (lambda x: x.logsumexp(1), 0),
    (lambda x: torch.linalg.vector_norm(x, 3, dim=1), 0),
    (lambda x: x.cumsum(1), 0),
    (lambda x: x.cummax(1), 0),
    (lambda x: x.median(1), 0),
]


@spmd()
def test_reducing_an_unsharded_dim_is_local_and_keeps_the_shard(mesh):
    full = torch.randn(6, 4, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    for reduction, output_dim in LOCAL_CASES:
        with shardtensor.strict_mode(), comm.observe() as records:
            reduced = reduction(x)
        assert list(records) == []
        for result, reference in zip(_values(reduced), _values(reduction(full))):
            assert result.placements == (Shard(output_dim),) * mesh.ndim
            torch.testing.assert_close(result.full_tensor(), reference)
    with shardtensor.strict_mode(), comm.observe() as records:
        hashes = torch.hash_tensor(x, 1)  # uint64, which gloo cannot gather: compared shard by shard
    assert list(records) == [] and hashes.placements == x.placements
    start, length = x.sharding.local_offset(mesh.get_coordinate())[0], x.to_local().shape[0]
    assert torch.equal(hashes.to_local(), torch.hash_tensor(full, 1)[start:start + length])
    if mesh.ndim == 2:
        mixed = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        with shardtensor.strict_mode(), comm.observe() as records:
            column_sums = mixed.sum(0)
        assert list(records) == [] and column_sums.placements == (Partial(), Shard(0))
        torch.testing.assert_close(column_sums.full_tensor(), full.sum(0))


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_norms_of_norms_stay_partial_and_every_use_gets_the_one_device_value(mesh):
    """Per-tensor p-norms of sharded data stay NormPartial through `stack` and the norm of the stack
    (clip_grad_norm_'s total: no collective), and whatever reads them later gets the one-device
    value: arithmetic (one all_reduce), a norm of another order, a stack with a negative replicated
    value, full_tensor, backward."""
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(5, 3, dtype=torch.float64, generator=generator),
             torch.randn(3, 6, dtype=torch.float64, generator=generator)]
    placements = [[Shard(0)] * mesh.ndim, [Shard(1)] + [Replicate()] * (mesh.ndim - 1)]
    minus = torch.tensor(-1.5, dtype=torch.float64)
    for order in (2.0, 3.0, 1.0, INFINITY):
        leaves = [distribute_tensor(full, mesh, where).requires_grad_() for full, where in zip(fulls, placements)]
        references = [full.clone().requires_grad_() for full in fulls]
        with shardtensor.strict_mode(), comm.observe() as records:
            norms = [torch.linalg.vector_norm(leaf, order) for leaf in leaves]
            total = torch.linalg.vector_norm(torch.stack(norms), order)
        assert list(records) == [] and total.placements == (NormPartial(order),) * mesh.ndim, order
        expected_norms = [torch.linalg.vector_norm(reference, order) for reference in references]
        expected = torch.linalg.vector_norm(torch.stack(expected_norms), order)
        with comm.observe() as records:
            scaled = total * 2 + 1
        assert [record.kind for record in records] == ["all_reduce"], (order, records)
        torch.testing.assert_close(scaled.full_tensor(), expected * 2 + 1)
        other = 2.0 if order != 2.0 else 3.0
        torch.testing.assert_close(torch.linalg.vector_norm(torch.stack(norms), other).full_tensor(),
                                   torch.linalg.vector_norm(torch.stack(expected_norms), other))
        replicated = distribute_tensor(minus, mesh, [Replicate()] * mesh.ndim)
        torch.testing.assert_close(torch.stack(norms + [replicated]).full_tensor(), torch.stack(expected_norms + [minus]))
        total.backward()
        expected.backward()
        for leaf, reference in zip(leaves, references):
            assert leaf.grad.placements == leaf.placements
            torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_partial_inputs(mesh):
    partial, full = partial_and_value(mesh, (4, 6))
    with shardtensor.strict_mode(), comm.observe() as records:
        linear = [partial.sum(1), partial.mean(0), partial.sum(), partial.cumsum(1)]
    assert list(records) == []  # sum, mean and cumsum of a P(sum) stay P(sum)
    for result, reference in zip(linear, [full.sum(1), full.mean(0), full.sum(), full.cumsum(1)]):
        assert result.placements == (Partial(),) * mesh.ndim
        torch.testing.assert_close(result.full_tensor(), reference)
    # nonlinear reductions reduce the Partial first (PEER_BUGS #165962: max/min of a Partial), each family
    nonlinear = [lambda t: t.amax(1), lambda t: t.max(), lambda t: t.max(0).indices, lambda t: t.amin(1),
                 lambda t: t.min(), lambda t: t.min(0).values, lambda t: t.argmin(), lambda t: torch.aminmax(t, dim=1).min,
                 lambda t: t.var(1), lambda t: t.prod(0), lambda t: torch.linalg.vector_norm(t, dim=1)]
    for reduce_op in ("sum", "avg"):
        partial, full = partial_and_value(mesh, (4, 6), reduce_op)
        with shardtensor.strict_mode():
            results = [reduction(partial) for reduction in nonlinear]
        for result, reduction in zip(results, nonlinear):
            torch.testing.assert_close(result.full_tensor(), reduction(full))
    for reduce_op, kept, other in (("max", lambda t: t.amax(0), lambda t: t.amin(0)),
                                   ("min", lambda t: t.amin(0), lambda t: t.amax(0))):
        extreme, extreme_value = partial_and_value(mesh, (4, 6), reduce_op)
        with shardtensor.strict_mode(), comm.observe() as records:
            same = kept(extreme)
        assert list(records) == [] and same.placements == (Partial(reduce_op),) * mesh.ndim
        torch.testing.assert_close(same.full_tensor(), kept(extreme_value))
        with shardtensor.strict_mode():  # amin of a P(max) is not a P(max): reduced first
            torch.testing.assert_close(other(extreme).full_tensor(), other(extreme_value))


@spmd()
def test_scans_along_a_sharded_dim_gather_it(mesh):
    full = torch.rand(5, 3, dtype=torch.float64) + 0.5
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with shardtensor.strict_mode():
        for scan in (torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummin):
            for result, reference in zip(_values(scan(x, 0)), _values(scan(full, 0))):
                torch.testing.assert_close(result.full_tensor(), reference)
                assert not any(placement.is_shard(0) for placement in result.placements)


@spmd(meshes=[(2,), (4,)])
def test_mean_of_uneven_explicit_shards_is_weighted(mesh):
    """PyTorch averaged the shards' means unweighted (pytorch#162692); we divide by the global count."""
    sizes = [1] + [3] * (mesh.size() - 1)
    full = torch.arange(float(sum(sizes)))
    offset = sum(sizes[:mesh.get_rank()])
    local = full[offset:offset + sizes[mesh.get_rank()]].clone()
    x = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, shard_sizes={0: sizes})
    with shardtensor.strict_mode():
        assert x.mean().full_tensor().item() == full.mean().item()


# Backward of each reduction, through the single-device autograd graph (the leaf is sharded on dim 0 or 1).
# Not prod/cumprod: their backward formulas mix plain `torch.ones`/`zeros` (not 0-d) into DTensor ops (refused).
BACKWARD_CASES = [
    lambda x: x.sum(0).pow(2).sum(),
    lambda x: x.mean(0).pow(2).sum() + x.mean(),
    lambda x: x.amax(0).sum() + x.amin(1).sum(),
    lambda x: x.max() + x.max(1).values.sum() + x.min(0)[0].sum(),
    lambda x: x.var(0).sum() + x.std(1, correction=0).sum(),
    lambda x: torch.linalg.vector_norm(x) + torch.linalg.vector_norm(x, 1, dim=0).sum(),
    lambda x: x.logsumexp(0).sum(),
    lambda x: (x.cumsum(1) ** 2).sum() + x.cumsum(0)[-1].sum(),
]


@pytest.mark.parametrize("case", range(len(BACKWARD_CASES)))
@spmd(meshes=[(1,), (4,), (2, 2)])
def test_backward_matches_single_device(mesh, case):
    loss_of = BACKWARD_CASES[case]
    full = torch.rand(5, 4, dtype=torch.float64) + 0.5
    for dim in (0, 1):
        leaf = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(dim)] * mesh.ndim)
        loss_of(leaf).full_tensor().backward()
        reference = full.clone().requires_grad_()
        loss_of(reference).backward()
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


aten = torch.ops.aten
INFINITY = float("inf")
# Median, mode, norms, dist, histc, count_nonzero, aminmax, trace, renorm, segment_reduce: (loss of the
# leaf, or None for integer results compared forward only). Each runs in strict mode on a leaf sharded
# on dim 0 or 1, forward and backward against one device.
MORE_CASES = [
    lambda x: x.median(0).values.sum() + x.nanmedian(1)[0].sum() + x.median() + x.nanmedian(),
    lambda x: x.mode(1).values.sum() + x.mode(0, keepdim=True)[0].sum(),
    lambda x: torch.aminmax(x, dim=0).min.sum() + torch.aminmax(x).max + torch.aminmax(x, dim=1, keepdim=True)[1].sum(),
    lambda x: aten.norm.ScalarOpt_dim(x, 2, [1]).sum() + aten.norm.ScalarOpt_dim(x, 1, [0]).sum() + aten.norm.Scalar(x, 3),
    lambda x: aten.norm.ScalarOpt_dim(x, INFINITY, [0]).sum() + aten.norm.ScalarOpt_dim(x, None, [0, 1], True).sum(),
    lambda x: torch.dist(x, x * 0.5) + torch.dist(x, 2 - x, 1) + torch.dist(x, x.sin(), INFINITY),
    lambda x: torch.nn.functional.pairwise_distance(x, x.cos()).sum(),
    lambda x: x.histc(4, 0.5, 1.25).sum() + x.histc(3)[1:],
    lambda x: torch.histogram(x.detach(), 3, density=True).hist + torch.histogram(x.detach(), 3).bin_edges[1:],
    lambda x: torch.count_nonzero(x > 1, 0) + torch.count_nonzero(x < 1).sum(),
    lambda x: x[:, :4].trace() + x.renorm(2, 0, 1.0).sum() + x.renorm(1, 1, 2.0).sum(),
    lambda x: aten.segment_reduce(x, "sum", lengths=SEGMENT_LENGTHS).sum()
    + aten.segment_reduce(x, "max", offsets=SEGMENT_OFFSETS).pow(2).sum(),
]
SEGMENT_LENGTHS = torch.tensor([2, 0, 3])
SEGMENT_OFFSETS = torch.tensor([0, 2, 2, 5])


@spmd()
def test_more_reductions_forward_and_backward(mesh):
    full = torch.rand(5, 4, dtype=torch.float64) + 0.5  # 5 rows on 4 ranks: one empty shard
    for loss_of in MORE_CASES:
        for dim in (0, 1):
            leaf = distribute_tensor(full.clone().requires_grad_(), mesh, [Shard(dim)] * mesh.ndim)
            reference = full.clone().requires_grad_()
            expected = loss_of(reference)
            with shardtensor.strict_mode():
                loss = loss_of(leaf)
                torch.testing.assert_close(loss.full_tensor(), expected)
                if expected.requires_grad:
                    loss.sum().backward()
            if expected.requires_grad:
                expected.sum().backward()
                torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_sharded_reduced_dims_give_partials_without_communication(mesh):
    full = torch.randn(5, 3, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    y = distribute_tensor(full.flip(1), mesh, [Shard(0)] * mesh.ndim)
    cases = [
        (lambda a, b: torch.aminmax(a, dim=0), ("min", "max")),
        (lambda a, b: torch.aminmax(a), ("min", "max")),
        (lambda a, b: torch.count_nonzero(a > 0, 0), ("sum",)),
        (lambda a, b: a.histc(5, -1, 1), ("sum",)),
        (lambda a, b: torch.histogram(a, 4, range=(-1.0, 1.0), weight=b.abs()), ("sum", None)),  # (counts, edges)
        (lambda a, b: torch.histogram(a, EDGES), ("sum", None)),
        (lambda a, b: torch.dist(a, b, 1), (NormPartial(1),)),
        (lambda a, b: torch.dist(a, b), (NormPartial(2),)),
        (lambda a, b: torch.dist(a, b, INFINITY), (NormPartial(INFINITY),)),
        (lambda a, b: torch.dist(a, b, -INFINITY), ("min",)),
        (lambda a, b: aten.norm.ScalarOpt_dim(a, INFINITY, [0]), (NormPartial(INFINITY),)),
    ]
    for function, reduce_ops in cases:
        with shardtensor.strict_mode(), comm.observe() as records:
            results = _values(function(x, y))
        assert list(records) == []  # Partial(max)/(min) wait until the value is asked for
        for result, reference, reduce_op in zip(results, _values(function(full, full.flip(1))), reduce_ops):
            if mesh.size() > 1:
                assert result.placements == (Replicate() if reduce_op is None else _partial(reduce_op),) * mesh.ndim
            torch.testing.assert_close(result.full_tensor(), reference)


EDGES = torch.tensor([-2.0, -0.5, 0.0, 0.1, 3.0], dtype=torch.float64)


@spmd()
def test_equal_and_allclose_give_every_rank_the_same_answer(mesh):
    full = torch.randn(5, 3, dtype=torch.float64)
    different = full.clone()
    different[4, 2] += 1e-3  # on the last shard only: the other ranks' shards agree
    for placements in ([Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim):
        x, y = (distribute_tensor(t, mesh, placements) for t in (full, different))
        same = distribute_tensor(full.clone(), mesh, placements)
        with shardtensor.strict_mode(), comm.observe() as records:
            answers = [torch.equal(x, same), torch.equal(x, y), torch.allclose(x, y), torch.allclose(x, y, atol=1e-2),
                       torch.equal(x, x[:4])]
        assert answers == [True, False, False, True, False]
        sharded = placements[0] != Replicate() and mesh.size() > 1
        assert [record.kind for record in records] == (["all_reduce"] * 4 if sharded else [])
