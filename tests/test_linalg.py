"""Batched linear algebra on DTensors: batch-sharded solves, factorizations and decompositions run
locally (no collectives), forward and backward equal one device, and data-dependent errors are
raised by every rank alike instead of leaving some ranks hanging."""

import warnings

import pytest
import torch
from helpers import partial_and_value
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.ops.linalg import BatchedLinalgRule
from shardtensor.rules import OpCall, TensorMeta

R = Replicate()
linalg = torch.linalg


def _inputs():
    """A batch of 3 (uneven on 2 and 4 ranks): a well-conditioned square A, a right-hand side B,
    a symmetric positive definite S, an upper triangular U."""
    a = torch.randn(3, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b = torch.randn(3, 4, 2, dtype=torch.float64)
    s = a @ a.mT + torch.eye(4, dtype=torch.float64)
    return {"A": a, "B": b, "S": s, "U": a.triu()}


# name -> (function of the leaves, forward needs the `info` gather of `_linalg_check_errors`)
CASES = {
    "solve": (lambda t: linalg.solve(t["A"], t["B"]), True),
    "solve_ex_vector": (lambda t: linalg.solve_ex(t["A"], t["B"][..., 0]).result, False),
    "solve_triangular": (lambda t: linalg.solve_triangular(t["U"], t["B"], upper=True), False),
    "lu_factor_then_lu_solve": (lambda t: linalg.lu_solve(*linalg.lu_factor_ex(t["A"])[:2], t["B"]), False),
    "lu": (lambda t: sum(factor.sum((-2, -1)) for factor in linalg.lu(t["A"])), False),
    "lu_unpack": (lambda t: torch.lu_unpack(*linalg.lu_factor_ex(t["A"])[:2])[2], False),
    "inv_ex": (lambda t: linalg.inv_ex(t["A"]).inverse, False),
    "inv": (lambda t: linalg.inv(t["A"]), True),
    "cholesky": (lambda t: linalg.cholesky(t["S"]), True),
    "cholesky_solve": (lambda t: torch.cholesky_solve(t["B"], linalg.cholesky_ex(t["S"]).L), False),
    "triangular_solve": (lambda t: torch.triangular_solve(t["B"], t["U"]).solution, False),
    "eigvalsh": (lambda t: linalg.eigvalsh(t["S"]), False),
    "eigvals": (lambda t: linalg.eigvals(t["A"].detach()).abs(), False),  # backward needs _conj (no rule yet)
    "svdvals": (lambda t: linalg.svdvals(t["A"]), False),
    "pinv": (lambda t: linalg.pinv(t["A"]), False),
    "det": (lambda t: linalg.det(t["A"]), False),
    "matrix_exp": (lambda t: linalg.matrix_exp(t["A"] / 8), False),
    "qr": (lambda t: linalg.qr(t["A"]).R, False),
    "householder_product": (lambda t: linalg.householder_product(t["A"][..., :3], t["B"][..., :3, 0]), False),
    "ldl_factor_then_ldl_solve": (  # ldl has no derivatives: forward only
        lambda t: linalg.ldl_solve(*linalg.ldl_factor_ex(t["S"].detach())[:2], t["B"].detach()), False),
}


@spmd()
def test_batch_sharded_linalg_is_local_and_matches_one_device(mesh):
    for name, (function, gathers_info) in CASES.items():
        try:
            _check_batch_sharded(mesh, function, gathers_info)
        except Exception as error:
            raise AssertionError(f"case {name!r} on mesh {tuple(mesh.shape)}: {error}") from error


def _check_batch_sharded(mesh, function, gathers_info):
    fulls = _inputs()
    leaves = {key: distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim).requires_grad_()
              for key, full in fulls.items()}
    references = {key: full.clone().requires_grad_() for key, full in fulls.items()}
    with shardtensor.strict_mode(), comm.observe() as records:
        result = function(leaves)
    assert {record.kind for record in records} <= ({"all_gather"} if gathers_info else set())
    if mesh.size() > 1:
        assert gathers_info == bool(records)  # the gather is of `info`, a few ints
        assert all(record.bytes_received <= 3 * 4 for record in records)
    expected = function(references)
    assert result.placements == (Shard(0),) * mesh.ndim
    assert_close(result.full_tensor(), expected)
    if not expected.requires_grad:
        return
    with shardtensor.strict_mode():
        result.sum().backward()
    expected.sum().backward()
    for key, leaf in leaves.items():
        if references[key].grad is None:
            assert leaf.grad is None
        else:
            assert_close(leaf.grad.full_tensor(), references[key].grad)


