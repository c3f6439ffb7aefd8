"""Sharding rules: convolution on inputs sharded along spatial dims, by halo exchange.

`aten.convolution` and `aten.convolution_backward` (transposed calls take the rows and local ops of
`ops/spatial_conv_transpose.py`; the rest of this note is about plain ones) get, besides the batch and
channel rows of `nn.Convolution`, a row per spatial dim d: input `Shard(d)`, weight and bias
Replicate, output `Shard(d)`. The local op exchanges the window of input rows its output rows need
(`halo.exchange`, point to point between the coordinates that share rows; the zero padding of the
convolution comes in as zero rows of the window) and convolves it with padding 0 on the sharded
dims. Output row o belongs to the coordinate owning input row `o * stride - padding + dilation *
(kernel_size - 1) // 2` (the centre of its receptive field, `halo.SlidingWindow.offset`): a
stride-1 'same' convolution keeps the input's shard sizes, uneven in, uneven out; shards thinner
than the halo take rows from farther coordinates; a coordinate may own no output rows.

The backward needs the input window again: autograd saved the input DTensor, not the window (it
runs below autograd), so the forward keeps the halo rows it received with the input's shard
(`halo.exchange(keep=True)`: the halo only, freed with the shard) and the backward rebuilds the
window from them (`reuse=True`) without communicating; only an input the backward sees in another
layout (moved, or written in place) exchanges again. It runs the local `convolution_backward` with
the same zero padding, and sends the window's gradient back to the rows' owners (`halo.exchange_gradient`);
weight and bias gradients are Partial(sum) over the spatial shards. Its grad_output is taken
sharded exactly like the forward's output, or Replicate (the gradient of a `sum()`), which each
rank slices. Both declare their exchanges (`LocalCollective("batch_p2p", ...)`) so that the cost
model prefers them to moving the field to batch sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..halo import (
    Bounds, Exchange, SlidingWindow, exchange, exchange_gradient, exchange_shape, exchanged_bytes, shard_bounds,
)
from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from ..rules import LocalCollective, OpCall, Row, TensorMeta
from .nn import Convolution, ConvolutionBackward, _masked_outputs
from .spatial_conv_transpose import (
    transposed_backward_local_op, transposed_backward_rows, transposed_local_op, transposed_local_shape_key,
    transposed_rows,
)
from .registry import aten, register_rule


R, P = Replicate(), Partial("sum")

__all__ = ["SpatialConvolution", "SpatialConvolutionBackward", "sliding_windows", "spatial_exchanges"]


def _per_dim(values: Sequence[int], count: int) -> tuple[int, ...]:
    """An aten int list argument for `count` spatial dims (a single value applies to all)."""
    values = tuple(values)
    return values * count if len(values) == 1 else values


def sliding_windows(call: OpCall, input_meta: TensorMeta, weight_meta: TensorMeta) -> tuple[SlidingWindow, ...]:
    """The convolution's window geometry along each spatial dim (dims 2, 3, ...)."""
    spatial = input_meta.ndim - 2
    stride = _per_dim(call.argument("stride"), spatial)
    padding = _per_dim(call.argument("padding"), spatial)
    dilation = _per_dim(call.argument("dilation"), spatial)
    return tuple(
        SlidingWindow(weight_meta.shape[2 + index], stride[index], padding[index], dilation[index])
        for index in range(spatial)
    )


