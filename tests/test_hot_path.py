"""The eager hot path: cached plans (`plan_cache.Plan`) must be reused, and never for other inputs.

Each test alternates calls of one op whose decisions differ (shapes, layouts, scalar arguments,
meshes) and checks every result against the single-device value, so a plan or a decision reused
for the wrong inputs shows up as a wrong number.
"""

from __future__ import annotations

import functools
import operator
import warnings

import pytest
import torch
from helpers import counting_dispatch, partial_and_value
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Replicate, Shard, comm, dispatch, distribute_tensor, plan_cache
from shardtensor.mesh import DeviceMesh
from shardtensor.ops.registry import RULES, register_rule
from shardtensor.rules import Row


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
@spmd()
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
    key = functools.partial(plan_cache.fast_key, DTensor, op)
    assert key(([1, 2],), {}) != key(([1.0, 2.0],), {})
    assert key(([1, 2],), {}) != key(((1, 2),), {})
    assert key(([[1], [2]],), {}) is None  # nested: the slow path decides


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


@spmd()
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


# ---- the `__torch_function__` fast path ----------------------------------------------------------

# name -> (call, whether the fast path may serve it). Each takes (x, y, weight): x and y of one
# shape and layout, weight a Replicate square matrix.
FUNCTION_CALLS = {
    "add": (lambda x, y, w: x + y, True),
    "mul": (lambda x, y, w: torch.mul(x, y), True),
    "relu": (lambda x, y, w: x.relu(), True),
    "sum": (lambda x, y, w: x.sum(), True),
    "sum dim 1": (lambda x, y, w: x.sum(1), True),
    "mm": (lambda x, y, w: x @ w, True),
    "scalar": (lambda x, y, w: x * 2.5, True),
    "gelu": (lambda x, y, w: torch.nn.functional.gelu(x), True),
    "cast": (lambda x, y, w: x.to(torch.float64), True),
    "partial times scalar": (lambda x, y, w: x.sum() * 3, True),
    "partial plus scalar": (lambda x, y, w: x.sum() + 1, True),
    "0-d tensor": (lambda x, y, w: x * torch.tensor(2.5), True),
    "partial times 0-d tensor": (lambda x, y, w: x.sum() / torch.tensor(-3.0), True),
    "where with a 0-d tensor": (lambda x, y, w: torch.where(y > 0, x, torch.tensor(0.5)), True),
    "in place with a 0-d tensor": (lambda x, y, w: x.clone().sub_(torch.tensor(0.5)), True),
    "view": (lambda x, y, w: x.view(-1), False),
    "transpose": (lambda x, y, w: x.t(), False),
    "in place": (lambda x, y, w: x.clone().add_(y), True),
    "out=": (lambda x, y, w: torch.add(x, y, out=torch.empty_like(x)), False),
    "dropout": (lambda x, y, w: torch.nn.functional.dropout(x, 0.5), False),
}


def _same_dtensor(result, reference) -> None:
    """The fast path's result is exactly the normal path's: layout, metadata and local values."""
    assert type(result) is type(reference)
    if not isinstance(reference, torch.Tensor):
        return
    assert result.sharding == reference.sharding and result.placements == reference.placements
    assert (result.shape, result.stride(), result.dtype) == (reference.shape, reference.stride(), reference.dtype)
    assert result.requires_grad == reference.requires_grad
    local, expected = result.to_local(), reference.to_local()
    assert (local.shape, local.stride(), local.dtype) == (expected.shape, expected.stride(), expected.dtype)
    assert torch.equal(local, expected)


@spmd()
def test_function_fast_path_gives_exactly_the_aten_path_result(mesh):
    """Every call three times with the fast path off and on (learn, then serve): same results."""
    from shardtensor import torch_function

    inputs = []
    for rows, placement in ((7, Shard(0)), (5, Shard(1)), (3, Replicate())):  # uneven shards too
        full, other = torch.randn(rows, 6), torch.randn(rows, 6)
        if True:
            placements = _placements(mesh, placement)
            inputs.append((full, other, distribute_tensor(full, mesh, placements), distribute_tensor(other, mesh, placements)))
    weight_full = torch.randn(6, 6)
    weight = distribute_tensor(weight_full, mesh, _placements(mesh, Replicate()))
    served = set()
    for name, (function, may_serve) in FUNCTION_CALLS.items():
        for full, other, x, y in inputs:
            torch.manual_seed(1)
            torch_function.fast_path_enabled = False
            try:
                reference = function(x, y, weight)
            finally:
                torch_function.fast_path_enabled = True
            for _ in range(3):
                torch.manual_seed(1)
                with pytest.MonkeyPatch.context() as monkeypatch:
                    dispatched = counting_dispatch(monkeypatch)
                    result = function(x, y, weight)
                if name != "dropout":  # random: each call draws new values
                    _same_dtensor(result, reference)
            if not dispatched:
                served.add(name)
            if name != "dropout":
                torch.testing.assert_close(result.full_tensor(), function(full, other, weight_full))
    assert served == {name for name, (_, may_serve) in FUNCTION_CALLS.items() if may_serve}


