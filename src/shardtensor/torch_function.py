"""Public torch functions on DTensors: the `__torch_function__` layer, above `dispatch`.

`DTensor.__torch_function__` calls `torch_function` for every public torch function, method and
operator that gets a DTensor argument, except the metadata reads (`.shape`, `.requires_grad`,
`.size()`...) and views (`.t()`, `.view()`, `x[1:]`...) that this module defines on `DTensor`
itself (see the end of the module: they run torch's own code, minus a `__torch_function__` round trip).
It does three things before the call reaches the aten level:

- **Fast path.** A call that records no autograd history (grad mode off, or no DTensor argument
  requires grad), runs under no dispatch mode or autocast, and is known to run exactly one aten op
  whose cached plan computes locally (no redistribution, no rule-specific local op or arguments, no
  view, no in-place or `out=` write, not random) is served here: the same public function runs on
  the local tensors and its result is wrapped with the plan's output spec. That skips the C++
  dispatcher round trip into Python, the aten-level argument normalisation and the plan key of
  `dispatch`. A function is learnt on a call that runs through `dispatch` on cached plans only
  (`dispatch.recording`), and checked once by running it on the local tensors: it must run the
  same single aten op and give a local result of the same shape, stride and dtype.
- **Data arguments.** Functions that read a tensor argument's values in C++ before any aten op
  sees it (`tensor_split`'s `indices_or_sections`) get the Python values a DTensor there stands
  for (`full_tensor().tolist()`, the same on every rank).
- **Tensors torch creates.** While the outermost public call runs, plain tensors that torch
  creates inside it from global metadata (the causal mask of `scaled_dot_product_attention`'s
  math path, `combinations`' mask, `matrix_rank`'s tolerance) are read as Replicate
  (`dtensor.created_by_torch`): see that function for the exact rule.
"""

from __future__ import annotations

import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import dispatch as _dispatch_module
from . import propagation
from .dispatch import _fast_key, _returns_view
from .dtensor import DTensor, DTensorSpec, outermost_call
from .gradients import watch_leaves

__all__ = ["torch_function", "clear_function_plans"]

_disabled = torch._C.DisableTorchFunctionSubclass
_run_normally = torch._C._disabled_torch_function_impl  # the call with `__torch_function__` off, in C++
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled
_any_requires_grad = torch._C._any_requires_grad  # reads `requires_grad` without coming back here
_NO_KEYWORDS: dict = {}
_GETTER = types.MethodWrapperType  # `.shape`, `.requires_grad`...: `getset_descriptor.__get__`


class _FunctionPlan:
    """What a learnt public function needs: where its DTensors are and the spec of its result
    (None: not servable here, but known to run from cached aten plans only)."""

    __slots__ = ("function", "positions", "spec", "input_specs", "generation")

    def __init__(self, function, args: tuple, kwargs: dict, positions: tuple[int, ...], spec: DTensorSpec | None):
        self.function, self.positions, self.spec = function, positions, spec
        # The key holds the ids of these specs: keeping them alive keeps the ids from being reused.
        self.input_specs = tuple(value._spec for value in (*args, *kwargs.values()) if isinstance(value, DTensor))
        self.generation = propagation.generation


# fast key (holding the function's id) -> _FunctionPlan
_function_plans: dict[tuple, _FunctionPlan] = {}
_MAX_FUNCTION_PLANS = 8192

# False: every call takes the normal path (tests compare the two; `bench/bench_ops.py` times both).
fast_path_enabled = True


def clear_function_plans() -> None:
    _function_plans.clear()


def torch_function(cls, function, types, args=(), kwargs=None):
    """`DTensor.__torch_function__`: serve the call from a function plan, or run it normally."""
    if type(function) is _GETTER:
        with _disabled():
            return function(*args)
    if kwargs is None:
        kwargs = _NO_KEYWORDS
    if not kwargs and len(args) == 1 and type(args[0]) is DTensor:  # `x.relu()`, `x.t()`: no loop
        key = (id(function), id(args[0]._spec))
    else:
        key = _fast_key(function, args, kwargs)
    plan = _function_plans.get(key) if key is not None else None
    if plan is not None and plan.function is function and plan.generation == propagation.generation:
        if (
            plan.spec is not None
            and fast_path_enabled
            and not _dispatch_modes()
            and not _autocast()
            and (not _grad_enabled() or not _any_requires_grad(*args))
        ):
            local_args = list(args)
            for position in plan.positions:
                local_args[position] = args[position]._local_tensor
            return DTensor._wrap(function(*local_args, **kwargs), plan.spec)
        # Known to run from cached aten plans only, so no plain tensor gets mixed in: no need to
        # mark the call for `created_by_torch`.
        watch_leaves(args, kwargs)
        return _run_normally(function, types, args, kwargs)
    watch_leaves(args, kwargs)
    return _call(function, args, kwargs, key)


