"""Elementwise nn ops on DTensors (losses with a reduction, shrink, prelu, glu, safe softmax),
forward and backward, against one device."""

import pytest
import torch
import torch.nn.functional as F
from helpers import value_agreement
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

R = Replicate()

# case -> (function of (input, target), whether the target is a probability)
LOSSES = {
    "binary_cross_entropy": (lambda x, t, reduction: F.binary_cross_entropy(x.sigmoid(), t, reduction=reduction), True),
    "binary_cross_entropy_with_logits": (
        lambda x, t, reduction: F.binary_cross_entropy_with_logits(x, t, reduction=reduction), True),
    "mse_loss": (lambda x, t, reduction: F.mse_loss(x, t, reduction=reduction), False),
    "huber_loss": (lambda x, t, reduction: F.huber_loss(x, t, reduction=reduction, delta=0.5), False),
    "smooth_l1_loss": (lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.5), False),
    "soft_margin_loss": (lambda x, t, reduction: F.soft_margin_loss(x, t.sign(), reduction=reduction), False),
}


def _placements(mesh):
    """Uneven: 5 rows and 3 columns on up to 4 ranks leave empty shards."""
    return [[Shard(0)], [Shard(1)]] if mesh.ndim == 1 else [[Shard(0), Shard(1)], [Shard(0), Shard(0)]]


@pytest.mark.parametrize("case", list(LOSSES))
@spmd()
def test_elementwise_losses_are_local_and_partial(mesh, case):
    """'none' keeps the shards; 'sum' and 'mean' (over the global count) are Partial, no data moved."""
    function, probability = LOSSES[case]
    full, target_full = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    if probability:
        target_full = target_full.sigmoid()
    for placements in _placements(mesh):
        for reduction in ("none", "sum", "mean"):
            x = distribute_tensor(full, mesh, placements).requires_grad_()
            target = distribute_tensor(target_full, mesh, placements)
            reference = full.clone().requires_grad_()
            with shardtensor.strict_mode(), comm.observe() as records:
                loss = function(x, target, reduction)
            # no data moves; binary_cross_entropy's probabilities only agree on their range (ops/value_checks.py)
            assert list(records) == (value_agreement(mesh, checked=2) if case == "binary_cross_entropy" else [])
            if reduction != "none" and mesh.size() > 1:
                assert all(p.is_partial() for p in loss.placements)
            expected = function(reference, target_full, reduction)
            assert_close(loss.full_tensor(), expected)
            grad = torch.randn(expected.shape, dtype=torch.float64)
            grad_dtensor = distribute_tensor(grad, mesh, [R if p.is_partial() else p for p in loss.placements])
            with shardtensor.strict_mode():
                loss.backward(grad_dtensor)
            expected.backward(grad)
            assert_close(x.grad.full_tensor(), reference.grad)


# name -> function of (input, a weight of 4 values)
ACTIVATIONS = {
    "hardshrink": lambda x, weight: F.hardshrink(x, 0.3),
    "softshrink": lambda x, weight: F.softshrink(x, 0.3),
    "prelu": lambda x, weight: F.prelu(x, weight),
    "glu": lambda x, weight: F.glu(x, dim=1),
    "safe_softmax": lambda x, weight: torch.ops.aten._safe_softmax(x, 1),
}


