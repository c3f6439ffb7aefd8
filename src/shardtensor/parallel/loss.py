"""`loss_parallel()`: cross-entropy on logits sharded along the class dim, without gathering them.

The engine already computes `F.cross_entropy` on class-sharded logits exactly and locally (the
log-softmax reduces its max and sum of exponentials across the shards, `nll_loss` picks each
target on the rank that holds its class and gives a Partial sum), but its backward needs one more
all_reduce (the log-softmax gradient's row sums). The context adds PyTorch's calling convention
for the vocab-parallel loss: the target and class weights may be plain tensors (read as laid out
like the logits' batch dims, and replicated), and the loss comes back replicated; logits sharded
along classes only, with class-index targets, take `vocab_loss`, whose backward communicates
nothing. Logits (N, C, d1, ...) with targets (N, d1, ...) are taken as rows (N * d1 * ..., C), so
that a sequence of classes is never gathered either. It intercepts `F.cross_entropy` (and so
`nn.CrossEntropyLoss`) through a `TorchFunctionMode`, only while the block runs; backward needs no
context. `F.nll_loss` (and `nn.NLLLoss`) of class-sharded log-probabilities takes plain targets
and weights the same way, since users write `F.nll_loss(F.log_softmax(logits, -1), target)` for
cross_entropy (PyTorch accepts it too).

    >>> with loss_parallel():  # doctest: +SKIP
    ...     loss = F.cross_entropy(logits, targets)  # logits: DTensor with Shard(1)
    >>> loss.backward()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..dtensor import DTensor
from ..placement import Placement, Replicate, Shard
from .layouts import redistribute_to
from .vocab_loss import class_sharded_cross_entropy, takes_fast_path

__all__ = ["loss_parallel"]


def _like_logits(value, logits: DTensor, class_dim: int):
    """A plain target as the DTensor it stands for: class indices laid out like the logits' other
    dims, class probabilities laid out like the logits (or, holding every class, replicated along
    the class dim); shapes from the logits (no collective)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    probabilities = value.ndim == logits.ndim
    removed = None if probabilities else class_dim
    shape = tuple(size for dim, size in enumerate(logits.shape) if dim != removed)
    placements: list[Placement] = []
    sizes = {}
    for mesh_dim, placement in enumerate(logits.placements):
        # Probabilities over every class (what a user holds) are replicated along the sharded classes.
        whole_classes = probabilities and placement == Shard(class_dim) and value.size(class_dim) == logits.size(class_dim)
        if not isinstance(placement, Shard) or placement.dim == removed or whole_classes:
            placements.append(Replicate())
            continue
        placements.append(Shard(placement.dim - (removed is not None and placement.dim > removed)))
        if len(logits.sharding.shard_order[placement.dim]) == 1:  # keep the logits' exact (uneven) pieces
            sizes[mesh_dim] = logits.sharding.pieces[placement.dim]
    return DTensor.from_local(value, logits.device_mesh, placements, shape=shape, shard_sizes=sizes or None)


def _replicated(value, logits: DTensor):
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    mesh = logits.device_mesh
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, shape=tuple(value.shape))


def _as_rows(input: DTensor, target):
    """Logits (N, C, d1, ...) sharded along the batch or the classes, with plain class-index targets
    (N, d1, ...), as rows (N * d1 * ..., C) and flat targets (no communication), which the 2-D loss
    handles without gathering (aten would reshape them for nll_loss2d, which has no class-sharded
    rule); None for anything else."""
    plain_indices = isinstance(target, torch.Tensor) and not isinstance(target, DTensor) and target.ndim == input.ndim - 1
    if not plain_indices or not all(p in (Shard(0), Shard(1)) or p.is_replicate() for p in input.placements):
        return None
    return input.movedim(1, -1).reshape(-1, input.shape[1]), target.reshape(-1)


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):
    """F.cross_entropy with plain target/weight read as laid out like the logits; Partial results reduced."""
    if not isinstance(input, DTensor):
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    legacy = size_average is not None or reduce is not None
    as_rows = _as_rows(input, target) if input.ndim > 2 and not legacy else None
    if as_rows is not None:
        loss = _cross_entropy(*as_rows, weight, None, ignore_index, None, reduction, label_smoothing)
        return loss.reshape(input.shape[0], *input.shape[2:]) if reduction == "none" else loss
    if takes_fast_path(input, target, weight, reduction, legacy):
        return class_sharded_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)
    class_dim = 1 if input.ndim >= 2 else 0
    loss = F.cross_entropy(
        input,
        _like_logits(target, input, class_dim),
        _replicated(weight, input),
        size_average,
        ignore_index,
        reduce,
        reduction,
        label_smoothing,
    )
    return _reduced(loss)


def _nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    """F.nll_loss on class-sharded log-probabilities (`F.log_softmax(logits, -1)`, the pair users
    write for cross_entropy), with plain target/weight read as `_cross_entropy` reads them."""
    if not isinstance(input, DTensor):
        return F.nll_loss(input, target, weight, size_average, ignore_index, reduce, reduction)
    as_rows = _as_rows(input, target) if input.ndim > 2 and size_average is None and reduce is None else None
    if as_rows is not None:
        loss = _nll_loss(*as_rows, weight, None, ignore_index, None, reduction)
        return loss.reshape(input.shape[0], *input.shape[2:]) if reduction == "none" else loss
    class_dim = 1 if input.ndim >= 2 else 0
    target = _like_logits(target, input, class_dim)
    loss = F.nll_loss(input, target, _replicated(weight, input), size_average, ignore_index, reduce, reduction)
    return _reduced(loss)


def _reduced(loss: DTensor) -> DTensor:
    """The loss with its Partial mesh dims reduced (replicated), as PyTorch's loss_parallel returns it."""
    return redistribute_to(loss, [Replicate() if p.is_partial() else p for p in loss.placements])


_INTERCEPTED = {F.cross_entropy: _cross_entropy, F.nll_loss: _nll_loss}


class _LossParallelMode(TorchFunctionMode):
    """Routes `F.cross_entropy` and `F.nll_loss` to their loss-parallel forms; every other call runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _INTERCEPTED.get(func, func)(*args, **(kwargs or {}))


@contextlib.contextmanager
def loss_parallel():
    """Compute `F.cross_entropy` / `nn.CrossEntropyLoss` on class-sharded logits (`Shard(1)` of an
    (N, C) DTensor, e.g. a ColwiseParallel head's output viewed as (N, C)) without gathering them.

    The target (class indices or probabilities) and `weight` may be plain tensors: the target as
    this rank's part, laid out like the logits' batch dims; the weight replicated. `ignore_index`,
    `label_smoothing`, `weight` and every reduction work, forward and backward; the loss is
    returned replicated. Backward may run inside or outside the block. `F.nll_loss` /
    `nn.NLLLoss` of `F.log_softmax(logits, -1)` is handled alike.

    >>> with loss_parallel():  # doctest: +SKIP
    ...     loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
    """
    with _LossParallelMode():
        yield
