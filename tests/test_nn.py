"""nn ops on DTensors, forward and backward, against the single-device computation."""

import itertools

import torch
import torch.nn.functional as F
from helpers import index_agreement
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor

R = Replicate()


def _leaf(full, mesh, placements):
    return distribute_tensor(full.detach(), mesh, placements).requires_grad_()


def _reference(full):
    return full.detach().clone().requires_grad_()


def _backward(output, grad_full):
    """Backward from an explicit gradient laid out like the output (Partial read as Replicate)."""
    placements = [R if placement.is_partial() else placement for placement in output.placements]
    output.backward(distribute_tensor(grad_full, output.device_mesh, placements))


def _grad(dtensor):
    return dtensor.grad.full_tensor()


def _compare_with_single_device(y, expected, grad, pairs):
    """Forward values, then the gradients of (DTensor, reference) pairs after a strict-mode backward."""
    assert_close(y.full_tensor(), expected)
    with shardtensor.strict_mode():
        _backward(y, grad)
    expected.backward(grad)
    for dtensor, reference in pairs:
        assert_close(_grad(dtensor), reference.grad)


def _on(mesh, one_dim, two_dim):
    return one_dim if mesh.ndim == 1 else two_dim


@spmd()
def test_softmax_and_log_softmax_keep_shards_and_reduce_a_sharded_dim(mesh):
    full = torch.randn(6, 10, dtype=torch.float64)
    grad = torch.randn(6, 10, dtype=torch.float64)
    for placements in _on(mesh, [[Shard(0)], [Shard(1)], [R]], [[Shard(0), Shard(1)], [Shard(1), Shard(1)], [R, Shard(0)]]):
        for function in (F.softmax, F.log_softmax):
            x, reference = _leaf(full, mesh, placements), _reference(full)
            with shardtensor.strict_mode(), comm.observe() as records:
                y = function(x, dim=1)
            assert y.placements == x.placements
            sharded_softmax_dim = any(p == Shard(1) for p in placements) and mesh.size() > 1
            assert {record.kind for record in records} == ({"all_reduce"} if sharded_softmax_dim else set())
            expected = function(reference, dim=1)
            _compare_with_single_device(y, expected, grad, [(x, reference)])


@spmd()
def test_layer_norm_on_batch_shards_is_local_and_parameter_grads_are_partial(mesh):
    full, weight_full, bias_full = (torch.randn(5, 3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64),
                                    torch.randn(8, dtype=torch.float64))
    grad = torch.randn(5, 3, 8, dtype=torch.float64)
    for placements in _on(mesh, [[Shard(0)], [Shard(1)]], [[Shard(0), Shard(1)], [Shard(1), Shard(0)]]):
        x, weight, bias = _leaf(full, mesh, placements), _leaf(weight_full, mesh, [R] * mesh.ndim), _leaf(bias_full, mesh, [R] * mesh.ndim)
        references = [_reference(t) for t in (full, weight_full, bias_full)]
        with shardtensor.strict_mode(), comm.observe() as records:
            y = F.layer_norm(x, (8,), weight, bias)
        assert list(records) == [] and y.placements == x.placements
        expected = F.layer_norm(references[0], (8,), references[1], references[2])
        _compare_with_single_device(y, expected, grad, zip((x, weight, bias), references))
        if mesh.size() > 1:
            assert all(p.is_partial() for p in weight.grad.placements if not p.is_replicate())


