"""Live tensor bytes: a dispatch mode that counts the storages the ops run inside it create, their peak,
and what held the peak (parameters, gradients, optimizer state, activations).

No allocator is read: every aten op's outputs are looked at, a storage not seen before is added with its
bytes, and a weak reference to it subtracts them when it is freed. So it measures the same thing on real
CPU tensors (the measured side of a forecast's check) as on fake ones (the forecast), and it needs
neither CUDA nor a CPU allocator hook. It sees what ops allocate, not what a kernel allocates and frees
inside one op, nor buffers of the communication library (gloo, nccl) that are not tensors. Meta tensors
(the stand-ins propagation runs a rule on, on a first call) hold no memory and are not counted, so a
step measures the same with cold and warm caches.

Roles are learnt from hooks while the mode is entered: a module's parameters at its forward (plain,
sharded or gathered by FSDP), the gradients of an optimizer's parameters before its step and its state
after it. A storage that ever held a role keeps it; every other storage counts as activations (which
here means everything else: saved activations, temporaries, communication buffers, gradients that are
reduced and freed before an optimizer sees them).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..dtensor import DTensor

__all__ = ["CATEGORIES", "LiveBytes", "local_tensors"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")
# When a storage held several roles, the first of these it held names it.
_ROLE_ORDER = ("parameters", "optimizer_state", "gradients")


def local_tensors(value) -> list[torch.Tensor]:
    """The plain tensors in a (nested) value, DTensors read as their local shards."""
    found = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, DTensor):
            found.append(leaf._local_tensor)
        elif isinstance(leaf, torch.Tensor):
            found.append(leaf)
    return found


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created by ops run inside it, and their peak.

    DTensor ops are left to DTensor (the mode answers NotImplemented), whose local ops come back here
    as plain ones, so each storage is counted once, on the local shard. `track` adds tensors made
    before the mode was entered (a model built outside it).

        >>> with LiveBytes() as counter:  # doctest: +SKIP
        ...     loss = model(x).sum(); loss.backward()
        >>> counter.peak, counter.peak_by_category()  # doctest: +SKIP
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (serial, bytes)
        self._references: dict[int, weakref.ref] = {}
        self._serials = itertools.count()
        self._roles: dict[int, str] = {}  # serial -> role
        self.current = 0
        self.peak = 0
        self._peak_live: dict[int, int] = {}  # serial -> bytes, at the peak
        self._peak_unsaved = False
        self._hooks: list = []

    # --- counting ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented
        output = self._run(func, args, kwargs or {})
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        return output

    def _run(self, func, args, kwargs):
        """Run the op (a subclass may answer some ops itself)."""
        return func(*args, **kwargs)

    def track(self, value) -> None:
        """Count the storages of the tensors in `value` (DTensors by their local shards) from now on."""
        for tensor in local_tensors(value):
            self._add(tensor)

    def _add(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":  # a planning stand-in (a rule run on meta tensors): no memory
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            if known[1] != size:  # resized in place
                self._live[key] = (known[0], size)
                self._change(size - known[1])
            return
        self._live[key] = (next(self._serials), size)
        self._references[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._change(size)

    def _free(self, key: int) -> None:
        self._references.pop(key, None)
        known = self._live.pop(key, None)
        if known is not None:
            self._change(-known[1], freed=known)

    def _change(self, delta: int, freed: tuple[int, int] | None = None) -> None:
        if delta < 0 and self._peak_unsaved:
            self._save_peak(freed)
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
            self._peak_unsaved = True

    def _save_peak(self, freed: tuple[int, int] | None = None) -> None:
        """Remember what is live at the peak (taken when the count first falls from it)."""
        self._peak_live = {serial: size for serial, size in self._live.values()}
        if freed is not None:
            self._peak_live[freed[0]] = freed[1]
        self._peak_unsaved = False

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.current
        self._peak_unsaved = True

    # --- roles -------------------------------------------------------------------------------
    def tag(self, value, role: str) -> None:
        """Give the storages of the tensors in `value` a role (counting them if they were not yet)."""
        for tensor in local_tensors(value):
            self._add(tensor)
            known = self._live.get(tensor.untyped_storage()._cdata)
            if known is None:  # not counted (a real tensor among fake ones)
                continue
            serial = known[0]
            held = self._roles.get(serial)
            if held is None or _ROLE_ORDER.index(role) < _ROLE_ORDER.index(held):
                self._roles[serial] = role

    def peak_by_category(self) -> dict[str, int]:
        """The bytes live at the peak, by role (`CATEGORIES`)."""
        if self._peak_unsaved:
            self._save_peak()
        totals = dict.fromkeys(CATEGORIES, 0)
        for serial, size in self._peak_live.items():
            totals[self._roles.get(serial, "activations")] += size
        return totals

    @contextlib.contextmanager
    def learning_roles(self):
        """Tag roles from global module and optimizer hooks while the block runs."""

        def parameters_of(module, *_):
            self.tag(list(module.parameters(recurse=False)), "parameters")

        def gradients_of(optimizer, *_):
            self.tag([p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None],
                     "gradients")

        def state_of(optimizer, *_):
            self.tag([list(state.values()) for state in optimizer.state.values()], "optimizer_state")

        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(parameters_of),
            torch.nn.modules.module.register_module_forward_hook(parameters_of),
            register_optimizer_step_pre_hook(gradients_of),
            register_optimizer_step_post_hook(state_of),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
