"""Sharding rules: unfold and fold (`aten.im2col`, `aten.col2im`, each the other's backward) on
inputs sharded along the height, by halo exchange.

`im2col` of an image (N, C, H, W) sharded on H gives blocks (N, C * kh * kw, L) with L = rows x
columns of blocks, row-major: a rank's block rows are a contiguous run of L, so the output is
sharded on L. Block row b belongs to the coordinate owning image row `b * stride + offset` (the
centre of its window, `halo.SlidingWindow.output_bounds`, as convolution and pooling); each rank
exchanges the image rows its blocks read (zero rows for the padding) and unfolds them with padding
0 on H. `col2im` is the adjoint: blocks sharded on L in whole block rows are folded into the image
rows they cover, and those rows' sums go to their owners (`halo.exchange_gradient`). Its output
rows are the ones whose blocks these are: the image shards whose `output_bounds` give the blocks'
shards (for stride 1 exactly the unfolded image's shards; with a larger stride the largest such
boundaries).

A sharded width has no layout on L: a rank's block columns are a strided set of L (a run of columns
in every block row), and `Shard` gives each coordinate one run. So there is no row for W: the planner
moves an image sharded on W to one of `PlaneRule`'s rows or the height's (gathering W over its mesh
dims, H keeping its halo exchange on a 2-D mesh; or the batch), and the values stay the single-device
ones. (An exact W row would exist only where each coordinate owns at most one block row.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..halo import Bounds, Exchange, SlidingWindow, exchange, exchange_gradient, exchange_shape, exchanged_bytes
from ..halo import shard_bounds
from ..layout import Layout
from ..placement import Shard
from ..rules import LocalCollective, OpCall, Row
from .nn_spatial import PlaneRule
from .registry import aten, register_rule

__all__ = ["Unfold", "Fold"]


def _windows(call: OpCall) -> tuple[SlidingWindow, SlidingWindow]:
    """The sliding window along the height and along the width."""
    values = [list(call.argument(name)) for name in ("kernel_size", "stride", "padding", "dilation")]
    values = [value * 2 if len(value) == 1 else value for value in values]
    return tuple(SlidingWindow(*(value[index] for value in values)) for index in range(2))


@dataclass(frozen=True, slots=True)
class _Plan:
    """An unfold or fold on one layout: the exchange of image rows along the height, the block
    rows each coordinate owns, and the blocks per block row."""

    exchange: Exchange
    blocks: Bounds
    columns: int

    def at(self, mesh_shape, coordinate) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(image rows owned, window rows, block rows owned) at `coordinate`."""
        piece = self.exchange.piece(mesh_shape, coordinate)
        return self.exchange.shard_bounds[piece], self.exchange.windows[piece], self.blocks[piece]

    def received_bytes(self, row_bytes: int) -> int:
        step = self.exchange
        return max(exchanged_bytes(step.shard_bounds, step.windows, step.edge, piece, row_bytes)[1]
                   for piece in range(len(step.shard_bounds)))


def _plan(call: OpCall, mesh_dims: tuple[int, ...], image_bounds: Bounds, height_dim: int, image: Sequence[int]):
    height, width = _windows(call)
    blocks = height.output_bounds(image_bounds, height.output_size(image[-2]))
    windows = height.input_windows(blocks)
    return _Plan(Exchange(mesh_dims, height_dim, image_bounds, windows, "zeros"), blocks, width.output_size(image[-1]))


class _BlockRowsRule(PlaneRule):
    """`PlaneRule`'s rows, and one more where `_plan` finds an exchange: the input's tensor dim
    `ndim - dim_from_end` (the image's height, the blocks' L) sharded, and the output's dim of the
    same index (L, height). Subclasses give `_plan` and `_row_bytes`."""

    def __init__(self, name: str, spatial_rank: int, dim_from_end: int):
        super().__init__(name, spatial_rank)
        self.dim_from_end = dim_from_end

    def _plan(self, call: OpCall, layout: Layout) -> _Plan | None:
        raise NotImplementedError

    def _row_bytes(self, call: OpCall) -> int:
        """The bytes of one image row (all planes), as the cost model counts them."""
        raise NotImplementedError

    def rows_for_layouts(self, call, layouts):
        rows = list(self.rows(call))
        plan = self._plan(call, layouts[0])
        if plan is not None:
            received = plan.received_bytes(self._row_bytes(call))
            collectives = (LocalCollective("batch_p2p", received),) if received else ()
            dim = layouts[0].ndim - self.dim_from_end
            rows.append(Row((Shard(dim),), (Shard(dim),), collectives))
        return rows

    def local_shape_key(self, call, input_layouts, coordinate):
        plan = self._plan(call, input_layouts[0])
        return None if plan is None else plan.at(input_layouts[0].mesh_shape, coordinate)


