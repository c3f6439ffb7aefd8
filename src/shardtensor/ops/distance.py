"""Sharding rules: pairwise distances (`torch.cdist`, `nn.functional.pdist`) and their backwards.

`cdist(x1 (*, P, M), x2 (*, R, M))` is a (*, P, R) table of p-norms of row differences. Rows of
x1 and rows of x2 shard the table's rows and columns with no communication; batch dims shard
when both inputs have the same batch shape. The feature dim M is summed inside the norm, so
sharding it is exact only for the norms that are sums or maxima of per-feature terms: p = 0 and
p = 1 give Partial(sum), p = inf gives Partial(max). The backward is elementwise in M given the
distances, so it keeps M sharded for every p.
"""

from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate, Shard
from ..rules import OpCall, Row, TensorMeta
from .registry import aten, register_rule

__all__ = ["cdist_forward", "cdist_backward", "pdist_forward", "pdist_backward"]

R = Replicate()


def _feature_partial(p: float) -> Partial | None:
    """The Partial a p-norm over a sharded feature dim leaves, or None when it has none."""
    if p in (0.0, 1.0):
        return Partial("sum")
    if p == math.inf:
        return Partial("max")
    return None


def _batch_dims(first: TensorMeta, second: TensorMeta) -> range:
    """Batch dims x1 and x2 share exactly (broadcast batches stay Replicate)."""
    batch = first.ndim - 2
    return range(batch) if first.shape[:batch] == second.shape[: second.ndim - 2] else range(0)


def cdist_forward(call: OpCall) -> list[Row]:
    """`_cdist_forward(x1, x2, p, compute_mode)`: rows of x1, rows of x2, batch, or features."""
    batch = call.inputs[0].ndim - 2
    rows = [Row((R,), (R, R))]
    rows += [Row((Shard(dim),), (Shard(dim), Shard(dim))) for dim in _batch_dims(*call.inputs[:2])]
    rows += [Row((Shard(batch),), (Shard(batch), R)), Row((Shard(batch + 1),), (R, Shard(batch)))]
    partial = _feature_partial(call.argument("p"))
    if partial is not None:
        rows.append(Row((partial,), (Shard(batch + 1), Shard(batch + 1))))
    return rows


def cdist_backward(call: OpCall) -> list[Row]:
    """`_cdist_backward(grad, x1, x2, p, cdist)` -> the gradient of x1 (shaped like x1)."""
    batch = call.inputs[1].ndim - 2
    rows = [Row((R,), (R, R, R, R))]
    rows += [Row((Shard(dim),), (Shard(dim),) * 4) for dim in _batch_dims(*call.inputs[1:3])]
    rows.append(Row((Shard(batch),), (Shard(batch), Shard(batch), R, Shard(batch))))  # rows of x1
    rows.append(Row((Partial("sum"),), (Shard(batch + 1), R, Shard(batch), Shard(batch + 1))))  # rows of x2
    rows.append(Row((Shard(batch + 1),), (R, Shard(batch + 1), Shard(batch + 1), R)))  # features
    return rows


def pdist_forward(call: OpCall) -> list[Row]:
    """`_pdist_forward(x (N, M), p)`: the condensed distances of every row pair; only a sharded
    feature dim with p in (0, 1, inf) stays local (rows pair across shards)."""
    rows = [Row((R,), (R,))]
    partial = _feature_partial(call.argument("p"))
    if partial is not None:
        rows.append(Row((partial,), (Shard(1),)))
    return rows


def pdist_backward(call: OpCall) -> list[Row]:
    """`_pdist_backward(grad, x, p, pdist)`: elementwise in the feature dim given the distances."""
    return [Row((R,), (R, R, R)), Row((Shard(1),), (R, Shard(1), R))]


register_rule([aten._cdist_forward.default], cdist_forward)
register_rule([aten._cdist_backward.default], cdist_backward)
register_rule([aten._pdist_forward.default], pdist_forward)
register_rule([aten._pdist_backward.default], pdist_backward)