@spmd(meshes=[(2,)])
def test_function_fast_path_leaves_autograd_calls_to_the_aten_path(mesh):
    """An input that requires grad records history through the aten path, served or learnt before."""
    full = torch.randn(4, 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    for _ in range(3):
        x + x  # learnt and served without grad
    leaf = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_(True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        dispatched = counting_dispatch(monkeypatch)
        result = leaf + x
    assert dispatched and result.requires_grad and result.grad_fn is not None
    result.sum().backward()
    assert torch.equal(leaf.grad.full_tensor(), torch.ones(4, 3))
    with torch.no_grad(), pytest.MonkeyPatch.context() as monkeypatch:
        dispatched = counting_dispatch(monkeypatch)
        result = leaf + x
    assert not dispatched and not result.requires_grad
    assert torch.equal(result.full_tensor(), full + full)


@spmd(meshes=[(2,), (2, 2)])
def test_function_fast_path_is_not_learnt_from_a_kept_move(mesh):
    """A Partial input reduced before is seen by dispatch in its moved (Replicate) layout: a call
    learnt then must not serve later calls whose Partial input has no kept move."""
    plan_cache.clear_plans()
    full = torch.randn(4, 3, dtype=torch.float64)
    x = distribute_tensor(full, mesh, _placements(mesh, Replicate()))
    x + x  # an aten plan for (Replicate, Replicate), so the call below runs from cached plans only
    kept, kept_full = partial_and_value(mesh, (4, 3))
    kept.exp()  # reduces `kept` and keeps the move
    torch.testing.assert_close((x + kept).full_tensor(), full + kept_full)
    for seed in (1, 2):
        fresh, fresh_full = partial_and_value(mesh, (4, 3), seed=seed)
        torch.testing.assert_close((x + fresh).full_tensor(), full + fresh_full)


# name -> an in-place call on (x, y, z) of one shape and layout with a Python float `scale` that
# changes from call to call (the writes of `AdamW(foreach=False)` among them).
IN_PLACE_CALLS = {
    "mul_": lambda x, y, z, scale: x.mul_(scale),
    "add_": lambda x, y, z, scale: x.add_(y, alpha=scale),
    "lerp_": lambda x, y, z, scale: x.lerp_(y, 0.1),
    "addcmul_": lambda x, y, z, scale: x.addcmul_(y, z, value=scale),
    "addcdiv_": lambda x, y, z, scale: x.addcdiv_(y, z.abs() + 1, value=-scale),
    "copy_": lambda x, y, z, scale: x.copy_(y),
    "+=": lambda x, y, z, scale: operator.iadd(x, y),
    "relu(inplace=True)": lambda x, y, z, scale: torch.nn.functional.relu(x, inplace=True),
}


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
@spmd()
def test_in_place_calls_are_served_where_the_tensor_lies(mesh, placement):
    """An in-place call whose plan writes `self` where it lies is learnt on its second call and then
    runs on the local tensors without the dispatcher: single-device values, no collective, the
    DTensor returned, its version counter bumped once per call as the dispatcher bumps it."""
    for name, call in IN_PLACE_CALLS.items():
        fulls = [torch.randn(7, 5, dtype=torch.float64) for _ in range(3)]  # 7 rows: uneven shards
        dtensors = [distribute_tensor(full.clone(), mesh, _placements(mesh, placement)) for full in fulls]
        for scale in (0.5, 1.5, 2.5):
            version = dtensors[0]._version
            with pytest.MonkeyPatch.context() as monkeypatch, comm.observe() as records:
                dispatched = counting_dispatch(monkeypatch)
                result = call(*dtensors, scale)
            call(*fulls, scale)
            assert result is dtensors[0] and dtensors[0]._version == version + 1, name
            assert not records, name
            torch.testing.assert_close(dtensors[0].full_tensor(), fulls[0], msg=lambda text: f"{name}: {text}")
        assert not dispatched, name  # the third call was served


@spmd(meshes=[(2,)])
def test_other_call_patterns_of_a_function_do_not_key_its_calls_on_their_scalars(mesh):
    """`x.add_(2.0)`, `x.add_(y)`, `x.add_(y, alpha=1)` (torch leaves out an `alpha` equal to its
    default) and `x.add_(y, alpha=s)` reach aten differently; whatever ran before, `alpha` values new
    on every call (an optimizer's step sizes) are served after the first."""
    full, other = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    x, y = (distribute_tensor(value.clone(), mesh, [Shard(0)]) for value in (full, other))
    for _ in range(2):
        for tensor, operand in ((x, y), (full, other)):
            tensor.add_(2.0), tensor.add_(operand), tensor.add_(operand, alpha=1), tensor.add_(operand, alpha=1.0)
    for step in range(4):
        alpha = 0.5 + step
        with pytest.MonkeyPatch.context() as monkeypatch:
            dispatched = counting_dispatch(monkeypatch)
            x.add_(y, alpha=alpha)
        full.add_(other, alpha=alpha)
        if step >= 2:  # learnt at the first call on cached plans; every later alpha is served
            assert not dispatched, step
    torch.testing.assert_close(x.full_tensor(), full)


def _write_after_save(leaf, weight):
    """`weight`, saved for `leaf`'s gradient, written in place under no_grad; then backward."""
    product = leaf * weight
    with torch.no_grad():
        weight.mul_(0.5)
    product.sum().backward()


@spmd(meshes=[(2,)])
def test_in_place_fast_path_keeps_autograd_checks(mesh):
    """A served write bumps the version counter autograd saved, so backward through the written
    tensor raises as on one device; with grad on, a leaf that requires grad still refuses a write."""
    full = torch.randn(4, 3)
    leaf = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    weight = distribute_tensor(full, mesh, [Shard(0)])
    with torch.no_grad():
        for _ in range(3):
            leaf.mul_(0.5)  # learnt, then served
    for pair in ((full.clone().requires_grad_(), full.clone()), (leaf, weight)):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _write_after_save(*pair)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            pair[0].mul_(0.5)


@spmd(meshes=[(2, 2)])
def test_in_place_fast_path_leaves_writes_into_views_of_copies_to_the_dispatcher(mesh):
    """A plan learnt on a DTensor does not serve a write into a view of a moved copy of the same spec:
    the dispatcher stores the copy's new value into the tensor it views."""
    full = torch.randn(5, 5)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    view = x.diagonal(1)  # one diagonal dim is gathered first: a view of a copy
    same_spec = DTensor(view.to_local().clone(), view._spec)
    for _ in range(3):
        same_spec.mul_(0.5)  # learnt, then served
    view.mul_(0.5)
    full.diagonal(1).mul_(0.5)
    assert torch.equal(x.full_tensor(), full)


def _through_torch_function(dtensor, name: str, *args):
    """A read or call as it went before `DTensor` defined it: torch's getter or method, which
    enters `__torch_function__`."""
    base = vars(torch._C.TensorBase)[name]
    if isinstance(base, property) or type(base).__name__ == "getset_descriptor":
        return base.__get__(dtensor)
    return base(dtensor, *args)


def _same_metadata(dtensor, plain) -> None:
    """Every attribute and method `DTensor` defines reads as torch's own and as a plain tensor's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `.grad` of a non-leaf warns, for both
        _compare_metadata(dtensor, plain)


def _compare_metadata(dtensor, plain) -> None:
    from shardtensor import tensor_methods, torch_function

    for name in tensor_methods.METADATA_ATTRIBUTES:
        value = getattr(dtensor, name)
        reference = _through_torch_function(dtensor, name)
        assert value is reference or value == reference, name
        if name in ("shape", "dtype", "layout", "ndim", "requires_grad", "is_leaf", "itemsize", "is_cpu"):
            assert value == getattr(plain, name), name
    for name, value in tensor_methods.DENSE_CONSTANTS.items():  # class constants: torch agrees
        assert getattr(dtensor, name) is value is _through_torch_function(dtensor, name) is getattr(plain, name), name
    assert (dtensor.grad is None) == (plain.grad is None) and (dtensor.grad_fn is None) == (plain.grad_fn is None)
    for name in tensor_methods.METADATA_METHODS:
        assert getattr(dtensor, name)() == _through_torch_function(dtensor, name), name
    for function in torch_function.METADATA_FUNCTIONS:  # `torch.is_complex(x)`: served without the normal path
        assert function(dtensor) == function(plain), function
    if plain.ndim:
        assert dtensor.size(-1) == plain.size(-1) and dtensor.stride(0) == _through_torch_function(dtensor, "stride", 0)
    assert type(dtensor.shape) is torch.Size and dtensor.size() == plain.size() and dtensor.stride() == plain.stride()


@spmd(meshes=[(2,), (2, 2)])
def test_metadata_defined_on_the_class_reads_exactly_as_torch(mesh):
    """`.shape`, `.requires_grad`, `.size()`... skip `__torch_function__` and give torch's values:
    built by distribute_tensor and from_local, Partial, after requires_grad_ and backward, under no_grad."""
    from shardtensor import DTensor, Partial

    full = torch.randn(7, 6)
    x = distribute_tensor(full, mesh, _placements(mesh, Shard(0)))
    _same_metadata(x, full)
    local = torch.randn(3, 6, dtype=torch.float64)
    from_local = DTensor.from_local(local, mesh, _placements(mesh, Shard(1)))
    _same_metadata(from_local, torch.empty(3, 6 * mesh.size(), dtype=torch.float64))
    partial = DTensor.from_local(torch.ones(2, 3), mesh, _placements(mesh, Partial()))
    _same_metadata(partial, torch.ones(2, 3))
    complex_full = torch.randn(4, 6, dtype=torch.complex64)  # `torch.is_complex` is answered from the spec
    _same_metadata(distribute_tensor(complex_full, mesh, _placements(mesh, Shard(1))), complex_full)
    scalar = distribute_tensor(torch.tensor(2.0), mesh, _placements(mesh, Replicate()))
    assert torch.numel(scalar) == 1 and torch.numel(x) == 42 and torch.is_floating_point(x)
    leaf, plain_leaf = x.detach().requires_grad_(), full.detach().requires_grad_()
    _same_metadata(leaf, plain_leaf)
    result, plain_result = (leaf * 2).sum(), (plain_leaf * 2).sum()
    _same_metadata(result, plain_result)
    result.backward()
    plain_result.backward()
    _same_metadata(leaf, plain_leaf)
    assert torch.equal(leaf.grad.full_tensor(), plain_leaf.grad)
    with torch.no_grad():
        _same_metadata(leaf * 2, plain_leaf * 2)
    leaf.grad = None  # the setters and deleters are torch's too
    del plain_leaf.grad
    leaf.requires_grad = False
    plain_leaf.requires_grad = False
    _same_metadata(leaf, plain_leaf)
    with pytest.raises(AttributeError):
        leaf.shape = (1,)


@spmd(meshes=[(2,)])
def test_views_defined_on_the_class_are_autograd_views_of_their_input(mesh):
    """`t()`, `view`, `x[1:]`... skip `__torch_function__` but still run through the dispatcher:
    the result shares the input's version counter and `_base`, as on one device."""
    full = torch.randn(4, 6)
    x = distribute_tensor(full, mesh, [Shard(1)])
    calls = [lambda t: t.t(), lambda t: t.transpose(0, 1), lambda t: t.view(2, 12), lambda t: t.unsqueeze(0),
             lambda t: t[1:3], lambda t: t[1, ..., None], lambda t: t.reshape(24)]
    for call in calls:
        view, plain_view = call(x), call(full)
        assert view._is_view() and view._base is x and plain_view._is_view()
        x.mul_(1)
        assert view._version == x._version
        assert torch.equal(view.full_tensor(), call(full))
    # An index that makes torch build a tensor still goes through `__torch_function__`.
    assert torch.equal(x[[0, 2]].full_tensor(), full[[0, 2]])


@spmd(meshes=[(2,)])
def test_methods_defined_on_the_class_keep_torch_function_modes_and_plain_operands(mesh):
    """A torch function mode still sees `x + y`, `x.shape`, `x.t()`; a plain tensor operand still
    goes through torch's protocol (and is refused as before); results equal the normal path's."""
    from torch.overrides import TorchFunctionMode

    from shardtensor import torch_function

    class Recording(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.functions = []

        def __torch_function__(self, function, types, args=(), kwargs=None):
            self.functions.append(function)
            return function(*args, **(kwargs or {}))

    full, other = torch.randn(4, 6), torch.randn(4, 6)
    x, y = (distribute_tensor(value, mesh, [Shard(0)]) for value in (full, other))
    for _ in range(2):
        x + y, x.relu(), x.sum(1)  # learnt: the next calls are served
    with Recording() as mode:
        added, shape, transposed, summed = x + y, x.shape, x.t(), x.sum(1)
        x.mul_(1.0)
    assert torch.Tensor.add in mode.functions and torch.Tensor.t in mode.functions  # `+` passes `add`
    assert torch.Tensor.mul_ in mode.functions
    assert torch.Tensor.sum in mode.functions and shape == (4, 6)
    torch_function.fast_path_enabled = False
    try:
        normal = (x + y, x.t(), x.sum(1))
    finally:
        torch_function.fast_path_enabled = True
    for result, reference in zip((added, transposed, summed), normal):
        _same_dtensor(result, reference)
    with pytest.raises(RuntimeError, match="plain torch.Tensor"):
        x + other
    with pytest.raises(RuntimeError, match="plain torch.Tensor"):
        x.add_(other)
    assert torch.equal((x * 2.0).full_tensor(), full * 2.0)
