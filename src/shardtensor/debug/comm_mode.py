"""CommDebugMode: count the collectives (and their bytes) that a block of DTensor code issues.

Mirrors `torch.distributed.tensor.debug.CommDebugMode` (`get_total_counts`, `get_comm_counts`,
`generate_comm_debug_tracing_table`) and adds what it lacks: the bytes this rank sent and
received per kind, the collectives each torch op caused, and the ops that took the replicate
fallback inside the block. It reads `shardtensor.comm.observe()` records, so it sees the same
numbers as every other tool.

Counts are keyed by our collective kinds (strings). Their c10d counterparts (`C10D_NAMES`):

| kind | c10d / functional collective |
|---|---|
| all_gather | all_gather_into_tensor (uneven sizes: all_to_all_single, still counted as all_gather) |
| all_to_all | all_to_all_single |
| all_reduce | all_reduce |
| reduce_scatter | reduce_scatter_tensor |
| broadcast | broadcast |
| scatter | scatter |
| send, recv, batch_p2p | send, recv, batch_isend_irecv |

    >>> with CommDebugMode() as mode:  # doctest: +SKIP
    ...     y = x.redistribute(placements=[Replicate()])
    >>> mode.get_comm_counts()  # doctest: +SKIP
    {'all_gather': 1}
"""

from __future__ import annotations

import collections
import dataclasses

from torch.utils._python_dispatch import TorchDispatchMode

from .. import comm, dispatch

__all__ = ["CommDebugMode", "CommBytes", "C10D_NAMES"]

C10D_NAMES = {
    "all_gather": "all_gather_into_tensor",
    "all_to_all": "all_to_all_single",
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter_tensor",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "batch_p2p": "batch_isend_irecv",
}
# Collectives not issued inside a torch op: redistribute, full_tensor, distribute_tensor, from_local.
OUTSIDE_OPS = "(no op: redistribute, full_tensor, distribute_tensor)"


@dataclasses.dataclass(frozen=True, slots=True)
class CommBytes:
    """Bytes this rank sent and received, for an ideal algorithm (see `comm.CommRecord`)."""

    sent: int
    received: int


class _OpTracker(TorchDispatchMode):
    """Notes which collective records each torch op added (by their positions in the record list)."""

    def __init__(self, records: list):
        super().__init__()
        self.records = records
        self.by_op: list[tuple[str, int, int]] = []  # (op name, first record, end record)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = len(self.records)
        result = func(*args, **(kwargs or {}))
        if len(self.records) > start:
            self.by_op.append((str(func), start, len(self.records)))
        return result


class CommDebugMode:
    """A context manager that records every collective this rank issues inside it.

    The mode is reusable: entering it again starts a fresh recording.
    """

    def __init__(self):
        self.records: list[comm.CommRecord] = []
        self._observer = None
        self._tracker: _OpTracker | None = None
        self._fallbacks_before: collections.Counter[str] = collections.Counter()
        self._fallbacks: collections.Counter[str] | None = None

    def __enter__(self) -> CommDebugMode:
        self._observer = comm.observe()
        self.records = self._observer.__enter__()
        self._tracker = _OpTracker(self.records)
        self._tracker.__enter__()
        self._fallbacks_before = collections.Counter(dispatch.fallback_counts)
        self._fallbacks = None
        return self

    def __exit__(self, *exc_info) -> None:
        self._fallbacks = collections.Counter(dispatch.fallback_counts) - self._fallbacks_before
        self._tracker.__exit__(*exc_info)
        self._observer.__exit__(*exc_info)

    # --- PyTorch's API ---------------------------------------------------------------------------------
    def get_total_counts(self) -> int:
        """How many collectives ran inside the block (one-rank groups issue none)."""
        return len(self.records)

    def get_comm_counts(self) -> dict[str, int]:
        """Collectives by kind, e.g. `{'all_gather': 2, 'all_reduce': 1}`."""
        return dict(collections.Counter(record.kind for record in self.records))

    # --- what PyTorch lacks ----------------------------------------------------------------------------
    def get_comm_bytes(self) -> dict[str, CommBytes]:
        """Bytes this rank sent and received, by collective kind."""
        sent: collections.Counter[str] = collections.Counter()
        received: collections.Counter[str] = collections.Counter()
        for record in self.records:
            sent[record.kind] += record.bytes_sent
            received[record.kind] += record.bytes_received
        return {kind: CommBytes(sent[kind], received[kind]) for kind in self.get_comm_counts()}

    def get_total_bytes(self) -> CommBytes:
        """Bytes this rank sent and received over all collectives."""
        return CommBytes(sum(r.bytes_sent for r in self.records), sum(r.bytes_received for r in self.records))

    def get_fallback_counts(self) -> dict[str, int]:
        """Ops (by name) that had no sharding rule and gathered their inputs to Replicate, with counts."""
        if self._fallbacks is not None:
            return dict(self._fallbacks)
        return dict(collections.Counter(dispatch.fallback_counts) - self._fallbacks_before)

    def get_comm_counts_by_op(self) -> dict[str, dict[str, int]]:
        """Collectives by the torch op that issued them; `OUTSIDE_OPS` holds the rest."""
        by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        inside = set()
        for name, start, end in self._tracker.by_op if self._tracker else []:
            for index in range(start, end):
                if index not in inside:
                    by_op[name][self.records[index].kind] += 1
                    inside.add(index)
        for index, record in enumerate(self.records):
            if index not in inside:
                by_op[OUTSIDE_OPS][record.kind] += 1
        return {name: dict(counts) for name, counts in by_op.items()}

    def generate_comm_debug_tracing_table(self, noise_level: int = 0) -> str:
        """A text summary: totals by kind with bytes; noise_level >= 1 adds collectives per op
        and per mesh dim, and the fallback ops."""
        lines = [f"Global: {self.get_total_counts()} collectives, "
                 f"{_bytes_text(self.get_total_bytes())}"]
        for kind, count in sorted(self.get_comm_counts().items()):
            lines.append(f"  {kind} (c10d {C10D_NAMES.get(kind, kind)}): {count}, "
                         f"{_bytes_text(self.get_comm_bytes()[kind])}")
        if noise_level >= 1:
            by_mesh_dim = collections.Counter((r.kind, r.mesh_dim) for r in self.records)
            if by_mesh_dim:
                lines.append("By mesh dim:")
                for (kind, mesh_dim), count in sorted(by_mesh_dim.items(), key=str):
                    lines.append(f"  {kind} on mesh dim {mesh_dim}: {count}")
            by_op = self.get_comm_counts_by_op()
            if by_op:
                lines.append("By op:")
                for name, counts in by_op.items():
                    text = ", ".join(f"{kind} x{count}" for kind, count in sorted(counts.items()))
                    lines.append(f"  {name}: {text}")
            fallbacks = self.get_fallback_counts()
            if fallbacks:
                lines.append("Replicate fallback (no sharding rule):")
                for name, count in sorted(fallbacks.items()):
                    lines.append(f"  {name}: {count}")
        return "\n".join(lines)


def _bytes_text(amount: CommBytes) -> str:
    return f"sent {amount.sent} B, received {amount.received} B"
