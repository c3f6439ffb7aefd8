"""Which plain tensors mixed with DTensors in an aten op may be read as Replicate, and what of a
0-d one's value decides.

A plain tensor the caller passes could hold anything on each rank, so dispatch refuses it. Two
kinds are safe: tensors torch itself creates, from global metadata only, inside a public function
called on DTensors (`outermost_call` marks that call, `created_by_torch` answers), and, unchecked,
every plain tensor inside an `implicit_replication()` block. A 0-d plain tensor is read like a
Python scalar; as the scale of a Partial DTensor its sign decides like a scalar's (`scale_signs`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .placement import Partial
from .rules import scale_sign

__all__ = ["outermost_call", "created_by_torch", "implicit_replication", "value_sign", "scale_signs"]


class _CallState(threading.local):
    """Per thread: how deep public torch calls on DTensors are nested, and whether plain tensors
    torch creates inside the outermost one are read as Replicate."""

    depth = 0
    torch_created_replicate = False
    implicit_replication_depth = 0  # `implicit_replication()` blocks


_call_state = _CallState()


def _has_plain_tensor(values, dtensor_class: type) -> bool:
    """Whether `values` (nested lists and tuples included) hold a plain tensor of more than one element."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if not isinstance(value, dtensor_class) and value.numel() != 1:
                return True
        elif isinstance(value, (list, tuple)) and _has_plain_tensor(value, dtensor_class):
            return True
    return False


class outermost_call:
    """Marks a public torch call on DTensors (`__torch_function__`) while it runs; only the
    outermost one on this thread decides, from its own arguments, what `created_by_torch` says."""

    __slots__ = ("dtensor_class", "args", "kwargs", "outermost")

    def __init__(self, dtensor_class: type, args: tuple, kwargs: dict):
        self.dtensor_class, self.args, self.kwargs = dtensor_class, args, kwargs

    def __enter__(self) -> None:
        state = _call_state
        self.outermost = state.depth == 0
        if self.outermost:
            state.torch_created_replicate = not (
                _has_plain_tensor(self.args, self.dtensor_class)
                or _has_plain_tensor(self.kwargs.values(), self.dtensor_class)
            )
        state.depth += 1

    def __exit__(self, *exception) -> None:
        state = _call_state
        state.depth -= 1
        if self.outermost:
            state.torch_created_replicate = False


def created_by_torch(tensor: torch.Tensor) -> bool:
    """Whether a plain tensor mixed with DTensors in an aten op may be read as Replicate.

    True inside a public torch function called with DTensor arguments (the outermost such call on
    this thread) that got no plain tensor of its own except one-element ones (read like 0-d ones): a
    plain tensor that shows up then was created by torch from global metadata (a causal mask from
    sizes, a tolerance from a dtype) and is the same on every rank. A plain tensor the caller passed is refused, and so is
    everything in a call that got one (torch may derive new tensors from it, which carry this
    rank's data). Also true inside `implicit_replication()` (unchecked).
    """
    state = _call_state
    return state.torch_created_replicate or state.implicit_replication_depth > 0


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block (on this thread) an op that mixes a plain tensor with DTensors reads the
    plain tensor as Replicate instead of raising.

    Unchecked: nothing verifies that the tensor is the same on every rank; if it is not, results
    are silently wrong. Plain tensors that torch creates inside a public function from global
    metadata need no such block (see `created_by_torch`).

    >>> with implicit_replication():  # doctest: +SKIP
    ...     x + torch.arange(4.0)  # the same arange on every rank
    """
    state = _call_state
    state.implicit_replication_depth += 1
    try:
        yield
    finally:
        state.implicit_replication_depth -= 1


def value_sign(tensor: torch.Tensor) -> int | None | str:
    """`rules.scale_sign` of the value of a 0-d plain tensor: its sign, None for inf or NaN.

    Reads the value: free for a CPU tensor (`torch.tensor(2.0)` is one, and may scale CUDA tensors);
    for a CUDA tensor, a device-to-host copy that waits for every kernel queued before it (a host sync).
    """
    return scale_sign(tensor.item())


def scale_signs(dtensor_class: type, values) -> tuple:
    """`value_sign` of each 0-d plain tensor among `values` (a call's arguments, lists one level deep)
    when some DTensor among them is Partial; () otherwise, without reading any value.

    A Partial scaled by inf or NaN is not the scaled reduction (a sum of +inf and -inf operands is NaN
    where inf times the sum is +-inf), so next to a Partial the scale's sign decides, as a Python
    scalar's does (`ShardingRule.value_keys` SIGN). Read only there: elsewhere no rule row depends on it.
    """
    for value in values:
        if isinstance(value, dtensor_class):
            if _is_partial(value):
                break
        elif isinstance(value, (list, tuple)) and any(
            isinstance(item, dtensor_class) and _is_partial(item) for item in value
        ):
            break
    else:  # no Partial: the common case, a loop without building anything
        return ()
    flat = [item for value in values for item in (value if isinstance(value, (list, tuple)) else (value,))]
    return tuple(
        value_sign(value) for value in flat
        if isinstance(value, torch.Tensor) and not isinstance(value, dtensor_class) and value.ndim == 0
    )


def _is_partial(dtensor) -> bool:
    """Whether some mesh dim of a DTensor's placements is Partial (a plain loop: called per argument)."""
    for placement in dtensor._spec.layout.placements:
        if isinstance(placement, Partial):
            return True
    return False