@spmd()
def test_group_norm_and_rms_norm_on_an_uneven_batch(mesh):
    full, weight_full, bias_full = (torch.randn(5, 6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64),
                                    torch.randn(6, dtype=torch.float64))
    grad = torch.randn(5, 6, 4, dtype=torch.float64)
    placements = [Shard(0)] * mesh.ndim
    x, weight, bias = _leaf(full, mesh, placements), _leaf(weight_full, mesh, [R] * mesh.ndim), _leaf(bias_full, mesh, [R] * mesh.ndim)
    references = [_reference(t) for t in (full, weight_full, bias_full)]
    with shardtensor.strict_mode(), comm.observe() as records:
        y = F.group_norm(x, 3, weight, bias)
    assert list(records) == [] and y.placements == x.placements
    expected = F.group_norm(references[0], 3, references[1], references[2])
    _compare_with_single_device(y, expected, grad, zip((x, weight, bias), references))
    # rms_norm decomposes into pointwise ops and a mean (rules of other families).
    x, weight = _leaf(full, mesh, placements), _leaf(full[0, 0], mesh, [R] * mesh.ndim)
    references = [_reference(full), _reference(full[0, 0])]
    y = F.rms_norm(x, (4,), weight)
    expected = F.rms_norm(references[0], (4,), references[1])
    assert_close(y.full_tensor(), expected)
    _backward(y, grad)
    expected.backward(grad)
    assert_close(_grad(x), references[0].grad)
    assert_close(_grad(weight), references[1].grad)


@spmd()
def test_vocab_sharded_embedding_is_local_and_partial(mesh):
    table = torch.randn(11, 4, dtype=torch.float64)
    indices_full = torch.tensor([[0, 10, 3, 3, 7], [5, 1, 9, 2, 3], [8, 6, 4, 0, 10]])
    grad = torch.randn(3, 5, 4, dtype=torch.float64)
    cases = [  # (table placements, indices placements, padding_idx)
        ([Shard(0)] * mesh.ndim, [R] * mesh.ndim, None),
        ([Shard(0)] * mesh.ndim, [R] * mesh.ndim, 3),
        ([R] * mesh.ndim, [Shard(1)] * mesh.ndim, None),
        ([Shard(1)] * mesh.ndim, [R] * mesh.ndim, None),
        ([Shard(0)] + [R] * (mesh.ndim - 1), [R] + [Shard(0)] * (mesh.ndim - 1), 7),
    ]
    for table_placements, index_placements, padding_idx in cases:
        weight, reference = _leaf(table, mesh, table_placements), _reference(table)
        indices = distribute_tensor(indices_full, mesh, index_placements)
        with shardtensor.strict_mode(), comm.observe() as records:
            y = F.embedding(indices, weight, padding_idx=padding_idx)
        # no data moves; sharded indices only agree on their range, over the mesh dims that shard them
        sharding_mesh_dims = [mesh_dim for mesh_dim, placement in enumerate(index_placements) if placement.is_shard()]
        assert list(records) == (index_agreement(mesh, sharding_mesh_dims) if sharding_mesh_dims else [])
        if table_placements[0] == Shard(0) and mesh.size() > 1:
            assert y.placements[0] == Partial("sum")
        expected = F.embedding(indices_full, reference, padding_idx=padding_idx)
        _compare_with_single_device(y, expected, grad, [(weight, reference)])
        if table_placements == [Shard(0)] * mesh.ndim:
            assert weight.grad.placements == weight.placements  # each rank wrote only its rows


@spmd()
def test_cross_entropy_on_an_uneven_batch_and_on_sharded_classes(mesh):
    logits_full = torch.randn(7, 5, dtype=torch.float64)
    target_full = torch.tensor([0, 4, 2, -100, 1, 3, 4])
    class_weight = torch.rand(5, dtype=torch.float64) + 0.5
    for reduction in ("mean", "sum", "none"):
        for weight_full in (None, class_weight):
            for logits_placements, target_placements in [
                ([Shard(0)] * mesh.ndim, [Shard(0)] * mesh.ndim),  # 7 rows: uneven on 2 and 4 ranks
                ([Shard(1)] * mesh.ndim, [R] * mesh.ndim),  # vocab-parallel loss
            ]:
                logits, reference = _leaf(logits_full, mesh, logits_placements), _reference(logits_full)
                target = distribute_tensor(target_full, mesh, target_placements)
                weight = None if weight_full is None else distribute_tensor(weight_full, mesh, [R] * mesh.ndim)
                with shardtensor.strict_mode(), comm.observe() as records:
                    loss = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
                assert {record.kind for record in records} <= {"all_reduce"}  # the logits never move
                expected = F.cross_entropy(reference, target_full, weight=weight_full, reduction=reduction)
                assert_close(loss.full_tensor(), expected)
                with shardtensor.strict_mode():
                    _backward(loss, torch.ones_like(expected))
                expected.backward(torch.ones_like(expected))
                assert_close(_grad(logits), reference.grad)


