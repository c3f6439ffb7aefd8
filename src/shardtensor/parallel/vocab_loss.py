"""Cross-entropy of logits sharded only along the class dim, with a backward that communicates nothing.

The gradient of a log-softmax needs each row's sum of the incoming gradient, which, summed across
class shards, costs an all_reduce. For cross-entropy that sum is known without it: the gradient
with respect to the log-probabilities of row i is `-g_i * T[i]`, with
`T[i, c] = (1 - eps) * w[t_i] * [c == t_i] + eps / C * w[c]`, whose row sum
`(1 - eps) * w[t_i] + eps / C * sum(w)` every rank computes from the (replicated) targets and
weights. So `d loss / d logits = g_i * (softmax * sum(T[i]) - T[i])` is local to each shard.
The forward costs the log-softmax's two all_reduces (row max, sum of exponentials) and one for
the loss itself, as PyTorch's vocab-parallel loss.
"""

from __future__ import annotations

import torch

from .. import comm
from ..dtensor import DTensor
from ..placement import Replicate, Shard

__all__ = ["class_sharded_cross_entropy", "takes_fast_path"]

_REDUCTIONS = ("none", "sum", "mean")


def _local_plain(value):
    return value.to_local() if isinstance(value, DTensor) else value


def takes_fast_path(logits: DTensor, target, weight, reduction: str, legacy: bool) -> bool:
    """Logits (N, C) sharded along classes only, class-index targets and weights replicated."""
    if legacy or reduction not in _REDUCTIONS or logits.ndim != 2:
        return False
    if not all(p == Shard(1) or p.is_replicate() for p in logits.placements):
        return False
    for value in (target, weight):
        if isinstance(value, DTensor) and not all(p.is_replicate() for p in value.placements):
            return False
    target_local = _local_plain(target)
    return isinstance(target_local, torch.Tensor) and target_local.ndim == 1 and not target_local.is_floating_point()


def _class_mesh_dims(logits: DTensor) -> tuple[int, ...]:
    return tuple(mesh_dim for mesh_dim, p in enumerate(logits.placements) if p == Shard(1))


def _all_reduce(tensor, mesh, mesh_dims, reduce_op):
    for mesh_dim in mesh_dims:
        tensor = comm.all_reduce(tensor, mesh, mesh_dim, reduce_op=reduce_op)
    return tensor


def _target_error(target: torch.Tensor, classes: int, ignore_index: int) -> str:
    bad = target[(target != ignore_index) & ((target < 0) | (target >= classes))]
    return (
        f"cross_entropy: target value {int(bad[0])} is out of range for {classes} classes; allowed: "
        f"0 <= target < {classes}, or the ignore_index {ignore_index}"
    )


class _ClassShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, smoothing):
        mesh, layout = logits.device_mesh, logits.sharding
        class_dims = _class_mesh_dims(logits)
        local = logits.to_local()
        classes = logits.shape[1]
        first = layout.local_offset(mesh.get_coordinate())[1]
        columns = local.shape[1]
        weight = torch.ones(classes, dtype=local.dtype, device=local.device) if weight is None else weight.to(local.dtype)
        row_max = local.amax(dim=1) if columns else torch.full((local.shape[0],), -torch.inf, dtype=local.dtype, device=local.device)
        row_max = _all_reduce(row_max.detach(), mesh, class_dims, "max")
        shifted = local - row_max.unsqueeze(1)
        total = _all_reduce(shifted.exp().sum(dim=1), mesh, class_dims, "sum")
        log_probs = shifted - total.log().unsqueeze(1)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, 0)
        out_of_range = ((safe_target < 0) | (safe_target >= classes)).any()
        if torch.compiler.is_compiling():  # a graph cannot branch on data: the check runs in it and raises there
            torch._assert_async(~out_of_range, f"loss_parallel: a target is outside [0, {classes}) and not ignore_index")
        elif bool(out_of_range):  # every rank holds every target: all raise
            raise IndexError(_target_error(target, classes, ignore_index))
        target_weight = torch.where(valid, weight[safe_target], 0)
        inside = valid & (safe_target >= first) & (safe_target < first + columns)
        picked = log_probs.gather(1, (safe_target - first).clamp(0, max(columns - 1, 0)).unsqueeze(1)).squeeze(1) if columns else torch.zeros_like(row_max)
        picked = torch.where(inside, picked, 0)
        local_weight = weight[first : first + columns]
        smooth = (log_probs * local_weight).sum(dim=1) if columns else torch.zeros_like(row_max)
        rows = -(1 - smoothing) * target_weight * picked - torch.where(valid, smooth, 0) * (smoothing / classes)
        normalizer = target_weight.sum()
        if reduction == "none":
            result = rows
        else:
            result = rows.sum() / normalizer if reduction == "mean" else rows.sum()
        result = _all_reduce(result, mesh, class_dims, "sum")
        ctx.save_for_backward(log_probs, safe_target, valid, target_weight, weight, normalizer)
        ctx.logits_spec, ctx.reduction, ctx.smoothing, ctx.first = logits._spec, reduction, smoothing, first
        replicated = [Replicate()] * mesh.ndim
        return DTensor.from_local(result, mesh, replicated, shape=tuple(result.shape))

    @staticmethod
    def backward(ctx, grad):
        log_probs, safe_target, valid, target_weight, weight, normalizer = ctx.saved_tensors
        spec, smoothing, first = ctx.logits_spec, ctx.smoothing, ctx.first
        classes, columns = spec.layout.shape[1], log_probs.shape[1]
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        scale = grad / normalizer if ctx.reduction == "mean" else grad
        scale = torch.where(valid, scale.expand_as(target_weight), 0)
        targets = torch.zeros_like(log_probs)
        local_target = safe_target - first
        inside = valid & (local_target >= 0) & (local_target < columns)
        if columns:  # one write per row (0 where the target lies elsewhere): no nonzero(), no host sync
            picked = torch.where(inside, (1 - smoothing) * target_weight, 0).to(targets.dtype)
            targets.scatter_(1, local_target.clamp(0, columns - 1).unsqueeze(1), picked.unsqueeze(1))
        targets = targets + (smoothing / classes) * weight[first : first + columns]
        row_sums = (1 - smoothing) * target_weight + (smoothing / classes) * weight.sum()
        grad_logits = scale.unsqueeze(1) * (log_probs.exp() * row_sums.unsqueeze(1) - targets)
        return DTensor(grad_logits, spec), None, None, None, None, None


@torch.compiler.allow_in_graph  # one node of a torch.compile graph, which AOTAutograd traces into
def class_sharded_cross_entropy(logits: DTensor, target, weight, ignore_index: int, reduction: str, smoothing: float) -> DTensor:
    """`F.cross_entropy` for `takes_fast_path` inputs, returned replicated."""
    return _ClassShardedCrossEntropy.apply(logits, _local_plain(target), _local_plain(weight), ignore_index, reduction, smoothing)
