"""Which module is running, forward or backward: the context CommDebugMode attributes collectives to.

Forward: a global forward pre-hook (`torch.nn.modules.module.register_module_forward_pre_hook`)
enters a module before its own pre-hooks run, and a forward hook registered on the module itself
(after any hooks a parallel style added) leaves it once those have run, so the collectives of a
style's input and output hooks count for the module they belong to. Backward: an autograd hook on
the module's outputs enters it when their gradient arrives, and one on its inputs leaves it when
theirs is computed; the end of the backward pass clears what is left, and its callbacks (leaf
gradients reduced together) count for Global's backward. Every hook is removed on exit, but the global
pre-hook: one function, registered on first use and kept, that passes each call to the running trackers.
torch.compile guards a graph on the global hooks (their keys), so a hook registered per tracker would
recompile every compiled module at each CommDebugMode; the kept one costs one recompile, once.

Inside a compiled graph no module is tracked (the hooks return at once while dynamo traces them): its
collectives count for the module that called the graph eagerly (`torch.compile(model)`'s
OptimizedModule, or the module around a `.compile()`d one).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook

from ..dtensor import DTensor
from .direct_collectives import in_compiled_graph

__all__ = ["ModuleTracker", "ModuleInfo", "GLOBAL", "FORWARD", "BACKWARD"]

GLOBAL = "Global"
FORWARD = "forward"
BACKWARD = "backward"


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleInfo:
    """A module seen in forward: its name, type, place in the tree and its parameters."""

    fqn: str
    module_type: str
    depth: int  # Global is 0, a root module 1
    parents: tuple[str, ...]  # outermost first, starting with Global
    parameters: tuple[tuple[str, torch.Tensor], ...]


def _tensors(value) -> list[torch.Tensor]:
    """The tensors requiring grad in a module's (nested) inputs or outputs."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _remove_last(stack: list[str], fqn: str) -> bool:
    """Remove the innermost entry `fqn` of a stack of running modules; False if it holds none."""
    for position in range(len(stack) - 1, -1, -1):
        if stack[position] == fqn:
            del stack[position]
            return True
    return False


_running: list[ModuleTracker] = []  # the trackers entered and not yet left, outermost first
_pre_hook = None  # the handle of `_enter_forward`, once registered


def _enter_forward(module: torch.nn.Module, inputs) -> None:
    """The global forward pre-hook: every running tracker enters `module`."""
    if torch.compiler.is_compiling() or not _running:
        return
    for tracker in _running:
        tracker._enter_forward(module, inputs)


def _compiled_model(module: torch.nn.Module) -> torch.nn.Module:
    """The model a `torch.compile(model)` wrapper runs (its `_orig_mod`), else the module itself."""
    return getattr(module, "_orig_mod", module)


class ModuleTracker:
    """Tracks the current (module, phase) and calls `on_change(fqn, phase)` whenever it changes."""

    def __init__(self, on_change: Callable[[str, str], None]):
        self._on_change = on_change
        self.modules: dict[str, ModuleInfo] = {}  # in the order first seen
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._forward: list[str] = []
        self._backward: list[str] = []
        self._in_backward = False
        self._handles: list = []
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self._thread: int | None = None  # torch's module hooks are global: only this rank's thread is tracked

    @property
    def current(self) -> tuple[str, str]:
        if self._forward:
            return self._forward[-1], FORWARD
        if self._backward:
            return self._backward[-1], BACKWARD
        return GLOBAL, BACKWARD if self._in_backward else FORWARD

    def __enter__(self) -> ModuleTracker:
        self.modules = {GLOBAL: ModuleInfo(GLOBAL, "", 0, (), ())}
        self._names = weakref.WeakKeyDictionary()
        self._forward, self._backward, self._in_backward = [], [], False
        self._thread = threading.get_ident()  # the rank's (`launch.simulate` runs ranks as threads)
        self._handles = []
        global _pre_hook
        if _pre_hook is None:
            _pre_hook = register_module_forward_pre_hook(_enter_forward)
        _running.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        if self in _running:
            _running.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = weakref.WeakSet()

    # --- forward ------------------------------------------------------------------------------------
    def _name(self, module: torch.nn.Module) -> str:
        """`Root.child.grandchild`, the root named by its class (as PyTorch's ModTracker does);
        `torch.compile(model)`'s wrapper (OptimizedModule) is named as the model it compiled."""
        module = _compiled_model(module)
        if module not in self._names:
            root = type(module).__name__
            for name, submodule in module.named_modules():
                self._names.setdefault(submodule, f"{root}.{name}" if name else root)
        return self._names[module]

    def _enter_forward(self, module: torch.nn.Module, inputs) -> None:
        if threading.get_ident() != self._thread:  # another simulated rank's module
            return
        if isinstance(module, torch.fx.GraphModule) and in_compiled_graph():  # a compiled graph, run by aot_eager
            return
        fqn = self._name(module)
        if fqn not in self.modules:
            parents = self.modules[self._forward[-1]] if self._forward else self.modules[GLOBAL]
            model = _compiled_model(module)
            parameters = tuple(model.named_parameters(recurse=False))
            self.modules[fqn] = ModuleInfo(fqn, type(model).__name__, parents.depth + 1,
                                           parents.parents + (parents.fqn,), parameters)
        if module not in self._hooked:  # after the module's own forward hooks (a style's output hook)
            self._handles.append(module.register_forward_hook(self._leave_forward, always_call=True))
            self._hooked.add(module)
        tensors = _tensors(inputs)
        if tensors:
            self._handles.append(register_multi_grad_hook(tensors, lambda grads: self._leave_backward(fqn)))
        self._forward.append(fqn)
        self._on_change(*self.current)

    def _leave_forward(self, module: torch.nn.Module, inputs, output) -> None:
        if torch.compiler.is_compiling():  # inside a compiled module: the graph holds no tracking; its
            return  # collectives count for the module that called it eagerly (the compiled one)
        fqn = self._name(module)
        _remove_last(self._forward, fqn)
        tensors = _tensors(output)
        if tensors:
            self._handles.append(register_multi_grad_hook(tensors, lambda grad: self._enter_backward(fqn), mode="any"))
        self._on_change(*self.current)

    # --- backward -----------------------------------------------------------------------------------
    def _enter_backward(self, fqn: str) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # One gradient may enter several modules at once (a model's output is its last layer's):
        # the innermost must be on top, so a module goes below the modules running inside it.
        position = len(self._backward)
        while position > 0 and fqn in self.modules[self._backward[position - 1]].parents:
            position -= 1
        self._backward.insert(position, fqn)
        self._on_change(*self.current)

    def _leave_backward(self, fqn: str) -> None:
        if _remove_last(self._backward, fqn):
            self._on_change(*self.current)

    def _end_backward(self) -> None:
        """No module runs any more, but callbacks queued during the pass (the leaf gradients'
        reduction) still belong to its backward: the phase ends after them, queued behind them."""
        self._backward = []
        self._on_change(*self.current)
        torch.autograd.Variable._execution_engine.queue_callback(self._leave_backward_pass)

    def _leave_backward_pass(self) -> None:
        self._in_backward = False
        self._on_change(*self.current)

    def sharding_info(self) -> dict[str, tuple]:
        """`{"Module.child.weight": placements}` for every DTensor parameter of the modules seen."""
        return {
            f"{info.fqn}.{name}": parameter.placements
            for info in self.modules.values()
            for name, parameter in info.parameters
            if isinstance(parameter, DTensor)
        }
