"""`implicit_replication()`: read every plain tensor mixed with DTensors as Replicate (unchecked)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import dtensor

__all__ = ["implicit_replication"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block (on this thread) an op that mixes a plain tensor with DTensors reads the
    plain tensor as Replicate instead of raising.

    Unchecked: nothing verifies that the tensor is the same on every rank; if it is not, results
    are silently wrong. Plain tensors that torch creates inside a public function from global
    metadata need no such block (see `shardtensor.dtensor.created_by_torch`).

    >>> with implicit_replication():  # doctest: +SKIP
    ...     x + torch.arange(4.0)  # the same arange on every rank
    """
    state = dtensor._call_state
    state.implicit_replication_depth += 1
    try:
        yield
    finally:
        state.implicit_replication_depth -= 1
