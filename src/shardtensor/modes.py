"""The engine's three switches: strict mode, explicit communication, trusted indices.

Each is a context manager and an environment variable read once at import (`read_environment()`
re-reads them):
- `strict_mode()` / `SHARDTENSOR_STRICT=1`: an op without a sharding rule raises instead of taking
  the replicate fallback;
- `explicit_communication()` / `SHARDTENSOR_EXPLICIT_COMM=1`: any redistribution an op would do
  implicitly (a rule moving an input, or the fallback gathering one) raises, naming the plan;
- `trusted_indices()` / `SHARDTENSOR_TRUST_INDICES=1`: index arguments are not checked on every
  rank alike (no agreement collective per indexing op).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .redistribute import explain

__all__ = [
    "strict_mode", "explicit_communication", "trusted_indices", "read_environment",
    "is_strict", "is_explicit", "indices_trusted", "describe", "implicit_communication_error",
]


class _Switches:
    """Depth of each context manager's blocks, and what the environment said at the last read."""

    strict_environment = False
    explicit_environment = False
    trust_environment = False
    strict_depth = 0
    explicit_depth = 0
    trust_depth = 0


def _environment_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def read_environment() -> None:
    """(Re-)read `SHARDTENSOR_STRICT`, `SHARDTENSOR_EXPLICIT_COMM` and `SHARDTENSOR_TRUST_INDICES`;
    done once at import."""
    _Switches.strict_environment = _environment_flag("SHARDTENSOR_STRICT")
    _Switches.explicit_environment = _environment_flag("SHARDTENSOR_EXPLICIT_COMM")
    _Switches.trust_environment = _environment_flag("SHARDTENSOR_TRUST_INDICES")


read_environment()


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Inside this block an op without a sharding rule raises instead of gathering to Replicate.

    >>> with shardtensor.strict_mode():  # doctest: +SKIP
    ...     torch.cumsum(x, 0)  # NotImplementedError if aten.cumsum has no rule
    """
    _Switches.strict_depth += 1
    try:
        yield
    finally:
        _Switches.strict_depth -= 1


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
    _Switches.explicit_depth += 1
    try:
        yield
    finally:
        _Switches.explicit_depth -= 1


@contextlib.contextmanager
def trusted_indices() -> Iterator[None]:
    """Inside this block index arguments are not checked: no agreement collective per indexing op.

    A bad sharded index then raises on the rank that holds it only, and the other ranks wait in
    their next collective until the process-group timeout. Enter the block on every rank alike.

    >>> with shardtensor.trusted_indices():  # doctest: +SKIP
    ...     embedding(batch_sharded_token_ids)  # no all_reduce of the index range
    """
    _Switches.trust_depth += 1
    try:
        yield
    finally:
        _Switches.trust_depth -= 1


def is_strict() -> bool:
    return _Switches.strict_depth > 0 or _Switches.strict_environment


def is_explicit() -> bool:
    return _Switches.explicit_depth > 0 or _Switches.explicit_environment


def indices_trusted() -> bool:
    return _Switches.trust_depth > 0 or _Switches.trust_environment


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
