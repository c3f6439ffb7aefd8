"""`context_parallel`: shard the sequence of plain tensors in place and run SDPA as ring attention.

Inside the context, each buffer holds only this rank's piece of its sequence dim (head-tail order
when causal load balance is on), and `F.scaled_dot_product_attention` is replaced by ring attention
(`ring_attention.py`), which expects q/k/v that are such local pieces (sequence dim -2, heads -3):
compute q/k/v from the sharded buffers as usual and call SDPA. On exit the replacement is undone and
the buffers get their full contents back (except those in `no_restore_buffers`). Mirrors
`torch.distributed.tensor.experimental.context_parallel`, but runs on CPU as well as CUDA, with
causal masks, GQA and backward, because it is plain torch math.

    >>> with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):  # doctest: +SKIP
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ...     (full_out,) = context_parallel_unshard(mesh, [out], [2])

Changing `F.scaled_dot_product_attention` is the one monkey-patch the project allows (the PyTorch
API does the same); it is restored in a `finally`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import comm
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from .ring_attention import ROTATE_METHODS, SequenceLayout, ring_attention

__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method"]

_rotate_method = "allgather"


def set_rotate_method(rotate_method: str) -> None:
    """How k/v move: "allgather" (one all_gather per call, the default) or "alltoall" (ring, point to point)."""
    global _rotate_method
    if rotate_method not in ROTATE_METHODS:
        raise NotImplementedError(f"set_rotate_method: {rotate_method!r} is not supported; "
                                  f"choose one of {ROTATE_METHODS}")
    _rotate_method = rotate_method


def _mesh_error(mesh: DeviceMesh, function: str) -> ValueError:
    return ValueError(f"{function}: needs a 1-D mesh (the sequence is sharded along its only mesh dim); "
                      f"got {mesh!r}; pass the context-parallel sub-mesh, e.g. mesh['cp']")


def _layout(mesh: DeviceMesh, load_balance: bool, function: str) -> SequenceLayout:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise _mesh_error(mesh, function)
    return SequenceLayout(mesh.size(0), load_balance)


def _divisibility_error(function: str, shape, dim: int, layout: SequenceLayout) -> ValueError:
    balance = " (head-tail causal load balance: 2 chunks per rank)" if layout.load_balance else ""
    return ValueError(
        f"{function}: a buffer of shape {tuple(shape)} has sequence length {shape[dim]} on dim {dim}, not "
        f"divisible by {layout.chunk_count} = {layout.chunks_per_rank} x {layout.world_size} ranks{balance}; "
        f"pad the sequence to a multiple of {layout.chunk_count}"
    )


def _local_piece(tensor: torch.Tensor, dim: int, layout: SequenceLayout, coordinate: int) -> torch.Tensor:
    """This coordinate's chunks of `tensor` along `dim`, concatenated in layout order."""
    if tensor.shape[dim] % layout.chunk_count:
        raise _divisibility_error("context_parallel", tensor.shape, dim, layout)
    chunks = tensor.chunk(layout.chunk_count, dim=dim)
    return torch.cat([chunks[chunk] for chunk in layout.chunks(coordinate)], dim=dim)


def _replace_contents(buffer: torch.Tensor, contents: torch.Tensor) -> None:
    """Make `buffer` (same tensor object) hold `contents`: resized in place, or, for a tensor that
    requires grad (which torch will not resize, e.g. a parameter), given new data."""
    if buffer.requires_grad:
        buffer.data = contents.detach().clone()
        return
    with torch.no_grad():
        buffer.resize_(contents.shape)
        buffer.copy_(contents)


