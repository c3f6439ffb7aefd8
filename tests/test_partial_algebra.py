"""Partial algebra: elementwise ops keep Partial only where that is exact, and reduce first otherwise."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import local_piece, partial_and_value, torch_collectives, torch_mesh
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode


def _operand(rank: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """What rank `rank` holds: different on every rank, so a wrong reduction shows."""
    return (torch.linspace(-1, 2, 6, dtype=dtype).reshape(2, 3) * (rank + 1 + seed) - rank).to(dtype)


def _partial(mesh, reduce_op="sum", seed=0, dtype=torch.float64):
    """A DTensor Partial(reduce_op) on every mesh dim and its single-device value."""
    local = _operand(dist.get_rank(), seed, dtype)
    operands = torch.stack([_operand(rank, seed, dtype) for rank in range(mesh.size())])
    value = {"sum": operands.sum(0), "avg": operands.mean(0), "max": operands.amax(0), "min": operands.amin(0)}
    return DTensor.from_local(local, mesh, [Partial(reduce_op)] * mesh.ndim), value[reduce_op]


def _replicate(mesh, full):
    return distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)


def _check(result, value, placements=None, *, exact=False):
    if placements is not None:
        assert result.placements == placements, (result.placements, placements)
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result.full_tensor(), value, **tolerance)


@spmd()
def test_partial_sum_plus_scalar_or_replicate_adds_it_once(mesh):
    partial, value = _partial(mesh)
    r_full = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    with shardtensor.strict_mode():
        plus_scalar, plus_replicate, minus = partial + 1.5, partial + _replicate(mesh, r_full), 2 - partial
    _check(plus_scalar, value + 1.5)
    _check(plus_replicate, value + r_full)
    _check(minus, 2 - value)
    # A scalar is added on one operand: the sum stays Partial (strict mode: no fallback).
    assert plus_scalar.placements == minus.placements == (Partial("sum"),) * mesh.ndim
    # P(sum) + R may stay P(sum) by making R Partial too (R on one coordinate, zeros elsewhere): exact and local.


@spmd()
def test_a_scalar_added_in_place_or_by_a_list_op_to_a_partial_sum_is_added_once(mesh):
    """PEER_BUGS #163193 through the other doors: in place (the Partial itself holds the sum after), a
    0-d plain tensor, `_foreach_add` with a scalar, a list of scalars or a 0-d tensor; each adds the
    scalar once: on one operand without a collective, or (a multi-tensor op, which has no local op per
    element) after reducing the Partial once (one all_reduce over every mesh dim at once)."""
    scalar = torch.tensor(1.5, dtype=torch.float64)
    calls = {"add_": lambda t: t.add_(1.5), "+=": lambda t: t.__iadd__(1.5), "sub_": lambda t: t.sub_(2.0),
             "add(alpha)": lambda t: torch.add(t, 1.5, alpha=2), "rsub": lambda t: torch.rsub(t, 2.0),
             "+ 0-d": lambda t: t + scalar, "add_(0-d)": lambda t: t.add_(scalar),
             "_foreach_add": lambda t: torch._foreach_add([t], 1.5)[0],
             "_foreach_add_": lambda t: (torch._foreach_add_([t], 1.5), t)[1],
             "_foreach_add([s])": lambda t: torch._foreach_add([t], [1.5])[0],
             "_foreach_sub_(0-d)": lambda t: (torch._foreach_sub_([t], scalar), t)[1]}
    reduced_once = ["all_reduce"] if mesh.size() > 1 else []
    for name, call in calls.items():
        partial, value = _partial(mesh)
        with shardtensor.strict_mode(), comm.observe() as records:
            result = call(partial)
        assert [record.kind for record in records] == (reduced_once if name.startswith("_foreach") else []), (name, records)
        expected = call(value)
        _check(result, expected)
        if name.endswith("_") or name in ("+=", "add_(0-d)", "_foreach_sub_(0-d)"):
            assert result is partial, name


@spmd()
def test_linear_ops_keep_partial_sum_without_communication(mesh):
    a, a_value = _partial(mesh, seed=0)
    b, b_value = _partial(mesh, seed=3)
    r_full = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).reshape(2, 3)
    r = _replicate(mesh, r_full)
    partial = (Partial(),) * mesh.ndim
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [a + b, a - b, torch.add(a, b, alpha=2), -a, a * 3, 3 * a, a / 4, a * r, r * a, a / r,
                   torch.lerp(a, b, 0.25), torch.addcmul(a, b, r), torch.where(r > 1, a, b)]
    assert list(records) == []
    expected = [a_value + b_value, a_value - b_value, a_value + 2 * b_value, -a_value, a_value * 3, 3 * a_value,
                a_value / 4, a_value * r_full, r_full * a_value, a_value / r_full, torch.lerp(a_value, b_value, 0.25),
                torch.addcmul(a_value, b_value, r_full), torch.where(r_full > 1, a_value, b_value)]
    for result, reference in zip(results, expected):
        _check(result, reference, partial)


@spmd()
def test_nonlinear_ops_reduce_partial_first(mesh):
    a, a_value = _partial(mesh, seed=0)
    b, b_value = _partial(mesh, seed=3)
    with shardtensor.strict_mode():
        results = [a * b, a / b, a.exp(), a.relu(), torch.maximum(a, b), a > 0.5, a ** 2, a.abs()]
    expected = [a_value * b_value, a_value / b_value, a_value.exp(), a_value.relu(), torch.maximum(a_value, b_value),
                a_value > 0.5, a_value ** 2, a_value.abs()]
    for result, reference in zip(results, expected):
        if result is not results[0] and result is not results[1]:  # a * b may reduce only b and stay P(sum)
            assert not any(p.is_partial() for p in result.placements)
        _check(result, reference)


@spmd()
def test_max_and_min_partials(mesh):
    high, high_value = _partial(mesh, "max")
    low, low_value = _partial(mesh, "min", seed=2)
    r_full = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    r = _replicate(mesh, r_full)
    maximum, minimum = (Partial("max"),) * mesh.ndim, (Partial("min"),) * mesh.ndim
    with shardtensor.strict_mode(), comm.observe() as records:
        kept = [(-high, minimum), (-low, maximum), (high.relu(), maximum), (high.exp(), maximum),
                (low.clamp(-1, 1), minimum), (high * 2, maximum), (high * -2, minimum),
                (torch.maximum(high, r), maximum), (high + 1, maximum), (1 - high, minimum)]
    assert list(records) == []
    expected = [-high_value, -low_value, high_value.relu(), high_value.exp(), low_value.clamp(-1, 1), high_value * 2,
                high_value * -2, torch.maximum(high_value, r_full), high_value + 1, 1 - high_value]
    for (result, placements), reference in zip(kept, expected):
        _check(result, reference, placements, exact=True)
    with shardtensor.strict_mode():  # not monotone, or a sum of maxima: reduce first
        reduced = [high * high, high.sin(), high + low, torch.minimum(high, low)]
    expected = [high_value * high_value, high_value.sin(), high_value + low_value, torch.minimum(high_value, low_value)]
    for result, reference in zip(reduced, expected):
        _check(result, reference, exact=True)
    assert not any(p.is_partial() for result in reduced[:3] for p in result.placements)


@spmd()
def test_in_place_scaling_of_max_and_min_partials_by_a_negative_number_reduces_first(mesh):
    """x.mul_(-1) of a P(max) x: the negated operands are a P(min)'s, but x keeps its placement in
    place; so x is reduced first and holds its new value as a P(max) again (out of place, -x is P(min))."""
    calls = {"mul_(-1)": lambda t: t.mul_(-1), "neg_": lambda t: t.neg_(), "div_(-2)": lambda t: t.div_(-2),
             "mul_(-0.5)": lambda t: t.mul_(-0.5), "__imul__(-3)": lambda t: t.__imul__(-3),
             "_foreach_mul_(-1)": lambda t: torch._foreach_mul_([t], -1), "_foreach_neg_": lambda t: torch._foreach_neg_([t])}
    for reduce_op in ("max", "min"):
        for name, call in calls.items():
            x, value = _partial(mesh, reduce_op)
            placements = x.placements
            with shardtensor.strict_mode(), comm.observe() as records:
                call(x)
            call(value)
            assert x.placements == placements, (reduce_op, name)
            reduced_once = ["all_reduce"] if mesh.size() > 1 else []  # over every mesh dim at once
            assert [record.kind for record in records] == reduced_once, (reduce_op, name, records)
            _check(x, value, exact=True)
    for reduce_op in ("max", "min"):  # a positive scale keeps the Partial, without communication
        x, value = _partial(mesh, reduce_op)
        with shardtensor.strict_mode(), comm.observe() as records:
            x.mul_(2)
        assert list(records) == []
        _check(x, value * 2, (Partial(reduce_op),) * mesh.ndim, exact=True)


@spmd()
def test_scaling_a_partial_by_inf_or_nan_or_dividing_by_zero_reduces_first(mesh):
    """inf * (a0 + a1) is not inf * a0 + inf * a1 (operands of both signs give NaN): no Partial row, even
    right after a finite scale of the same Partial cached its decision and plan (multi-tensor plans
    included, with a scalar or a list of scalars; a 0-d plain tensor scale too)."""
    inf, nan = math.inf, math.nan
    calls = {"* 2": lambda t: t * 2, "* inf": lambda t: t * inf, "* -inf": lambda t: t * -inf, "* nan": lambda t: t * nan,
             "/ 0": lambda t: t / 0, "/ -0.0": lambda t: t / -0.0, "/ 4": lambda t: t / 4,
             "mul_(-inf)": lambda t: t.mul_(-inf), "div_(0)": lambda t: t.div_(0),
             "_foreach_mul(2)": lambda t: torch._foreach_mul([t], 2.0)[0],
             "_foreach_mul(inf)": lambda t: torch._foreach_mul([t], inf)[0],
             "_foreach_div(0)": lambda t: torch._foreach_div([t], 0.0)[0],
             "_foreach_mul([2])": lambda t: torch._foreach_mul([t], [2.0])[0],
             "_foreach_mul([inf])": lambda t: torch._foreach_mul([t], [inf])[0],
             "_foreach_mul([nan])": lambda t: torch._foreach_mul([t], [nan])[0],
             # a 0-d plain tensor decides by its value's sign like a Python number (read next to a Partial)
             "* tensor(2)": lambda t: t * torch.tensor(2.0), "* tensor(inf)": lambda t: t * torch.tensor(inf),
             "tensor(-inf) *": lambda t: torch.tensor(-inf) * t, "* tensor(nan)": lambda t: t * torch.tensor(nan),
             "/ tensor(4)": lambda t: t / torch.tensor(4.0), "/ tensor(0)": lambda t: t / torch.tensor(0.0),
             "mul_(tensor(-inf))": lambda t: t.mul_(torch.tensor(-inf)),
             "div_(tensor(0))": lambda t: t.div_(torch.tensor(0, dtype=torch.int64)),
             "_foreach_mul(tensor(2))": lambda t: torch._foreach_mul([t], torch.tensor(2.0))[0],
             "_foreach_mul(tensor(-inf))": lambda t: torch._foreach_mul([t], torch.tensor(-inf))[0],
             "_foreach_div_(tensor(0))": lambda t: (torch._foreach_div_([t], torch.tensor(0.0)), t)[1]}
    finite = ("* 2", "/ 4", "_foreach_mul(2)", "_foreach_mul([2])", "* tensor(2)", "/ tensor(4)", "_foreach_mul(tensor(2))")
    for reduce_op in ("sum", "avg", "max", "min"):
        for name, call in calls.items():
            x, value = _partial(mesh, reduce_op)
            with shardtensor.strict_mode():
                result = call(x)
            torch.testing.assert_close(result.full_tensor(), call(value), rtol=0, atol=0, equal_nan=True,
                                       msg=lambda message, name=name: f"P({reduce_op}) {name}: {message}")
            if name in finite and reduce_op in ("sum", "avg"):
                assert result.placements == x.placements, name
            elif name not in finite:
                assert not any(p.is_partial() for p in result.placements) or result is x, (reduce_op, name)


@spmd()
def test_a_0d_tensor_scale_of_a_partial_communicates_like_a_python_number(mesh):
    """Read next to a Partial, a 0-d plain tensor's sign picks the rows a Python number would: a positive
    or negative finite scale keeps (or swaps) the Partial without communication, an infinite one costs
    exactly the one all_reduce of reducing first; each call after the other reuses no wrong plan."""
    reduced_once = ["all_reduce"] if mesh.size() > 1 else []
    cases = [("sum", lambda t: t * torch.tensor(2.0), "sum", []),
             ("max", lambda t: torch.tensor(-2.0) * t, "min", []),
             ("max", lambda t: t / torch.tensor(0.5), "max", []),
             ("sum", lambda t: t * torch.tensor(math.inf), None, reduced_once),
             ("avg", lambda t: t / torch.tensor(0.0), None, reduced_once),
             ("sum", lambda t: t * torch.tensor(3.0), "sum", [])]
    for reduce_op, call, kept, kinds in cases * 2:
        x, value = _partial(mesh, reduce_op)
        with shardtensor.strict_mode(), comm.observe() as records:
            result = call(x)
        assert [record.kind for record in records] == kinds, (reduce_op, kept, records)
        placements = (Partial(kept),) * mesh.ndim if kept else (Replicate(),) * mesh.ndim
        assert result.placements == placements, (reduce_op, result.placements)
        torch.testing.assert_close(result.full_tensor(), call(value), rtol=1e-12, atol=1e-12, equal_nan=True)


@spmd()
def test_partial_avg_commutes_with_adding_a_replicated_value(mesh):
    average, value = _partial(mesh, "avg")
    with shardtensor.strict_mode(), comm.observe() as records:
        results = [average + 1, average * 3, average - average]
    assert list(records) == []
    for result, reference in zip(results, [value + 1, value * 3, value - value]):
        _check(result, reference, (Partial("avg"),) * mesh.ndim)


@spmd()
def test_casts_keep_partial_only_when_widening_floats(mesh):
    single, value = _partial(mesh, dtype=torch.float32)
    with shardtensor.strict_mode(), comm.observe() as records:
        wider = single.to(torch.float64)
    assert list(records) == [] and wider.placements == (Partial(),) * mesh.ndim
    torch.testing.assert_close(wider.full_tensor(), value.double(), rtol=1e-6, atol=1e-6)
    leaf = single.detach().requires_grad_()
    (leaf.to(torch.float64) * 3).sum().backward()  # backward through the kept cast too
    assert leaf.grad.dtype == torch.float32 and torch.equal(leaf.grad.full_tensor(), torch.full((2, 3), 3.0))
    double, double_value = _partial(mesh)
    with shardtensor.strict_mode():
        narrower, integer = double.to(torch.float32), double.to(torch.int64)
    assert not any(p.is_partial() for p in narrower.placements + integer.placements)
    assert torch.equal(narrower.full_tensor(), double_value.float())
    assert torch.equal(integer.full_tensor(), double_value.to(torch.int64))
    high, high_value = _partial(mesh, "max")
    with shardtensor.strict_mode():
        narrowed = high.to(torch.float32)
    assert narrowed.placements == (Partial("max"),) * mesh.ndim
    assert torch.equal(narrowed.full_tensor(), high_value.float())


@pytest.mark.parametrize("length", [5, 3])
@spmd(meshes=[(2,), (4,)])
def test_mean_over_uneven_shards_is_weighted(mesh, length):
    full = torch.linspace(1, 3, length, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)])
    torch.testing.assert_close((x * 2 + 1).mean().full_tensor(), (full * 2 + 1).mean(), rtol=1e-12, atol=1e-12)


@spmd(meshes=[(2, 2)])
def test_partial_sum_and_avg_mix_across_mesh_dims(mesh):
    """P(sum) on one mesh dim and P(avg) on the other commute (both linear), as in torch DTensor: the
    value, redistributes (one all_reduce over both mesh dims, see the next test) and linear ops,
    which keep the mix without communication, match one device; so does a sum whose result mixes them."""
    for reduce_ops in (("sum", "avg"), ("avg", "sum")):
        mixed, value = partial_and_value(mesh, (4, 6), reduce_ops)
        other, other_value = partial_and_value(mesh, (4, 6), reduce_ops, seed=7)
        placements = tuple(Partial(op) for op in reduce_ops)
        _check(mixed, value, placements)
        with comm.observe() as records:
            replicated = mixed.redistribute(mesh, [Replicate(), Replicate()])
        assert [(record.kind, record.mesh_dim) for record in records] == [("all_reduce", (0, 1))]
        _check(replicated, value)
        for targets in ([Shard(0), Replicate()], [Shard(0), Shard(1)], [Replicate(), placements[1]]):
            _check(mixed.redistribute(mesh, targets), value, tuple(targets))
        with shardtensor.strict_mode(), comm.observe() as records:
            results = [mixed + other, mixed * 2.5, mixed.sum(), mixed.sum(dim=0), mixed.mean(dim=1), mixed.cumsum(0)]
        assert list(records) == [], [(record.kind, record.mesh_dim) for record in records]
        references = [value + other_value, value * 2.5, value.sum(), value.sum(dim=0), value.mean(dim=1),
                      value.cumsum(0)]
        for result, reference in zip(results, references):
            _check(result, reference, placements)
    full = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    piece = local_piece(full, (2, 2), [Shard(1), Replicate()], mesh.get_coordinate())
    scale = 1.0 + mesh.get_coordinate()[1]  # operands 1x and 2x the piece: their average is 1.5x
    sharded_average = DTensor.from_local(piece * scale, mesh, [Shard(1), Partial("avg")])
    with shardtensor.strict_mode(), comm.observe() as records:
        row_sums = sharded_average.sum(dim=1)  # the result mixes them: P(sum) from the sharded dim
    assert list(records) == []
    _check(row_sums, full.sum(dim=1) * 1.5, (Partial("sum"), Partial("avg")))


MIXES = {2: [("sum", "avg"), ("avg", "sum")], 3: [("sum", "avg", "sum"), ("avg", "avg", "sum"), ("avg", "sum", "avg")]}


@spmd(meshes=[(2, 2), (2, 2, 2)])
def test_a_sum_and_avg_mix_reduces_in_one_collective(mesh):
    """A P(sum)/P(avg) mix reduces over all its mesh dims in one collective, a sum divided by the
    ranks along the avg mesh dims: one all_reduce to Replicate, one reduce_scatter to Shard(0) on
    every mesh dim, with ring bytes over the whole mesh (asynchronously too). torch DTensor (the oracle, same operands)
    gives the same values with one all_reduce per mesh dim: 2 on 2x2, 3 on 2x2x2, where ours is 1."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate

    ranks, shape, itemsize = mesh.size(), (8, 6), 8
    for reduce_ops in MIXES[mesh.ndim]:
        mixed, value = partial_and_value(mesh, shape, reduce_ops)
        for targets, kind, received in [
            ([Replicate()] * mesh.ndim, "all_reduce", 2 * (ranks - 1) * 48 * itemsize // ranks),
            ([Shard(0)] * mesh.ndim, "reduce_scatter", (ranks - 1) * 48 * itemsize // ranks),
        ]:
            with CommDebugMode() as mode:
                result = mixed.redistribute(mesh, targets)
            assert mode.get_comm_counts() == {kind: 1}, (reduce_ops, targets, mode.get_comm_counts())
            assert mode.get_total_bytes().received == received
            _check(result, value, tuple(targets))
            _check(mixed.redistribute(mesh, targets, async_op=True), value, tuple(targets))  # divided once waited
        oracle = TorchDTensor.from_local(mixed.to_local(), torch_mesh(mesh), [TorchPartial(op) for op in reduce_ops])
        reduced, torch_count = torch_collectives(lambda: oracle.redistribute(placements=[TorchReplicate()] * mesh.ndim))
        assert torch_count == mesh.ndim
        torch.testing.assert_close(reduced.to_local(), value, rtol=1e-12, atol=1e-12)


@spmd(meshes=[(2, 2)])
def test_partials_that_do_not_commute_are_not_reduced(mesh):
    """avg (or sum) of maxima is not the maximum of averages: such a mix is refused with what is allowed,
    and the way out the message gives (reduce one mesh dim by hand, rebuild) gives the value of that order."""
    for reduce_ops in (("avg", "max"), ("sum", "min")):
        mixed, value = partial_and_value(mesh, (2, 3), reduce_ops)  # value: mesh dim 1 reduced first
        with pytest.raises(ValueError, match=r"may mix Partial\('sum'\) with Partial\('avg'\)"):
            mixed.full_tensor()
        reduced = comm.all_reduce(mixed.to_local(), mesh, 1, reduce_op=reduce_ops[1])
        _check(DTensor.from_local(reduced, mesh, [Partial(reduce_ops[0]), Replicate()]), value)


# name -> call of `x` (a DTensor or its single-device value) and a scalar `s`: a Python number or a 0-d plain tensor
SCALAR_SUMS = {
    "x + s": lambda x, s: x + s,
    "s + x": lambda x, s: s + x,
    "x - s": lambda x, s: x - s,
    "s - x": lambda x, s: s - x,
    "add(x, s, alpha=-2)": lambda x, s: torch.add(x, s, alpha=-2),
    "add(s, x, alpha=-2)": lambda x, s: torch.add(s, x, alpha=-2) if isinstance(s, torch.Tensor) else s - 2 * x,  # s, x: 2 ops
    "sub(x, s, alpha=3)": lambda x, s: torch.sub(x, s, alpha=3),
    "rsub(x, s, alpha=2)": lambda x, s: torch.rsub(x, s, alpha=2),
    "x.add_(s)": lambda x, s: x.add_(s),
    "x.sub_(s)": lambda x, s: x.sub_(s),
    "sub(x, s, out=)": lambda x, s: torch.sub(x, s, out=x.clone()),  # out lies like the result
}


def _sum_placement(name: str, reduce_op: str) -> str:
    """The reduce op of `name` on P(reduce_op) plus `scalar`: a negative coefficient of `x` swaps max and min."""
    negated = name in ("s - x", "rsub(x, s, alpha=2)", "add(s, x, alpha=-2)")
    return {"max": "min", "min": "max"}.get(reduce_op, reduce_op) if negated else reduce_op


@pytest.mark.parametrize("name", sorted(SCALAR_SUMS))
@spmd(meshes=[(2,), (2, 2)])
def test_a_scalar_added_to_a_partial_keeps_it_without_a_collective(mesh, name):
    """P(x) plus or minus a Python number or a 0-d plain tensor stays Partial, with no collective: a
    P(sum) adds it on one operand (a P(sum) on either mesh dim of 2x2 with P(avg), or both), P(avg)/P(max)/P(min)
    on every operand, and `s - P(max)` is P(min). Values of one device, ints too."""
    call = SCALAR_SUMS[name]
    layouts = [("sum",), ("avg",), ("max",), ("min",)]
    if mesh.ndim == 2:
        layouts += [("sum", "avg"), ("avg", "sum")]
    scalars = [1.5, -3, torch.tensor(2.5, dtype=torch.float64), torch.tensor(-4.0)]
    for reduce_ops in layouts:
        reduce_ops = reduce_ops * mesh.ndim if len(reduce_ops) == 1 else reduce_ops
        for scalar in scalars:
            dtensor, value = partial_and_value(mesh, (7, 4), reduce_ops)
            with CommDebugMode() as mode:
                result = call(dtensor, scalar)
            assert mode.get_total_counts() == 0, (reduce_ops, scalar, mode.get_comm_counts())
            expected = tuple(Partial(_sum_placement(name, op)) for op in reduce_ops)
            _check(result, call(value, scalar), expected)
    if mesh.ndim == 2:  # uneven rows sharded over mesh dim 0, P(sum) over mesh dim 1
        dtensor, value = partial_and_value(mesh, (7, 4), "sum")
        dtensor = dtensor.redistribute(mesh, [Shard(0), Partial("sum")])
        with CommDebugMode() as mode:
            result = call(dtensor, scalars[2])
        assert mode.get_total_counts() == 0
        _check(result, call(value, scalars[2]), (Shard(0), Partial("sum")))
    operands = torch.stack([torch.arange(28).reshape(7, 4) * (rank + 1) - 9 * rank for rank in range(mesh.size())])
    for reduce_op, value in (("sum", operands.sum(0)), ("max", operands.amax(0))):  # ints: exact
        dtensor = DTensor.from_local(operands[dist.get_rank()].clone(), mesh, [Partial(reduce_op)] * mesh.ndim)
        with CommDebugMode() as mode:
            result = call(dtensor, 3)
        assert mode.get_total_counts() == 0
        _check(result, call(value, 3), (Partial(_sum_placement(name, reduce_op)),) * mesh.ndim, exact=True)


@spmd(meshes=[(2,), (2, 2)])
def test_a_non_finite_addend_keeps_only_what_is_exact(mesh):
    """`P(max) + inf` is reduced first (an operand of -inf would give NaN), `P(sum) + inf` and
    `P(avg) - nan` stay Partial; an infinite alpha scaling the DTensor keeps no Partial (as a scale)."""
    for reduce_op, call, stays in [
        ("max", lambda x: x + math.inf, False),
        ("min", lambda x: x - math.inf, False),
        ("sum", lambda x: x + math.inf, True),
        ("avg", lambda x: x - math.nan, True),
        ("sum", lambda x: torch.add(torch.tensor(1.0, dtype=torch.float64), x, alpha=math.inf), False),
    ]:
        dtensor, value = partial_and_value(mesh, (7, 4), reduce_op)
        with CommDebugMode() as mode:
            result = call(dtensor)
        assert (mode.get_total_counts() == 0) == stays, (reduce_op, mode.get_comm_counts())
        assert result.placements[0].is_partial() == stays
        torch.testing.assert_close(result.full_tensor(), call(value), equal_nan=True)


@spmd(meshes=[(2,), (2, 2)])
def test_foreach_add_of_a_scalar_to_a_partial_sum_reduces_it_first(mesh):
    """A multi-tensor call cannot add on one operand only (no local op per element): its P(sum)
    elements are reduced first, in one all_reduce, and P(max) ones stay Partial."""
    sums, maxima = partial_and_value(mesh, (7, 4), "sum"), partial_and_value(mesh, (5,), "max", seed=3)
    with CommDebugMode() as mode:
        results = torch._foreach_add([sums[0], maxima[0]], 2.0)
    assert mode.get_comm_counts() == {"all_reduce": 1}
    assert results[1].placements == (Partial("max"),) * mesh.ndim
    for result, (_, value) in zip(results, (sums, maxima)):
        torch.testing.assert_close(result.full_tensor(), value + 2.0)
