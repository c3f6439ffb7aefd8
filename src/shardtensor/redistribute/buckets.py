"""Reductions of many tensors in one collective: Partial shards reduced together, DDP-bucket style.

A tensor whose layout differs from its target only where it is Partial and the target Replicate
(a data-parallel gradient, an optimizer reading it) needs an all_reduce and nothing else. Such
tensors on one mesh, with the same Partial mesh dims, reduce op, dtype and device, are flattened
into one buffer and reduced by one all_reduce, instead of one collective each.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..placement import Partial, Replicate

__all__ = ["reduction_only", "all_reduce_together", "reduce_in_buckets"]


def reduction_only(source: Layout, target: Layout) -> tuple[tuple[int, ...], str] | None:
    """(mesh dims, reduce op) when `target` is `source` with some Partial mesh dims (one plain
    reduce op, not product) made Replicate and the same pieces, else None."""
    mesh_dims, reduce_ops = [], set()
    for mesh_dim, (have, want) in enumerate(zip(source.placements, target.placements)):
        if have == want:
            continue
        if not (type(have) is Partial and isinstance(want, Replicate)):
            return None
        mesh_dims.append(mesh_dim)
        reduce_ops.add(have.reduce_op)
    if len(reduce_ops) != 1 or reduce_ops & {"product"} or source.pieces != target.pieces:
        return None
    return tuple(mesh_dims), reduce_ops.pop()


def all_reduce_together(locals_: Sequence[torch.Tensor], mesh, mesh_dims: tuple[int, ...], reduce_op: str) -> list:
    """One all_reduce of every local tensor, flattened into one buffer; the reduced tensors, shaped
    like the inputs (views into the reduced buffer)."""
    if len(locals_) == 1:
        return [comm.all_reduce(locals_[0], mesh, mesh_dims if len(mesh_dims) > 1 else mesh_dims[0], reduce_op=reduce_op)]
    flat = torch.cat([local.reshape(-1) for local in locals_])
    reduced = comm.all_reduce(flat, mesh, mesh_dims if len(mesh_dims) > 1 else mesh_dims[0], reduce_op=reduce_op)
    results, offset = [], 0
    for local in locals_:
        count = local.numel()
        results.append(reduced[offset:offset + count].view(local.shape))
        offset += count
    return results


def reduce_in_buckets(locals_: Sequence[torch.Tensor], sources: Sequence[Layout], targets: Sequence[Layout],
                      mesh) -> list[torch.Tensor | None]:
    """For each local tensor whose move from `sources[i]` to `targets[i]` is a reduction only: its
    reduced tensor, all of one bucket (mesh dims, reduce op, dtype, device) from one all_reduce;
    None for the others (moved otherwise, or not at all)."""
    buckets: dict[tuple, list[int]] = collections.defaultdict(list)
    for index, (local, source, target) in enumerate(zip(locals_, sources, targets)):
        reduction = None if source == target else reduction_only(source, target)
        if reduction is not None:
            buckets[(reduction, local.dtype, local.device)].append(index)
    results: list[torch.Tensor | None] = [None] * len(locals_)
    for ((mesh_dims, reduce_op), _, _), members in buckets.items():
        reduced = all_reduce_together([locals_[index] for index in members], mesh, mesh_dims, reduce_op)
        for index, tensor in zip(members, reduced):
            results[index] = tensor
    return results