def _check_buffers(buffers, buffer_seq_dims, no_restore_buffers):
    buffers = list(buffers or [])
    buffer_seq_dims = list(buffer_seq_dims or [])
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError(f"context_parallel: {len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims; "
                         "give one sequence dim per buffer")
    for buffer in buffers:
        if not isinstance(buffer, torch.Tensor) or isinstance(buffer, DTensor):
            raise TypeError(f"context_parallel: buffers must be plain torch.Tensors (sharded in place), got "
                            f"{type(buffer).__name__}")
    known = {id(buffer) for buffer in buffers}
    restore_skipped = {id(buffer) for buffer in (no_restore_buffers or ())}
    if not restore_skipped <= known:
        raise ValueError("context_parallel: every tensor in no_restore_buffers must also be in buffers")
    dims = [dim % buffer.dim() for buffer, dim in zip(buffers, buffer_seq_dims)]
    return buffers, dims, restore_skipped


def _sharded_attention(mesh: DeviceMesh, layout: SequenceLayout):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        """Ring attention over the context's sequence-sharded query/key/value (local pieces)."""
        if attn_mask is not None or dropout_p != 0.0:
            raise NotImplementedError("scaled_dot_product_attention inside context_parallel supports "
                                      "is_causal masks only, without attn_mask and with dropout_p=0.0; got "
                                      f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}")
        if any(isinstance(tensor, DTensor) for tensor in (query, key, value)):
            raise TypeError("scaled_dot_product_attention inside context_parallel takes the plain local "
                            "sequence pieces (the buffers the context sharded), not DTensors; use .to_local()")
        return ring_attention(query, key, value, mesh=mesh, layout=layout, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa, method=_rotate_method)

    return scaled_dot_product_attention


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: Sequence[torch.Tensor] | None = None,
                     buffer_seq_dims: Sequence[int] | None = None,
                     no_restore_buffers: set[torch.Tensor] | Sequence[torch.Tensor] | None = None,
                     load_balance: bool = True):
    """Shard `buffers` along `buffer_seq_dims` in place and run SDPA as ring attention over `mesh`.

    `load_balance` (ours, default on as in PyTorch) uses the head-tail chunk order so causal
    attention costs every rank the same; it applies to every buffer and to SDPA alike.
    """
    layout = _layout(mesh, load_balance, "context_parallel")
    buffers, dims, restore_skipped = _check_buffers(buffers, buffer_seq_dims, no_restore_buffers)
    coordinate = mesh.get_local_rank(0)
    pieces = [_local_piece(buffer, dim, layout, coordinate) for buffer, dim in zip(buffers, dims)]
    originals = [None if id(buffer) in restore_skipped else buffer.detach().clone() for buffer in buffers]
    original_attention = F.scaled_dot_product_attention
    try:
        for buffer, piece in zip(buffers, pieces):
            _replace_contents(buffer, piece)
        F.scaled_dot_product_attention = _sharded_attention(mesh, layout)
        yield
    finally:
        F.scaled_dot_product_attention = original_attention
        for buffer, original in zip(buffers, originals):
            if original is not None:
                _replace_contents(buffer, original)


def context_parallel_unshard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *,
                             load_balance: bool = True) -> list[torch.Tensor]:
    """The full sequences of `buffers` sharded by `context_parallel` (one all_gather each), in original order."""
    layout = _layout(mesh, load_balance, "context_parallel_unshard")
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel_unshard: {len(buffers)} buffers but {len(seq_dims)} seq_dims")
    order = layout.global_order()
    position_of_chunk = [order.index(chunk) for chunk in range(layout.chunk_count)]
    gathered = []
    for buffer, dim in zip(buffers, seq_dims):
        dim = dim % buffer.dim()
        if buffer.shape[dim] % layout.chunks_per_rank:
            raise _divisibility_error("context_parallel_unshard", buffer.shape, dim, layout)
        full = comm.all_gather(buffer, mesh, 0, dim=dim, sizes=[buffer.shape[dim]] * layout.world_size)
        chunks = full.chunk(layout.chunk_count, dim=dim)
        gathered.append(torch.cat([chunks[position] for position in position_of_chunk], dim=dim))
    return gathered
