"""Multi-tensor ops (`torch._foreach_*`) on lists of DTensors with mixed layouts, against single device."""

import math

import pytest
import torch
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.ops.registry import RULES

R = Replicate()
SHAPES = [(7, 5), (6, 9), (5, 3), (3, 4)]  # uneven over 2 and 4 ranks; (3, 4) leaves a rank an empty Shard(0)


def _placements(mesh) -> list[list]:
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [R], [Shard(0)]]
    return [[Shard(0), Shard(1)], [Shard(1), R], [R, R], [R, Shard(0)]]


def _lists(mesh, count: int, seed: int = 0, positive: bool = False):
    """`count` lists of full tensors (one per shape) and the same as DTensors with mixed layouts."""
    generator = torch.Generator().manual_seed(seed)
    fulls = []
    for _ in range(count):
        tensors = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]
        fulls.append([tensor.abs() + 0.5 for tensor in tensors] if positive else tensors)
    dtensors = [[distribute_tensor(full.clone(), mesh, placements) for full, placements in zip(tensors, _placements(mesh))]
                for tensors in fulls]
    return fulls, dtensors


def _assert_lists_close(dtensors, fulls, mesh):
    assert len(dtensors) == len(fulls)
    for dtensor, full, placements in zip(dtensors, fulls, _placements(mesh)):
        assert list(dtensor.placements) == placements
        assert_close(dtensor.full_tensor(), full)


# name -> (function of the lists (and their count), number of lists, needs positive values)
ELEMENTWISE = {
    "add.List": (lambda a, b: torch._foreach_add(a, b, alpha=0.5), 2, False),
    "add.Scalar": (lambda a: torch._foreach_add(a, 1.5), 1, False),
    "add.ScalarList": (lambda a: torch._foreach_add(a, [0.5, -1.0, 2.0, 3]), 1, False),
    "sub.List": (lambda a, b: torch._foreach_sub(a, b), 2, False),
    "mul.List": (lambda a, b: torch._foreach_mul(a, b), 2, False),
    "mul.ScalarList": (lambda a: torch._foreach_mul(a, [0.5, -1.0, 2.0, 3.0]), 1, False),
    "div.Scalar": (lambda a: torch._foreach_div(a, 3.0), 1, False),
    "div.List": (lambda a, b: torch._foreach_div(a, b), 2, True),
    "addcmul.Scalar": (lambda a, b, c: torch._foreach_addcmul(a, b, c, value=0.3), 3, False),
    "addcdiv.ScalarList": (lambda a, b, c: torch._foreach_addcdiv(a, b, c, [0.1, 0.2, -0.3, 0.4]), 3, True),
    "lerp.Scalar": (lambda a, b: torch._foreach_lerp(a, b, 0.25), 2, False),
    "lerp.List": (lambda a, b, c: torch._foreach_lerp(a, b, c), 3, False),
    "sqrt": (lambda a: torch._foreach_sqrt(a), 1, True),
    "neg": (lambda a: torch._foreach_neg(a), 1, False),
    "exp": (lambda a: torch._foreach_exp(a), 1, False),
    "pow.Scalar": (lambda a: torch._foreach_pow(a, 2.0), 1, False),
    "pow.List": (lambda a, b: torch._foreach_pow(a, b), 2, True),
    "pow.ScalarAndTensor": (lambda a: torch._foreach_pow(2.0, a), 1, False),
    "maximum.List": (lambda a, b: torch._foreach_maximum(a, b), 2, False),
    "maximum.Scalar": (lambda a: torch._foreach_maximum(a, 0.1), 1, False),
    "clamp_max.ScalarList": (lambda a: torch._foreach_clamp_max(a, [0.0, 0.5, 1.0, -0.5]), 1, False),
    "clone": (lambda a: torch._foreach_clone(a), 1, False),
}


@spmd()
def test_elementwise_foreach_ops_keep_each_tensors_layout_without_communication(mesh):
    for name, (function, count, positive) in ELEMENTWISE.items():
        fulls, dtensors = _lists(mesh, count, positive=positive)
        with comm.observe() as records:
            results = function(*dtensors)
        assert list(records) == [], name
        _assert_lists_close(results, function(*fulls), mesh)


