"""Regressions for silent wrong gradients the OpInfo sweep found (issue 3).

Root cause: `diagonal` had no rule, so the replicate fallback returned a gathered copy instead of a
view; the backward of `linalg.qr` (and `householder_product`) halves that diagonal in place, and the
write never reached the gradient. `diagonal` now runs on the local shard and returns a view.
"""

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

MESHES = [(1,), (4,), (2, 2)]
DIAGONAL_CASES = [(0, 0, 1), (2, 0, 1), (-1, 0, 1), (1, 1, 0), (0, 0, 2), (-1, 2, 1)]


def _placements(mesh, first: int, second: int):
    """Shard(first) on mesh dim 0, then Shard(second) (2-D meshes), as the failing sweep samples did."""
    return [Shard(first)] + [Shard(second)] * (mesh.ndim - 1)


@pytest.mark.parametrize("sharded_dims", [(0, 0), (1, 1), (2, 0), (0, 2)])
@spmd(meshes=MESHES)
def test_diagonal_is_a_local_view(mesh, sharded_dims):
    full = torch.randn(5, 6, 7)
    x = distribute_tensor(full, mesh, _placements(mesh, *sharded_dims))
    for offset, dim1, dim2 in DIAGONAL_CASES:
        with shardtensor.strict_mode(), comm.observe() as records:
            result = x.diagonal(offset, dim1, dim2)
        # Rows and columns of the diagonal both sharded: one of them is gathered first.
        if not {dim1 % 3, dim2 % 3} <= set(sharded_dims[: mesh.ndim]):
            assert list(records) == []
            assert result.to_local().untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr()
        assert torch.equal(result.full_tensor(), full.diagonal(offset, dim1, dim2))


def _halve_diagonal(mesh, sharded_dims):
    """The pattern of the qr backward: `grad.diagonal(...).mul_(0.5)` must change `grad`."""
    full = torch.randn(5, 5)
    x = distribute_tensor(full, mesh, _placements(mesh, *sharded_dims))
    expected = full.clone()
    expected.diagonal(1).mul_(0.5)
    x.diagonal(1).mul_(0.5)
    assert torch.equal(x.full_tensor(), expected)


@pytest.mark.parametrize("sharded_dims", [(0, 0), (1, 1), (0, 1)])
@spmd(meshes=[(4,), (2, 2)])
def test_writing_through_a_diagonal_reaches_the_tensor(mesh, sharded_dims):
    """On (2, 2), (0, 1) shards rows and columns: one diagonal dim is gathered first, so the
    diagonal is a view of a copy and writing into it raises instead of being silently lost."""
    if sharded_dims == (0, 1) and mesh.ndim == 2:
        x = distribute_tensor(torch.randn(5, 5), mesh, _placements(mesh, *sharded_dims))
        with pytest.raises(RuntimeError, match="view of a redistributed copy"):
            x.diagonal(1).mul_(0.5)
    else:
        _halve_diagonal(mesh, sharded_dims)


@pytest.mark.parametrize("dim", [0, 1])
@spmd(meshes=MESHES)
def test_diagonal_backward(mesh, dim):
    full = torch.randn(4, 6, requires_grad=True)
    x = distribute_tensor(full.detach(), mesh, [Shard(dim)] * mesh.ndim).requires_grad_()
    weight = torch.randn(4)
    result = x.diagonal(-1)
    (result * distribute_tensor(weight[:3], mesh, [Replicate()] * mesh.ndim)).sum().backward()
    (full.diagonal(-1) * weight[:3]).sum().backward()
    assert torch.equal(result.full_tensor(), full.diagonal(-1))
    assert torch.equal(x.grad.full_tensor(), full.grad)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(5, 5), (6, 4)])
@spmd(meshes=MESHES)
def test_linalg_qr_backward(mesh, dim, shape):
    full = torch.randn(*shape, requires_grad=True)
    x = distribute_tensor(full.detach(), mesh, [Shard(dim)] * mesh.ndim).requires_grad_()
    grad_q, grad_r = torch.randn_like(full), torch.randn(shape[1], shape[1]).triu()
    grad_r = grad_r[: min(shape), :]
    q, r = torch.linalg.qr(x)
    replicate = [Replicate()] * mesh.ndim
    torch.autograd.backward((q, r), (distribute_tensor(grad_q[:, : q.shape[1]].contiguous(), mesh, replicate),
                                     distribute_tensor(grad_r, mesh, replicate)))
    expected_q, expected_r = torch.linalg.qr(full)
    torch.autograd.backward((expected_q, expected_r), (grad_q[:, : q.shape[1]].contiguous(), grad_r))
    torch.testing.assert_close(q.full_tensor(), expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.full_tensor(), expected_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.full_tensor(), full.grad, rtol=1e-4, atol=1e-4)
