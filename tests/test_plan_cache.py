"""The plan and decision caches are keyed on what decides, bounded, and counted per op.

A scalar whose value does not change the rule's decision (`mul`'s factor apart from its sign,
`add(alpha=)`, `addcdiv(value=)`, `lerp(weight=)`) does not make a new decision per value; values
that decide (a factor's sign next to a Partial(max), view sizes, dims) and every scalar's type still
do. Every result is compared with the single-device one, so a decision reused for the wrong call
shows up as a wrong number or layout.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from helpers import all_reduce_records, counting_dispatch, partial_and_value
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, plan_cache, propagation
from shardtensor.debug import CacheCounts, plan_cache_counts

aten = torch.ops.aten


def _counts(op) -> CacheCounts:
    return plan_cache_counts().get(str(op), CacheCounts(0, 0, 0, 0))


def _new_decisions(op, before: CacheCounts) -> int:
    return _counts(op).decisions - before.decisions


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_a_loop_of_scalar_products_makes_one_decision(mesh):
    full = torch.randn(7, 4)  # uneven over 2 and 4 ranks
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    before = _counts(aten.mul.Tensor)
    for step in range(20):
        assert torch.equal((x * float(step)).full_tensor(), full * float(step))
    assert _new_decisions(aten.mul.Tensor, before) <= 1  # one (none if an earlier test made it)
    after = _counts(aten.mul.Tensor)
    assert after.hits - before.hits >= 18 and after.misses - before.misses <= 2  # 0.0 and 1.0: other signs


@spmd(meshes=[(1,), (2,)])
def test_alpha_value_and_weight_pass_through_without_a_new_decision(mesh):
    fulls = [torch.randn(6, 4) for _ in range(3)]
    a, b, c = (distribute_tensor(full, mesh, [Shard(1)]) for full in fulls)
    calls = {
        aten.add.Tensor: (lambda s, a, b, c: torch.add(a, b, alpha=s)),
        aten.addcdiv.default: (lambda s, a, b, c: torch.addcdiv(a, b, c.abs() + 1, value=s)),
        aten.lerp.Scalar: (lambda s, a, b, c: torch.lerp(a, b, s)),
        aten.sub.Tensor: (lambda s, a, b, c: a - s),
    }
    for op, call in calls.items():
        call(0.25, a, b, c)
        before = _counts(op)
        for step in range(1, 8):
            scalar = step / 3
            assert torch.allclose(call(scalar, a, b, c).full_tensor(), call(scalar, *fulls))
        assert _new_decisions(op, before) == 0, op
        assert _counts(op).misses == before.misses, op


@spmd(meshes=[(2,), (2, 2)])
def test_values_that_decide_stay_in_the_key(mesh):
    """A negative factor turns P(max) into P(min); 2, 2.0 and True give other dtypes; sizes and
    dims give other layouts."""
    operands = torch.randn(5)
    high = DTensor.from_local(operands + mesh.get_coordinate()[0], mesh, [Partial("max")] * mesh.ndim)
    value = high.full_tensor()
    for factor, kept in ((2.0, "max"), (-2.0, "min"), (3.0, "max"), (-0.5, "min")):
        result = high * factor
        assert result.placements == (Partial(kept),) * mesh.ndim
        assert torch.equal(result.full_tensor(), value * factor)
    integers = distribute_tensor(torch.arange(8).reshape(4, 2), mesh, [Shard(0)] * mesh.ndim)
    for scalar in (2, 2.0, True, 3, 0.5, False):
        assert (integers * scalar).dtype == (torch.arange(8) * scalar).dtype
        assert (integers + scalar).dtype == (torch.arange(8) + scalar).dtype
        for _ in range(3):  # learnt, then served: a 0-d tensor's dtype stays in the key
            product = integers * torch.tensor(scalar)
            assert product.dtype == (torch.arange(8) * torch.tensor(scalar)).dtype
        assert torch.equal(product.full_tensor(), torch.arange(8).reshape(4, 2) * torch.tensor(scalar))
    full = torch.randn(4, 6)
    x = distribute_tensor(full, mesh, [Shard(1)] * mesh.ndim)
    for shape in ((24,), (2, 12), (8, 3)):
        assert torch.equal(x.view(shape).full_tensor(), full.view(shape))
    for dim in (0, 1, 0):
        summed = x.sum(dim)
        assert torch.allclose(summed.full_tensor(), full.sum(dim))
        assert summed.placements == ((Shard(0),) if dim == 0 else (Partial(),)) * mesh.ndim


@spmd(meshes=[(2,)])
def test_caches_are_bounded_and_drop_the_least_recently_used(mesh):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(plan_cache, "MAX_PLANS", 3)
        monkeypatch.setattr(propagation, "MAX_DECISIONS", 3)
        plan_cache.clear_plans()
        fulls = [torch.randn(rows, 3) for rows in range(2, 9)]
        tensors = [distribute_tensor(full, mesh, [Shard(0)]) for full in fulls]
        kept = tensors[0].exp()  # used again after every other call: never the least recent
        for full, tensor in zip(fulls[1:], tensors[1:]):
            assert torch.equal(tensor.exp().full_tensor(), full.exp())
            assert torch.equal(tensors[0].exp().full_tensor(), kept.full_tensor())
            assert len(plan_cache.plans) <= 3 and len(plan_cache.function_plans) <= 3
            assert len(propagation._cache) <= 3
        before = _counts(aten.exp.default)
        tensors[0].exp()
        assert _counts(aten.exp.default).misses == before.misses  # still cached
        tensors[1].exp()
        assert _counts(aten.exp.default).misses == before.misses + 1  # dropped long ago
        plan_cache.clear_plans()


def test_counts_print_per_op():
    counts = CacheCounts(hits=5, misses=2, decisions=1, decision_hits=1)
    assert str(counts) == "5 hits, 2 misses, 1 decisions, 1 decision hits"


@spmd(meshes=[(1,)])
def test_replicate_inputs_of_a_scaled_sum_keep_their_values(mesh):
    """The first call decides; later calls with other values run with their own values."""
    full = torch.randn(3, 3)
    x = distribute_tensor(full, mesh, [Replicate()])
    results = [(x * (step + 0.5)).full_tensor() for step in range(4)]
    assert all(torch.equal(result, full * (step + 0.5)) for step, result in enumerate(results))


# name -> (aten op, call of `x` (a DTensor or its single-device value) and a 0-d plain tensor `t`)
ZERO_DIM_CALLS = {
    "x * t": (aten.mul.Tensor, lambda x, t: x * t),
    "t * x": (aten.mul.Tensor, lambda x, t: t * x),
    "torch.mul(x, t)": (aten.mul.Tensor, lambda x, t: torch.mul(x, t)),
    "x + t": (aten.add.Tensor, lambda x, t: x + t),
    "x - t": (aten.sub.Tensor, lambda x, t: x - t),
    "x / t": (aten.div.Tensor, lambda x, t: x / t),
    "x.mul_(t)": (aten.mul_.Tensor, lambda x, t: x.mul_(t)),
    "x.add_(t)": (aten.add_.Tensor, lambda x, t: x.add_(t)),
    "x.sub_(t)": (aten.sub_.Tensor, lambda x, t: x.sub_(t)),
    "x.div_(t)": (aten.div_.Tensor, lambda x, t: x.div_(t)),
}
_SCALINGS = {"x * t", "t * x", "torch.mul(x, t)", "x / t", "x.mul_(t)", "x.div_(t)"}
_SUMS = {"x + t", "x - t", "x.add_(t)", "x.sub_(t)"}


def _expected_path(name: str, placement: str, scale: float, coordinate) -> str:
    """How a call runs once learnt: "served" above the dispatcher (its result is computed where the input
    lies) or "plan" (a cached aten plan: one that reduces a Partial input first, as P(max) scaled by a
    negative is P(min), not P(max), and in place the plan writes the reduced copy back into the Partial;
    or one that runs the rule's local op: a scalar added to a P(sum) is added on the operand at
    coordinate 0 only, and the other ranks add a zero)."""
    if placement in ("S(0)", "R", "P(avg)"):
        return "served"
    if name in _SUMS:
        return "served" if placement == "P(max)" or not any(coordinate) else "plan"
    in_place = name.endswith("_(t)")
    if name in _SCALINGS and (not in_place or scale > 0 or placement == "P(sum)"):
        return "served"
    return "plan"


def _zero_dim_input(mesh, placement: str):
    """A fresh DTensor in `placement` ("S(0)", "R", "P(sum)"...) and its single-device value: fresh, so
    that no reduction of an earlier call is kept on a Partial input."""
    if placement.startswith("P"):
        return partial_and_value(mesh, (7, 4), placement[2:-1])
    full = torch.randn(7, 4, dtype=torch.float64)  # 7 rows: uneven over 2 and 4 ranks
    return distribute_tensor(full.clone(), mesh, [Shard(0) if placement == "S(0)" else Replicate()] * mesh.ndim), full


@pytest.mark.parametrize("name", sorted(ZERO_DIM_CALLS))
@spmd(meshes=[(2,), (2, 2)])
def test_a_zero_dim_tensor_operand_whose_value_changes_hits_its_plan(mesh, name):
    """`x * torch.tensor(s)` with a new `s` every call (a scheduled scale), in each layout: the values
    of one device; once both signs were seen (learnt), no plan-cache miss, and the calls whose result
    is computed where the input lies are served above the dispatcher."""
    op, call = ZERO_DIM_CALLS[name]
    warm_up, loop = (1.0, -1.0, 1.0, -1.0), (0.5, -2.5, 3.5, -4.5, 5.5)
    for placement in ("S(0)", "R", "P(sum)", "P(max)", "P(avg)"):
        for step, scale in enumerate(warm_up + loop):
            dtensor, value = _zero_dim_input(mesh, placement)
            scale_tensor = torch.tensor(scale, dtype=torch.float64)
            before = _counts(op)
            with pytest.MonkeyPatch.context() as monkeypatch:
                dispatched = counting_dispatch(monkeypatch)
                result = call(dtensor, scale_tensor)
            expected = call(value, scale_tensor)
            torch.testing.assert_close(result.full_tensor(), expected, msg=lambda text: f"{placement} {scale}: {text}")
            if step < len(warm_up):
                continue
            path, context = _expected_path(name, placement, scale, mesh.get_coordinate()), (placement, scale)
            hits, misses = _counts(op).hits - before.hits, _counts(op).misses - before.misses
            assert (hits, misses) == (1, 0), context
            assert (dispatched == []) == (path == "served"), (context, dispatched)


# name -> (aten op, in-place write into a Partial that must be reduced first, the reduce ops it is tried on)
REDUCED_WRITES = {
    "p.mul_(-2.0)": (aten.mul_.Tensor, lambda p: p.mul_(-2.0), ("max",)),
    "p.mul_(t)": (aten.mul_.Tensor, lambda p: p.mul_(torch.tensor(-0.5, dtype=torch.float64)), ("max",)),
}


@pytest.mark.parametrize("name", sorted(REDUCED_WRITES))
@spmd(meshes=[(2,), (2, 2)])
def test_an_in_place_write_into_a_partial_reduced_first_is_planned_once(mesh, name):
    """A loop of in-place writes that reduce their Partial DTensor first (P(max) scaled by a negative)
    makes one decision and then hits its plan: every call still
    reduces (one all_reduce over every mesh dim, of the tensor's bytes) and stores the reduced result
    back into the Partial, which keeps its placements and holds the single-device value."""
    op, call, reduce_ops = REDUCED_WRITES[name]
    for reduce_op in reduce_ops:
        dtensor, value = partial_and_value(mesh, (7, 4), reduce_op)
        call(dtensor)  # learnt (or found, if an earlier test made the plan)
        call(value)
        before = _counts(op)
        for step in range(4):
            with comm.observe() as records:
                result = call(dtensor)
            assert result is dtensor and dtensor.placements == (Partial(reduce_op),) * mesh.ndim
            assert records == all_reduce_records(mesh, value.numel() * value.element_size()), (reduce_op, step)
            torch.testing.assert_close(dtensor.full_tensor(), call(value))
        after = _counts(op)
        counted = (after.hits - before.hits, after.misses - before.misses, _new_decisions(op, before))
        assert counted == (4, 0, 0), (reduce_op, counted)


# name -> (aten op, a scalar `s` added to a Partial `p`, in place or not)
SCALAR_ADDITIONS = {
    "p.add_(s)": (aten.add_.Tensor, lambda p, s: p.add_(s)),
    "p.add_(t)": (aten.add_.Tensor, lambda p, s: p.add_(torch.tensor(s, dtype=torch.float64))),
    "p - s": (aten.sub.Tensor, lambda p, s: p - s),
    "s - p": (aten.rsub.Scalar, lambda p, s: s - p),
    "add(p, s, alpha)": (aten.add.Tensor, lambda p, s: torch.add(p, s, alpha=0.5)),
}


@pytest.mark.parametrize("name", sorted(SCALAR_ADDITIONS))
@spmd(meshes=[(2,), (2, 2)])
def test_a_loop_adding_a_changing_scalar_to_a_partial_hits_one_plan_without_collectives(mesh, name):
    """`p.add_(s)` with a new `s` every call (was one all_reduce per call on P(sum) and P(max)): after one
    call that learns it, every call hits its plan, issues no collective, keeps the Partial (in place,
    `p` itself) and gives the single-device value; P(sum) adds `s` on one operand (both mesh dims of 2x2)."""
    op, call = SCALAR_ADDITIONS[name]
    plan_cache.clear_plans()  # from empty caches, so that the counts do not depend on the tests run before
    for reduce_op in ("sum", "max", "avg"):
        dtensor, value = partial_and_value(mesh, (7, 4), reduce_op)
        placements = call(dtensor, 0.25).placements  # learnt
        call(value, 0.25)
        before = _counts(op)
        for step in range(4):
            scalar = 1.5 + step
            with comm.observe() as records:
                result = call(dtensor, scalar)
            assert records == [] and result.placements == placements, (reduce_op, step, records)
            torch.testing.assert_close(result.full_tensor(), call(value, scalar))
            assert (result is dtensor) == name.startswith("p.add_")
        after = _counts(op)
        counted = (after.hits - before.hits, after.misses - before.misses, _new_decisions(op, before))
        assert counted == (4, 0, 0), (reduce_op, counted)


@spmd(meshes=[(2,)])
def test_a_planned_in_place_write_that_reads_its_own_target_reads_what_it_writes(mesh):
    """`p.add_(p)` on P(max) (both operands reduced to Shard(0)) and `p.mul_(p)` on P(sum) (the operand
    reduced): a plan is keyed by specs, so the plan made by `p.add_(q)` (q of p's spec) serves `p.add_(p)`
    too. The written copy is stored back, and a read of the same DTensor moved alike reads that copy: the
    single-device values, with one reduction of p per call."""
    calls = {
        "add_": ("max", torch.Tensor.add_, ["reduce_scatter", "all_gather"]),
        "mul_": ("sum", torch.Tensor.mul_, ["all_reduce"]),
    }
    for name, (reduce_op, call, kinds) in calls.items():
        dtensor, _ = partial_and_value(mesh, (7, 4), reduce_op)
        other, _ = partial_and_value(mesh, (7, 4), reduce_op, seed=10)
        call(dtensor, other)  # makes the plan
        for step in range(3):
            dtensor, value = partial_and_value(mesh, (7, 4), reduce_op, seed=step)
            with comm.observe() as records:
                call(dtensor, dtensor)
            call(value, value)
            torch.testing.assert_close(dtensor.full_tensor(), value, msg=lambda text: f"{name}: {text}")
            assert dtensor.placements == (Partial(reduce_op),)
            assert [record.kind for record in records] == kinds, name


# In-place binary ops whose rule reduces an operand read from a P(sum): with the written tensor itself as
# that operand, the written result is stored back, not the reduced read (wrong values before).
SELF_OPERAND_WRITES = {
    "p.atan2_(p)": lambda p: p.atan2_(p),
    "p.hypot_(p)": lambda p: p.hypot_(p),
    "p.fmod_(p)": lambda p: p.fmod_(p),
    "p.xlogy_(p)": lambda p: p.xlogy_(p),
    "p.addcmul_(p, p)": lambda p: p.addcmul_(p, p),
}


@spmd(meshes=[(2,), (2, 2)])
def test_in_place_ops_reading_their_own_partial_target_give_single_device_values(mesh):
    """`p.atan2_(p)` and the like on a P(sum): the single-device values, the DTensor itself returned."""
    for name, call in SELF_OPERAND_WRITES.items():
        dtensor, value = partial_and_value(mesh, (7, 4), "sum")
        result = call(dtensor)
        call(value)
        assert result is dtensor, name
        torch.testing.assert_close(dtensor.full_tensor(), value, equal_nan=True, msg=lambda text: f"{name}: {text}")


def test_a_full_cache_keeps_both_keys_of_a_plan_in_use():
    """A plan stored under its values' key and its value-free key is one object with one `used` flag. A
    CLOCK sweep in a full cache that cleared the flag through the first key evicted the second right after
    it (they are stored side by side), so the next call with new values missed (seen after ~3,000 tests
    in a worker: `p - s` on 2x2 counted one miss in four calls)."""

    class Entry:
        def __init__(self, used):
            self.used = used

    cache = OrderedDict()
    shared = Entry(True)
    cache["values"], cache["value-free"] = shared, shared
    for index in range(plan_cache.MAX_PLANS - 2):
        cache[index] = Entry(False)
    plan_cache._store(cache, "new", Entry(False))
    assert cache["value-free"] is shared and cache["values"] is shared and 0 not in cache
    assert len(cache) == plan_cache.MAX_PLANS