@spmd()
def test_a_singular_matrix_raises_on_every_rank(mesh):
    """`linalg.inv` checks `info` after the local factorization: every rank sees all of it and raises
    the single-device error (naming the global batch element), none is left waiting."""
    full = torch.randn(3, 4, 4, dtype=torch.float64)
    full = full @ full.mT + torch.eye(4, dtype=torch.float64)  # positive definite, but for the last one
    full[2] = 0
    matrices = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with shardtensor.strict_mode():
        with pytest.raises(RuntimeError, match=r"linalg.inv: \(Batch element 2\)"):
            linalg.inv(matrices)
        with pytest.raises(RuntimeError, match=r"linalg.inv_ex: \(Batch element 2\)"):
            linalg.inv_ex(matrices, check_errors=True)  # the kernel checks: computed on every rank
        with pytest.raises(RuntimeError, match=r"cholesky_inverse: \(Batch element 2\)"):
            torch.cholesky_inverse(matrices)  # ditto: its kernel checks the data (message of torch 2.13 and 2.14)
        if hasattr(torch.ops.aten, "cholesky"):  # torch 2.13; torch 2.14 removed the op (torch.cholesky raises at once)
            with warnings.catch_warnings(), pytest.raises(RuntimeError, match=r"^cholesky: \(Batch element 2\)"):
                warnings.simplefilter("ignore")  # torch.cholesky is deprecated (warned once per process)
                torch.cholesky(matrices)  # the deprecated `cholesky` checks in its kernel too
    inverse, info = linalg.inv_ex(matrices)  # no check: local, and the info says which one failed
    assert info.full_tensor().tolist() == [0, 0, 1]
    assert comm.all_reduce(torch.ones(1), mesh, 0, reduce_op="sum").item() == mesh.size(0)  # all ranks still in step


@spmd()
def test_batch_dims_broadcast_and_uneven_nested_shards(mesh):
    """A's batch (2, 3) broadcasts against B's (3,) and C's (1, 3): each shards where it spans the
    output's batch dim, and is Replicate where it broadcasts."""
    a_full = torch.randn(2, 3, 4, 4, dtype=torch.float64) + 4 * torch.eye(4, dtype=torch.float64)
    b_full, c_full = torch.randn(3, 4, 2, dtype=torch.float64), torch.randn(1, 3, 4, 2, dtype=torch.float64)
    if mesh.ndim == 1:
        a_placements, b_placements, c_placements = [Shard(1)], [Shard(0)], [Shard(1)]
    else:
        a_placements, b_placements, c_placements = [Shard(0), Shard(1)], [R, Shard(0)], [R, Shard(1)]
    a, b, c = (distribute_tensor(full, mesh, placements).requires_grad_() for full, placements in
               ((a_full, a_placements), (b_full, b_placements), (c_full, c_placements)))
    references = [full.clone().requires_grad_() for full in (a_full, b_full, c_full)]
    with shardtensor.strict_mode(), comm.observe() as records:
        result = linalg.solve_triangular(a, b, upper=False) + linalg.solve_ex(a, c).result
    assert list(records) == [] and result.placements == tuple(a_placements)
    expected = (linalg.solve_triangular(references[0], references[1], upper=False)
                + linalg.solve_ex(references[0], references[2]).result)
    assert_close(result.full_tensor(), expected)
    with shardtensor.strict_mode():
        result.sum().backward()
    expected.sum().backward()
    for leaf, reference in zip((a, b, c), references):
        assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_a_partial_right_hand_side_stays_partial(mesh):
    """Solves are linear in the right-hand side: a Partial(sum) one gives a Partial(sum) solution
    without reducing it first."""
    triangular = torch.randn(4, 4, dtype=torch.float64).triu() + 4 * torch.eye(4, dtype=torch.float64)
    matrix = distribute_tensor(triangular, mesh, [R] * mesh.ndim)
    right_hand_side, right_hand_side_full = partial_and_value(mesh, (4, 3), seed=1)
    with shardtensor.strict_mode(), comm.observe() as records:
        solution = linalg.solve_triangular(matrix, right_hand_side, upper=True)
    assert list(records) == [] and solution.placements == (Partial(),) * mesh.ndim
    assert_close(solution.full_tensor(), linalg.solve_triangular(triangular, right_hand_side_full, upper=True))


def test_rows_follow_the_core_dims_table():
    """lu_solve(LU (2, 3, 4, 4), pivots (2, 3, 4), B (3, 4, 1)): B broadcasts along batch dim 0."""
    rule = BatchedLinalgRule((2, 1, 2), linear_in=2)
    metas = (TensorMeta((2, 3, 4, 4), (48, 16, 4, 1), torch.float64), TensorMeta((2, 3, 4), (12, 4, 1), torch.int32),
             TensorMeta((3, 4, 1), (4, 1, 1), torch.float64))
    call = OpCall(torch.ops.aten.linalg_lu_solve.default, metas, metas, ())
    assert [str(row) for row in rule.rows(call)] == [
        "[R <- R, R, R]", "[S(0) <- S(0), S(0), R]", "[S(1) <- S(1), S(1), S(0)]", "[P(sum) <- R, R, P(sum)]",
    ]
