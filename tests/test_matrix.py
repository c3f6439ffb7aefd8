"""Matrix products on DTensors: einsum-spec rules for mm, bmm, mv, dot, vdot, addmm, addmv, addr,
addbmm, baddbmm (and the matmul / linear / einsum calls that decompose into them), forward and
backward against one device."""

import pytest
import torch
import torch.nn.functional as F
from helpers import partial_and_value, partial_of, torch_collectives, torch_mesh
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.dispatch import fallback_counts
from shardtensor.ops.matrix import einsum_rows

MATRIX_OPS = ("aten.mm.default", "aten.bmm.default", "aten.mv.default", "aten.dot.default",
              "aten.addmm.default", "aten.baddbmm.default")
R, P = Replicate(), Partial()


def _fallbacks() -> dict:
    return {name: fallback_counts[name] for name in MATRIX_OPS}


def _leaf(full: torch.Tensor, mesh, placement) -> DTensor:
    """`full` distributed with `placement` on every mesh dim; a Partial(sum) holds different operands on
    every rank that add up to `full`."""
    if isinstance(placement, Partial):
        return partial_of(full, mesh, seed=1)
    return distribute_tensor(full.clone().requires_grad_(), mesh, [placement] * mesh.ndim)


def test_einsum_rows_follow_the_spec():
    assert [str(row) for row in einsum_rows("mk,kn->mn")] == [
        "[R <- R, R]", "[S(0) <- S(0), R]", "[P(sum) <- S(1), S(0)]", "[S(1) <- R, S(1)]",
        "[P(sum) <- P(sum), R]", "[P(sum) <- R, P(sum)]", "[P(avg) <- P(avg), R]", "[P(avg) <- R, P(avg)]",
    ]
    assert "[S(0) <- S(0), S(0)]" in [str(row) for row in einsum_rows("bmk,bkn->bmn")]


MM_CASES = [  # (a, b, output placement, collectives in the op)
    (Shard(0), R, Shard(0), 0),  # row-sharded activations, replicated weight
    (R, Shard(1), Shard(1), 0),  # column-sharded weight
    (Shard(1), Shard(0), P, 0),  # contraction sharded: partial sums, no communication yet
    (P, R, P, 0),  # linear in a
    (R, R, R, 0),
]


@pytest.mark.parametrize("case", range(len(MM_CASES)))
@spmd()
def test_mm_rows_are_chosen_without_communication(mesh, case):
    a_placement, b_placement, expected, _ = MM_CASES[case]
    a_full, b_full = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    a, b = _leaf(a_full, mesh, a_placement), _leaf(b_full, mesh, b_placement)
    with shardtensor.strict_mode(), comm.observe() as records:
        product = torch.mm(a, b)
    assert list(records) == []
    if mesh.size() > 1:
        assert product.placements == (expected,) * mesh.ndim
    torch.testing.assert_close(product.full_tensor(), a_full @ b_full)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_mm_backward_and_partial_operands(mesh):
    a_full, b_full = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    before = _fallbacks()
    a, b = _leaf(a_full, mesh, Shard(1)), _leaf(b_full, mesh, Shard(0))
    (torch.mm(a, b) * 2).sum().backward()
    reference_a, reference_b = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    (torch.mm(reference_a, reference_b) * 2).sum().backward()
    torch.testing.assert_close(a.grad.full_tensor(), reference_a.grad)
    torch.testing.assert_close(b.grad.full_tensor(), reference_b.grad)
    partial_a, partial_b = _leaf(a_full, mesh, P), _leaf(b_full, mesh, P)  # both Partial: one must be reduced
    with shardtensor.strict_mode(), comm.observe() as records:
        product = torch.mm(partial_a, partial_b)
    assert records and {record.kind for record in records} == {"all_reduce"}  # one operand reduced, no gather
    torch.testing.assert_close(product.full_tensor(), a_full @ b_full)
    assert _fallbacks() == before


@spmd(meshes=[(2, 2)])
def test_mm_on_a_2d_mesh_mixes_rows_per_mesh_dim(mesh):
    a_full, b_full = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    a = distribute_tensor(a_full, mesh, [Shard(0), Shard(1)])
    b = distribute_tensor(b_full, mesh, [R, Shard(0)])
    with shardtensor.strict_mode(), comm.observe() as records:
        product = torch.mm(a, b)
    assert list(records) == [] and product.placements == (Shard(0), P)
    torch.testing.assert_close(product.full_tensor(), a_full @ b_full)


BATCHED_CASES = [  # (batch1, batch2, output)
    (Shard(0), Shard(0), Shard(0)),  # batch
    (Shard(1), R, Shard(1)),
    (R, Shard(2), Shard(2)),
    (Shard(2), Shard(1), P),  # contraction
]


