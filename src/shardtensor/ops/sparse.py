"""Sparse layouts are refused: a DTensor's shards are dense strided tensors.

Ops that would make a sparse tensor out of a DTensor (`to_sparse`, `to_sparse_csr`...,
`sparse_coo_tensor` with DTensor values, `sparse_mask`) have a rule that raises, and dispatch raises
the same error for a plain sparse tensor given next to DTensors. The decision is made from the op
and global metadata, so every rank raises it before any collective (the replicate fallback would
have gathered the inputs and then failed to wrap a sparse result).
"""

from __future__ import annotations

from ..rules import OpCall, ShardingRule
from .registry import aten, register_rule

__all__ = ["sparse_layout_error"]


# The aten ops whose result has a sparse layout (COO, CSR, CSC, BSR, BSC).
SPARSE_RESULT_OPS = (
    aten._to_sparse, aten._to_sparse_csr, aten._to_sparse_csc, aten._to_sparse_bsr, aten._to_sparse_bsc,
    aten._sparse_coo_tensor_with_dims_and_tensors, aten.sparse_compressed_tensor, aten._sparse_compressed_tensor_unsafe,
    aten.sparse_mask,
)


def sparse_layout_error(op, given: str) -> NotImplementedError:
    """The error for a sparse layout in `op` (`given` says where it was)."""
    return NotImplementedError(
        f"{op}: {given}, but DTensors hold dense strided shards only: sparse layouts (COO, CSR, CSC, BSR, "
        f"BSC) are not supported. Use dense ops on the DTensor, or make the sparse tensor from a plain "
        f"one (x.full_tensor().to_sparse(), or x.to_local().to_sparse() for this rank's shard)"
    )


class RefuseSparse(ShardingRule):
    """The rule of an op whose result is sparse: raises on every rank, names the op."""

    __name__ = "refuse_sparse"
    accepts_plain_tensors = True  # `sparse_coo_tensor`'s plain indices: the error, not a plain-tensor one

    def rows(self, call: OpCall):
        shapes = [list(meta.shape) for meta in call.inputs]
        raise sparse_layout_error(call.op, f"its result would be sparse (inputs of shapes {shapes})")


register_rule(SPARSE_RESULT_OPS, RefuseSparse())