@dataclass(frozen=True, slots=True)
class _Spatial:
    """A convolution's exchanges on one input layout: one per sharded spatial dim, the output rows
    each coordinate owns there, and the padding left for the local convolution (0 on sharded dims)."""

    exchanges: tuple[Exchange, ...]
    output_bounds: dict[int, Bounds]  # tensor dim -> output rows per piece
    local_padding: tuple[int, ...]

    def outputs(self, step: Exchange, mesh_shape, coordinate) -> tuple[int, int]:
        """The output rows (start, stop) along `step`'s dim that the rank at `coordinate` owns."""
        return self.output_bounds[step.dim][step.piece(mesh_shape, coordinate)]

    def key(self, mesh_shape, coordinate) -> tuple:
        """This coordinate's windows and output rows: what its local output shape depends on."""
        return tuple((step.window(mesh_shape, coordinate), self.outputs(step, mesh_shape, coordinate))
                     for step in self.exchanges)

    def owns_no_output(self, mesh_shape, coordinate) -> bool:
        return any(start == stop for start, stop in (self.outputs(step, mesh_shape, coordinate) for step in self.exchanges))


def spatial_exchanges(call: OpCall, input_layout: Layout, input_meta: TensorMeta, weight_meta: TensorMeta) -> _Spatial:
    """The exchanges of a convolution of `call`'s geometry on an input laid out as `input_layout`."""
    windows = sliding_windows(call, input_meta, weight_meta)
    exchanges, bounds_by_dim, padding = [], {}, []
    for index, window in enumerate(windows):
        dim = 2 + index
        if not input_layout.shard_order[dim]:
            padding.append(window.padding)
            continue
        size = input_meta.shape[dim]
        bounds = shard_bounds(input_layout, dim)
        outputs = window.output_bounds(bounds, window.output_size(size))
        exchanges.append(Exchange(input_layout.shard_order[dim], dim, bounds, window.input_windows(outputs), "zeros"))
        bounds_by_dim[dim] = outputs
        padding.append(0)
    return _Spatial(tuple(exchanges), bounds_by_dim, tuple(padding))


def _halo_bytes(call: OpCall, layout: Layout | None, input_meta: TensorMeta, weight_meta: TensorMeta, dim: int) -> int:
    """The most bytes a rank receives in the exchange along `dim`: exact for the input's layout when
    it shards `dim`, else for even chunks over the largest mesh dim; without a layout, an estimate
    from the global shape (the window's span of rows). For the cost model."""
    if layout is None:
        window = sliding_windows(call, input_meta, weight_meta)[dim - 2]
        plane = math.prod(input_meta.shape) // max(input_meta.shape[dim], 1)
        return (window.span - 1) * plane * input_meta.dtype.itemsize
    if not layout.shard_order[dim]:
        largest = max(range(layout.mesh_ndim), key=lambda mesh_dim: layout.mesh_shape[mesh_dim])
        layout = layout.with_placements([Shard(dim) if mesh_dim == largest else placement
                                         for mesh_dim, placement in enumerate(layout.placements)])
    step = next(step for step in spatial_exchanges(call, layout, input_meta, weight_meta).exchanges if step.dim == dim)
    plane = math.prod(max(pieces, default=0) for index, pieces in enumerate(layout.pieces) if index != dim)
    row_bytes = plane * input_meta.dtype.itemsize
    return max(exchanged_bytes(step.shard_bounds, step.windows, step.edge, piece, row_bytes)[1]
               for piece in range(len(step.shard_bounds)))


def _spatial_dims(call: OpCall, input_meta: TensorMeta) -> range:
    return range(0) if call.argument("transposed") else range(2, input_meta.ndim)


def _local_output_shape(window: torch.Tensor, weight: torch.Tensor, call_arguments) -> list[int]:
    """The local output shape of a convolution of `window` (padding 0 on sharded dims), computed
    without the kernel (which refuses windows without rows)."""
    stride, padding, dilation = call_arguments
    count = window.ndim - 2
    windows = [
        SlidingWindow(weight.size(2 + index), _per_dim(stride, count)[index], _per_dim(padding, count)[index],
                      _per_dim(dilation, count)[index])
        for index in range(count)
    ]
    return [window.size(0), weight.size(0), *(geometry.output_size(window.size(2 + index))
                                              for index, geometry in enumerate(windows))]


