"""Test helpers shared by the test files: exact global tensors and one rank's piece of them.

`local_piece` is computed with `torch.chunk` only (not with the library's `Layout`), so a test that
compares a DTensor's local tensor with it checks the library against an independent expectation.
"""

from __future__ import annotations

import os

import torch

from shardtensor.placement import Shard


def exact_full(shape, seed: int = 0, *, dtype=torch.float64) -> torch.Tensor:
    """The same global tensor on every rank: small integers, so sums and products stay exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, tuple(shape), generator=generator).to(dtype)


def local_piece(full: torch.Tensor, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The piece of `full` a rank at `coordinate` holds under `placements` (default shard order).

    A tensor dim sharded over several mesh dims is chunked by the lowest mesh dim first, then each
    piece by the next one (nested shards), as `torch.chunk` does; missing chunks are empty.
    """
    piece = full
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % full.ndim
        chunks = torch.chunk(piece, mesh_shape[mesh_dim], dim) if piece.size(dim) else ()
        index = coordinate[mesh_dim]
        piece = chunks[index] if index < len(chunks) else piece.narrow(dim, piece.size(dim), 0)
    return piece


def layout_box(full: torch.Tensor, layout, coordinate) -> torch.Tensor:
    """The box of `full` that `layout` (a shardtensor Layout, any shard sizes) gives `coordinate`:
    a view narrowed to the layout's offset and local shape."""
    local = full
    for dim, (start, length) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        local = local.narrow(dim, start, length)
    return local


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process runs (c10d names them `pt_gloo_runloop`; Linux only).

    Each live gloo process group has its own; c10d's destroy_process_group does not stop them, only
    freeing the group does. One still running while Python finalizes can abort the process.
    """
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as name:
                count += name.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count
