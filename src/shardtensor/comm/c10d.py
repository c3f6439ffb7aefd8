"""The c10d calls every collective ends in, eager or traced.

Eagerly these are torch.distributed's in-place collectives, as before. While `torch.compile` traces
(dynamo, or AOTAutograd running our dispatch on fake tensors) they are functional collectives
(`torch.ops._c10d_functional.*`, each followed by `wait_tensor`): the graph then holds collectives the
compiler can order and overlap, and no in-place c10d call the compiled program could race ahead of.
Each function returns (result, c10d work): eagerly the buffer it was given, written in place; traced,
the functional collective's new tensor in the buffer's shape (the buffer is not written, so a graph
holds no copy into it and drops a buffer nothing else reads), and None for the work, whose wait is in
the graph. Each takes the collective's `record` (`wire._record_on`), which also says which of the two to
run: traced, a record, left in the graph beside the functional collective (`records._emit`) to be recorded
whenever the graph runs; eagerly None, the caller having recorded it (so a collective asks `tracing()` once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .records import CommRecord, _emit

__all__ = ["REDUCE_OPS", "tracing", "refuse_point_to_point", "all_gather_single", "all_reduce", "reduce_scatter_single", "all_to_all_single", "broadcast"]

_compiling = torch.compiler.is_compiling
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_functional = torch.ops._c10d_functional

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def tracing() -> bool:
    """Whether collectives are being traced into a graph rather than run: torch.compile's session (dynamo,
    and AOTAutograd running our dispatch) or a proxy dispatch mode such as make_fx's. A fake tensor mode
    alone is not tracing: `shardtensor.forecast` runs a step on fake tensors over a fake process group,
    and its collectives are the eager calls, recorded."""
    return _compiling() or torch._C._get_dispatch_mode(_PROXY) is not None


def _landed(buffer: torch.Tensor, result: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _functional.wait_tensor(result).view(buffer.shape), None


def all_gather_single(output: torch.Tensor, local: torch.Tensor, group, size: int, async_op: bool,
                      record: CommRecord | None):
    """Every group rank's flat `local`, in group-rank order, into the flat `output`."""
    if record is not None:
        _emit(record, local)
        return _landed(output, _functional.all_gather_into_tensor(local, size, group.group_name))
    return output, _all_gather_single(output, local, group=group, async_op=async_op)


def all_reduce(buffer: torch.Tensor, reduce_op: str, group, async_op: bool, record: CommRecord | None):
    """`buffer` reduced over the group (in place when eager)."""
    if record is not None:
        _emit(record, buffer)
        return _landed(buffer, _functional.all_reduce(buffer, reduce_op, group.group_name))
    return buffer, dist.all_reduce(buffer, op=REDUCE_OPS[reduce_op], group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, stacked: torch.Tensor, reduce_op: str, group, size: int,
                          async_op: bool, record: CommRecord | None):
    """This group rank's equal part of the flat `stacked` reduced over the group, into the flat `output`."""
    if record is not None:
        _emit(record, stacked)
        return _landed(output, _functional.reduce_scatter_tensor(stacked, reduce_op, size, group.group_name))
    return output, _reduce_scatter_single(output, stacked, op=REDUCE_OPS[reduce_op], group=group, async_op=async_op)


def all_to_all_single(received: torch.Tensor, sent: torch.Tensor, output_splits: Sequence[int],
                      input_splits: Sequence[int], group, async_op: bool, record: CommRecord | None):
    """Part i of the flat `sent` (input_splits[i] elements) to group rank i; what arrives into `received`."""
    if record is not None:
        _emit(record, sent)
        return _landed(received, _functional.all_to_all_single(sent, list(output_splits), list(input_splits),
                                                               group.group_name))
    return received, dist.all_to_all_single(received, sent, list(output_splits), list(input_splits), group=group,
                                            async_op=async_op)


def broadcast(buffer: torch.Tensor, source_rank: int, group, async_op: bool, record: CommRecord | None):
    """Global rank `source_rank`'s `buffer` on every rank of the group (in place when eager)."""
    if record is not None:
        _emit(record, buffer)
        source = dist.get_group_rank(group, source_rank)
        return _landed(buffer, _functional.broadcast(buffer, source, group.group_name))
    return buffer, dist.broadcast(buffer, src=source_rank, group=group, async_op=async_op)


def refuse_point_to_point(what: str) -> None:
    """Point-to-point exchanges have no functional form here yet: tracing one is an error, never a
    graph that leaves the transfer out."""
    if tracing():
        raise NotImplementedError(
            f"comm.{what} runs point-to-point sends, which shardtensor cannot trace into a torch.compile graph "
            f"yet; run this part eagerly (outside the compiled function, or under torch.compiler.disable)"
        )