class SpatialConvolution(Convolution):
    """`nn.Convolution`'s rows, plus one per spatial dim computed by halo exchange (see the module)."""

    __name__ = "convolution"

    def rows(self, call: OpCall) -> list[Row]:
        return self._rows(call, None)

    def rows_for_layouts(self, call, layouts):
        if call.argument("transposed"):  # ops/spatial_conv_transpose.py
            return super().rows(call) + transposed_rows(call, layouts)
        return self._rows(call, layouts[0])

    def _rows(self, call: OpCall, input_layout: Layout | None) -> list[Row]:
        rows = super().rows(call)
        input_meta, weight_meta = call.inputs[0], call.inputs[1]
        bias = (R,) * isinstance(call.argument("bias"), TensorMeta)
        for dim in _spatial_dims(call, input_meta):
            halo = _halo_bytes(call, input_layout, input_meta, weight_meta, dim)
            collectives = (LocalCollective("batch_p2p", halo),) if halo else ()
            rows.append(Row((Shard(dim),), (Shard(dim), R) + bias, collectives))
        return rows

    def local_arguments(self, call, input_layouts, coordinate):
        if call.argument("transposed"):
            return None
        spatial = spatial_exchanges(call, input_layouts[0], call.inputs[0], call.inputs[1])
        return call.with_arguments(padding=list(spatial.local_padding)) if spatial.exchanges else None

    def local_shape_key(self, call, input_layouts, coordinate):
        if call.argument("transposed"):
            return transposed_local_shape_key(call, input_layouts, coordinate)
        spatial = spatial_exchanges(call, input_layouts[0], call.inputs[0], call.inputs[1])
        return spatial.key(input_layouts[0].mesh_shape, coordinate)

    def local_op(self, call, input_layouts, coordinate):
        convolve = super().local_op(call, input_layouts, coordinate)
        if call.argument("transposed"):
            return transposed_local_op(call, input_layouts, coordinate) or convolve
        spatial = spatial_exchanges(call, input_layouts[0], call.inputs[0], call.inputs[1])
        if not spatial.exchanges:
            return convolve
        mesh_shape = input_layouts[0].mesh_shape
        empty = spatial.owns_no_output(mesh_shape, coordinate)

        def halo_convolution(mesh, tensor, weight, bias, stride, padding, dilation, *rest):
            if mesh is None:  # shapes only
                window = tensor.new_empty(exchange_shape(tensor.shape, mesh_shape, coordinate, spatial.exchanges))
            else:  # the halo kept for the backward (`SpatialConvolutionBackward`) when it will run
                window = exchange(tensor, mesh, spatial.exchanges, keep=torch.is_grad_enabled())
            if empty:
                return window.new_zeros(_local_output_shape(window, weight, (stride, padding, dilation)))
            return convolve(mesh, window, weight, bias, stride, padding, dilation, *rest)

        return halo_convolution


