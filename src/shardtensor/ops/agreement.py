"""Checks that every rank agrees on: one small all_reduce(max) of per-rank verdicts, so that a bad input
raises on every rank or on none.

A kernel that checks its inputs (index ranges in `index_checks.py`, value ranges in `value_checks.py`)
sees only this rank's shard. Where a checked argument is not Replicate on some mesh dim, ranks hold
different values there, so each rank reduces its verdicts (integers where > 0 means "bad") with max
over exactly those mesh dims; every rank then sees the same worst verdicts and raises alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..placement import Replicate

__all__ = ["varying_mesh_dims", "start_agreement"]


def varying_mesh_dims(layouts: Sequence[Layout]) -> tuple[int, ...]:
    """The mesh dims (sorted) on which some of `layouts` is not Replicate: where ranks may hold other values.
    Without any, every rank checks the same values and no agreement is needed."""
    return tuple(sorted({
        mesh_dim
        for layout in layouts
        for mesh_dim, placement in enumerate(layout.placements)
        if not isinstance(placement, Replicate)
    }))


def start_agreement(verdicts: list[int], mesh, mesh_dims: tuple[int, ...], device):
    """Start the all_reduce(max) of this rank's `verdicts` over `mesh_dims`, asynchronously (so that it
    can overlap a local kernel); `.wait()` on the handle gives every rank the same worst verdicts."""
    mesh_dim = mesh_dims if len(mesh_dims) > 1 else mesh_dims[0]
    return comm.all_reduce(torch.tensor(verdicts, device=device), mesh, mesh_dim, reduce_op="max", async_op=True)
