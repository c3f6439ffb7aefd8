"""Observability of every collective: `observe()` collects records, `call_counts` counts calls.

Every collective with more than one rank calls `_record` exactly once, whatever c10d calls it makes,
so debug tools and benchmarks read the same numbers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

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