@pytest.mark.parametrize("case", range(len(BATCHED_CASES)))
@spmd()
def test_bmm_and_baddbmm_forward_and_backward(mesh, case):
    first_placement, second_placement, expected = BATCHED_CASES[case]
    first_full, second_full = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 6, 3, dtype=torch.float64)
    addend_full = torch.randn(5, 3, dtype=torch.float64)  # broadcast over the batch
    first, second = _leaf(first_full, mesh, first_placement), _leaf(second_full, mesh, second_placement)
    addend = _leaf(addend_full, mesh, R)
    before = _fallbacks()
    with shardtensor.strict_mode(), comm.observe() as records:
        product = torch.bmm(first, second)
        fused = torch.baddbmm(addend, first, second, beta=0.5, alpha=2.0)
    assert list(records) == []
    if mesh.size() > 1:
        assert product.placements == (expected,) * mesh.ndim and fused.placements == product.placements
    torch.testing.assert_close(product.full_tensor(), torch.bmm(first_full, second_full))
    torch.testing.assert_close(fused.full_tensor(), torch.baddbmm(addend_full, first_full, second_full, beta=0.5, alpha=2.0))
    (product.sum() + fused.sum()).backward()
    references = [tensor.clone().requires_grad_() for tensor in (first_full, second_full, addend_full)]
    first_reference, second_reference, addend_reference = references
    fused_reference = torch.baddbmm(addend_reference, first_reference, second_reference, beta=0.5, alpha=2.0)
    (torch.bmm(first_reference, second_reference).sum() + fused_reference.sum()).backward()
    for leaf, reference in zip((first, second, addend), references):
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)
    assert _fallbacks() == before


ADDMM_CASES = [  # (bias shape, bias, a, b, output)
    ((3,), R, Shard(1), Shard(0), P),  # partial product: the bias becomes Partial, added once
    ((5, 3), Shard(0), Shard(0), R, Shard(0)),
    ((1, 3), R, Shard(0), R, Shard(0)),  # bias broadcast along the sharded dim stays Replicate
    ((3,), Shard(0), R, Shard(1), Shard(1)),
]


