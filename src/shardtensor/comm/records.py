"""Observability of every collective: `observe()` collects records, `call_counts` counts calls.

Every collective with more than one rank is recorded exactly once per call, whatever c10d calls it makes,
so debug tools and benchmarks read the same numbers. Eagerly it calls `_record`. Traced into a
torch.compile graph it emits `_emit`'s op, `torch.ops.shardtensor.record_collective`, beside its
functional collective: the graph then records the collective each time it runs (the op's kernel calls
`_record`), and tracing records nothing. The op reads the collective's input (which orders it before
the collective, as eager mode records first, and keeps inductor from fusing across it only where the
collective already stops fusion), returns nothing and is marked side-effecting, so no pass removes it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.fx.node import has_side_effect

from ..rank_state import per_rank_contents

__all__ = ["CommRecord", "observe", "call_counts"]


@dataclasses.dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as seen by this rank, with the bytes an ideal algorithm moves.

    all_gather: sent = local bytes * (n-1), received = the other pieces. all_to_all: the pieces
    sent to / received from other coordinates. all_reduce: ring, sent = received =
    2 * (n-1) / n * bytes. reduce_scatter: sent = input bytes minus this rank's piece, received =
    (n-1) * this rank's piece. broadcast and scatter: the source sends each peer its bytes
    directly, the others receive theirs. send / recv / batch_p2p: the tensors' bytes, group_size 2, and
    `mesh_dim` None, except a batch_p2p along mesh dims (a halo exchange, a ring, a redistribute
    exchange): those mesh dims. `mesh_dim_names`: the names of the mesh dims on the mesh that issued it
    (FSDP's "dp" sub-mesh and tensor parallelism's "tp" label their own), None for unnamed meshes and
    `mesh_dim` None; not compared, so records built by hand in tests equal recorded ones.
    """

    kind: str
    mesh_dim: int | tuple[int, ...] | None
    group_size: int
    bytes_sent: int
    bytes_received: int
    mesh_dim_names: tuple[str, ...] | None = dataclasses.field(default=None, compare=False)


_observers: list[list[CommRecord]] = []
call_counts: collections.Counter[str] = collections.Counter()
per_rank_contents("comm.observers", _observers)
per_rank_contents("comm.call_counts", call_counts)


@contextlib.contextmanager
def observe():
    """Collect the `CommRecord`s of the calls made inside the block (nestable)."""
    records: list[CommRecord] = []
    _observers.append(records)
    try:
        yield records
    finally:
        for index in range(len(_observers) - 1, -1, -1):
            if _observers[index] is records:
                del _observers[index]
                break


def _record(kind: str, mesh_dim: int | tuple[int, ...] | None, group_size: int, bytes_sent: int, bytes_received: int,
            mesh_dim_names: tuple[str, ...] | None = None) -> None:
    call_counts[kind] += 1
    if _observers:
        record = CommRecord(kind, mesh_dim, group_size, bytes_sent, bytes_received, mesh_dim_names)
        for records in _observers:
            records.append(record)



# The op a traced collective leaves in its graph. Its arguments are the record's fields as plain values
# (a graph holds no Python object, and inductor's on-disk cache may load the graph in another process);
# `mesh_dim` is a list: one entry for a mesh dim, more for a tuple of mesh dims (never one: see `_peers`).
_library = torch.library.Library("shardtensor", "FRAGMENT")
_library.define(
    "record_collective(Tensor sent, str kind, int[] mesh_dim, int group_size, SymInt bytes_sent, "
    "SymInt bytes_received, str[]? mesh_dim_names) -> ()"
)


def _record_collective(sent, kind, mesh_dim, group_size, bytes_sent, bytes_received, mesh_dim_names) -> None:
    _record(kind, mesh_dim[0] if len(mesh_dim) == 1 else tuple(mesh_dim), group_size, bytes_sent, bytes_received,
            None if mesh_dim_names is None else tuple(mesh_dim_names))


def _traced_record_collective(*arguments) -> None:
    """While tracing (fake or functional tensors) nothing is recorded: the graph records when it runs."""


_library.impl("record_collective", _record_collective, "CompositeExplicitAutograd")
torch.library.register_fake("shardtensor::record_collective", _traced_record_collective, lib=_library)
record_collective = has_side_effect(torch.ops.shardtensor.record_collective.default)


def _emit(record: CommRecord, sent: torch.Tensor) -> None:
    """Leave `record` in the graph being traced, read with `sent`, the tensor its collective sends."""
    mesh_dim = list(record.mesh_dim) if isinstance(record.mesh_dim, tuple) else [record.mesh_dim]
    names = None if record.mesh_dim_names is None else list(record.mesh_dim_names)
    record_collective(sent, record.kind, mesh_dim, record.group_size, record.bytes_sent, record.bytes_received, names)