class SpatialConvolutionBackward(ConvolutionBackward):
    """`nn.ConvolutionBackward`'s rows, plus per spatial dim d: grad_output `Shard(d)` (exactly the
    forward output's shards) or Replicate (sliced locally), input `Shard(d)`, weight Replicate ->
    grad_input `Shard(d)`, weight and bias gradients Partial(sum)."""

    __name__ = "convolution_backward"

    def rows(self, call: OpCall) -> list[Row]:
        return self._rows(call, None, grad_sharded_like_output=True)

    def rows_for_layouts(self, call, layouts):
        if call.argument("transposed"):  # ops/spatial_conv_transpose.py
            outputs = _masked_outputs((None, P, P), call.argument("output_mask"))
            return super().rows(call) + transposed_backward_rows(call, layouts, outputs)
        return self._rows(call, layouts[1], grad_sharded_like_output=self._grad_matches_output(call, layouts))

    def _rows(self, call: OpCall, input_layout: Layout | None, grad_sharded_like_output: bool) -> list[Row]:
        rows = super().rows(call)
        grad_meta, input_meta, weight_meta = call.inputs
        outputs = _masked_outputs((None, P, P), call.argument("output_mask"))
        for dim in _spatial_dims(call, input_meta):
            halo = _halo_bytes(call, input_layout, input_meta, weight_meta, dim)
            # The window's gradient back to the owners (the window itself from the forward's halo).
            collectives = (LocalCollective("batch_p2p", halo),) if halo else ()
            row_outputs = tuple(Shard(dim) if placement is None else placement for placement in outputs)
            if grad_sharded_like_output:
                rows.append(Row(row_outputs, (Shard(dim), Shard(dim), R), collectives))
            rows.append(Row(row_outputs, (R, Shard(dim), R), collectives))
        return rows

    @staticmethod
    def _grad_matches_output(call: OpCall, layouts: Sequence[Layout]) -> bool:
        """grad_output may stay sharded where its pieces are the forward output's for the input's
        pieces, and where the engine's piece alignment cannot swap them (equal sizes, other pieces)."""
        grad_layout, input_layout = layouts[0], layouts[1]
        spatial = spatial_exchanges(call, input_layout, call.inputs[1], call.inputs[2])
        for dim, outputs in spatial.output_bounds.items():
            pieces = tuple(stop - start for start, stop in outputs)
            if grad_layout.shard_order[dim] != input_layout.shard_order[dim] or grad_layout.pieces[dim] != pieces:
                return False
            if grad_layout.shape[dim] == input_layout.shape[dim] and pieces != input_layout.pieces[dim]:
                return False
        return True

    def local_op(self, call, input_layouts, coordinate):
        backward = super().local_op(call, input_layouts, coordinate)
        if call.argument("transposed"):
            return transposed_backward_local_op(call, input_layouts, coordinate) or backward
        grad_layout, input_layout = input_layouts[0], input_layouts[1]
        spatial = spatial_exchanges(call, input_layout, call.inputs[1], call.inputs[2])
        if not spatial.exchanges:
            return backward
        mesh_shape = input_layout.mesh_shape
        empty = spatial.owns_no_output(mesh_shape, coordinate)
        # grad_output Replicate on a sharded dim: this rank's output rows are sliced from it.
        slices = [
            (step.dim, spatial.outputs(step, mesh_shape, coordinate))
            for step in spatial.exchanges if not grad_layout.shard_order[step.dim]
        ]

        def halo_backward(mesh, grad, tensor, weight, bias_sizes, *rest):
            output_mask = rest[-1]
            for dim, (start, stop) in slices:
                grad = grad.narrow(dim, start, stop - start)
            if mesh is None:  # shapes only
                window = tensor.new_empty(exchange_shape(tensor.shape, mesh_shape, coordinate, spatial.exchanges))
            else:  # the forward's halo, if kept for this shard
                window = exchange(tensor, mesh, spatial.exchanges, reuse=True)
            if empty:
                results = (torch.zeros_like(window), torch.zeros_like(weight), grad.new_zeros(grad.size(1)))
                results = tuple(result if wanted else None for result, wanted in zip(results, output_mask))
            else:
                results = backward(mesh, grad, window, weight, bias_sizes, *rest)
            grad_window = results[0]
            if grad_window is None:
                return results
            if mesh is None:
                grad_input = torch.empty_like(tensor)
            else:
                grad_input = exchange_gradient(grad_window, mesh, spatial.exchanges)
            return (grad_input, *results[1:])

        return halo_backward

    def local_values(self, call, input_layouts, coordinate) -> dict:
        values = super().local_values(call, input_layouts, coordinate)
        spatial = spatial_exchanges(call, input_layouts[1], call.inputs[1], call.inputs[2])
        if spatial.exchanges and not call.argument("transposed"):  # transposed: its local op sets them
            return values | {"padding": list(spatial.local_padding)}
        return values


register_rule([aten.convolution.default], SpatialConvolution())
register_rule([aten.convolution_backward.default], SpatialConvolutionBackward())
