"""The engine's three switches: strict mode, explicit communication, trusted indices.

Each is a context manager and an environment variable read once at import (`read_environment()`
re-reads them):
- `strict_mode()` / `SHARDTENSOR_STRICT=1`: an op without a sharding rule raises instead of taking
  the replicate fallback;
- `explicit_communication()` / `SHARDTENSOR_EXPLICIT_COMM=1`: any redistribution an op would do
  implicitly (a rule moving an input, or the fallback gathering one) raises, naming the plan;
- `trusted_indices()` / `SHARDTENSOR_TRUST_INDICES=1`: index arguments are not checked on every
  rank alike (no agreement collective per indexing op).

Thread policy: a context manager affects only the thread that entered it (like
`implicit_replication()`), so two threads may run under different modes at once; the environment
variables apply to every thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from .redistribute import explain

__all__ = [
    "strict_mode", "explicit_communication", "trusted_indices", "read_environment",
    "is_strict", "is_explicit", "indices_trusted", "describe", "implicit_communication_error",
]


class _Environment:
    """What the environment said at the last read; shared by every thread."""

    strict = False
    explicit = False
    trust = False


class _Depths(threading.local):
    """Depth of each context manager's blocks in the current thread."""

    strict = 0
    explicit = 0
    trust = 0


_depths = _Depths()


def _environment_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def read_environment() -> None:
    """(Re-)read `SHARDTENSOR_STRICT`, `SHARDTENSOR_EXPLICIT_COMM` and `SHARDTENSOR_TRUST_INDICES`;
    done once at import."""
    _Environment.strict = _environment_flag("SHARDTENSOR_STRICT")
    _Environment.explicit = _environment_flag("SHARDTENSOR_EXPLICIT_COMM")
    _Environment.trust = _environment_flag("SHARDTENSOR_TRUST_INDICES")


read_environment()


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Inside this block an op without a sharding rule raises instead of gathering to Replicate.

    >>> with shardtensor.strict_mode():  # doctest: +SKIP
    ...     torch.cumsum(x, 0)  # NotImplementedError if aten.cumsum has no rule
    """
    _depths.strict += 1
    try:
        yield
    finally:
        _depths.strict -= 1


@contextlib.contextmanager
def explicit_communication() -> Iterator[None]:
    """Inside this block an op that would communicate implicitly raises instead, showing the plan.

    That is an op whose rule moves an input, or whose rule's local op issues collectives itself
    (softmax over a sharded dim, nll_loss 'mean' over a sharded batch, batch-norm running
    statistics, `equal` of sharded tensors: `Row.collectives`). Communication then happens only
    where the program asks for it (`redistribute`, `full_tensor`); ops whose rules compute locally
    (or yield Partial) still run. (The agreement on out-of-range indices of sharded index tensors is
    a check, not part of the computation: `shardtensor.trusted_indices()` skips it.)

    >>> with shardtensor.explicit_communication():  # doctest: +SKIP
    ...     x_row_sharded + y_column_sharded  # RuntimeError naming aten.add.Tensor and the plan
    """
    _depths.explicit += 1
    try:
        yield
    finally:
        _depths.explicit -= 1


@contextlib.contextmanager
def trusted_indices() -> Iterator[None]:
    """Inside this block index arguments are not checked: no agreement collective per indexing op.

    A bad sharded index then raises on the rank that holds it only, and the other ranks wait in
    their next collective until the process-group timeout. Enter the block on every rank alike.

    >>> with shardtensor.trusted_indices():  # doctest: +SKIP
    ...     embedding(batch_sharded_token_ids)  # no all_reduce of the index range
    """
    _depths.trust += 1
    try:
        yield
    finally:
        _depths.trust -= 1


def is_strict() -> bool:
    return _depths.strict > 0 or _Environment.strict


def is_explicit() -> bool:
    return _depths.explicit > 0 or _Environment.explicit


def indices_trusted() -> bool:
    return _depths.trust > 0 or _Environment.trust


def describe(dtensors) -> str:
    """The placements and global shape of each DTensor, for error messages."""
    return ", ".join(f"[{', '.join(str(p) for p in d.placements)}] shape={tuple(d.shape)}" for d in dtensors)


def implicit_communication_error(op, dtensors, targets, what: str, local_collectives=()) -> RuntimeError:
    """Explicit-communication mode refuses an op that would move `dtensors` to `targets` (None: stays)
    or whose rule's local op issues `local_collectives` ((mesh dim, `LocalCollective`) pairs)."""
    lines = [
        f"{op} would communicate implicitly ({what}), which explicit-communication mode "
        f"forbids. Inputs: {describe(dtensors)}. The plan it would run:"
    ]
    for number, (dtensor, target) in enumerate(zip(dtensors, targets)):
        if target is not None and target != dtensor.sharding:
            lines.append(f"input {number}: " + explain(dtensor.sharding, target, dtensor.element_size()))
    for mesh_dim, collective in local_collectives:
        lines.append(f"inside the op (its sharding rule's local computation): {collective} on mesh dim {mesh_dim}")
    lines.append(
        "Redistribute the inputs yourself first (x.redistribute(mesh, placements)), or leave "
        "shardtensor.explicit_communication() / unset SHARDTENSOR_EXPLICIT_COMM."
    )
    return RuntimeError("\n".join(lines))
