"""`shardtensor.experimental.register_sharding`: users add or replace an op's rule."""

import math

import pytest
import torch
from helpers import partial_and_value
from spmd import spmd

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CacheCounts, plan_cache_counts
from shardtensor.experimental import register_sharding
from shardtensor.ops.registry import RULES, register_rule
from shardtensor.propagation import clear_cache

aten = torch.ops.aten


# torch.library.custom_op refuses keyword-only Tensor arguments; a Library definition allows them.
_library = torch.library.Library("register_sharding_test", "DEF")
_library.define("scaled_add(Tensor x, *, Tensor other, float scale) -> Tensor")
_library.impl("scaled_add", lambda x, *, other, scale: x + scale * other, "CompositeExplicitAutograd")


@torch.library.custom_op("register_sharding_test::fill_with_row_index_", mutates_args=("x",))
def _fill_with_row_index_(x: torch.Tensor, start: int) -> None:
    x.copy_(torch.arange(start, start + x.shape[0], dtype=x.dtype).unsqueeze(1).expand_as(x))


@_fill_with_row_index_.register_fake
def _(x, start):
    return None


@register_sharding(torch.ops.register_sharding_test.scaled_add.default)
def _scaled_add_strategies(x, *, other, scale):
    # A Tensor keyword argument (`other`) gets a placement like any DTensor argument.
    return [([Replicate()], [Replicate(), Replicate(), None])] + [
        ([Shard(dim)], [Shard(dim), Shard(dim), None]) for dim in range(x.ndim)
    ]


@register_sharding(torch.ops.register_sharding_test.fill_with_row_index_.default)
def _fill_strategies(x, start):
    # Returns nothing: no output placements. Sharding rows would need per-shard starts: columns only.
    return [([], [Replicate(), None])] + [([], [Shard(dim), None]) for dim in range(1, x.ndim)]


def _softmax_strategies(x, dim, half_to_float):
    softmax_dim = dim if dim >= 0 else dim + x.ndim
    strategies = [([Replicate()], [Replicate(), None, None])]
    for sharding_dim in range(x.ndim):
        if sharding_dim != softmax_dim:
            strategies.append(([Shard(sharding_dim)], [Shard(sharding_dim), None, None]))
    return strategies


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_the_softmax_example_overrides_and_restores(mesh):
    full = torch.linspace(-2, 2, 24).reshape(4, 6)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    previous = RULES.get(aten._softmax.default)
    try:
        register_sharding(aten._softmax.default)(_softmax_strategies)
        with shardtensor.strict_mode(), comm.observe() as records:
            result = torch.softmax(x, dim=1)
        assert list(records) == [] and result.placements == x.placements
        torch.testing.assert_close(result.full_tensor(), torch.softmax(full, dim=1), rtol=0, atol=0)
        with shardtensor.strict_mode():
            other_dim = torch.softmax(x, dim=0)  # the rule needs dim 0 unsharded: it is gathered
        assert not any(p.is_shard(0) for p in other_dim.placements)
        torch.testing.assert_close(other_dim.full_tensor(), torch.softmax(full, dim=0), rtol=0, atol=0)
    finally:
        if previous is None:
            RULES.pop(aten._softmax.default, None)
            clear_cache()
        else:
            register_rule([aten._softmax.default], previous, override=True)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_custom_op_with_a_tensor_keyword_argument(mesh):
    x_full, other_full = torch.arange(8.0).reshape(4, 2), torch.ones(4, 2)
    x = distribute_tensor(x_full, mesh, [Shard(0)] * mesh.ndim)
    other = distribute_tensor(other_full, mesh, [Replicate()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        result = torch.ops.register_sharding_test.scaled_add(x, other=other, scale=0.5)
    assert list(records) == [] and result.placements == x.placements
    assert torch.equal(result.full_tensor(), x_full + 0.5 * other_full)


@spmd(meshes=[(2,), (2, 2)])
def test_custom_op_that_returns_nothing(mesh):
    x = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(1)] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        returned = torch.ops.register_sharding_test.fill_with_row_index_(x, 5)
    assert returned is None and list(records) == []
    assert torch.equal(x.full_tensor(), torch.arange(5.0, 9.0).unsqueeze(1).expand(4, 3))
    rows = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)] * mesh.ndim)
    with shardtensor.strict_mode():
        torch.ops.register_sharding_test.fill_with_row_index_(rows, 5)  # gathered, filled, written back
    assert torch.equal(rows.full_tensor(), torch.arange(5.0, 9.0).unsqueeze(1).expand(4, 3))


def _any_scale_keeps_a_partial_sum(x, other):
    # Reads no sign: a Partial(sum) times any finite scale is the sum of the scaled operands.
    return [([Replicate()], [Replicate(), None]), ([Partial()], [Partial(), None])]


@spmd(meshes=[(2,), (2, 2)])
def test_a_replaced_rule_decides_whether_a_0d_scales_sign_is_read(mesh):
    """Plan keys hold the sign of a 0-d plain scale next to a Partial only while the op's rule reads it:
    after a rule that reads no sign replaces mul's, `* tensor(2)` and `* tensor(-2)` share one plan;
    with mul's own rule put back, `* tensor(inf)` reduces first. Flat and multi-tensor calls alike
    (`_foreach_mul` decides element by element with mul's rule)."""
    x, value = partial_and_value(mesh, (4, 3))
    calls = {aten.mul.Tensor: lambda t, scale: t * scale,
             aten._foreach_mul.Tensor: lambda t, scale: torch._foreach_mul([t], scale)[0]}
    replaced = [aten.mul.Tensor, aten.mul.Scalar]
    previous = [RULES[op] for op in replaced]

    def run(op, call, scales: tuple) -> CacheCounts:
        before = plan_cache_counts().get(str(op), CacheCounts(0, 0, 0, 0))
        for scale in scales:
            with shardtensor.strict_mode():
                result = call(x, torch.tensor(scale, dtype=torch.float64))
            expected = call(value, torch.tensor(scale, dtype=torch.float64))
            torch.testing.assert_close(result.full_tensor(), expected, rtol=1e-12, atol=1e-12, equal_nan=True)
            assert result.placements == (x.placements if math.isfinite(scale) else (Replicate(),) * mesh.ndim)
        after = plan_cache_counts()[str(op)]
        return CacheCounts(after.hits - before.hits, after.misses - before.misses, 0, 0)

    clear_cache()  # no plan of an earlier test for these layouts: every count below is exact
    for op, call in calls.items():
        counts = run(op, call, (2.0, -2.0))
        assert (counts.hits, counts.misses) == (0, 2), (op, counts)  # mul's rule: the two signs, two plans
    try:
        register_sharding(replaced)(_any_scale_keeps_a_partial_sum)
        for op, call in calls.items():
            counts = run(op, call, (2.0, -2.0))
            assert (counts.hits, counts.misses) == (1, 1), (op, counts)
    finally:
        for op, rule in zip(replaced, previous):
            register_rule([op], rule, override=True)
    for op, call in calls.items():
        run(op, call, (2.0, math.inf))


def test_bad_strategies_and_ops_are_explained():
    with pytest.raises(TypeError, match="overload"):
        register_sharding(aten.add)
