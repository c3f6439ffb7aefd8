"""Ops on DTensors: generic rules, the replicate fallback, strict mode, in-place, out= and autograd."""

import os

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, modes, plan_cache
from shardtensor.dispatch import fallback_counts
from shardtensor.ops.registry import RULES, register_rule, same_layout


# Ops without a sharding rule (and that no op family will ever give one): they exercise the fallback.
@torch.library.custom_op("dispatch_test::product", mutates_args=())
def _product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x @ y


@torch.library.custom_op("dispatch_test::running_total", mutates_args=())
def _running_total(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0)


@torch.library.custom_op("dispatch_test::accumulate_", mutates_args=("x",))
def _accumulate_(x: torch.Tensor) -> None:
    x.copy_(x.cumsum(0))


def _sharded(mesh):
    return [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)


def test_registering_an_op_twice_is_an_error():
    assert torch.ops.aten.add.Tensor in RULES
    with pytest.raises(RuntimeError, match="registered twice"):
        register_rule([torch.ops.aten.add.Tensor], same_layout)


@spmd()
def test_pointwise_on_equal_layouts_is_local_and_exact(mesh):
    a_full = torch.linspace(-3, 3, 6 * 5).reshape(6, 5)
    b_full = torch.linspace(1, 2, 6 * 5).reshape(6, 5)
    a = distribute_tensor(a_full, mesh, _sharded(mesh))
    b = distribute_tensor(b_full, mesh, _sharded(mesh))
    with comm.observe() as records:
        results = [a + b, a * b - 2, (a / b).exp(), torch.relu(a), a > 0.5, 3 - a, a + torch.tensor(2.0)]
    assert list(records) == []
    expected = [a_full + b_full, a_full * b_full - 2, (a_full / b_full).exp(), torch.relu(a_full), a_full > 0.5,
                3 - a_full, a_full + 2]
    for result, reference in zip(results, expected):
        assert result.placements == a.placements
        assert torch.equal(result.full_tensor(), reference)


@spmd()
def test_partial_plus_scalar_adds_the_scalar_once(mesh):
    local = torch.ones(4)
    partial = shardtensor.DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)
    assert torch.equal((partial + 1).full_tensor(), torch.full((4,), mesh.size() + 1.0))
    ones = torch.ones_like(partial)
    assert ones.placements == (Replicate(),) * mesh.ndim
    assert torch.equal(ones.full_tensor(), torch.ones(4))
    assert torch.equal(partial.clone().full_tensor(), torch.full((4,), float(mesh.size())))


@spmd()
def test_broadcasting_and_mixed_layouts_give_single_device_results(mesh):
    matrix = torch.arange(24.0).reshape(6, 4)
    row = torch.arange(4.0) * 10
    a = distribute_tensor(matrix, mesh, _sharded(mesh))
    b = distribute_tensor(row, mesh, [Replicate()] * mesh.ndim)
    assert torch.equal((a + b).full_tensor(), matrix + row)
    c = distribute_tensor(matrix, mesh, [Replicate()] * mesh.ndim)
    assert torch.equal((a * c).full_tensor(), matrix * matrix)


@spmd()
def test_fallback_equals_single_device_and_is_counted(mesh):
    x_full = torch.arange(20.0).reshape(4, 5)
    y_full = torch.linspace(0, 1, 15).reshape(5, 3)
    x = distribute_tensor(x_full, mesh, _sharded(mesh))
    y = distribute_tensor(y_full, mesh, [Replicate()] * mesh.ndim)
    before = fallback_counts["dispatch_test.product.default"]
    product = torch.ops.dispatch_test.product(x, y)
    assert fallback_counts["dispatch_test.product.default"] == before + 1
    assert product.placements == (Replicate(),) * mesh.ndim
    torch.testing.assert_close(product.full_tensor(), x_full @ y_full)
    cumulative = torch.ops.dispatch_test.running_total(x)  # same shape as x: re-sharded like x
    assert cumulative.placements == x.placements
    assert torch.equal(cumulative.full_tensor(), torch.cumsum(x_full, 0))