def _call(function, args: tuple, kwargs: dict, key: tuple | None):
    """The normal path: data arguments read, the call marked as outermost, learnt if it qualifies."""
    reader = _DATA_ARGUMENTS.get(function)
    if reader is not None:
        args, kwargs = _read_data_arguments(reader, args, kwargs)
        key = None  # never learnt: every call must read its data arguments first
    with outermost_call(args, kwargs):
        if key is None or _dispatch_modes() or _autocast():
            with _disabled():
                return function(*args, **kwargs)
        recorded: list = []
        _dispatch_module.recording.append(recorded)
        try:
            with _disabled():
                result = function(*args, **kwargs)
        finally:
            _dispatch_module.recording.pop()
    if None not in recorded:  # every aten op ran from a cached plan: the verdict is final
        if len(_function_plans) >= _MAX_FUNCTION_PLANS:
            _function_plans.clear()
        _function_plans[key] = _learn(function, args, kwargs, recorded, result)
    return result


class _AtenOps(TorchDispatchMode):
    """The aten ops a call on plain tensors runs (to check a function before it is learnt)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.ops.append(op)
        return op(*args, **(kwargs or {}))


def _learn(function, args: tuple, kwargs: dict, recorded: list, result) -> _FunctionPlan:
    """A plan serving the call here if it ran one aten op that computes locally, else one that
    only says the call needs no marking."""
    positions = tuple(index for index, value in enumerate(args) if type(value) is DTensor)
    if len(recorded) != 1 or type(result) is not DTensor:
        return _FunctionPlan(function, args, kwargs, positions, None)
    plan = recorded[0]
    op = plan.op
    if (
        plan.single_spec is None
        or plan.simple_positions is None
        or not plan.runs_op
        or result._spec is not plan.single_spec
        or _returns_view(op)
        or torch.Tag.nondeterministic_seeded in op.tags
        or any(isinstance(value, torch.Tensor) for value in kwargs.values())
        or sum(isinstance(value, torch.Tensor) for value in args) != len(positions)
    ):
        return _FunctionPlan(function, args, kwargs, positions, None)
    local_args = list(args)
    for position in positions:
        local_args[position] = args[position]._local_tensor
    with torch.no_grad(), _AtenOps() as seen:
        local = function(*local_args, **kwargs)
    expected = result._local_tensor
    if (
        seen.ops != [op]
        or type(local) is not torch.Tensor
        or local.shape != expected.shape
        or local.stride() != expected.stride()
        or local.dtype != expected.dtype
    ):
        return _FunctionPlan(function, args, kwargs, positions, None)
    return _FunctionPlan(function, args, kwargs, positions, plan.single_spec)


# ---- arguments read as data ----------------------------------------------------------------------

# function -> (position, keyword names) of an argument whose values the function reads in C++.
_DATA_ARGUMENTS = {
    torch.tensor_split: (1, ("indices_or_sections", "tensor_indices_or_sections", "indices", "sections")),
    torch.Tensor.tensor_split: (1, ("indices_or_sections", "tensor_indices_or_sections", "indices", "sections")),
}


def _as_values(value):
    """A DTensor argument read as data: the Python value(s) it holds, the same on every rank."""
    if not isinstance(value, DTensor):
        return value
    full = value.full_tensor()
    with _disabled():
        return full.tolist()


def _read_data_arguments(reader, args: tuple, kwargs: dict):
    position, names = reader
    if len(args) > position and isinstance(args[position], DTensor):
        args = (*args[:position], _as_values(args[position]), *args[position + 1:])
    for name in names:
        if isinstance(kwargs.get(name), DTensor):
            kwargs = {**kwargs, name: _as_values(kwargs[name])}
    return args, kwargs


DTensor.__torch_function__ = classmethod(torch_function)  # called directly from now on


# ---- metadata reads and views, without `__torch_function__` --------------------------------------
#
# Defined on `DTensor` itself, these come before torch's C getters and methods, so reading `.shape`
# or calling `.size()` or `.t()` costs a Python call instead of a `__torch_function__` round trip
# (about 0.3 us instead of 1.1 us for a read). Each runs torch's own getter or method with
# subclass `__torch_function__` off (what `torch_function` does for them anyway), so the result
# is exactly torch's, and torch function modes still see the call. Views cannot be served like
# functional ops: only the dispatcher's ADInplaceOrView kernel makes the result an autograd view
# of its input (shared version counter, `_base`), and torch has no Python API for that. These
# views create no plain tensor of their own, so they need no `outermost_call` mark either.

_TENSOR_BASE = torch._C.TensorBase
_METADATA_ATTRIBUTES = (
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
    "is_cpu", "is_cuda", "is_meta", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes",
    "_version", "_base", "output_nr",
)
_METADATA_METHODS = (
    "dim", "ndimension", "size", "stride", "numel", "nelement", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "storage_offset",
)
_VIEW_METHODS = ("t", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "expand", "flatten")
# `x[index]` skips `__torch_function__` when the index holds only these (views, no tensor built);
# other indices (lists, tensors, bools) take the normal path, which marks tensors torch builds.
_VIEW_INDEX_TYPES = frozenset((int, slice, type(None), type(Ellipsis)))


def _attribute(name: str) -> property:
    descriptor = vars(_TENSOR_BASE)[name]
    get, set_, delete = descriptor.__get__, descriptor.__set__, descriptor.__delete__
    return property(
        lambda self: _run_normally(get, (), (self,), _NO_KEYWORDS),
        lambda self, value: _run_normally(set_, (), (self, value), _NO_KEYWORDS),
        lambda self: _run_normally(delete, (), (self,), _NO_KEYWORDS),
        doc=descriptor.__doc__,
    )


def _method(name: str):
    base = getattr(_TENSOR_BASE, name)

    def method(self, *args, **kwargs):
        return _run_normally(base, (), (self, *args), kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = base.__doc__
    return method


# Common functional methods and operators: when every tensor argument is a DTensor and no torch
# function mode is on, they call `torch_function` directly with what torch's `__torch_function__`
# protocol would pass (an operator passes its method: `x + y` passes `Tensor.add`, and a TypeError
# becomes NotImplemented), without the protocol's C++ round trip (about 0.5-1 us).
_OPERATOR_METHODS = {"__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__matmul__": "matmul"}
_FUNCTIONAL_METHODS = (
    "add", "sub", "mul", "div", "matmul", "mm", "relu", "exp", "tanh", "sigmoid", "neg", "abs", "sum", "mean",
)
_DTENSOR_TYPES = (DTensor,)
_torch_function_enabled = torch._C._is_torch_function_enabled  # False inside DisableTorchFunctionSubclass
_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def _only_dtensors(values) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor) and type(value) is not DTensor:
            return False
    return True


def _functional_method(name: str, function_name: str):
    base, function = getattr(torch.Tensor, name), getattr(torch.Tensor, function_name)
    operator = name != function_name

    def method(self, *args, **kwargs):
        if (
            type(self) is DTensor
            and _torch_function_enabled()
            and not _function_mode_enabled()
            and _only_dtensors(args)
            and (not kwargs or _only_dtensors(kwargs.values()))
        ):
            if not operator:
                return torch_function(DTensor, function, _DTENSOR_TYPES, (self, *args), kwargs)
            try:
                return torch_function(DTensor, function, _DTENSOR_TYPES, (self, *args), kwargs)
            except TypeError:
                return NotImplemented
        return base(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = base.__doc__
    return method


_base_getitem = _TENSOR_BASE.__getitem__


def _getitem(self, index):
    kind = type(index)
    if kind in _VIEW_INDEX_TYPES or (kind is tuple and _VIEW_INDEX_TYPES.issuperset(map(type, index))):
        return _run_normally(_base_getitem, (), (self, index), _NO_KEYWORDS)
    return _base_getitem(self, index)


for _name in _METADATA_ATTRIBUTES:
    setattr(DTensor, _name, _attribute(_name))
for _name in (*_METADATA_METHODS, *_VIEW_METHODS):
    setattr(DTensor, _name, _method(_name))
for _name, _function_name in (*_OPERATOR_METHODS.items(), *zip(_FUNCTIONAL_METHODS, _FUNCTIONAL_METHODS)):
    setattr(DTensor, _name, _functional_method(_name, _function_name))
DTensor.__getitem__ = _getitem
