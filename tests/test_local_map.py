"""local_map against the single-device results of PyTorch's documented examples, on 1, 2, 4 and 2x2 ranks."""

import pytest
import torch
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.experimental import local_map

MESHES = [(1,), (2,), (4,), (2, 2)]


def _every_mesh_dim(mesh):
    return tuple(range(mesh.ndim))


def mm_allreduce_forward(device_mesh, W, X):
    """The docs' example: a local matmul of the contraction dim's pieces, then the sum over ranks."""
    partial_sum_tensor = torch.mm(W, X)
    return comm.all_reduce(partial_sum_tensor, device_mesh, _every_mesh_dim(device_mesh), reduce_op="sum")


def mm_forward(W, X):
    return torch.mm(W, X)


def mul_forward(X, scalar):
    return X * scalar


@spmd(meshes=MESHES)
def test_mm_allreduce_forward_as_in_the_docs(mesh):
    torch.manual_seed(0)
    W, X = torch.randn(12, 8), torch.randn(8, 16)
    col_wise, row_wise = [Shard(1)] * mesh.ndim, [Shard(0)] * mesh.ndim
    local_mm_allreduce_forward = local_map(
        mm_allreduce_forward,
        out_placements=[Replicate()] * mesh.ndim,
        in_placements=(None, col_wise, row_wise),
        device_mesh=mesh,
    )
    W_dt, X_dt = distribute_tensor(W, mesh, col_wise), distribute_tensor(X, mesh, row_wise)
    with CommDebugMode() as mode:
        Y_dt = local_mm_allreduce_forward(mesh, W_dt, X_dt)
    assert isinstance(Y_dt, DTensor) and Y_dt.placements == (Replicate(),) * mesh.ndim
    assert mode.get_comm_counts() == ({} if mesh.size() == 1 else {"all_reduce": 1})
    assert_close(Y_dt.to_local(), torch.mm(W, X))


@spmd(meshes=MESHES)
def test_mismatched_placements_raise_unless_redistributing(mesh):
    torch.manual_seed(1)
    W, X = torch.randn(12, 8), torch.randn(8, 16)
    replicate, row_wise = [Replicate()] * mesh.ndim, [Shard(0)] * mesh.ndim
    W_dt, X_dt = distribute_tensor(W, mesh, replicate), distribute_tensor(X, mesh, replicate)
    strict = local_map(mm_forward, out_placements=row_wise, in_placements=(row_wise, replicate))
    with pytest.raises(ValueError, match=r"argument 0 has placements .* redistribute_inputs=True"):
        strict(W_dt, X_dt)
    moving = local_map(mm_forward, out_placements=row_wise, in_placements=(row_wise, replicate), redistribute_inputs=True)
    with CommDebugMode() as mode:
        Y_dt = moving(W_dt, X_dt)
    # Replicate -> Shard is a local slice; the Shard output's exact sizes cost one exchange of local
    # shapes (one all_gather of fixed-size records over the whole mesh, which spans the world).
    assert mode.get_comm_counts() == ({"all_gather": 1} if mesh.size() > 1 else {})
    assert Y_dt.placements == tuple(row_wise)
    assert_close(Y_dt.full_tensor(), W @ X)