IN_PLACE = {
    "add_.List": lambda a, b: torch._foreach_add_(a, b, alpha=-2),
    "mul_.Scalar": lambda a, b: torch._foreach_mul_(a, 0.9),
    "addcmul_.Scalar": lambda a, b: torch._foreach_addcmul_(a, b, b, value=0.1),
    "addcdiv_.ScalarList": lambda a, b: torch._foreach_addcdiv_(a, b, [c.abs() + 1 for c in b], [-0.1, 0.2, 0.3, -0.4]),
    "lerp_.Scalar": lambda a, b: torch._foreach_lerp_(a, b, 0.1),
    "sqrt_": lambda a, b: torch._foreach_sqrt_([x.abs_() for x in a]),
    "maximum_.List": lambda a, b: torch._foreach_maximum_(a, b),
    "copy_": lambda a, b: torch._foreach_copy_(a, b),
    "zero_": lambda a, b: torch._foreach_zero_(a),
}


@spmd()
def test_in_place_foreach_ops_write_every_shard(mesh):
    for name, function in IN_PLACE.items():
        fulls, dtensors = _lists(mesh, 2, seed=1)
        function(*fulls)
        with comm.observe() as records:
            function(*dtensors)
        assert list(records) == [], name
        _assert_lists_close(dtensors[0], fulls[0], mesh)


@spmd()
def test_foreach_norm_reduces_the_whole_list_in_one_all_reduce(mesh):
    """Orders 2, 1, 3 (sums of |x|^p), 0 (counts), inf/-inf (max/min; a rank's empty shard of the
    (3, 4) tensor counts as the identity)."""
    fulls, dtensors = _lists(mesh, 1)
    for order in (2.0, 1.0, 3.0, 0.0, math.inf, -math.inf):
        with comm.observe() as records:
            norms = torch._foreach_norm(dtensors[0], order)
        expected = torch._foreach_norm(fulls[0], order)
        for norm, reference in zip(norms, expected):
            assert list(norm.placements) == [R] * mesh.ndim
            assert_close(norm.full_tensor(), reference)
        assert [record.kind for record in records] == ([] if mesh.size() == 1 else ["all_reduce"]), order


@spmd()
def test_foreach_max_and_powsum_and_norm_dtype(mesh):
    fulls, dtensors = _lists(mesh, 1)
    for function in (torch._foreach_max, lambda tensors: torch.ops.aten._foreach_powsum.Scalar(tensors, 3.0),
                     lambda tensors: torch._foreach_norm([t.float() for t in tensors], 2, dtype=torch.float64)):
        with comm.observe() as records:
            results = function(dtensors[0])
        assert len(records) == (0 if mesh.size() == 1 else 1)
        for result, reference in zip(results, function(fulls[0])):
            assert result.dtype == reference.dtype
            assert_close(result.full_tensor(), reference)


@spmd(meshes=[(1,), (2, 2)])
def test_a_list_of_replicated_tensors_needs_no_collective_for_its_norm(mesh):
    tensors = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    dtensors = [distribute_tensor(tensor, mesh, [R] * mesh.ndim) for tensor in tensors]
    with comm.observe() as records:
        norms = torch._foreach_norm(dtensors, 2)
    assert list(records) == []
    for norm, reference in zip(norms, torch._foreach_norm(tensors, 2)):
        assert_close(norm.full_tensor(), reference)


@spmd(meshes=[(2,), (4,)])
def test_partial_elements_stay_partial_where_the_op_is_linear_and_are_reduced_where_not(mesh):
    local_values = [torch.randn(4, 3, dtype=torch.float64) for _ in range(2)]
    partials = [DTensor.from_local(local, mesh, [Partial()]) for local in local_values]
    totals = [partial.full_tensor() for partial in partials]
    scaled = torch._foreach_mul(partials, -2.0)
    assert all(list(result.placements) == [Partial()] for result in scaled)
    for result, total in zip(scaled, totals):
        assert_close(result.full_tensor(), total * -2.0)
    with comm.observe() as records:
        roots = torch._foreach_exp(partials)
    assert [record.kind for record in records] == ["all_reduce"], records  # all reduced together, once
    for result, total in zip(roots, totals):
        assert_close(result.full_tensor(), total.exp())


