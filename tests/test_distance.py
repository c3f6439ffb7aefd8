"""Pairwise distances on DTensors: `torch.cdist` and `nn.functional.pdist`, forward and backward,
against one device, for every rule row (rows of x1, rows of x2, batch, features)."""

import math

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor


def _placements(mesh, placement):
    return [placement] + [Replicate()] * (mesh.ndim - 1)


def _check(mesh, function, inputs, placements, expect_local_forward=False):
    """`function` on DTensors gives the single-device value and gradients (strict mode)."""
    plain = [value.clone().requires_grad_() for value in inputs]
    expected = function(*plain)
    expected.sum().backward()
    distributed = [distribute_tensor(value, mesh, _placements(mesh, placement)).requires_grad_()
                   for value, placement in zip(inputs, placements)]
    with shardtensor.strict_mode():
        with comm.observe() as records:
            result = function(*distributed)
        if expect_local_forward:
            assert records == [], records
        torch.testing.assert_close(result.full_tensor(), expected)
        result.sum().backward()
    for value, tensor in zip(plain, distributed):
        torch.testing.assert_close(tensor.grad.full_tensor(), value.grad)


# (x1 placement, x2 placement): rows of x1 (uneven: 5 rows), rows of x2 (3 rows: an empty shard on 4 ranks),
# features, batch.
CDIST_CASES = [(Shard(1), Replicate()), (Replicate(), Shard(1)), (Shard(2), Shard(2)), (Shard(0), Shard(0))]


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, math.inf])
@spmd()
def test_cdist_matches_one_device(mesh, p):
    x1, x2 = torch.randn(2, 5, 6), torch.randn(2, 3, 6)
    for placements in CDIST_CASES:
        local = placements[0] != placements[1] or placements[0] == Shard(0) or p in (0.0, 1.0, math.inf)
        _check(mesh, lambda a, b: torch.cdist(a, b, p=p), (x1, x2), placements, expect_local_forward=local)


@spmd(meshes=[(4,)])
def test_cdist_over_features_leaves_a_partial_for_one_norms(mesh):
    x1, x2 = torch.randn(5, 8), torch.randn(3, 8)
    for p, reduce_op in ((1.0, "sum"), (math.inf, "max")):
        result = torch.cdist(distribute_tensor(x1, mesh, [Shard(1)]), distribute_tensor(x2, mesh, [Shard(1)]), p=p)
        assert result.placements == (Partial(reduce_op),)
        torch.testing.assert_close(result.full_tensor(), torch.cdist(x1, x2, p=p))


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
@spmd()
def test_pdist_matches_one_device(mesh, p):
    x = torch.randn(5, 6)
    for placement in (Replicate(), Shard(1), Shard(0)):
        _check(mesh, lambda a: torch.nn.functional.pdist(a, p=p), (x,), (placement,))
