"""How tensors travel through c10d: bools as bytes, views resolved, reduce ops by name, each collective's
record (`_record_on`), and the one uneven exchange (`_exchange`, an all_to_all_single in coordinate
order) that the uneven all_gather, all_to_all and uneven reduce_scatter share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import c10d
from .c10d import REDUCE_OPS as _REDUCE_OPS
from .peers import _Peers
from .records import CommRecord, _record

# Bools reduce as uint8: "sum" and "max" are any (logical or), "product" and "min" are all.
_BOOL_REDUCE_OPS = {"sum": "max", "max": "max", "min": "min", "product": "min"}


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as c10d moves it: bools travel as uint8 (same bytes); a conjugate or negative view
    (`x.conj()`) is resolved first, since c10d sends the memory and would drop the view's meaning."""
    tensor = tensor.resolve_conj().resolve_neg()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _unwire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.view(torch.bool) if dtype == torch.bool else tensor


def _with_size(shape: Sequence[int], dim: int, size: int) -> list[int]:
    shape = list(shape)
    shape[dim] = size
    return shape


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _reduce_op(function: str, reduce_op: str, dtype: torch.dtype) -> str:
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"{function}: reduce_op {reduce_op!r} is not one of {sorted(_REDUCE_OPS)}")
    if dtype == torch.bool:
        if reduce_op not in _BOOL_REDUCE_OPS:
            raise ValueError(f"{function}: reduce_op {reduce_op!r} has no meaning for bool tensors; "
                             f"use one of {sorted(_BOOL_REDUCE_OPS)} (sum/max = any, product/min = all)")
        return _BOOL_REDUCE_OPS[reduce_op]
    if reduce_op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{function}: reduce_op 'avg' needs a floating or complex tensor, got {dtype} (the mean of "
                         f"integers is not an integer in general); reduce with 'sum' and divide in a floating dtype")
    return reduce_op


def _record_on(kind: str, peers: _Peers, bytes_sent: int, bytes_received: int, traced: bool) -> CommRecord | None:
    """Record a collective along `peers` now (eager: returns None), or return its record while `traced`
    (`c10d.tracing()`, asked once by the collective), for the c10d call to leave in the graph (`c10d`), which
    then records it on every run."""
    if traced:
        return CommRecord(kind, peers.mesh_dim, peers.size, bytes_sent, bytes_received, peers.mesh_dim_names)
    _record(kind, peers.mesh_dim, peers.size, bytes_sent, bytes_received, peers.mesh_dim_names)
    return None


def _exchange(send: Sequence[torch.Tensor | None], receive_shapes: Sequence[Sequence[int] | None],
              template: torch.Tensor, peers: _Peers, async_op: bool, kind: str, traced: bool):
    """One `all_to_all_single`: send[c] goes to coordinate c, a tensor of receive_shapes[c] comes back,
    recorded as a collective of `kind` with the bytes it moves (`traced`: `c10d.tracing()`).

    None entries move nothing. Returns (c10d work, function giving the received tensors in
    coordinate order).
    """
    input_splits = [0 if send[c] is None else send[c].numel() for c in peers.group_order]
    output_splits = [0 if receive_shapes[c] is None else math.prod(receive_shapes[c]) for c in peers.group_order]
    element_size = template.element_size()
    record = _record_on(kind, peers, sum(input_splits) * element_size, sum(output_splits) * element_size, traced)
    flat = [send[c].reshape(-1) for c in peers.group_order if send[c] is not None]
    send_buffer = torch.cat(flat) if flat else template.new_empty(0)
    receive_buffer = template.new_empty(sum(output_splits))
    receive_buffer, work = c10d.all_to_all_single(receive_buffer, send_buffer, output_splits, input_splits,
                                                  peers.group, async_op, record)

    def received() -> list[torch.Tensor | None]:
        by_group_rank = receive_buffer.split(output_splits)
        return [None if receive_shapes[c] is None else by_group_rank[peers.group_rank[c]].view(receive_shapes[c])
                for c in range(peers.size)]

    return work, received