@pytest.mark.parametrize("case", range(len(ADDMM_CASES)))
@spmd()
def test_addmm_adds_the_bias_once(mesh, case):
    bias_shape, bias_placement, a_placement, b_placement, expected = ADDMM_CASES[case]
    bias_full = torch.randn(bias_shape, dtype=torch.float64)
    a_full, b_full = torch.randn(5, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    bias, a, b = (_leaf(full, mesh, placement) for full, placement in
                  ((bias_full, bias_placement), (a_full, a_placement), (b_full, b_placement)))
    with shardtensor.strict_mode(), comm.observe() as records:
        result = torch.addmm(bias, a, b, beta=1.5)
    assert list(records) == []
    if mesh.size() > 1:
        assert result.placements == (expected,) * mesh.ndim
    torch.testing.assert_close(result.full_tensor(), torch.addmm(bias_full, a_full, b_full, beta=1.5))
    result.sum().backward()
    references = [tensor.clone().requires_grad_() for tensor in (bias_full, a_full, b_full)]
    torch.addmm(*references, beta=1.5).sum().backward()
    for leaf, reference in zip((bias, a, b), references):
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_mv_and_dot_shard_the_contraction_into_partial(mesh):
    matrix_full, vector_full, other_full = (torch.randn(shape, dtype=torch.float64) for shape in ((5, 7), (7,), (7,)))
    before = _fallbacks()
    matrix, vector, other = _leaf(matrix_full, mesh, Shard(1)), _leaf(vector_full, mesh, Shard(0)), _leaf(other_full, mesh, Shard(0))
    with shardtensor.strict_mode(), comm.observe() as records:
        product, inner = torch.mv(matrix, vector), torch.dot(vector, other)
    assert list(records) == []
    if mesh.size() > 1:
        assert product.placements == (P,) * mesh.ndim and inner.placements == (P,) * mesh.ndim
    torch.testing.assert_close(product.full_tensor(), matrix_full @ vector_full)
    torch.testing.assert_close(inner.full_tensor(), vector_full @ other_full)
    (product.sum() + inner * 3).backward()
    references = [tensor.clone().requires_grad_() for tensor in (matrix_full, vector_full, other_full)]
    ((references[0] @ references[1]).sum() + (references[1] @ references[2]) * 3).backward()
    for leaf, reference in zip((matrix, vector, other), references):
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)
    rows = distribute_tensor(matrix_full, mesh, [Shard(0)] * mesh.ndim)
    replicated = distribute_tensor(vector_full, mesh, [R] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        by_rows = torch.mv(rows, replicated)
    assert list(records) == [] and by_rows.placements == (Shard(0),) * mesh.ndim
    torch.testing.assert_close(by_rows.full_tensor(), matrix_full @ vector_full)
    assert _fallbacks() == before


@spmd()
def test_matmul_linear_and_einsum_use_the_matrix_rules(mesh):
    inputs_full = torch.randn(4, 3, 6, dtype=torch.float64)
    weight_full, bias_full = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    other_full = torch.randn(4, 6, 2, dtype=torch.float64)
    before = _fallbacks()
    inputs = _leaf(inputs_full, mesh, Shard(0))
    weight, bias, other = _leaf(weight_full, mesh, R), _leaf(bias_full, mesh, R), _leaf(other_full, mesh, Shard(0))
    results = [F.linear(inputs, weight, bias), torch.matmul(inputs, weight.t()), torch.einsum("bmk,bkn->bmn", inputs, other),
               torch.matmul(inputs, other)]
    references = [tensor.clone().requires_grad_() for tensor in (inputs_full, weight_full, bias_full, other_full)]
    x, w, b, o = references
    expected = [F.linear(x, w, b), torch.matmul(x, w.t()), torch.einsum("bmk,bkn->bmn", x, o), torch.matmul(x, o)]
    for result, reference in zip(results, expected):
        torch.testing.assert_close(result.full_tensor(), reference)
    sum(result.sum() for result in results).backward()
    sum(reference.sum() for reference in expected).backward()
    for leaf, reference in zip((inputs, weight, bias, other), references):
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)
    assert _fallbacks() == before


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_matmul_with_a_vector_operand_forward_and_backward(mesh):
    """Regression: `matmul(vector, matrix)` is `unsqueeze(0)`, `mm`, then the in-place `squeeze_(0)`; the
    result kept the shape (1, n), so its backward raised in to_local on every rank."""
    for a_shape, b_shape in [((5,), (5, 3)), ((3, 5), (5,)), ((5,), (2, 5, 3)), ((5,), (5,))]:
        for placement in (R, Shard(0)):
            a_full, b_full = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
            a, b = _leaf(a_full, mesh, placement), _leaf(b_full, mesh, placement)
            references = [full.clone().requires_grad_() for full in (a_full, b_full)]
            with shardtensor.strict_mode():
                product = torch.matmul(a, b)
            expected = torch.matmul(*references)
            assert product.shape == expected.shape
            torch.testing.assert_close(product.full_tensor(), expected)
            grad = torch.randn_like(expected)
            with shardtensor.strict_mode():
                product.backward(distribute_tensor(grad, mesh, [R] * mesh.ndim))
            expected.backward(grad)
            for dtensor, reference in zip((a, b), references):
                torch.testing.assert_close(dtensor.grad.full_tensor(), reference.grad)


ADDEND_CASES = [  # (op, shapes of (addend, first, second), their placements, output placement)
    (torch.addmv, ((5,), (5, 6), (6,)), (R, Shard(1), Shard(0)), P),  # contraction sharded: addend made Partial
    (torch.addmv, ((5,), (5, 6), (6,)), (Shard(0), Shard(0), R), Shard(0)),
    (torch.addmv, ((1,), (5, 6), (6,)), (R, Shard(0), R), Shard(0)),  # 4 ranks: a shard without rows
    (torch.addmv, ((), (5, 3), (3,)), (R, Shard(1), Shard(0)), P),  # 4 ranks: a shard without columns
    (torch.addr, ((5, 3), (5,), (3,)), (Shard(0), Shard(0), R), Shard(0)),
    (torch.addr, ((1, 3), (5,), (3,)), (R, Shard(0), R), Shard(0)),  # addend broadcast along the sharded dim
    (torch.addr, ((3,), (5,), (3,)), (Shard(0), R, Shard(0)), Shard(1)),
    (torch.addbmm, ((5, 3), (3, 5, 6), (3, 6, 3)), (R, Shard(0), Shard(0)), P),  # the (uneven) batch is summed
    (torch.addbmm, ((5, 3), (3, 5, 6), (3, 6, 3)), (Shard(0), Shard(1), R), Shard(0)),
]


@spmd()
def test_addmv_addr_addbmm_add_the_addend_once(mesh):
    for function, shapes, placements, expected in ADDEND_CASES:
        fulls = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
        leaves = [_leaf(full, mesh, placement) for full, placement in zip(fulls, placements)]
        with shardtensor.strict_mode(), comm.observe() as records:
            result = function(*leaves, beta=0.5, alpha=2.0)
        assert list(records) == [], function
        if mesh.size() > 1:
            assert result.placements == (expected,) * mesh.ndim, function
        references = [full.clone().requires_grad_() for full in fulls]
        reference = function(*references, beta=0.5, alpha=2.0)
        torch.testing.assert_close(result.full_tensor(), reference)
        with shardtensor.strict_mode():
            (result * 3).sum().backward()
        (reference * 3).sum().backward()
        for leaf, reference_leaf in zip(leaves, references):
            torch.testing.assert_close(leaf.grad.full_tensor(), reference_leaf.grad)


