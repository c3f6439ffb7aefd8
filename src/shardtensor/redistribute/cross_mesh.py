"""Cross-mesh redistribute: move a tensor between layouts on two different meshes.

The meshes may differ in shape, in rank order and in rank set (even disjoint ones: a pipeline
hand-off). Every rank of the world calls the move (SPMD), whether or not it is in either mesh.

1. Partial mesh dims of the source are reduced to Replicate on the source mesh (an operand is not
   a slice of the tensor, so it cannot be handed over piece by piece).
2. A `HandOff` lists the point-to-point transfers: for every target rank and every distinct source
   shard that overlaps its target shard, one holder of that source shard sends the overlap. A rank
   that holds the source shard itself copies locally, and replicas share the sending by target
   coordinate. So every rank receives exactly the target elements it does not hold, once.

Ranks outside the target mesh end with a local tensor without elements (as PyTorch's DTensor
gives ranks outside its mesh); ranks outside the source mesh pass such a tensor, send nothing and
receive their target shard. Such a stand-in cannot say whether the source requires grad, which decides
whether the move's backward runs on every rank that takes part: with the data, the holders tell the
ranks of the target mesh that hold no source shard (`redistribute_across_meshes_with_requires_grad`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import comm
from ..layout import Layout
from .bounds import boxes
from .executor import _narrow, _region, cost_model_for, exchange_into, execute
from .planner import plan

__all__ = ["Transfer", "HandOff", "hand_off", "redistribute_across_meshes", "redistribute_across_meshes_with_requires_grad",
           "empty_shard"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Global rank `sender` gives global rank `receiver` the box (offset, shape) of the tensor."""

    sender: int
    receiver: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class HandOff:
    """Every transfer of a cross-mesh move, the same on every rank. Local copies have sender == receiver."""

    source: Layout
    target: Layout
    source_ranks: tuple[int, ...]  # global ranks in row-major mesh-coordinate order
    target_ranks: tuple[int, ...]
    transfers: tuple[Transfer, ...]

    def received_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes global rank `rank` receives from other ranks."""
        return itemsize * sum(t.numel for t in self.transfers if t.receiver == rank and t.sender != rank)

    @property
    def messages(self) -> int:
        return sum(1 for transfer in self.transfers if transfer.sender != transfer.receiver)

    def __str__(self) -> str:
        receivers = sorted({transfer.receiver for transfer in self.transfers})
        most = max((self.received_bytes(rank, 1) for rank in receivers), default=0)
        return (
            f"hand-off {self.source} on ranks {list(self.source_ranks)}  ->  {self.target} on ranks "
            f"{list(self.target_ranks)}: {self.messages} point-to-point message(s), at most {most} "
            f"elements received per rank"
        )


@functools.lru_cache(maxsize=1024)
def hand_off(source: Layout, source_ranks: tuple[int, ...], target: Layout, target_ranks: tuple[int, ...]) -> HandOff:
    """The transfers from `source` (no Partial) on `source_ranks` to `target` on `target_ranks` (cached)."""
    if source.partial_mesh_dims() or target.partial_mesh_dims():
        raise ValueError(
            f"a hand-off moves slices, not Partial operands: source {source}, target {target}; reduce the "
            f"Partial mesh dims first (redistribute_across_meshes does it for the source)"
        )
    if source.shape != target.shape:
        raise ValueError(f"a cross-mesh move keeps the global shape; source {source.shape}, target {target.shape}")
    holders: dict[tuple, list[int]] = {}
    for rank, box in zip(source_ranks, boxes(source)):
        holders.setdefault(box, []).append(rank)
    transfers = []
    for index, (receiver, wanted) in enumerate(zip(target_ranks, boxes(target))):
        for box, ranks in holders.items():
            region = _region(*box, *wanted)
            if region is None:
                continue
            sender = receiver if receiver in ranks else ranks[index % len(ranks)]
            transfers.append(Transfer(sender, receiver, region[0], region[1]))
    return HandOff(source, target, source_ranks, target_ranks, tuple(transfers))


def empty_shard(local: torch.Tensor, ndim: int) -> torch.Tensor:
    """The local tensor of a rank outside a DTensor's mesh: no elements, `ndim` dims (at least 1)."""
    return local.new_empty((0,) * max(ndim, 1))


