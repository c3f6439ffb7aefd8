"""Reductions of many tensors in one collective: Partial shards reduced together, DDP-bucket style.

A tensor whose layout differs from its target only where it is Partial and the target Replicate
(a data-parallel gradient, an optimizer reading it) needs an all_reduce and nothing else. Such
tensors on one mesh, with the same Partial mesh dims and reduce ops, dtype and device, are flattened
into one buffer and reduced by one all_reduce, instead of one collective each (a P(sum)/P(avg) mix
too: a sum divided by the ranks along the avg mesh dims, `flattened_partial`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..placement import Partial, Replicate, flattened_partial

__all__ = ["reduction_only", "all_reduce_together", "reduce_in_buckets"]


def reduction_only(source: Layout, target: Layout) -> tuple[tuple[int, ...], tuple[Partial, ...]] | None:
    """(mesh dims, their Partials) when `target` is `source` with some Partial mesh dims (one plain
    reduce op, not product, or sum mixed with avg) made Replicate and the same pieces, else None."""
    mesh_dims, partials = [], []
    for mesh_dim, (have, want) in enumerate(zip(source.placements, target.placements)):
        if have == want:
            continue
        if not (type(have) is Partial and isinstance(want, Replicate)):
            return None
        mesh_dims.append(mesh_dim)
        partials.append(have)
    reduce_ops = {partial.reduce_op for partial in partials}
    one_op = len(reduce_ops) == 1 and "product" not in reduce_ops
    if not (one_op or reduce_ops == {"sum", "avg"}) or source.pieces != target.pieces:
        return None
    return tuple(mesh_dims), tuple(partials)


def all_reduce_together(locals_: Sequence[torch.Tensor], mesh, mesh_dims: tuple[int, ...],
                        partials: Sequence[Partial]) -> list:
    """One all_reduce over `mesh_dims` (whose Partials are `partials`) of every local tensor, flattened
    into one buffer; the reduced tensors, shaped like the inputs (views into the reduced buffer)."""
    reduced_as, divisor = flattened_partial(partials, [mesh.shape[mesh_dim] for mesh_dim in mesh_dims])
    group = mesh_dims if len(mesh_dims) > 1 else mesh_dims[0]
    flat = locals_[0] if len(locals_) == 1 else torch.cat([local.reshape(-1) for local in locals_])
    reduced = comm.all_reduce(flat, mesh, group, reduce_op=reduced_as.reduce_op)
    if divisor != 1:
        reduced.div_(divisor)
    if len(locals_) == 1:
        return [reduced]
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
    for ((mesh_dims, partials), _, _), members in buckets.items():
        reduced = all_reduce_together([locals_[index] for index in members], mesh, mesh_dims, partials)
        for index, tensor in zip(members, reduced):
            results[index] = tensor
    return results
