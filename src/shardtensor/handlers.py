"""Handlers: the user's own implementation of a torch function or an aten op on DTensors, found before
the library's sharding rules (PhysicsNeMo ShardTensor's registry, under its names).

A function handler (`DTensor.register_function_handler(func, handler)`, or by name for ops made with
`torch.library.custom_op`: `register_named_function_handler("ns.op.default", handler)`) is called as
`handler(func, types, args, kwargs)` from `__torch_function__`, above autograd: what it computes is
differentiated like any other code (`to_local`/`from_local`, `halo_map` and DTensor ops all are). A
dispatch handler (`register_dispatch_handler(aten_op, handler)`) is called as `handler(*args, **kwargs)`
from `__torch_dispatch__`, below autograd: the op's derivative formula stays torch's, and the ops of
the backward are dispatched (and handled) the same way. While a handler runs, a call of the function
or op it handles takes the library's path: a handler may call `func` to get the default.

`enable_patches(False)` (a context) switches every handler off; `patches_enabled()` says whether they
are on. The hooks read only `FUNCTION_HANDLERS` / `DISPATCH_HANDLERS`, the live tables, which are
empty when nothing is registered or patches are off: the hot path pays one truth test of a dict.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from . import propagation

__all__ = [
    "DISPATCH_HANDLERS", "FUNCTION_HANDLERS", "dispatch_handler", "enable_patches", "function_handler",
    "patches_enabled", "register_dispatch_handler", "register_function_handler",
    "register_named_function_handler", "run_handler",
]

# The live tables the hooks read: function (or custom op name) -> handler, aten op (or its name) -> handler.
FUNCTION_HANDLERS: dict = {}
DISPATCH_HANDLERS: dict = {}
# What the user registered, kept while patches are off.
_functions: dict = {}
_names: dict[str, Callable] = {}
_ops: dict = {}
_enabled = True


class _Running(threading.local):
    """The functions and ops whose handler runs in this thread: their calls inside it take the library's path."""

    def __init__(self):
        self.keys: set = set()


_running = _Running()


def register_function_handler(func: Callable, handler: Callable | None) -> None:
    """Call `handler(func, types, args, kwargs)` instead of the library's path when `func` (a torch
    function or Tensor method) gets a DTensor; `handler=None` removes it."""
    _register(_functions, func, handler, "register_function_handler")


def register_named_function_handler(name: str, handler: Callable | None) -> None:
    """Like `register_function_handler`, for the function whose `str()` is `name` (a custom op made with
    `torch.library.custom_op("ns::op", ...)` is "ns.op.default"); `handler=None` removes it."""
    if not isinstance(name, str):
        raise TypeError(f"register_named_function_handler takes the function's name as a str "
                        f"(e.g. 'ns.op.default'), got {type(name).__name__}; use register_function_handler "
                        f"for the function itself")
    _register(_names, name, handler, "register_named_function_handler")


def register_dispatch_handler(op, handler: Callable | None) -> None:
    """Call `handler(*args, **kwargs)` instead of the library's rule when the aten op `op` (an overload:
    `torch.ops.aten.mul.Tensor`) gets a DTensor; `handler=None` removes it."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(f"register_dispatch_handler takes an aten overload such as torch.ops.aten.mul.Tensor, "
                        f"got {op!r} ({type(op).__name__}); pick the overload (op.default, op.Tensor, ...)")
    _register(_ops, op, handler, "register_dispatch_handler")


def _register(table: dict, key, handler, function: str) -> None:
    if handler is None:
        table.pop(key, None)
    elif not callable(handler):
        raise TypeError(f"{function}: the handler of {key!r} must be callable (or None to remove it), "
                        f"got {type(handler).__name__}")
    else:
        table[key] = handler
    _refresh()


def _refresh() -> None:
    """Fill the live tables from the registrations; when they change, make cached plans stale (a plan
    learnt before would run an op or function that now has a handler without asking it)."""
    functions, ops = {}, {}
    if _enabled:
        functions.update(_functions)
        functions.update(_names)
        ops.update(_ops)
        ops.update((str(op), handler) for op, handler in _ops.items())
    if functions == FUNCTION_HANDLERS and ops == DISPATCH_HANDLERS:
        return  # e.g. `enable_patches(False)` with nothing registered: the caches stay
    FUNCTION_HANDLERS.clear()
    FUNCTION_HANDLERS.update(functions)
    DISPATCH_HANDLERS.clear()
    DISPATCH_HANDLERS.update(ops)
    propagation.clear_cache()


def patches_enabled() -> bool:
    """Whether registered handlers are used (True unless inside `enable_patches(False)`)."""
    return _enabled


@contextlib.contextmanager
def enable_patches(enabled: bool = True):
    """Use the registered handlers (True) or not (False) inside the block; the previous state after it."""
    global _enabled
    previous = _enabled
    _enabled = bool(enabled)
    _refresh()
    try:
        yield
    finally:
        _enabled = previous
        _refresh()


def function_handler(function) -> Callable | None:
    """The live handler of a torch function (by the function, then by its name), None inside its own handler."""
    handler = FUNCTION_HANDLERS.get(function)
    if handler is None and _names:
        handler = FUNCTION_HANDLERS.get(str(function))
    if handler is None or function in _running.keys:
        return None
    return handler


def dispatch_handler(op) -> Callable | None:
    """The live handler of an aten op (by the overload, then by its name), None inside its own handler."""
    handler = DISPATCH_HANDLERS.get(op)
    if handler is None:
        handler = DISPATCH_HANDLERS.get(str(op))
    if handler is None or op in _running.keys:
        return None
    return handler


def run_handler(key, handler: Callable, args: tuple, kwargs: dict):
    """`handler(*args, **kwargs)`, during which calls of `key` (the handled function or op) are not handled."""
    _running.keys.add(key)
    try:
        return handler(*args, **kwargs)
    finally:
        _running.keys.discard(key)