@spmd(meshes=[(2, 2)])
def test_cross_entropy_with_batch_and_classes_sharded_over_different_mesh_dims(mesh):
    """Regression: (S(0), S(1)) logits with 'mean' divided each batch shard by its own total weight
    (twice the loss), and a class weight broke the local shapes of sharded outputs; every per-mesh-dim
    mix of batch, class and no sharding must be exact. 37 classes: with very few classes, gathering
    the logits is cheaper than log_softmax's two all_reduces of the row statistics, and the planner
    (which counts those, `Row.collectives`) rightly gathers."""
    logits_full = torch.randn(7, 37, dtype=torch.float64)
    target_full = torch.tensor([0, 36, 2, -100, 1, 3, 4])
    class_weight = torch.rand(37, dtype=torch.float64) + 0.5
    per_mesh_dim = [R, Shard(0), Shard(1)]  # nothing, the batch, the classes
    for logits_placements in itertools.product(per_mesh_dim, repeat=2):
        target_placements = [Shard(0) if p == Shard(0) else R for p in logits_placements]
        for reduction, weight_full, ignore_index in [("mean", None, -100), ("mean", class_weight, 4),
                                                     ("sum", class_weight, -100), ("none", None, 1),
                                                     ("none", class_weight, -100)]:
            ignored_target_full = target_full.masked_fill(target_full == -100, ignore_index)
            logits, reference = _leaf(logits_full, mesh, list(logits_placements)), _reference(logits_full)
            target = distribute_tensor(ignored_target_full, mesh, target_placements)
            weight = None if weight_full is None else distribute_tensor(weight_full, mesh, [R, R])
            with shardtensor.strict_mode(), comm.observe() as records:
                loss = F.cross_entropy(logits, target, weight=weight, reduction=reduction, ignore_index=ignore_index)
            assert {record.kind for record in records} <= {"all_reduce"}  # the logits never move
            expected = F.cross_entropy(reference, ignored_target_full, weight=weight_full, reduction=reduction,
                                       ignore_index=ignore_index)
            _compare_with_single_device(loss, expected, torch.rand_like(expected), [(logits, reference)])


@spmd()
def test_convolution_sharded_on_batch_and_channels(mesh):
    for function, spatial in ((F.conv1d, (9,)), (F.conv2d, (5, 6))):
        input_full = torch.randn(5, 4, *spatial, dtype=torch.float64)
        weight_full = torch.randn(6, 4, *(3,) * len(spatial), dtype=torch.float64)
        bias_full = torch.randn(6, dtype=torch.float64)
        many = [Shard(0)] * (mesh.ndim - 1)
        cases = [  # (input, weight, bias placements, expected output placement on mesh dim 0)
            ([Shard(0)] + many, [R] + [R] * (mesh.ndim - 1), Shard(0)),
            ([R] + many, [Shard(0)] + [R] * (mesh.ndim - 1), Shard(1)),
            ([Shard(1)] + many, [Shard(1)] + [R] * (mesh.ndim - 1), Partial("sum")),
        ]
        for input_placements, weight_placements, output_placement in cases:
            bias_placements = [Shard(0) if p == Shard(0) else R for p in weight_placements]
            tensors = [_leaf(input_full, mesh, input_placements), _leaf(weight_full, mesh, weight_placements),
                       _leaf(bias_full, mesh, bias_placements)]
            references = [_reference(t) for t in (input_full, weight_full, bias_full)]
            with shardtensor.strict_mode(), comm.observe() as records:
                y = function(*tensors, padding=1)
            if mesh.size() > 1:
                assert y.placements[0] == output_placement and list(records) == []
            expected = function(*references, padding=1)
            _compare_with_single_device(y, expected, torch.randn_like(expected), zip(tensors, references))


