"""`FastTensorMethods`: the metadata reads, views and common operators of `DTensor`, defined on
the class so that they skip the `__torch_function__` round trip. `DTensor` inherits this mixin.

Coming before torch's C getters and methods, these make reading `.shape` or calling `.size()` or
`.t()` cost a Python call instead of a `__torch_function__` round trip (about 0.3 us instead of
1.1 us for a read). Each runs torch's own getter or method with subclass `__torch_function__` off
(what `torch_function` does for them anyway), so the result is exactly torch's, and torch function
modes still see the call. Views cannot be served like functional ops: only the dispatcher's
ADInplaceOrView kernel makes the result an autograd view of its input (shared version counter,
`_base`), and torch has no Python API for that. These views create no plain tensor of their own,
so they need no `outermost_call` mark either.
"""

from __future__ import annotations

import types

import torch

from .torch_function import torch_function

__all__ = ["DENSE_CONSTANTS", "FastTensorMethods", "METADATA_ATTRIBUTES", "METADATA_METHODS", "VIEW_METHODS"]

_run_normally = torch._C._disabled_torch_function_impl  # the call with `__torch_function__` off, in C++
_NO_KEYWORDS: dict = {}

_TENSOR_BASE = torch._C.TensorBase
METADATA_ATTRIBUTES = (
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
    "is_cpu", "is_cuda", "is_meta", "itemsize", "nbytes",
    "_version", "_base", "output_nr",
)
# A DTensor's shards are dense strided tensors (sparse, nested and quantized ones are refused where
# they would enter: `from_local`, `ops/sparse.py`), so these reads are class constants: an optimizer
# asks `p.grad.is_sparse` of every parameter on every step. Being plain values, they are the one read
# a torch function mode does not see.
DENSE_CONSTANTS = {"is_sparse": False, "is_quantized": False, "is_nested": False}
METADATA_METHODS = (
    "dim", "ndimension", "size", "stride", "numel", "nelement", "is_contiguous", "element_size",
    "is_floating_point", "is_complex", "storage_offset",
)
VIEW_METHODS = ("t", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "expand", "flatten")
# `x[index]` skips `__torch_function__` when the index holds only these (views, no tensor built);
# other indices (lists, tensors, bools) take the normal path, which marks tensors torch builds.
_VIEW_INDEX_TYPES = frozenset((int, slice, type(None), type(Ellipsis)))


def _attribute(name: str) -> property:
    descriptor = vars(_TENSOR_BASE)[name]
    get, set_, delete = descriptor.__get__, descriptor.__set__, descriptor.__delete__
    return property(
        lambda self: _run_normally(get, (), (self,)),  # no keywords: parsed faster than an empty dict
        lambda self, value: _run_normally(set_, (), (self, value)),
        lambda self: _run_normally(delete, (), (self,)),
        doc=descriptor.__doc__,
    )


def _method(name: str):
    base = getattr(_TENSOR_BASE, name)

    def method(self, *args, **kwargs):
        return _run_normally(base, (), (self, *args), kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = base.__doc__
    return method


# Common methods and operators, functional and in place (an optimizer's per-parameter updates):
# when every tensor argument is a DTensor (or a 0-d plain tensor) and no torch function mode is on, they call
# `torch_function` directly with what torch's `__torch_function__` protocol would pass (an operator
# passes its method: `x + y` passes `Tensor.add`, and a TypeError becomes NotImplemented), without
# the protocol's C++ round trip (about 0.5-1 us).
_OPERATOR_METHODS = {"__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div", "__matmul__": "matmul"}
_FUNCTIONAL_METHODS = (
    "add", "sub", "mul", "div", "matmul", "mm", "relu", "exp", "tanh", "sigmoid", "neg", "abs", "sum", "mean", "sqrt",
    "add_", "sub_", "mul_", "div_", "lerp_", "addcmul_", "addcdiv_",
)
_torch_function_enabled = torch._C._is_torch_function_enabled  # False inside DisableTorchFunctionSubclass
_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def _only_dtensors(values, cls: type) -> bool:
    """Whether every tensor among `values` is a DTensor or a 0-d plain tensor (read as a scalar)."""
    for value in values:
        if isinstance(value, torch.Tensor) and type(value) is not cls:
            if type(value) is not torch.Tensor or value.ndim:
                return False
    return True


def _functional_method(name: str, function_name: str):
    base, function = getattr(torch.Tensor, name), getattr(torch.Tensor, function_name)
    operator = name != function_name

    def method(self, *args, **kwargs):
        cls = type(self)
        if (
            _torch_function_enabled()
            and not _function_mode_enabled()
            and _only_dtensors(args, cls)
            and (not kwargs or _only_dtensors(kwargs.values(), cls))
        ):
            if not operator:
                return torch_function(cls, function, (cls,), (self, *args), kwargs)
            try:
                return torch_function(cls, function, (cls,), (self, *args), kwargs)
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


def _bind_torch_function(cls, **kwargs) -> None:
    """Give each class made from the mixin `torch_function` bound to it as a plain attribute rather
    than a classmethod. Torch looks `__torch_function__` up on every tensor argument of every
    overload it tries (about 650 lookups in an AdamW step of 24 parameters), and a classmethod
    builds and frees a bound method on each lookup; a bound method stored on the class is returned
    as it is. Torch's check for the deprecated plain-method form (`__self__` is the argument) sees
    the class, not the tensor."""
    super(FastTensorMethods, cls).__init_subclass__(**kwargs)
    cls.__torch_function__ = types.MethodType(torch_function, cls)


def _namespace() -> dict:
    namespace = {
        "__slots__": (), "__module__": __name__, "__doc__": __doc__, "__getitem__": _getitem,
        "__init_subclass__": _bind_torch_function,
        **DENSE_CONSTANTS,
    }
    namespace.update((name, _attribute(name)) for name in METADATA_ATTRIBUTES)
    namespace.update((name, _method(name)) for name in (*METADATA_METHODS, *VIEW_METHODS))
    namespace.update(
        (name, _functional_method(name, function_name))
        for name, function_name in (*_OPERATOR_METHODS.items(), *zip(_FUNCTIONAL_METHODS, _FUNCTIONAL_METHODS))
    )
    return namespace


# Built from the name lists above in one statement: the mixin is complete when it exists.
FastTensorMethods = type("FastTensorMethods", (), _namespace())