@spmd()
def test_vdot_and_vecdot_shard_the_contraction_into_partial(mesh):
    first_full, second_full = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    first, second = _leaf(first_full, mesh, Shard(0)), _leaf(second_full, mesh, Shard(0))
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [torch.vdot(first, second), torch.linalg.vecdot(first, second)]
    assert list(records) == []
    references = [full.clone().requires_grad_() for full in (first_full, second_full)]
    expected = [torch.vdot(*references), torch.linalg.vecdot(*references)]
    for result, reference in zip(results, expected):
        if mesh.size() > 1:
            assert result.placements == (P,) * mesh.ndim
        torch.testing.assert_close(result.full_tensor(), reference)
    with shardtensor.strict_mode():
        sum(results).backward()
    sum(expected).backward()
    for leaf, reference in zip((first, second), references):
        torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


# name -> the product of an input x (4, 3, 6) and a weight w (5, 6), bias b (5,), on any torch
AVERAGED_PRODUCTS = {
    "mm": lambda x, w, b: torch.mm(x[0], w.t()),
    "matmul": lambda x, w, b: torch.matmul(x, w.t()),
    "einsum": lambda x, w, b: torch.einsum("bmk,nk->bmn", x, w),
    "linear": lambda x, w, b: F.linear(x, w),
    "linear_bias": lambda x, w, b: F.linear(x, w, b),  # matmul, then a Replicate bias added to P(avg): exact
    "addmm": lambda x, w, b: torch.addmm(b, x[0], w.t(), beta=0.5, alpha=2.0),
    "addmm_plain_addend": lambda x, w, b: torch.addmm(torch.tensor(1.5, dtype=torch.float64), x[0], w.t()),
}


@spmd(meshes=[(2,), (2, 2), (2, 2, 2)])
def test_products_keep_a_partial_avg_input(mesh):
    """mm / matmul / einsum / linear (with a bias too) / addmm of a Partial(avg) input and Replicate
    weights are Partial(avg), as for Partial(sum) (linear in the input; a Replicate addend added to
    every operand of an average is added once): no collective in the op, and one all_reduce over the
    whole mesh when the value is read. torch DTensor (the oracle, same operands) also issues none
    in the op and one all_reduce per mesh dim when reading it; ours is lower on 2x2 and 2x2x2. A
    non-linear op after the product (relu) reduces first. The weight's gradient matches one device."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate

    inputs, inputs_value = partial_and_value(mesh, (4, 3, 6), "avg")
    weight_full, bias_full = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    oracle_inputs = TorchDTensor.from_local(inputs.to_local(), torch_mesh(mesh), [TorchPartial("avg")] * mesh.ndim)
    oracle_weight, oracle_bias = (TorchDTensor.from_local(full, torch_mesh(mesh), [TorchReplicate()] * mesh.ndim)
                                  for full in (weight_full, bias_full))
    for name, product in AVERAGED_PRODUCTS.items():
        weight, bias = _leaf(weight_full, mesh, R), _leaf(bias_full, mesh, R)
        with shardtensor.strict_mode(), CommDebugMode() as in_op:
            result = product(inputs, weight, bias)
        assert in_op.get_total_counts() == 0 and result.placements == (Partial("avg"),) * mesh.ndim, name
        with CommDebugMode() as reading:
            value = result.full_tensor()
        assert reading.get_comm_counts() == {"all_reduce": 1}, name
        reference_weight = weight_full.clone().requires_grad_()
        reference = product(inputs_value, reference_weight, bias_full)
        torch.testing.assert_close(value, reference)
        grad = torch.randn_like(reference)
        result.backward(distribute_tensor(grad, mesh, [R] * mesh.ndim))
        reference.backward(grad)
        torch.testing.assert_close(weight.grad.full_tensor(), reference_weight.grad)
        oracle, torch_in_op = torch_collectives(lambda: product(oracle_inputs, oracle_weight, oracle_bias))
        oracle_value, torch_reading = torch_collectives(oracle.full_tensor)
        assert (torch_in_op, torch_reading) == (0, mesh.ndim), name
        torch.testing.assert_close(oracle_value, reference)
        with CommDebugMode() as nonlinear:
            rectified = torch.relu(product(inputs, weight, bias))
        assert nonlinear.get_comm_counts() == {"all_reduce": 1} and rectified.placements == (R,) * mesh.ndim
        torch.testing.assert_close(rectified.full_tensor(), torch.relu(reference))