@spmd()
def test_transposed_convolution_on_an_uneven_batch_with_groups(mesh):
    """Regression: the bias gradient's local size came from the weight's dim 0 (the input channels of
    a transposed convolution), so ranks with a batch shard raised and the others hung."""
    for function, spatial in ((F.conv_transpose1d, (4,)), (F.conv_transpose2d, (3, 4))):
        input_full = torch.randn(2, 4, *spatial, dtype=torch.float64)  # 2 rows: empty shards on 4 ranks
        weight_full = torch.randn(4, 3, *(2,) * len(spatial), dtype=torch.float64)
        bias_full = torch.randn(6, dtype=torch.float64)
        for input_placements in ([Shard(0)] * mesh.ndim, [Shard(1)] * mesh.ndim):
            tensors = [_leaf(input_full, mesh, input_placements), _leaf(weight_full, mesh, [R] * mesh.ndim),
                       _leaf(bias_full, mesh, [Shard(0)] * mesh.ndim)]
            references = [_reference(t) for t in (input_full, weight_full, bias_full)]
            options = dict(stride=3, padding=1, output_padding=2, groups=2, dilation=2)
            with shardtensor.strict_mode():
                y = function(*tensors, **options)
            assert all(p in (Shard(0), R) for p in y.placements)  # batch sharding, never Shard(1)
            if input_placements[0] == Shard(0):
                assert y.placements == tuple(input_placements)
            expected = function(*references, **options)
            _compare_with_single_device(y, expected, torch.randn_like(expected), zip(tensors, references))


@spmd()
def test_scaled_dot_product_attention_on_batch_or_heads_is_local(mesh):
    shape = (4, 4, 5, 3)
    fulls = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    grad = torch.randn(shape, dtype=torch.float64)
    for placements in _on(mesh, [[Shard(0)], [Shard(1)]], [[Shard(0), Shard(1)], [Shard(1), Shard(1)]]):
        for causal in (False, True):
            tensors = [_leaf(full, mesh, placements) for full in fulls]
            references = [_reference(full) for full in fulls]
            with shardtensor.strict_mode(), comm.observe() as records:
                y = F.scaled_dot_product_attention(*tensors, is_causal=causal)
            assert list(records) == [] and y.placements == tuple(placements)
            expected = F.scaled_dot_product_attention(*references, is_causal=causal)
            _compare_with_single_device(y, expected, grad, zip(tensors, references))


@spmd(meshes=[(4,), (2, 2)])
def test_scaled_dot_product_attention_with_fewer_heads_than_ranks(mesh):
    """Regression: a rank holding no heads ran the CPU kernel, which dies on zero heads (SIGFPE)."""
    shape = (2, 2, 5, 3)
    fulls = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    grad = torch.randn(shape, dtype=torch.float64)
    tensors = [_leaf(full, mesh, [Shard(1)] * mesh.ndim) for full in fulls]
    references = [_reference(full) for full in fulls]
    with shardtensor.strict_mode(), comm.observe() as records:
        y = F.scaled_dot_product_attention(*tensors, is_causal=True)
    assert list(records) == [] and y.placements == (Shard(1),) * mesh.ndim
    expected = F.scaled_dot_product_attention(*references, is_causal=True)
    _compare_with_single_device(y, expected, grad, zip(tensors, references))


@spmd(meshes=[(2,), (2, 2)])
def test_group_norm_backward_from_an_expanded_gradient(mesh):
    """Regression: `full_tensor().sum().backward()` hands group_norm an expanded (stride 0) shard whose
    wrapper looks contiguous; the CPU kernel read it as contiguous and returned garbage."""
    full, weight_full = torch.randn(3, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    for placements in ([R] * mesh.ndim, [Shard(0)] * mesh.ndim):
        x, weight = _leaf(full, mesh, placements), _leaf(weight_full, mesh, [Shard(0)] * mesh.ndim)
        references = [_reference(full), _reference(weight_full)]
        F.group_norm(x, 2, weight).full_tensor().sum().backward()
        F.group_norm(references[0], 2, references[1]).sum().backward()
        assert_close(_grad(x), references[0].grad)
        assert_close(_grad(weight), references[1].grad)