@spmd(meshes=[(2,), (4,)])
def test_uneven_shard_outputs_are_exact(mesh):
    torch.manual_seed(2)
    W, X = torch.randn(5, 3), torch.randn(3, 4)  # 5 rows over 2 or 4 ranks: uneven, one rank may hold none
    W_dt, X_dt = distribute_tensor(W, mesh, [Shard(0)]), distribute_tensor(X, mesh, [Replicate()])
    local_mm = local_map(mm_forward, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]))
    with CommDebugMode() as mode:
        Y_dt = local_mm(W_dt, X_dt)
    assert Y_dt.sharding.pieces[0] == W_dt.sharding.pieces[0]
    assert mode.get_comm_counts() == {"all_gather": 1}  # the local shapes: exact sizes
    assert_close(Y_dt.full_tensor(), W @ X)
    even = local_map(mm_forward, out_placements=[Shard(0)], out_shard_sizes="chunk")
    W_even = distribute_tensor(torch.randn(4 * mesh.size(), 3), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        Y_even = even(W_even, X_dt)
    assert mode.get_total_counts() == 0
    assert_close(Y_even.full_tensor(), W_even.full_tensor() @ X)


@spmd(meshes=MESHES)
def test_non_tensor_arguments_and_outputs_pass_through(mesh):
    row_wise = [Shard(0)] * mesh.ndim
    X = torch.arange(8.0 * mesh.size()).reshape(2 * mesh.size(), 4)
    X_dt = distribute_tensor(X, mesh, row_wise)
    local_mul = local_map(mul_forward, out_placements=row_wise, in_placements=(row_wise, None))
    assert_close(local_mul(X_dt, 3.0).full_tensor(), X * 3.0)
    with pytest.raises(ValueError, match=r"argument 1 is a float, not a tensor, but in_placements\[1\]"):
        local_map(mul_forward, out_placements=row_wise, in_placements=(row_wise, row_wise))(X_dt, 3.0)

    def count_rows(X, offset):
        return X * 1, X.shape[0] + offset

    local_count = local_map(count_rows, out_placements=(row_wise, None), in_placements=(row_wise, None))
    Y_dt, rows = local_count(X_dt, 100)
    assert rows == X_dt.to_local().shape[0] + 100
    assert_close(Y_dt.full_tensor(), X)
    # Without DTensor arguments the function runs as is, even with a device_mesh given.
    assert_close(local_mul(X, 2.0), X * 2.0)
    on_mesh = local_map(mul_forward, out_placements=row_wise, device_mesh=mesh)
    assert type(on_mesh(X, 2.0)) is torch.Tensor
    # A plain tensor argument passes through even when in_placements names placements for it.
    plain = local_map(mm_forward, out_placements=row_wise, in_placements=(row_wise, row_wise))
    assert_close(plain(X_dt, torch.eye(4)).full_tensor(), X)


@spmd(meshes=[(2,), (2, 2)])
def test_as_a_decorator(mesh):
    replicate = [Replicate()] * mesh.ndim

    @local_map(out_placements=replicate, in_placements=(None, [Shard(1)] * mesh.ndim, [Shard(0)] * mesh.ndim))
    def decorated(device_mesh, W, X):
        return mm_allreduce_forward(device_mesh, W, X)

    torch.manual_seed(3)
    W, X = torch.randn(6, 8), torch.randn(8, 4)
    Y_dt = decorated(mesh, distribute_tensor(W, mesh, [Shard(1)] * mesh.ndim), distribute_tensor(X, mesh, [Shard(0)] * mesh.ndim))
    assert decorated.__name__ == "decorated"
    assert_close(Y_dt.full_tensor(), W @ X)


@spmd(meshes=MESHES)
def test_backward_reads_gradients_with_in_grad_placements(mesh):
    """Rows of X on each rank, W replicated: each rank's local gradient of W is its rows' share, a Partial
    sum, reduced when backward ends so that W's `.grad` is Replicate like W."""
    torch.manual_seed(4)
    X, W = torch.randn(4 * mesh.size(), 3), torch.randn(3, 5)
    row_wise, replicate = [Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim
    X_dt = distribute_tensor(X, mesh, row_wise).requires_grad_()
    W_dt = distribute_tensor(W, mesh, replicate).requires_grad_()
    local_mm = local_map(
        mm_forward, out_placements=row_wise, in_placements=(row_wise, replicate),
        in_grad_placements=(row_wise, [Partial()] * mesh.ndim),
    )
    grad = torch.randn(4 * mesh.size(), 5)
    local_mm(X_dt, W_dt).backward(distribute_tensor(grad, mesh, row_wise))
    X_ref, W_ref = X.clone().requires_grad_(), W.clone().requires_grad_()
    (X_ref @ W_ref).backward(grad)
    assert_close(X_dt.grad.full_tensor(), X_ref.grad)
    assert (X_dt.grad.placements, W_dt.grad.placements) == (tuple(row_wise), tuple(replicate))
    assert_close(W_dt.grad.to_local(), W_ref.grad)


@spmd(meshes=[(2,)])
def test_bad_calls_raise_on_every_rank(mesh):
    X_dt = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="in_placements has 1 entries but the call has 2 flattened arguments"):
        local_map(mul_forward, out_placements=[Shard(0)], in_placements=([Shard(0)],))(X_dt, 2.0)
    with pytest.raises(ValueError, match=r"in_placements\[0\] is None"):
        local_map(mul_forward, out_placements=[Shard(0)], in_placements=(None, None))(X_dt, 2.0)
    with pytest.raises(ValueError, match="func returned a DTensor"):
        local_map(lambda x: X_dt, out_placements=[Shard(0)])(X_dt)
    with pytest.raises(ValueError, match="func returned 1 flattened outputs but out_placements gives 2"):
        local_map(lambda x: x, out_placements=([Shard(0)], [Shard(0)]))(X_dt)
    with pytest.raises(ValueError, match="out_placements=.* is not understood"):
        local_map(mm_forward, out_placements=Shard(0))
    with pytest.raises(ValueError, match="out_shard_sizes='even' is not understood"):
        local_map(mm_forward, out_placements=[Shard(0)], out_shard_sizes="even")