@spmd(meshes=[(2,), (2, 2)])
def test_changing_scalars_reuse_the_one_decision_of_the_lists_layout(mesh):
    """Adam's bias-corrected step sizes are new on every step; the decision is made once."""
    fulls, dtensors = _lists(mesh, 3, positive=True)
    op = torch.ops.aten._foreach_addcdiv_.ScalarList
    rule = RULES[op]
    decisions = []
    original = rule.decision

    def counting(*args):
        decisions.append(args)
        return original(*args)

    rule.decision = counting
    try:
        for step in range(1, 6):
            scalars = [-0.01 / (1 - 0.9 ** step) * (index + 1) for index in range(len(SHAPES))]
            torch._foreach_addcdiv_(dtensors[0], dtensors[1], dtensors[2], scalars)
            torch._foreach_addcdiv_(fulls[0], fulls[1], fulls[2], scalars)
    finally:
        del rule.decision
    assert len(decisions) <= 1  # none when an earlier test already decided this layout
    _assert_lists_close(dtensors[0], fulls[0], mesh)


@spmd(meshes=[(2,)])
def test_lists_of_unequal_length_raise_on_every_rank(mesh):
    _, dtensors = _lists(mesh, 2)
    with pytest.raises(Exception, match="must have the same|equal length|one entry per tensor"):
        torch._foreach_add(dtensors[0], dtensors[1][:2])


@spmd(meshes=[(2,)])
def test_a_served_list_waits_for_the_data_of_an_async_redistribute(mesh):
    """A list plan reads the local tensors of a list in C; one still waiting for an async redistribute
    (no local value yet) is waited for, with the plan still served."""
    from shardtensor.plan_cache import cache_counts

    fulls, dtensors = _lists(mesh, 1)
    replicated = [distribute_tensor(full, mesh, [R]) for full in fulls[0]]
    for _ in range(2):  # learnt, then served
        torch._foreach_mul(replicated, 3.0)
    pending = [dtensor.redistribute(mesh, [R], async_op=True) for dtensor in dtensors[0]]
    assert any(dtensor._local_value is None for dtensor in pending)
    hits = cache_counts()["aten._foreach_mul.Scalar"].hits
    result = torch._foreach_mul(pending, 3.0)
    assert cache_counts()["aten._foreach_mul.Scalar"].hits == hits + 1
    for dtensor, full in zip(result, fulls[0]):
        assert dtensor.placements == (R,)
        assert_close(dtensor.to_local(), full * 3.0)
    assert not DTensor._waiting  # every wrapper it read was waited for: plans read shards directly again


@spmd(meshes=[(2,)])
def test_a_wrapper_dropped_while_waiting_stops_counting_as_waiting(mesh):
    """List plans read `_local_value` directly only while no wrapper waits for its shard; a waiting
    wrapper dropped unread must not keep them on the slower path (nor stay referenced)."""
    fulls, dtensors = _lists(mesh, 1)
    pending = dtensors[0][0].redistribute(mesh, [R], async_op=True)
    assert pending._local_value is None and len(DTensor._waiting) == 1
    del pending
    assert not DTensor._waiting
    result = torch._foreach_mul(dtensors[0], 2.0)
    for dtensor, full in zip(result, fulls[0]):
        assert_close(dtensor.full_tensor(), full * 2.0)


@spmd(meshes=[(2,), (2, 2)])
def test_tuples_of_dtensors_are_served_like_lists_and_results_are_tuples_as_torchs(mesh):
    """`torch._foreach_sqrt` returns a tuple, which an optimizer passes on (`_foreach_div_(sqrts, ...)`):
    tuples take the multi-tensor fast path as lists do (served without reaching `__torch_dispatch__`),
    and a served out-of-place call returns a tuple, as torch and the call that learnt it do."""
    fulls, dtensors = _lists(mesh, 1, positive=True)
    expected_roots = torch._foreach_sqrt(fulls[0])
    for _ in range(3):  # learnt, then served
        roots = torch._foreach_sqrt(tuple(dtensors[0]))
        assert type(roots) is type(expected_roots) is tuple
        torch._foreach_div_(roots, 2.0)
    dispatched = []
    original = DTensor.__torch_dispatch__
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(DTensor, "__torch_dispatch__",
                            classmethod(lambda cls, op, *rest: dispatched.append(op) or original(op, *rest)))
        roots = torch._foreach_sqrt(tuple(dtensors[0]))
        torch._foreach_div_(roots, 2.0)
    assert dispatched == [] and type(roots) is tuple
    torch._foreach_div_(expected_roots, 2.0)
    _assert_lists_close(roots, expected_roots, mesh)