@spmd()
def test_activations_keep_shards_off_their_dim(mesh):
    full = torch.randn(5, 4, 3, dtype=torch.float64)
    full[0, :, 1] = -float("inf")  # a row of -inf: _safe_softmax gives zeros there
    weight_full = torch.linspace(0.1, 0.5, 4, dtype=torch.float64)
    for name, function in ACTIVATIONS.items():
        data = full if name == "safe_softmax" else full.clamp(min=-10)
        for placements in ([Shard(0)] * mesh.ndim, [Shard(2)] * mesh.ndim):
            x = distribute_tensor(data, mesh, placements).requires_grad_()
            weight = distribute_tensor(weight_full, mesh, [R] * mesh.ndim).requires_grad_()
            reference, weight_reference = data.clone().requires_grad_(), weight_full.clone().requires_grad_()
            with shardtensor.strict_mode(), comm.observe() as records:
                y = function(x, weight)
            assert list(records) == [] and y.placements == x.placements, name
            expected = function(reference, weight_reference)
            assert_close(y.full_tensor(), expected)
            if name == "safe_softmax":
                continue  # no autograd formula: an aten op for the composite softmax
            grad = torch.randn(expected.shape, dtype=torch.float64)
            grad_dtensor = distribute_tensor(grad, mesh, placements)
            with shardtensor.strict_mode():
                y.backward(grad_dtensor)
            expected.backward(grad)
            assert_close(x.grad.full_tensor(), reference.grad)
            if name == "prelu":
                assert_close(weight.grad.full_tensor(), weight_reference.grad)


@spmd()
def test_margin_losses_shard_the_batch(mesh):
    """The forwards are local but for the agreement on the target classes' range (their backwards have
    no meta kernel: the replicate fallback)."""
    full, weight_full = torch.randn(5, 4, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    classes = torch.tensor([0, 3, 1, 1, 2])
    labels = torch.tensor([[3, 0, -1, 1], [1, -1, 0, 0], [0, 1, 2, 3], [-1, 0, 0, 0], [2, 2, -1, 0]])
    functions = {
        "multi_margin": lambda x, target, weight, reduction: F.multi_margin_loss(
            x, target, p=2, margin=0.7, weight=weight, reduction=reduction),
        "multilabel_margin": lambda x, target, weight, reduction: F.multilabel_margin_loss(
            x, target, reduction=reduction),
    }
    batch = [Shard(0)] * mesh.ndim
    for (name, function), target_full in zip(functions.items(), (classes, labels)):
        for reduction in ("none", "sum", "mean"):
            x = distribute_tensor(full, mesh, batch).requires_grad_()
            target = distribute_tensor(target_full, mesh, batch)
            weight = distribute_tensor(weight_full, mesh, [R] * mesh.ndim)
            reference = full.clone().requires_grad_()
            with shardtensor.strict_mode(), comm.observe() as records:
                loss = function(x, target, weight, reduction)
            assert list(records) == value_agreement(mesh), name  # the target classes agree on their range
            expected = function(reference, target_full, weight_full, reduction)
            assert_close(loss.full_tensor(), expected)
            grad = torch.randn(expected.shape, dtype=torch.float64)
            grad_dtensor = distribute_tensor(grad, mesh, [R if p.is_partial() else p for p in loss.placements])
            loss.backward(grad_dtensor)
            expected.backward(grad)
            assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(4,)])
def test_margin_losses_of_a_rank_without_samples_add_zero(mesh):
    """3 samples over 4 ranks: the last shard is empty, and torch's kernels return uninitialized memory
    for an empty batch reduced by 'sum' or 'mean' (here dirtied on purpose): the Partial sum must hold 0
    from that rank, so the loss is the one-device loss on every try."""
    full = torch.randn(3, 4, dtype=torch.float64)
    classes, labels = torch.tensor([0, 3, 1]), torch.tensor([[3, 0, -1, 1], [1, -1, 0, 0], [0, 1, 2, 3]])
    functions = {
        "multi_margin": (lambda x, target, reduction: F.multi_margin_loss(x, target, reduction=reduction), classes),
        "multilabel_margin": (
            lambda x, target, reduction: F.multilabel_margin_loss(x, target, reduction=reduction), labels),
    }
    for name, (function, target_full) in functions.items():
        for reduction in ("sum", "mean"):
            expected = function(full, target_full, reduction)
            for attempt in range(20):
                target = distribute_tensor(target_full, mesh, [Shard(0)])
                torch.full((4096,), 1e200, dtype=torch.float64).add_(1)  # freed: the allocator's memory is dirty
                x = distribute_tensor(full, mesh, [Shard(0)])
                loss = function(x, target, reduction).full_tensor()
                assert_close(loss, expected, msg=lambda m: f"{name} {reduction} #{attempt}: {m}")
