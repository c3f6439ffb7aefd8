"""Regressions for silent wrong gradients the OpInfo sweep found (issue 3).

`diagonal` had no rule, so the replicate fallback returned a gathered copy instead of a view; the
backward of `linalg.qr` (and `householder_product`) halves that diagonal in place, and the write
never reached the gradient. `diagonal` now runs on the local shard and returns a view.

Plain tensors an op writes to (`out=` buffers and `+=` accumulators that a backward formula such as
chunked `linear_cross_entropy(reduction='none')`'s allocates with `torch.empty`): dispatch made
them Replicate DTensors but tracked writes on the original arguments, so when the rule computed in
another layout (a Shard(1) `out=`) the result stayed in a moved copy and the buffer kept its
uninitialized, rank-dependent values. A 0-d plain accumulator got this rank's partial sum.
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
    diagonal is a view of a copy, whose write is stored back into the tensor."""
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


class _ThroughPlainBuffers(torch.autograd.Function):
    """`x * w`, whose backward writes into plain buffers the way chunked loss kernels do."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = torch.empty(grad.shape)  # uninitialized: differs between ranks until written
        torch.mul(grad, w, out=grad_x)
        grad_w = torch.zeros(w.shape)
        grad_w.add_((grad * x).sum(0))  # a partial sum when x is sharded on dim 0
        total = torch.zeros(())
        total.add_((grad * x).sum())
        return torch.zeros_like(x) + grad_x, torch.zeros_like(w) + grad_w + total


@pytest.mark.parametrize("dim", [0, 1])
@spmd(meshes=[(1,), (4,), (2, 2)])
def test_plain_buffers_written_in_backward(mesh, dim):
    """Values of a plain `out=`/in-place buffer are the single-device ones on every rank."""
    full_x, full_w = torch.randn(3, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    x = distribute_tensor(full_x.detach(), mesh, [Shard(dim)] * mesh.ndim).requires_grad_()
    w = distribute_tensor(full_w.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_()
    (_ThroughPlainBuffers.apply(x, w) * 1.5).sum().backward()
    (_ThroughPlainBuffers.apply(full_x, full_w) * 1.5).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), full_x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.full_tensor(), full_w.grad, rtol=1e-6, atol=1e-6)


@spmd(meshes=[(4,), (2, 2)])
def test_plain_scalar_accumulator_gets_the_full_sum(mesh):
    """`total.add_(x.sum())` with a plain 0-d `total` and a Partial sum: the full sum, every rank."""
    full = torch.randn(7, 3)
    x = distribute_tensor(full, mesh, [Shard(0)] + [Shard(1)] * (mesh.ndim - 1))
    total = torch.zeros(())
    total.add_(x.sum())
    torch.testing.assert_close(total, full.sum(), rtol=1e-6, atol=1e-6)
    out = torch.empty(())
    torch.sum(x, dim=(0, 1), out=out)
    torch.testing.assert_close(out, full.sum(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shapes", [((3,), ()), ((8, 3), (8,))])
@spmd(meshes=[(4,), (2, 2)])
def test_linear_cross_entropy_chunked_none_gradient(mesh, shapes):
    """The sweep case: chunked reduction='none' loss with the input sharded on dim 0."""
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    input_shape, target_shape = shapes
    options = LinearCrossEntropyOptions(allow_retain_graph=False, batch_chunk_size=2)
    full_input, full_weight = torch.randn(*input_shape, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    target = torch.randint(0, 4, target_shape)
    replicate = [Replicate()] * mesh.ndim
    x = distribute_tensor(full_input.detach(), mesh, [Shard(0)] * mesh.ndim).requires_grad_()
    weight = distribute_tensor(full_weight.detach(), mesh, replicate).requires_grad_()
    loss = torch.nn.functional.linear_cross_entropy(
        x, weight, distribute_tensor(target, mesh, replicate), reduction="none", options=options
    )
    loss.sum().backward()
    expected = torch.nn.functional.linear_cross_entropy(full_input, full_weight, target, reduction="none", options=options)
    expected.sum().backward()
    torch.testing.assert_close(loss.full_tensor(), expected, rtol=1e-5, atol=1e-5)
    # The kernel's backward allocates its gradients with torch.empty, so autograd may hand back plain
    # tensors; their values must still be the single-device ones on every rank.
    for gradient, expected_gradient in ((x.grad, full_input.grad), (weight.grad, full_weight.grad)):
        if isinstance(gradient, shardtensor.DTensor):
            gradient = gradient.full_tensor()
        torch.testing.assert_close(gradient, expected_gradient, rtol=1e-5, atol=1e-5)


class _FrexpOutRule(shardtensor.rules.ShardingRule):
    """frexp.Tensor_out elementwise: its two tensor keywords (`mantissa`, `exponent`) are not in sorted order."""

    def __init__(self, with_local_arguments: bool):
        self.with_local_arguments = with_local_arguments

    def rows(self, call):
        from shardtensor.rules import Row

        dims = range(call.inputs[0].ndim)
        return [Row((Shard(dim),) * 2, (Shard(dim),) * 3) for dim in dims] + [Row((Replicate(),) * 2, (Replicate(),) * 3)]

    def local_arguments(self, call, input_layouts, coordinate):
        return (call.args, dict(call.kwargs)) if self.with_local_arguments else None


@pytest.mark.parametrize("with_local_arguments", [False, True])
@spmd(meshes=[(1,), (4,), (2, 2)])
def test_tensor_keywords_reach_the_local_op_by_name(mesh, with_local_arguments):
    """Two tensor keyword arguments whose names are not in sorted order, through a rule with and
    without local arguments (`_local_flat`, plans and the per-coordinate meta evaluation)."""
    from shardtensor import propagation
    from shardtensor.ops.registry import RULES

    op = torch.ops.aten.frexp.Tensor_out
    previous = RULES.get(op)
    RULES[op] = _FrexpOutRule(with_local_arguments)
    propagation.clear_cache()
    try:
        full = torch.randn(6, 5) * 100
        placements = [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)
        x = distribute_tensor(full, mesh, placements)
        mantissa = distribute_tensor(torch.zeros(6, 5), mesh, placements)
        exponent = distribute_tensor(torch.zeros(6, 5, dtype=torch.int32), mesh, placements)
        for _ in range(2):  # the second call runs the cached plan
            with shardtensor.strict_mode(), comm.observe() as records:
                torch.frexp(x, out=(mantissa, exponent))
            assert list(records) == []
            expected_mantissa, expected_exponent = torch.frexp(full)
            assert torch.equal(mantissa.full_tensor(), expected_mantissa)
            assert torch.equal(exponent.full_tensor(), expected_exponent)
    finally:
        if previous is None:
            del RULES[op]
        else:
            RULES[op] = previous
        propagation.clear_cache()


@pytest.mark.parametrize("dim", [0, 1])
@spmd(meshes=[(4,), (2, 2)])
def test_writes_through_an_unsafe_view_are_not_lost(mesh, dim):
    """`_unsafe_view` aliases its input without saying so in its schema (`kron(out=)` writes through
    it): a write into it reaches the tensor, also when the view had to move its input (through the copy)."""
    full = torch.randn(4, 6)
    x = distribute_tensor(full, mesh, [Shard(dim)] * mesh.ndim)
    flat = torch.ops.aten._unsafe_view(x, [24])
    flat.mul_(2)
    assert torch.equal(x.full_tensor(), full * 2)