class Unfold(_BlockRowsRule):
    """`im2col(self, kernel_size, dilation, padding, stride)`: `PlaneRule`'s rows, and an image
    sharded on its height gives blocks sharded on L (none for the width: the module says why)."""

    def __init__(self):
        super().__init__("im2col", 3, dim_from_end=2)

    def _plan(self, call: OpCall, layout: Layout) -> _Plan | None:
        height_dim = layout.ndim - 2
        if not layout.shard_order[height_dim]:
            return None
        mesh_dims = layout.shard_order[height_dim]
        return _plan(call, mesh_dims, shard_bounds(layout, height_dim), height_dim, layout.shape)

    def _row_bytes(self, call):
        image = call.inputs[0]
        return math.prod(image.shape) // max(image.shape[-2], 1) * image.dtype.itemsize

    def local_op(self, call, input_layouts, coordinate):
        plan = self._plan(call, input_layouts[0])
        if plan is None:
            return super().local_op(call, input_layouts, coordinate)
        mesh_shape = input_layouts[0].mesh_shape
        _, _, (first, last) = plan.at(mesh_shape, coordinate)
        height, width = _windows(call)

        def unfold(mesh, tensor, kernel_size, dilation, padding, stride):
            if mesh is None:
                window = tensor.new_empty(exchange_shape(tensor.shape, mesh_shape, coordinate, (plan.exchange,)))
            else:
                window = exchange(tensor, mesh, (plan.exchange,))
            if last == first or window.numel() == 0:
                blocks = window.size(-3) * height.kernel_size * width.kernel_size
                return window.new_zeros([*window.shape[:-3], blocks, (last - first) * plan.columns])
            return aten.im2col(window, kernel_size, dilation, [0, width.padding], stride)

        return unfold


class Fold(_BlockRowsRule):
    """`col2im(self, output_size, kernel_size, dilation, padding, stride)`: `PlaneRule`'s rows, and
    blocks sharded on L in whole block rows give an image sharded on its height (the module says
    which rows)."""

    def __init__(self):
        super().__init__("col2im", 2, dim_from_end=1)

    def _plan(self, call: OpCall, layout: Layout) -> _Plan | None:
        blocks_dim = layout.ndim - 1
        if not layout.shard_order[blocks_dim]:
            return None
        height, width = _windows(call)
        image_height, image_width = call.argument("output_size")
        columns, rows = width.output_size(image_width), height.output_size(image_height)
        if any(piece % max(columns, 1) for piece in layout.pieces[blocks_dim]):
            return None  # a block row split between coordinates
        starts = [sum(layout.pieces[blocks_dim][:index]) // max(columns, 1) for index in range(len(layout.pieces[blocks_dim]))]
        # The largest image row boundary whose rows before it own exactly `start` block rows.
        boundaries = [0] + [image_height if start >= rows else min(max(start * height.stride + height.offset, 0), image_height)
                            for start in starts[1:]]
        boundaries = [max(boundaries[:index + 1]) for index in range(len(boundaries))] + [image_height]
        image_bounds = tuple(zip(boundaries[:-1], boundaries[1:]))
        image_shape = [*layout.shape[:-2], 1, image_height, image_width]
        plan = _plan(call, layout.shard_order[blocks_dim], image_bounds, blocks_dim, image_shape)
        block_bounds = tuple((start, stop) for start, stop in zip(starts, starts[1:] + [rows]))
        return plan if plan.blocks == block_bounds else None

    def _row_bytes(self, call):
        blocks = call.inputs[0]
        height, width = _windows(call)
        channels = blocks.shape[-2] // (height.kernel_size * width.kernel_size)
        return math.prod(blocks.shape[:-2]) * channels * call.argument("output_size")[1] * blocks.dtype.itemsize

    def local_op(self, call, input_layouts, coordinate):
        plan = self._plan(call, input_layouts[0])
        if plan is None:
            return super().local_op(call, input_layouts, coordinate)
        (own_start, own_stop), (window_start, window_stop), _ = plan.at(input_layouts[0].mesh_shape, coordinate)
        height, width = _windows(call)

        def fold(mesh, blocks, output_size, kernel_size, dilation, padding, stride):
            channels = blocks.size(-2) // (height.kernel_size * width.kernel_size)
            leading, image_width = blocks.shape[:-2], output_size[1]
            if mesh is None:
                return blocks.new_empty([*leading, channels, own_stop - own_start, image_width])
            window_rows = window_stop - window_start
            if window_rows == 0 or blocks.numel() == 0:
                window = blocks.new_zeros([*leading, channels, window_rows, image_width])
            else:
                window = aten.col2im(blocks, [window_rows, image_width], kernel_size, dilation, [0, width.padding], stride)
            return exchange_gradient(window, mesh, (plan.exchange,))

        return fold


register_rule([aten.im2col.default], Unfold())
register_rule([aten.col2im.default], Fold())
