"""The eager hot path: cached plans (`dispatch._Plan`) must be reused, and never for other inputs.

Each test alternates calls of one op whose decisions differ (shapes, layouts, scalar arguments,
meshes) and checks every result against the single-device value, so a plan or a decision reused
for the wrong inputs shows up as a wrong number.
"""

from __future__ import annotations

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard, comm, dispatch, distribute_tensor
from shardtensor.mesh import DeviceMesh
from shardtensor.ops.registry import RULES, register_rule
from shardtensor.propagation import Row

MESHES = [(1,), (2,), (4,), (2, 2)]


def _placements(mesh, placement):
    return [placement] * mesh.ndim


class _MissCounter:
    """Counts calls that miss the plan cache (go through `dispatch._dispatch_slowly`)."""

    def __init__(self, monkeypatch):
        self.misses = 0
        slow = dispatch._dispatch_slowly

        def counting(*args, **kwargs):
            self.misses += 1
            return slow(*args, **kwargs)

        monkeypatch.setattr(dispatch, "_dispatch_slowly", counting)


VIEW_CALLS = {
    "view": lambda t: t.view(t.shape[0] * t.shape[1]),
    "reshape": lambda t: t.reshape(t.shape[1], t.shape[0]),
    "t": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(1, 0),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "expand": lambda t: t.unsqueeze(0).expand(3, *t.shape),
    "slice": lambda t: t[1:7:2],
    "narrow": lambda t: t.narrow(1, 1, 2),
    "select": lambda t: t[:, 2],
}


@pytest.mark.parametrize("name", sorted(VIEW_CALLS))
@spmd(meshes=MESHES)
def test_view_ops_run_from_a_plan_without_communication(mesh, name):
    """Rules with per-coordinate local arguments (view, expand, slice) are planned like the others."""
    full = torch.randn(8, 4)
    x = distribute_tensor(full, mesh, _placements(mesh, Shard(0)))
    function = VIEW_CALLS[name]
    function(x)  # builds the plans
    with pytest.MonkeyPatch.context() as monkeypatch, shardtensor.strict_mode(), comm.observe() as records:
        counter = _MissCounter(monkeypatch)
        results = [function(x) for _ in range(3)]
    assert counter.misses == 0 and records == []
    for result in results:
        assert torch.equal(result.full_tensor(), function(full))


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_plans_for_other_shapes_layouts_and_sizes_are_never_mixed_up(mesh):
    """One op, alternating inputs whose decisions differ; each result is the single-device one."""
    even, uneven = torch.randn(8, 6), torch.randn(7, 6)
    inputs = []
    for full in (even, uneven):
        for placement in (Shard(0), Shard(1), Replicate()):
            inputs.append((full, distribute_tensor(full, mesh, _placements(mesh, placement))))
    calls = [
        lambda t: t.view(-1),
        lambda t: t.view(t.shape[0], 2, 3),
        lambda t: t.reshape(-1, 2),
        lambda t: t.unsqueeze(0).expand(2, *t.shape),
        lambda t: t.unsqueeze(0).expand(4, *t.shape),
        lambda t: t[1:5],
        lambda t: t[2:],
        lambda t: t[::3],
        lambda t: t.transpose(0, 1),
    ]
    with shardtensor.strict_mode():
        for _ in range(2):  # the second round runs every call from its plan
            for function in calls:
                for full, x in inputs:
                    assert torch.equal(function(x).full_tensor(), function(full))


@spmd(meshes=[(2,), (2, 2)])
def test_scalar_arguments_of_equal_value_but_other_type_get_their_own_plan(mesh):
    integers = torch.arange(8).reshape(4, 2)
    x = distribute_tensor(integers, mesh, _placements(mesh, Shard(0)))
    with shardtensor.strict_mode():
        for _ in range(2):
            for scalar in (2, 2.0, True, 3, 0.5):
                result = x * scalar
                expected = integers * scalar
                assert result.dtype == expected.dtype
                assert torch.equal(result.full_tensor(), expected)
            for exponent in (2, 2.0):
                assert torch.pow(x, exponent).dtype == torch.pow(integers, exponent).dtype


def test_fast_keys_tell_list_item_types_apart():
    op = torch.ops.aten.view.default
    assert dispatch._fast_key(op, ([1, 2],), {}) != dispatch._fast_key(op, ([1.0, 2.0],), {})
    assert dispatch._fast_key(op, ([1, 2],), {}) != dispatch._fast_key(op, ((1, 2),), {})
    assert dispatch._fast_key(op, ([[1], [2]],), {}) is None  # nested: the slow path decides


@spmd(meshes=[(2,), (4,)])
def test_meshes_of_one_shape_with_other_rank_orders_keep_their_own_local_arguments(mesh):
    """A slice's local arguments depend on this rank's coordinate; two meshes of one shape differ."""
    reversed_mesh = DeviceMesh("cpu", list(reversed(range(mesh.size(0)))))
    full = torch.randn(9, 3)
    on_mesh = distribute_tensor(full, mesh, [Shard(0)])
    on_reversed = distribute_tensor(full, reversed_mesh, [Shard(0)])
    assert on_mesh.sharding == on_reversed.sharding  # the same layout: only the coordinate tells them apart
    with shardtensor.strict_mode():
        for _ in range(2):
            for x in (on_mesh, on_reversed):
                assert torch.equal(x[2:7].full_tensor(), full[2:7])
                assert torch.equal(x.view(27).full_tensor(), full.view(27))


@spmd(meshes=MESHES)
def test_planned_views_backward_match_one_device(mesh):
    """A tiny MLP with views and transposes, forward and backward, twice (second time: plans)."""
    inputs, weight, projection = torch.randn(8, 6), torch.randn(4, 6), torch.randn(3, 4)
    for _ in range(2):
        reference_weight = weight.clone().requires_grad_(True)
        reference_projection = projection.clone().requires_grad_(True)
        hidden = (inputs.view(8, 2, 3).reshape(8, 6) @ reference_weight.t()).relu()
        (hidden @ reference_projection.transpose(0, 1)).view(-1).sum().backward()

        x = distribute_tensor(inputs, mesh, _placements(mesh, Shard(0)))
        sharded_weight = distribute_tensor(weight, mesh, _placements(mesh, Replicate())).requires_grad_(True)
        sharded_projection = distribute_tensor(projection, mesh, _placements(mesh, Replicate())).requires_grad_(True)
        with shardtensor.strict_mode():
            hidden = (x.view(8, 2, 3).reshape(8, 6) @ sharded_weight.t()).relu()
            (hidden @ sharded_projection.transpose(0, 1)).view(-1).sum().backward()
        torch.testing.assert_close(sharded_weight.grad.full_tensor(), reference_weight.grad)
        torch.testing.assert_close(sharded_projection.grad.full_tensor(), reference_projection.grad)


@spmd(meshes=[(2,)])
def test_a_rule_registered_later_replaces_plans_built_from_the_old_one(mesh):
    op = torch.ops.aten.neg.default
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    assert x.neg().placements == (Shard(0),)  # planned with the pointwise rule
    original = RULES[op]
    try:
        register_rule([op], lambda call: [Row((Replicate(),), (Replicate(),))], override=True)
        assert x.neg().placements == (Replicate(),)
    finally:
        register_rule([op], original, override=True)
    assert x.neg().placements == (Shard(0),)