@spmd()
def test_strict_mode_raises_naming_the_op(mesh):
    x = distribute_tensor(torch.ones(4, 4), mesh, _sharded(mesh))
    with shardtensor.strict_mode():
        assert torch.equal((x + 1).full_tensor(), torch.full((4, 4), 2.0))  # has a rule
        with pytest.raises(NotImplementedError, match="dispatch_test.running_total.default"):
            torch.ops.dispatch_test.running_total(x)
    os.environ["SHARDTENSOR_STRICT"] = "1"
    try:
        modes.read_environment()  # the environment is read once, at import
        with pytest.raises(NotImplementedError, match="strict"):
            torch.ops.dispatch_test.running_total(x)
    finally:
        del os.environ["SHARDTENSOR_STRICT"]
        modes.read_environment()
    assert torch.equal(torch.ops.dispatch_test.running_total(x).full_tensor(), torch.cumsum(torch.ones(4, 4), 0))


@spmd(meshes=[(2,), (2, 2)])
def test_cached_calls_reuse_one_plan_and_share_output_specs(mesh):
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, _sharded(mesh))
    first = x * 2
    plan_cache.clear_plans()
    first, second = x * 2, x * 2
    assert first._spec is second._spec  # the plan built the output spec once
    assert torch.equal(second.full_tensor(), torch.arange(8.0).reshape(4, 2) * 2)
    assert torch.equal((x * 2.0).full_tensor(), (x * 2).full_tensor())
    assert (x * True).dtype == torch.float32 and (x > 1).dtype == torch.bool


@spmd()
def test_plain_tensors_mixed_in_are_refused(mesh):
    x = distribute_tensor(torch.ones(4), mesh, [Shard(0)] * mesh.ndim)
    with pytest.raises(RuntimeError, match="plain torch.Tensor of shape \\(4,\\)"):
        x + torch.ones(4)


@spmd()
def test_in_place_and_out_update_the_dtensor(mesh):
    full = torch.arange(12.0).reshape(4, 3)
    x = distribute_tensor(full, mesh, _sharded(mesh))
    local = x.to_local()
    returned = x.add_(1)
    assert returned is x and x.to_local().data_ptr() == local.data_ptr()
    assert torch.equal(x.full_tensor(), full + 1)
    replicated = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    x.mul_(replicated)  # a rule moves `replicated`, never `x`
    assert torch.equal(x.full_tensor(), (full + 1) * full) and x.placements == tuple(_sharded(mesh))
    replicated.mul_(x)  # x is sharded: the new value is written back into the Replicate shard
    assert replicated.placements == (Replicate(),) * mesh.ndim
    assert torch.equal(replicated.full_tensor(), (full + 1) * full * full)
    torch.ops.dispatch_test.accumulate_(x)  # fallback, in place, returns nothing
    assert torch.equal(x.full_tensor(), ((full + 1) * full).cumsum(0))
    out = torch.empty_like(x)
    result = torch.add(x, x, out=out)
    assert result is out and torch.equal(out.full_tensor(), 2 * x.full_tensor())


@spmd()
def test_leaf_gradients_have_the_leaf_layout(mesh):
    full = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    weight_full = torch.linspace(0, 2, 12, dtype=torch.float64).reshape(4, 3)
    leaf = distribute_tensor(full.clone().requires_grad_(), mesh, _sharded(mesh))
    weight = distribute_tensor(weight_full, mesh, _sharded(mesh))
    for _ in range(2):  # the second pass accumulates through AccumulateGrad
        ((leaf * weight).relu() * leaf).sum().backward()
    reference = full.clone().requires_grad_()
    for _ in range(2):
        ((reference * weight_full).relu() * reference).sum().backward()
    assert isinstance(leaf.grad, shardtensor.DTensor) and leaf.grad.placements == leaf.placements
    torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_in_place_views_change_the_dtensor_shape(mesh):
    full = torch.arange(12.0).reshape(4, 3)
    x = distribute_tensor(full, mesh, _sharded(mesh))
    with shardtensor.strict_mode():
        assert x.unsqueeze_(0) is x and x.shape == (1, 4, 3)
        assert torch.equal(x.full_tensor(), full.unsqueeze(0))
        x.squeeze_(0)
        assert x.shape == (4, 3) and torch.equal(x.full_tensor(), full)
        x.t_()
        assert x.shape == (3, 4) and torch.equal(x.full_tensor(), full.t())
        x.transpose_(0, 1)
        assert x.shape == (4, 3) and torch.equal(x.full_tensor(), full)
        assert tuple(x.to_local().shape) == x.sharding.local_shape(mesh.get_coordinate())