def _ranks(mesh) -> tuple[int, ...]:
    return tuple(mesh.mesh.flatten().tolist())


def redistribute_across_meshes(local: torch.Tensor, source: Layout, source_mesh, target: Layout, target_mesh,
                               *, async_op: bool = False):
    """This rank's local tensor of `target` on `target_mesh`, from its local tensor of `source` on `source_mesh`.

    Every rank of the world calls it. With `async_op=True` returns a handle whose `wait()` gives the tensor.
    """
    output, wanted_offset, operations, regions = _hand_off_operations(local, source, source_mesh, target, target_mesh)
    return exchange_into(output, wanted_offset, operations, regions, async_op=async_op)


def redistribute_across_meshes_with_requires_grad(local: torch.Tensor, source: Layout, source_mesh, target: Layout,
                                                  target_mesh, requires_grad: bool) -> tuple[torch.Tensor, bool]:
    """`redistribute_across_meshes` (waited) and whether the source requires grad, as its holders say.

    Every rank of the world calls it, each with what its own DTensor says. A rank of the target mesh
    outside the source mesh holds a stand-in without data, whose `requires_grad` may differ from the
    source's; each such rank receives the holders' answer (one byte from one holder, spread over them)
    in the same batch of messages as the data. Every other rank keeps its own answer.
    """
    output, wanted_offset, operations, regions = _hand_off_operations(local, source, source_mesh, target, target_mesh)
    answers, answer = _requires_grad_operations(requires_grad, local.device, source_mesh, target_mesh)
    output = exchange_into(output, wanted_offset, operations + answers, regions, async_op=False)  # answers last
    return output, requires_grad if answer is None else bool(answer)


def _hand_off_operations(local: torch.Tensor, source: Layout, source_mesh, target: Layout, target_mesh):
    """This rank's output buffer (its local copies made), its offset, and its sends and receives (with
    the region of each receive) of a cross-mesh move; a Partial source is reduced first."""
    me = torch.distributed.get_rank()
    reduced = source.without_partial()
    if reduced != source and source_mesh.get_coordinate() is not None:
        local = execute(local, plan(source, reduced, local.element_size(), cost_model_for(source_mesh)), source_mesh)
    moves = hand_off(reduced, _ranks(source_mesh), target, _ranks(target_mesh))
    coordinate = target_mesh.get_coordinate()
    if coordinate is None:
        output = empty_shard(local, target.ndim)
        wanted_offset = None
    else:
        output = local.new_empty(target.local_shape(coordinate))
        wanted_offset = target.local_offset(coordinate)
    held_offset = None if source_mesh.get_coordinate() is None else reduced.local_offset(source_mesh.get_coordinate())
    operations, regions = [], []
    for transfer in moves.transfers:
        region = (transfer.offset, transfer.shape)
        if transfer.sender == me and transfer.receiver == me:
            _narrow(output, wanted_offset, region).copy_(_narrow(local, held_offset, region))
        elif transfer.sender == me:
            operations.append(comm.PointToPoint("send", _narrow(local, held_offset, region), transfer.receiver))
        elif transfer.receiver == me:
            buffer = local.new_empty(transfer.shape)
            operations.append(comm.PointToPoint("recv", buffer, transfer.sender))
            regions.append(region)
    return output, wanted_offset, operations, regions


def _requires_grad_operations(requires_grad: bool, device: torch.device, source_mesh, target_mesh):
    """This rank's sends and receive of the holders' answers (does the source require grad?), and its receive
    buffer (None on a rank that receives none)."""
    source_ranks = _ranks(source_mesh)
    stand_ins = [rank for rank in _ranks(target_mesh) if rank not in source_ranks]
    me = torch.distributed.get_rank()
    operations, answer = [], None
    for index, receiver in enumerate(stand_ins):
        sender = source_ranks[index % len(source_ranks)]
        if sender == me:
            operations.append(comm.PointToPoint("send", torch.tensor([requires_grad], device=device), receiver))
        elif receiver == me:
            answer = torch.empty(1, dtype=torch.bool, device=device)
            operations.append(comm.PointToPoint("recv", answer, sender))
    return operations, answer
