"""Leaf gradients keep their leaf's layout: `.grad` is laid out like the parameter after backward.

Backward ops choose their output layouts one op at a time, so the gradient that reaches a leaf
DTensor may be laid out otherwise: a Partial(sum) over a sharded batch (data parallel), a Partial
of a Replicate LayerNorm weight under tensor parallelism, a Replicate gradient of a sharded leaf.
PyTorch's DTensor stores such a gradient as it comes, so every rank may hold a full-size Partial
gradient of a sharded weight and the optimizer step reduces each parameter separately.

Our decision: **gradients are reduced during backward, together.** Every leaf DTensor that a torch
function records autograd history for (`watch_leaves`), or that `to_local()`, `redistribute()` or
`full_tensor()` is called on with grad enabled (`watch_leaf`: a Replicate weight read with
`grad_placements=[Partial()]` gets a Partial gradient, a Partial leaf read through `redistribute` a
Replicate one, and no torch function may ever see them), or that a compiled graph reads
(`watch_graph_input`, called by `__tensor_flatten__`: inside a graph torch functions see fake
stand-ins), gets a post-accumulate-grad hook. A gradient whose layout differs from its leaf's is set
aside, and when the backward pass ends (an autograd engine callback) all of them are re-laid at once:

- gradients that differ from their leaf only by Partial mesh dims (Replicate leaf, Partial
  gradient) are reduced in one all_reduce per (mesh, mesh dims, reduce ops, dtype), flattened into
  one buffer: a data-parallel step issues one collective for all its parameters, as DDP's bucket does;
- any other difference (Shard leaf, Partial or Replicate gradient) is redistributed per gradient by
  the planner (a reduce_scatter, or a local slice for a Replicate gradient); a Partial leaf's
  Replicate gradient becomes Partial operands locally (for a sum: one rank keeps it, the others
  zeros), so `.grad` holds the single-device gradient, the gradient with respect to the leaf's value.

A gradient whose move to its leaf's layout changes no local tensor (they differ only on mesh dims
of size 1, as every layout of a one-rank mesh does) is relabelled as it arrives, before it is
accumulated: nothing is set aside and nothing runs at the end of backward.

After backward `.grad` has the leaf's placements and shard sizes, so an optimizer step runs
locally. Accumulating into an existing `.grad` (a second backward without zeroing): a Partial
gradient of a Replicate leaf turns the existing `.grad` back into a Partial operand (locally), adds
to it, and is reduced with the others at the end of backward (one all_reduce per bucket again);
other layouts are added in the existing gradient's layout (moved per parameter).
"""

from __future__ import annotations

import collections
import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from .rank_state import per_rank_contents
from .redistribute import is_relabel, redistribute_local_tensor
from .redistribute.buckets import reduce_in_buckets, reduction_only
from .spec import DTensorSpec, contiguous_stride

__all__ = ["watch_leaves", "watch_leaf", "watch_graph_input"]

_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling  # True while dynamo traces and while AOTAutograd traces its graph


class _Pending:
    """Leaves whose gradient arrived in another layout during the running backward pass."""

    leaves: list = []


per_rank_contents("gradients.pending", _Pending.leaves)


def watch_leaves(dtensor_class: type, args: tuple, kwargs: dict) -> None:
    """Hook every leaf DTensor among a torch function's arguments that requires grad (once per leaf)."""
    if not _grad_enabled():
        return
    for value in args:
        if type(value) is dtensor_class:
            watch_leaf(value)
        elif type(value) in (list, tuple):
            for item in value:
                if type(item) is dtensor_class:
                    watch_leaf(item)
    for value in kwargs.values():
        if type(value) is dtensor_class:
            watch_leaf(value)


def watch_leaf(dtensor) -> None:
    """Hook `dtensor` (once) if it is a leaf that requires grad, so its gradient is re-laid to its layout.

    Not while compiling: a traced graph's leaves are fake stand-ins of the real ones, which
    `watch_graph_input` hooks when dynamo takes them as the graph's inputs (docs/compile.md)."""
    if _compiling():
        return
    if dtensor.requires_grad and dtensor.is_leaf and not dtensor.__dict__.get("_gradient_watched"):
        _hook(dtensor)


