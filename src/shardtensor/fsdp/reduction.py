"""The gradient side of a sharded-data-parallel unit: from the gradients autograd gives for the
unsharded parameters to gradient DTensors of the sharded ones.

Tensor-parallel gradients become plain local tensors first (`local_gradients`); a unit's gradients
are then packed coordinate-major into one flat buffer (`pack_gradients`) for one reduce-scatter (sum).
`Reduction` is that reduce-scatter in flight (for HSDP then an all-reduce), the division and the cast
back; each gradient DTensor waits on its slice of it (`gradient_dtensors`). The unit (`unit`) owns the
state these read and decides when gradients are synchronized.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import comm
from ..dtensor import DTensor
from ..redistribute.buckets import all_reduce_together, reduction_only
from .slots import ParameterSlot

__all__ = ["Reduction", "gradient_dtensors", "local_gradients", "pack_gradients"]


def local_gradients(slots: Sequence[ParameterSlot], grads: Sequence) -> list[torch.Tensor | None]:
    """Each gradient as a plain tensor of its unsharded shape. Tensor-parallel gradients that are Partial
    where their parameter is Replicate (norms and biases fed by a sequence-sharded stream) are summed in
    one all_reduce per (mesh, mesh dims, reduce ops); any other layout is redistributed on its own."""
    locals_: list = list(grads)
    groups: dict[tuple, list[int]] = {}
    for index, (slot, grad) in enumerate(zip(slots, grads)):
        if grad is None or slot.unsharded_spec is None:
            continue
        target = slot.unsharded_spec.layout
        reduction = reduction_only(grad.sharding, target) if grad.sharding != target else None
        if reduction is not None:
            groups.setdefault((grad.device_mesh, reduction, grad.dtype), []).append(index)
            continue
        with torch.no_grad():
            if grad.sharding != target:
                grad = grad.redistribute(slot.unsharded_spec.mesh, target.placements)
            locals_[index] = _checked_local(slot, grad)
    for (mesh, (mesh_dims, partials), _), indices in groups.items():
        pieces = [grads[index].to_local() for index in indices]
        for index, summed in zip(indices, all_reduce_together(pieces, mesh, mesh_dims, partials)):
            locals_[index] = summed.view(slots[index].unsharded_shape)
    return locals_


def _checked_local(slot: ParameterSlot, grad) -> torch.Tensor:
    local = grad.to_local()
    if tuple(local.shape) != slot.unsharded_shape:
        raise RuntimeError(
            f"fully_shard: the gradient of a tensor-parallel parameter came back as {grad.sharding} "
            f"(local shape {tuple(local.shape)}), which does not redistribute to its layout "
            f"{slot.unsharded_spec.layout} (local shape {slot.unsharded_shape})"
        )
    return local


def pack_gradients(slots: Sequence[ParameterSlot], grads: Sequence[torch.Tensor | None], segment_sizes: Sequence[int],
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reduce-scatter's input: every coordinate's pieces of the local gradients, coordinate-major as
    the gathered buffer holds the parameters (zeros for a parameter without gradient)."""
    scatter_input = torch.empty(sum(segment_sizes), dtype=dtype, device=device)
    sources, targets = [], []
    for slot, grad in zip(slots, grads):
        for c in range(len(segment_sizes)):
            numel = slot.piece_numel(c)
            if not numel:
                continue
            target = scatter_input[slot.gathered_offsets[c] : slot.gathered_offsets[c] + numel].view(slot.piece_shape(c))
            if grad is None:
                target.zero_()
            else:
                sources.append(grad.narrow(slot.dim, slot.piece_start(c), slot.piece_sizes[c]))
                targets.append(target)
    if targets:
        torch._foreach_copy_(targets, sources)
    return scatter_input


class Reduction:
    """One backward's reduced gradients of a unit, in flight: a reduce-scatter over the sharding mesh
    dim, for HSDP then an all-reduce over the replicating one, then the division and the cast back.
    `unit` is the `ParameterUnit` whose gradients these are."""

    def __init__(self, unit, handle):
        self._unit = unit
        self._handle = handle
        self._replicate_handle = None
        self._result: torch.Tensor | None = None

    def start_replicate_reduce(self) -> None:
        """Issue the HSDP all-reduce (called in a deterministic place: every rank issues it at the same point)."""
        unit = self._unit
        if unit.replicate_mesh_dim is None or self._replicate_handle is not None or self._result is not None:
            return
        scattered = self._handle.wait()
        if unit.partial_reduce_output is not None:  # earlier backwards' pieces, reduced on the sharding dim only
            scattered.add_(unit.partial_reduce_output)
            unit.partial_reduce_output = None
        self._replicate_handle = comm.all_reduce(scattered, unit.mesh, unit.replicate_mesh_dim, reduce_op="sum", async_op=True)

    def wait(self) -> torch.Tensor:
        """This rank's flat gradient pieces: summed over every data-parallel rank, divided, in the parameters' dtype."""
        if self._result is None:
            self.start_replicate_reduce()
            handle = self._replicate_handle if self._replicate_handle is not None else self._handle
            summed = handle.wait()
            if self._unit.all_reduce_hook is not None:
                self._unit.all_reduce_hook(summed)
            summed = summed.div_(self._unit.divide_factor()) if summed.is_floating_point() else summed
            self._result = summed.to(self._unit.parameter_dtype)
            self._handle = self._replicate_handle = None
        return self._result


class _GradientPiece:
    """A `pending` for one parameter's gradient DTensor: its slice of the unit's `Reduction`."""

    __slots__ = ("reduction", "offset", "shape")

    def __init__(self, reduction: Reduction, offset: int, shape: tuple[int, ...]):
        self.reduction, self.offset, self.shape = reduction, offset, shape

    def wait(self) -> torch.Tensor:
        return self.reduction.wait()[self.offset : self.offset + math.prod(self.shape)].view(self.shape)


def gradient_dtensors(reduction: Reduction, slots: Sequence[ParameterSlot], sharded_parameters: Sequence[torch.Tensor],
                      coordinate: int, placeholder: torch.Tensor) -> list[DTensor | None]:
    """A gradient DTensor per sharded parameter that requires grad (None for the others): this rank's
    piece, pending on `reduction` until first read."""
    results, offset = [], 0
    for slot, parameter in zip(slots, sharded_parameters):
        shape = slot.piece_shape(coordinate)
        if parameter.requires_grad:
            piece = _GradientPiece(reduction, offset, shape)
            results.append(DTensor(placeholder, slot.sharded_spec, pending=piece))
        else:
            results.append(None)
        offset += math.prod(shape)
    return results