@pytest.mark.parametrize(
    "name", ["bfloat16_round_trip", "softmax_with_dtype", "quantile"],
)
@spmd()
def test_ops_with_a_device_argument_propagate(mesh, name):
    """Ops whose aten form names a device (`_to_copy(..., device=cpu)`) must still run on meta tensors."""
    functions = {
        "bfloat16_round_trip": lambda x: x.bfloat16().float().sum(),
        "softmax_with_dtype": lambda x: torch.softmax(x, 1, dtype=torch.float64).sum(),
        "quantile": lambda x: torch.quantile(x, 0.3),
    }
    function = functions[name]
    full = torch.randn(4, 3)
    x = distribute_tensor(full, mesh, _sharded(mesh)).requires_grad_()
    result = function(x)
    result.backward()
    reference = full.clone().requires_grad_()
    expected = function(reference)
    expected.backward()
    torch.testing.assert_close(result.full_tensor(), expected)
    torch.testing.assert_close(x.grad.full_tensor(), reference.grad)


@spmd()
def test_ops_whose_shapes_depend_on_data_take_the_fallback(mesh):
    """Boolean-mask indexing runs `nonzero`, which meta tensors cannot evaluate: correct via the fallback."""
    full = torch.randn(6, 3)
    mask_full = full > 0
    x = distribute_tensor(full, mesh, _sharded(mesh)).requires_grad_()
    mask = distribute_tensor(mask_full, mesh, _sharded(mesh))
    selected = x[mask]
    reference = full.clone().requires_grad_()
    expected = reference[mask_full]
    assert torch.equal(selected.full_tensor(), expected)
    (selected * 2).sum().backward()
    (expected * 2).sum().backward()
    assert torch.equal(x.grad.full_tensor(), reference.grad)


# ---- plain tensors torch creates inside a public function; arguments read as data ---------------


def _composite_calls():
    """name -> (function of the inputs, input shapes): composites that build plain tensors inside."""
    attention = torch.nn.functional.scaled_dot_product_attention
    return {
        "scaled_dot_product_attention causal": (lambda q, k, v: attention(q, k, v, is_causal=True), [(2, 3, 4), (2, 6, 4), (2, 6, 4)]),
        "combinations": (lambda x: torch.combinations(x, r=2), [(5,)]),
        "linalg.matrix_rank": (lambda x: torch.linalg.matrix_rank(x).to(torch.float64), [(5, 4)]),
        "linalg.matrix_rank hermitian": (lambda x: torch.linalg.matrix_rank(x @ x.mT, hermitian=True).to(torch.float64), [(4, 4)]),
    }