def watch_graph_input(dtensor) -> None:
    """Hook `dtensor`, which requires grad, (once) if it is a real leaf: `__tensor_flatten__` calls this
    on every DTensor that dynamo makes a graph input of (a compiled module's parameters) or checks a
    graph's guards against (the parameters of another module reusing that graph), so a parameter used
    only inside compiled code gets eager mode's hooks, and its compiled gradient is re-laid and bucketed
    the same way. On every compiled call: a hooked parameter costs one dict lookup here."""
    if not dtensor.__dict__.get("_gradient_watched") and dtensor.is_leaf:
        if not is_fake(dtensor._local_tensor):  # AOTAutograd's fake or functional stand-ins have no backward
            _hook(dtensor)


def _hook(dtensor) -> None:
    """Mark `dtensor` hooked and register its two gradient hooks (before and after accumulation)."""
    dtensor._gradient_watched = True
    with torch._C.DisableTorchFunctionSubclass():  # registering is itself a torch function
        # The hook holds the leaf itself, not a weak reference: `Module._apply` (`module.double()`) swaps a
        # traceable subclass's parameters with `torch.utils.swap_tensors`, which refuses weakly referenced
        # tensors. The cycle (leaf -> its hooks -> leaf) is freed by Python's garbage collector.
        dtensor.register_hook(functools.partial(_before_accumulating, dtensor))
        dtensor.register_post_accumulate_grad_hook(_on_accumulated)


def _before_accumulating(leaf, incoming):
    """Before a gradient is added to its leaf's `.grad`. One whose move to the leaf's layout is a
    relabel is returned in the leaf's layout (the hook's result replaces it). One that is the leaf's
    layout but Partial (data parallel) while `.grad` already holds a reduced one: `.grad` becomes a
    Partial operand again, locally (one rank keeps it, the others zeros), so the sum accumulates
    without a collective and the end of backward reduces all such gradients together instead of
    one add each reducing its own."""
    if not isinstance(incoming, type(leaf)) or incoming.device_mesh != leaf.device_mesh:
        return None
    source, target = incoming.sharding, leaf.sharding
    if source == target:
        return None
    if is_relabel(source, target, incoming._spec.dtype.itemsize):
        spec = DTensorSpec(leaf.device_mesh, target, incoming._spec.stride, incoming._spec.dtype)
        return type(leaf)(incoming._local_tensor, spec)
    existing = leaf.grad
    if not isinstance(existing, type(leaf)) or existing.sharding != target or reduction_only(source, target) is None:
        return None
    local = redistribute_local_tensor(existing._local_tensor, existing.sharding, incoming.sharding, leaf.device_mesh)
    _set_grad(leaf, local, incoming.sharding)
    return None


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
    leaves = list(_Pending.leaves)
    _Pending.leaves.clear()  # the same list: `launch.simulate` swaps its contents per rank
    by_mesh: dict[int, list] = collections.defaultdict(list)
    for leaf in leaves:  # a gradient replaced meanwhile (the user's hook) may be there already
        if isinstance(leaf.grad, type(leaf)) and leaf.grad.sharding != leaf.sharding:
            by_mesh[id(leaf.device_mesh)].append(leaf)
    for members in by_mesh.values():
        mesh = members[0].device_mesh
        if mesh.get_coordinate() is None:  # no data on this rank (a cross-mesh redistribute's source): the layout only
            for leaf in members:
                _set_grad(leaf, leaf.grad._local_tensor)
            continue
        locals_ = [leaf.grad._local_tensor for leaf in members]
        sources = [leaf.grad.sharding for leaf in members]
        targets = [leaf.sharding for leaf in members]
        for leaf, local, source, target, reduced in zip(
            members, locals_, sources, targets, reduce_in_buckets(locals_, sources, targets, mesh)
        ):
            _set_grad(leaf, reduced if reduced is not None else redistribute_local_tensor(local, source, target, mesh))


def _set_grad(leaf, local: torch.Tensor, layout=None) -> None:
    """`leaf.grad` becomes `local` in the leaf's layout, or `layout` (contiguous, like a fresh gradient)."""
    spec = DTensorSpec(leaf.device_mesh, layout or leaf.sharding, contiguous_stride(leaf.shape), leaf.grad.dtype)
    leaf.grad = type(leaf)(local.contiguous(), spec)
