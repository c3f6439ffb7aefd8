"""Sharding rules for shape ops that are not plain views: diagonals, padding, rot90, block_diag,
_chunk_cat, out-of-place fill and `item`.

Like views they keep a shard where each rank's piece of the output is computed from its own piece
of the input. Where that needs per-rank arguments the rule gives them: a pad applies to the first
and last pieces of a padded dim only (a negative pad crops the pieces it overlaps), and a diagonal
written into a block of rows takes the part of the diagonal that crosses the block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..layout import Layout
from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule
from .common import dim_argument, normalized_dim
from .registry import aten, register_rule

__all__ = ["DiagonalFillRule", "DiagonalScatterRule", "ConstantPadRule", "diagonal_piece"]


def _partial_rows(outputs: int, inputs: int, reduce_ops: Sequence[str] = REDUCE_OPS) -> list[Row]:
    return [Row((Partial(op),) * outputs, (Partial(op),) * inputs) for op in reduce_ops]


def diagonal_piece(offset: int, first_row: int, first_column: int, rows: int, columns: int) -> tuple[int, int, int]:
    """The part of the `offset` diagonal inside the block `[first_row, +rows) x [first_column, +columns)`.

    Returns (the block's own diagonal offset, index of its first element in the global diagonal,
    number of elements): `diagonal(block, local_offset)` is `diagonal(whole, offset)[start:start + length]`.
    """
    local_offset = offset + first_row - first_column
    length = max(min(rows + min(local_offset, 0), columns - max(local_offset, 0)), 0)
    start = first_row + max(-local_offset, 0) - max(-offset, 0)
    return local_offset, max(start, 0) if length else 0, length


# ---- diag_embed, diagonal_backward: a vector written onto the diagonal of zeros ------------------


class DiagonalFillRule(ShardingRule):
    """diag_embed(x, offset, dim1, dim2) and diagonal_backward(grad, sizes, offset, dim1, dim2).

    The input's leading dims are the output's dims other than dim1/dim2, in order; its last dim is
    the diagonal. Leading dims keep their shard. A mesh dim on which the input is Replicate shards
    the output's dim1 instead (no communication: each rank writes the part of the diagonal that
    crosses its rows), so a replicated vector never becomes a replicated square of zeros.
    """

    __name__ = "diagonal fill"

    @staticmethod
    def _geometry(call: OpCall) -> tuple[tuple[int, ...], int, int, int]:
        """(global output shape, offset, dim1, dim2)."""
        shape = call.global_output_metas()[0].shape
        offset, dim1, dim2 = call.argument("offset"), call.argument("dim1"), call.argument("dim2")
        return shape, offset, normalized_dim(dim1, len(shape)), normalized_dim(dim2, len(shape))

    def rows(self, call: OpCall) -> list[Row]:
        shape, _, dim1, dim2 = self._geometry(call)
        others = [dim for dim in range(len(shape)) if dim not in (dim1, dim2)]
        rows = [Row((Shard(dim1),), (Replicate(),))]
        rows += [Row((Shard(dim),), (Shard(position),)) for position, dim in enumerate(others)]
        return rows + _partial_rows(1, 1)  # zeros stay zeros under every reduce op

    def local_arguments(self, call, input_layouts, coordinate):
        """(vector, local output sizes, the rows' own diagonal offset, dim1, dim2) for `local_op`."""
        shape, offset, dim1, dim2 = self._geometry(call)
        layout = input_layouts[0]
        splitting = [Shard(0) if placement == Replicate() else Replicate() for placement in layout.placements]
        rows_layout = Layout.create(layout.mesh_shape, splitting, (shape[dim1],))
        sizes = list(shape)
        sizes[dim1] = rows_layout.local_shape(coordinate)[0]
        others = [dim for dim in range(len(shape)) if dim not in (dim1, dim2)]
        for position, dim in enumerate(others):
            sizes[dim] = layout.local_shape(coordinate)[position]
        # `local_op`'s own arguments; the vector's placeholder is the first argument of both ops.
        return (call.args[0], sizes, offset + rows_layout.local_offset(coordinate)[0], dim1, dim2), {}

    def local_op(self, call, input_layouts, coordinate):
        _, offset, _, _ = self._geometry(call)

        def fill_diagonal_piece(mesh, local, sizes, local_offset, dim1, dim2):
            first_row = local_offset - offset
            _, start, length = diagonal_piece(offset, first_row, 0, sizes[dim1], sizes[dim2])
            return aten.diagonal_backward(local.narrow(-1, start, length), sizes, local_offset, dim1, dim2)

        return fill_diagonal_piece


class DiagonalScatterRule(ShardingRule):
    """diagonal_scatter(self, src, offset, dim1, dim2): self's other dims shard with src's leading
    dims; a shard of dim1 or dim2 of self takes the part of a Replicate src that crosses its block."""

    __name__ = "diagonal_scatter"

    @staticmethod
    def _geometry(call: OpCall) -> tuple[int, int, int]:
        ndim = call.inputs[0].ndim
        offset = call.argument("offset")
        return offset, normalized_dim(call.argument("dim1"), ndim), normalized_dim(call.argument("dim2"), ndim)

    def rows(self, call: OpCall) -> list[Row]:
        _, dim1, dim2 = self._geometry(call)
        others = [dim for dim in range(call.inputs[0].ndim) if dim not in (dim1, dim2)]
        rows = [Row((Replicate(),), (Replicate(), Replicate()))]
        rows += [Row((Shard(dim),), (Shard(dim), Shard(position))) for position, dim in enumerate(others)]
        rows += [Row((Shard(dim),), (Shard(dim), Replicate())) for dim in (dim1, dim2)]
        return rows + _partial_rows(1, 2)  # elements are copied, never combined

    def local_op(self, call, input_layouts, coordinate):
        offset, dim1, dim2 = self._geometry(call)
        layout = input_layouts[0]
        first, local_shape = layout.local_offset(coordinate), layout.local_shape(coordinate)
        local_offset, start, length = diagonal_piece(
            offset, first[dim1], first[dim2], local_shape[dim1], local_shape[dim2]
        )

        def scatter_diagonal_piece(mesh, local, source, *arguments, **keywords):
            return aten.diagonal_scatter(local, source.narrow(-1, start, length), local_offset, dim1, dim2)

        return scatter_diagonal_piece


# ---- padding --------------------------------------------------------------------------------------


def _overlap(start: int, end: int, low: int, high: int) -> int:
    return max(min(end, high) - max(start, low), 0)


class ConstantPadRule(ShardingRule):
    """constant_pad_nd(self, pad, value): every dim keeps its shard.

    On a padded dim the first piece gets the leading pad and the last piece the trailing one; a
    negative pad (cropping) removes from each piece the part of it that lies in the cropped range.
    A Partial passes where the pad value combines to itself: a zero under sum, any value under
    max/min/avg, 0 or 1 under product.
    """

    __name__ = "constant_pad_nd"

    def rows(self, call: OpCall) -> list[Row]:
        value = call.argument("value")
        rows = [Row((Replicate(),), (Replicate(),))]
        rows += [Row((Shard(dim),), (Shard(dim),)) for dim in range(call.inputs[0].ndim)]
        reduce_ops = ["avg", "max", "min"] + (["sum"] if value == 0 else []) + (["product"] if value in (0, 1) else [])
        return rows + _partial_rows(1, 1, reduce_ops)

    def local_arguments(self, call, input_layouts, coordinate):
        layout = input_layouts[0]
        pad = list(call.argument("pad"))
        if not any(layout.shard_order[layout.ndim - 1 - pair] for pair in range(len(pad) // 2)):
            return None
        offsets, local_shape = layout.local_offset(coordinate), layout.local_shape(coordinate)
        for pair in range(len(pad) // 2):
            dim = layout.ndim - 1 - pair
            if not layout.shard_order[dim]:
                continue
            size, start, end = layout.shape[dim], offsets[dim], offsets[dim] + local_shape[dim]
            piece, last_piece = layout.piece_index(dim, coordinate), len(layout.pieces[dim]) - 1
            before, after = pad[2 * pair], pad[2 * pair + 1]
            if before >= 0:
                pad[2 * pair] = before if piece == 0 else 0
            else:  # crop the part of this piece that lies in [0, -before)
                pad[2 * pair] = -_overlap(start, end, 0, -before)
            if after >= 0:
                pad[2 * pair + 1] = after if piece == last_piece else 0
            else:  # crop the part of this piece that lies in [size + after, size)
                pad[2 * pair + 1] = -_overlap(start, end, size + after, size)
        return call.with_arguments(pad=pad)


# ---- rot90, block_diag, _chunk_cat --------------------------------------------------------------


def rot90_rows(call: OpCall) -> list[Row]:
    """rot90(self, k, dims): other dims keep their shard; of the two rotated dims, the one that is
    not reversed keeps its shard too (dims[0] -> dims[1] for k = 1, dims[1] -> dims[0] for k = 3;
    both stay for k = 0, none for k = 2)."""
    ndim = call.inputs[0].ndim
    k = call.argument("k") % 4
    first, second = (normalized_dim(dim, ndim) for dim in call.argument("dims"))
    kept = [(dim, dim) for dim in range(ndim) if dim not in (first, second)]
    kept += {0: [(first, first), (second, second)], 1: [(first, second)], 2: [], 3: [(second, first)]}[k]
    rows = [Row((Replicate(),), (Replicate(),))]
    rows += [Row((Shard(output_dim),), (Shard(input_dim),)) for input_dim, output_dim in kept]
    return rows + _partial_rows(1, 1)


def block_diag_rows(call: OpCall) -> list[Row]:
    """block_diag: blocks land at offsets that depend on every block, so inputs are Replicate; a
    Partial passes (the zeros around the blocks combine to zero under every reduce op)."""
    inputs = len(call.inputs)
    return [Row((Replicate(),), (Replicate(),) * inputs)] + _partial_rows(1, inputs)


class ChunkCatRule(ShardingRule):
    """_chunk_cat(tensors, dim, num_chunks): dims before `dim` are shared by every tensor and the
    output, and keep their shard; `dim` and later dims are chunked, padded and flattened. The
    kernel refuses empty tensors, which an uneven shard can be, so an empty shard is built directly.
    """

    __name__ = "_chunk_cat"

    def rows(self, call: OpCall) -> list[Row]:
        dim = dim_argument(call)
        inputs = len(call.inputs)
        rows = [Row((Replicate(),), (Replicate(),) * inputs)]
        rows += [Row((Shard(leading),), (Shard(leading),) * inputs) for leading in range(dim)]
        return rows + _partial_rows(1, inputs)  # the padding zeros combine to zero

    def local_op(self, call, input_layouts, coordinate):
        def chunk_cat_or_empty(mesh, tensors, dim, num_chunks):
            first = tensors[0]
            dim = normalized_dim(dim, first.ndim)
            if all(first.shape[:dim]):  # only an empty shard of a leading dim is built here
                return aten._chunk_cat(tensors, dim, num_chunks)
            width = sum(-(-tensor.shape[dim] // num_chunks) * math.prod(tensor.shape[dim + 1:]) for tensor in tensors)
            return first.new_zeros((*first.shape[:dim], num_chunks, width))

        return chunk_cat_or_empty


# ---- fill, item -----------------------------------------------------------------------------------


def fill_rows(call: OpCall) -> list[Row]:
    """fill(self, value): the output lies like self; a Partial self gives Replicate (every rank
    holds the value, which must not be summed). A tensor `value` is Replicate (reduced if Partial)."""
    extra = (Replicate(),) * (len(call.inputs) - 1)
    rows = [Row((Replicate(),), (Replicate(),) + extra)]
    rows += [Row((Shard(dim),), (Shard(dim),) + extra) for dim in range(call.inputs[0].ndim)]
    return rows + [Row((Replicate(),), (Partial(op),) + extra) for op in REDUCE_OPS]


class LocalScalarRule(ShardingRule):
    """_local_scalar_dense (`item()`, `float(x)`, `bool(x)`): a one-element tensor read on every rank,
    so it is made Replicate first (a Partial is reduced, a shard gathered) and every rank returns the
    same number. On a sub-mesh the ranks outside it get that number too, sent by the mesh (torch's
    DTensor gives them None): SPMD code that branches on it (`if loss.item() > 0`, `if t.any()`)
    then takes the same branch, and so issues the same collectives, on every rank of the world."""

    __name__ = "_local_scalar_dense"
    returns_value = True

    def rows(self, call: OpCall) -> list[Row]:
        return [Row((), (Replicate(),))]


SHAPE_RULES: list[tuple[list, object]] = [
    ([aten.diag_embed.default, aten.diagonal_backward.default], DiagonalFillRule()),
    ([aten.diagonal_scatter.default], DiagonalScatterRule()),
    ([aten.constant_pad_nd.default], ConstantPadRule()),
    ([aten.rot90.default], rot90_rows),
    ([aten.block_diag.default], block_diag_rows),
    ([aten._chunk_cat.default], ChunkCatRule()),
    ([aten.fill.Scalar, aten.fill.Tensor], fill_rows),
    ([aten._local_scalar_dense.default], LocalScalarRule()),
]

for shape_ops, shape_rule in SHAPE_RULES:
    register_rule(shape_ops, shape_rule)
