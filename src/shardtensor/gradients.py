"""Leaf gradients keep their leaf's layout: `.grad` is laid out like the parameter after backward.

Backward ops choose their output layouts one op at a time, so the gradient that reaches a leaf
DTensor may be laid out otherwise: a Partial(sum) over a sharded batch (data parallel), a Partial
of a Replicate LayerNorm weight under tensor parallelism, a Replicate gradient of a sharded leaf.
PyTorch's DTensor stores such a gradient as it comes, so every rank may hold a full-size Partial
gradient of a sharded weight and the optimizer step reduces each parameter separately.

Our decision: **gradients are reduced during backward, together.** Every leaf DTensor that a torch
function records autograd history for gets a post-accumulate-grad hook (`watch_leaves`). A
gradient whose layout differs from its leaf's is set aside, and when the backward pass ends (an
autograd engine callback) all of them are re-laid at once:

- gradients that differ from their leaf only by Partial mesh dims (Replicate leaf, Partial
  gradient) are reduced in one all_reduce per (mesh, mesh dims, reduce op, dtype), flattened into
  one buffer: a data-parallel step issues one collective for all its parameters, as DDP's bucket does;
- any other difference (Shard leaf, Partial or Replicate gradient) is redistributed per gradient by
  the planner (a reduce_scatter, or a local slice for a Replicate gradient).

After backward `.grad` has the leaf's placements and shard sizes, so an optimizer step runs
locally. Accumulating into an existing `.grad` (a second backward without zeroing) adds the new
gradient in the existing gradient's layout, which reduces it per parameter inside backward.
"""

from __future__ import annotations

import collections

import torch

from . import comm
from .placement import Partial, Replicate
from .redistribute import redistribute_local_tensor
from .spec import DTensorSpec, contiguous_stride

__all__ = ["watch_leaves"]

_grad_enabled = torch.is_grad_enabled


class _Pending:
    """Leaves whose gradient arrived in another layout during the running backward pass."""

    leaves: list = []


def watch_leaves(dtensor_class: type, args: tuple, kwargs: dict) -> None:
    """Hook every leaf DTensor among a torch function's arguments that requires grad (once per leaf)."""
    if not _grad_enabled():
        return
    for value in args:
        if type(value) is dtensor_class:
            _watch(value)
        elif type(value) in (list, tuple):
            for item in value:
                if type(item) is dtensor_class:
                    _watch(item)
    for value in kwargs.values():
        if type(value) is dtensor_class:
            _watch(value)


def _watch(dtensor) -> None:
    if dtensor.requires_grad and dtensor.is_leaf and not dtensor.__dict__.get("_gradient_watched"):
        dtensor._gradient_watched = True
        with torch._C.DisableTorchFunctionSubclass():  # registering is itself a torch function
            dtensor.register_post_accumulate_grad_hook(_on_accumulated)


def _on_accumulated(leaf) -> None:
    grad = leaf.grad
    if not isinstance(grad, type(leaf)) or grad.device_mesh != leaf.device_mesh or grad.sharding == leaf.sharding:
        return
    _Pending.leaves.append(leaf)
    # One callback per set-aside leaf (a backward that fails never runs its callbacks, so no flag
    # may stay set): the first one at the end of backward re-lays them all, the others find none.
    torch.autograd.Variable._execution_engine.queue_callback(_relay_pending)


def _relay_pending() -> None:
    """At the end of backward: every set-aside gradient moved to its leaf's layout."""
    leaves, _Pending.leaves = _Pending.leaves, []
    groups: dict[tuple, list] = collections.defaultdict(list)
    for leaf in leaves:
        grad = leaf.grad
        if not isinstance(grad, type(leaf)) or grad.sharding == leaf.sharding:
            continue  # replaced meanwhile (the user's hook), or already there
        reduction = _reduction_only(grad, leaf)
        if reduction is None:
            local = redistribute_local_tensor(grad._local_tensor, grad.sharding, leaf.sharding, leaf.device_mesh)
            _set_grad(leaf, local)
        else:
            groups[(id(leaf.device_mesh), reduction, grad.dtype, grad.device)].append(leaf)
    for (_, (mesh_dims, reduce_op), _, _), members in groups.items():
        _reduce_together(members, mesh_dims, reduce_op)


def _reduction_only(grad, leaf) -> tuple[tuple[int, ...], str] | None:
    """(Partial mesh dims, reduce op) when the gradient is the leaf's layout but Partial there
    (one reduce op on all of them), else None."""
    mesh_dims, reduce_ops = [], set()
    for mesh_dim, (have, want) in enumerate(zip(grad.placements, leaf.placements)):
        if have == want:
            continue
        if not (type(have) is Partial and isinstance(want, Replicate)):
            return None
        mesh_dims.append(mesh_dim)
        reduce_ops.add(have.reduce_op)
    if len(reduce_ops) != 1 or reduce_ops & {"product"} or grad.sharding.pieces != leaf.sharding.pieces:
        return None
    return tuple(mesh_dims), reduce_ops.pop()


def _reduce_together(leaves: list, mesh_dims: tuple[int, ...], reduce_op: str) -> None:
    """One all_reduce of every gradient's shard, flattened into one buffer."""
    mesh = leaves[0].device_mesh
    locals_ = [leaf.grad._local_tensor for leaf in leaves]
    flat = torch.cat([local.reshape(-1) for local in locals_])
    reduced = comm.all_reduce(flat, mesh, mesh_dims if len(mesh_dims) > 1 else mesh_dims[0], reduce_op=reduce_op)
    offset = 0
    for leaf, local in zip(leaves, locals_):
        count = local.numel()
        _set_grad(leaf, reduced[offset:offset + count].view(local.shape))
        offset += count


def _set_grad(leaf, local: torch.Tensor) -> None:
    """`leaf.grad` becomes `local` in the leaf's layout (contiguous, like a fresh gradient)."""
    spec = DTensorSpec(leaf.device_mesh, leaf.sharding, contiguous_stride(leaf.shape), leaf.grad.dtype)
    leaf.grad = type(leaf)(local.contiguous(), spec)
