"""A divergence detector: every collective first agrees across its group on a fingerprint.

With `SHARDTENSOR_DEBUG_COLLECTIVES=1` in the environment, or inside `check_collectives()`, each
collective of `comm` first gathers every peer's `Fingerprint` (the collective, mesh dim, ranks,
dtype, the arguments every peer must pass alike, this rank's shape and the calling line) and, when
the agreed parts differ, raises `CollectiveMismatch` on every rank with each rank's fingerprint,
instead of hanging or exchanging mismatched buffers. Off by default; `comm` then pays one boolean
check per call. The fingerprint exchange is a c10d call of its own, not counted by `comm.observe`.

    >>> with check_collectives():  # doctest: +SKIP
    ...     x.full_tensor()
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

__all__ = ["CollectiveMismatch", "Fingerprint", "check_collectives", "enabled", "agree"]

enabled = os.environ.get("SHARDTENSOR_DEBUG_COLLECTIVES", "0") not in ("", "0")

_PACKAGE_DIRECTORY = os.path.dirname(os.path.abspath(__file__))


class CollectiveMismatch(RuntimeError):
    """Ranks of one group reached different collectives (or the same one with different arguments)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """One rank's view of a collective: `agreed` must be equal on every peer; shape and call site may differ."""

    kind: str
    mesh_dim: int | tuple[int, ...]
    ranks: tuple[int, ...]
    dtype: str
    agreed: tuple
    shape: tuple[int, ...]
    call_site: str

    def key(self) -> tuple:
        return (self.kind, self.mesh_dim, self.ranks, self.dtype, self.agreed)

    def __str__(self) -> str:
        return (f"{self.kind} over mesh dim {self.mesh_dim} (ranks {list(self.ranks)}), dtype {self.dtype}, "
                f"local shape {self.shape}, arguments {self.agreed}, called from {self.call_site}")


@contextlib.contextmanager
def check_collectives():
    """Check every collective inside the block (all ranks must enter it alike)."""
    global enabled
    previous, enabled = enabled, True
    try:
        yield
    finally:
        enabled = previous


def _call_site() -> str:
    """The innermost line outside shardtensor that led to this collective."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIRECTORY):
        frame = frame.f_back
    return "<shardtensor>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def agree(kind: str, peers, tensor: torch.Tensor, agreed: tuple) -> None:
    """Gather every peer's fingerprint of this collective; raise `CollectiveMismatch` on every rank if they differ."""
    mine = Fingerprint(kind, peers.mesh_dim, tuple(sorted(peers.ranks)), str(tensor.dtype), agreed,
                       tuple(tensor.shape), _call_site())
    gathered: list = [None] * peers.size
    dist.all_gather_object(gathered, mine, group=peers.group)
    if any(fingerprint.key() != mine.key() for fingerprint in gathered):
        raise CollectiveMismatch(_mismatch_error(gathered, dist.get_rank()))


def _mismatch_error(gathered: list, rank: int) -> str:
    lines = [f"ranks of one group are in different collectives (seen from rank {rank}); each rank's fingerprint:"]
    lines += [f"  rank {fingerprint.ranks[index]}: {fingerprint}" for index, fingerprint in enumerate(gathered)]
    lines.append("every rank of the group must make the same collective calls in the same order, with the "
                 "same dtype and agreed arguments; look for a rank-dependent branch or data-dependent shape")
    return "\n".join(lines)