@pytest.mark.parametrize("name", sorted(_composite_calls()))
@spmd(meshes=[(1,), (4,), (2, 2)])
def test_plain_tensors_torch_creates_inside_a_function_are_replicate(mesh, name):
    """sdpa's causal mask, combinations' mask, matrix_rank's tolerance: the single-device result,
    forward and backward."""
    function, shapes = _composite_calls()[name]
    fulls = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    placements = [[Shard(index % len(shape))] * mesh.ndim for index, shape in enumerate(shapes)]
    placements[0] = [Replicate()] * mesh.ndim  # mixed layouts, as OpInfo samples have
    inputs = [distribute_tensor(full, mesh, placement).requires_grad_(True) for full, placement in zip(fulls, placements)]
    references = [full.clone().requires_grad_(True) for full in fulls]
    result, expected = function(*inputs), function(*references)
    torch.testing.assert_close(result.full_tensor(), expected)
    if expected.requires_grad:
        result.sum().backward()
        expected.sum().backward()
        for dtensor, reference in zip(inputs, references):
            torch.testing.assert_close(dtensor.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_plain_tensors_the_caller_passes_are_still_refused(mesh):
    full = torch.randn(4, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="plain torch.Tensor of shape \\(4, 3\\) mixed with DTensors"):
        x + plain
    with pytest.raises(RuntimeError, match="mixed with DTensors"):
        torch.where(x > 0, x, plain)
    queries = distribute_tensor(torch.randn(2, 3, 4), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="mixed with DTensors"):  # the mask sdpa derives from it too
        torch.nn.functional.scaled_dot_product_attention(queries, queries, queries, attn_mask=torch.ones(3, 3) > 0)
    assert torch.equal((x + torch.tensor(2.0)).full_tensor(), full + 2)  # 0-d: allowed, as documented
    from shardtensor.experimental import implicit_replication

    with implicit_replication():  # unchecked opt-in: the plain tensor is the same on every rank here
        assert torch.equal((x + plain).full_tensor(), full + plain)
    with pytest.raises(RuntimeError, match="mixed with DTensors"):
        x + plain


@spmd(meshes=[(2,), (2, 2)])
def test_one_element_plain_tensors_read_as_replicate_as_0d_ones(mesh):
    """As PyTorch's DTensor: a plain tensor of one element, of any shape, is read as Replicate. So
    `torch.masked.var`/`std` work when they reduce to one element (they divide by a (1, 1) count built
    from `torch.ones(input.shape)`); a count of more elements is refused on every rank."""
    full = torch.randn(4, 6, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with shardtensor.strict_mode():
        for value in (4.0, 2.0):  # the second call runs the cached plan: the value is read, not kept
            assert torch.equal((x / torch.full((1, 1), value, dtype=torch.float64)).full_tensor(), full / value)
        for function in (torch.masked.var, torch.masked.std):
            torch.testing.assert_close(function(x).full_tensor(), function(full))
    with pytest.raises(RuntimeError, match="plain torch.Tensor of shape \\(1, 6\\) mixed with DTensors"):
        torch.masked.var(x, 0)


def test_only_the_outermost_call_decides_what_torch_created():
    from shardtensor.plain_tensors import created_by_torch, outermost_call

    plain, scalar = torch.ones(3), torch.tensor(1.0)
    assert not created_by_torch(plain)
    with outermost_call(DTensor, (scalar, [1, 2]), {}):
        assert created_by_torch(plain)
        with outermost_call(DTensor, (plain,), {}):  # a call torch makes inside: its arguments are torch's
            assert created_by_torch(plain)
        assert created_by_torch(plain)
    with outermost_call(DTensor, (scalar,), {"other": [plain]}):  # the caller passed one (nested in a list)
        assert not created_by_torch(plain)
        with outermost_call(DTensor, (), {}):
            assert not created_by_torch(plain)
    assert not created_by_torch(plain)


@spmd(meshes=[(1,), (4,), (2, 2)])
def test_tensor_split_with_dtensor_indices_reads_their_values(mesh):
    full = torch.randn(5, 7, dtype=torch.float64)
    for indices_full, dim in ((torch.tensor([1, 4]), 1), (torch.tensor([2, 3, 6]), 1), (torch.tensor(3), 0)):
        x = distribute_tensor(full, mesh, [Shard(1)] * mesh.ndim).requires_grad_(True)
        indices = distribute_tensor(indices_full, mesh, [Shard(0) if indices_full.ndim else Replicate()] * mesh.ndim)
        reference = full.clone().requires_grad_(True)
        calls = [lambda: torch.tensor_split(x, indices, dim), lambda: x.tensor_split(indices, dim=dim)] * 3
        with torch.no_grad():  # calls the `__torch_function__` layer could learn
            for call in calls:
                assert [piece.shape for piece in call()] == [piece.shape for piece in torch.tensor_split(full, indices_full, dim)]
        for pieces, expected in ((torch.tensor_split(x, indices, dim), torch.tensor_split(reference, indices_full, dim)),
                                 (x.tensor_split(indices, dim=dim), reference.tensor_split(indices_full, dim=dim))):
            assert len(pieces) == len(expected)
            for piece, expected_piece in zip(pieces, expected):
                assert torch.equal(piece.full_tensor(), expected_piece)
            sum((piece * (number + 1)).sum() for number, piece in enumerate(pieces)).backward()
            sum((piece * (number + 1)).sum() for number, piece in enumerate(expected)).backward()
        assert torch.equal(x.grad.full_tensor(), reference.grad)
