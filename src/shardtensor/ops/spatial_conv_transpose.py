"""Transposed convolution (`aten.convolution` with transposed=True, and its backward) on inputs
sharded along spatial dims, by halo exchange. `ops/spatial_conv.py`'s rules call these for
transposed calls (one rule per op: the plain convolution's rows live there).

Geometry along one spatial dim (input rows N, kernel k, stride s, padding p, dilation d): input row
i adds to output rows `i * s - p + j * d` for j in range(k). Output row o belongs to the coordinate
owning input row `floor((o + p - d * (k - 1) // 2) / s)` clamped into the input (the centre of the
inputs that reach it; `halo.output_bounds` with stride 1/s): a kernel-2 stride-2 upsampling gives
the coordinate holding input rows [a, b) the output rows [2a, 2b), uneven in, uneven out. Output
rows [o0, o1) read input rows `ceil((o0 + p - d * (k - 1)) / s)` to `floor((o1 - 1 + p) / s)`
(inside the input): that window is exchanged, convolved locally with padding and output_padding 0
on the sharded dims (its rows land on global rows `[i0 * s - p, (i1 - 1) * s - p + d * (k - 1) + 1)`),
and the rank's output rows are cut from it; rows that no input reaches (stride > kernel, the
output_padding at the end) hold the bias alone.

The backward rebuilds the window from the halo the forward kept (`halo.exchange` with keep and
reuse, as `ops/spatial_conv.py`: no second exchange of the input), cuts the gradient of its local output from grad_output (taken
sharded like the forward's output, or Replicate and sliced), runs the local `convolution_backward`
and sends the window's gradient to the rows' owners; weight and bias gradients are Partial(sum)
(each rank's output rows once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..halo import Bounds, Exchange, exchange, exchange_gradient, exchange_shape, exchanged_bytes, output_bounds
from ..halo import shard_bounds
from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from ..rules import LocalCollective, OpCall, Row, TensorMeta
from .registry import aten

__all__ = ["TransposedDim", "transposed_rows", "transposed_backward_rows", "transposed_local_op",
           "transposed_backward_local_op", "transposed_local_shape_key"]


R, P = Replicate(), Partial("sum")


@dataclass(frozen=True, slots=True)
class TransposedDim:
    """One spatial dim of a transposed convolution."""

    size: int
    kernel_size: int
    stride: int
    padding: int
    dilation: int
    output_padding: int

    @property
    def reach(self) -> int:
        return self.dilation * (self.kernel_size - 1)

    @property
    def output_size(self) -> int:
        return (self.size - 1) * self.stride - 2 * self.padding + self.reach + self.output_padding + 1

    def output_bounds(self, bounds: Bounds) -> Bounds:
        offset = Fraction(self.padding - self.reach // 2, self.stride)
        return output_bounds(bounds, self.output_size, Fraction(1, self.stride), offset)

    def input_window(self, start: int, stop: int) -> tuple[int, int]:
        """The input rows whose contributions reach output rows [start, stop), inside the input."""
        if stop <= start:
            return (0, 0)
        first = max(-((self.reach - start - self.padding) // self.stride), 0)  # ceil((start + p - reach) / s)
        last = min((stop - 1 + self.padding) // self.stride + 1, self.size)
        return (first, last) if first < last else (0, 0)

    def local_rows(self, window: tuple[int, int]) -> tuple[int, int]:
        """The global output rows a local transposed convolution of `window` (padding 0) gives."""
        first, last = window
        if last <= first:
            return (0, 0)
        return first * self.stride - self.padding, (last - 1) * self.stride - self.padding + self.reach + 1


def _per_dim(values: Sequence[int], count: int) -> tuple[int, ...]:
    values = tuple(values)
    return values * count if len(values) == 1 else values


def _dims(call: OpCall, input_meta: TensorMeta, weight_meta: TensorMeta) -> list[TransposedDim]:
    count = input_meta.ndim - 2
    arguments = [_per_dim(call.argument(name), count) for name in ("stride", "padding", "dilation", "output_padding")]
    return [TransposedDim(input_meta.shape[2 + index], weight_meta.shape[2 + index], *(values[index] for values in arguments))
            for index in range(count)]


@dataclass(frozen=True, slots=True)
class _Plan:
    """A transposed convolution on one input layout: per spatial dim its geometry, and per
    sharded one its exchange and every coordinate's output rows."""

    geometry: tuple[TransposedDim, ...]
    exchanges: tuple[Exchange, ...]
    outputs: tuple[Bounds, ...]

    @classmethod
    def of(cls, call: OpCall, layout: Layout, input_meta: TensorMeta, weight_meta: TensorMeta) -> _Plan:
        geometry = tuple(_dims(call, input_meta, weight_meta))
        exchanges, outputs = [], []
        for dim, dim_geometry in enumerate(geometry, start=2):
            if layout.shard_order[dim]:
                bounds = shard_bounds(layout, dim)
                owned = dim_geometry.output_bounds(bounds)
                windows = tuple(dim_geometry.input_window(start, stop) for start, stop in owned)
                exchanges.append(Exchange(layout.shard_order[dim], dim, bounds, windows, "none"))
                outputs.append(owned)
        return cls(geometry, tuple(exchanges), tuple(outputs))

    def at(self, mesh_shape, coordinate) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
        """tensor dim -> (this coordinate's output rows, the rows its local convolution gives)."""
        result = {}
        for step, owned in zip(self.exchanges, self.outputs):
            piece = step.piece(mesh_shape, coordinate)
            result[step.dim] = (owned[piece], self.geometry[step.dim - 2].local_rows(step.windows[piece]))
        return result

    def received_bytes(self, dim: int, row_bytes: int) -> int:
        step = next(step for step in self.exchanges if step.dim == dim)
        return max(exchanged_bytes(step.shard_bounds, step.windows, step.edge, piece, row_bytes)[1]
                   for piece in range(len(step.shard_bounds)))


def _plan(call: OpCall, layout: Layout, input_index: int) -> _Plan:
    return _Plan.of(call, layout, call.inputs[input_index], call.inputs[input_index + 1])


def _collectives(plan: _Plan, dim: int, meta: TensorMeta, count: int) -> tuple[LocalCollective, ...]:
    row_bytes = math.prod(meta.shape) // max(meta.shape[dim], 1) * meta.dtype.itemsize
    received = plan.received_bytes(dim, row_bytes)
    return (LocalCollective("batch_p2p", received),) * count if received else ()


def _local_arguments(plan: _Plan, sharded: Sequence[int], stride, padding, dilation, output_padding):
    """padding and output_padding 0 on the sharded dims (the cut makes the rank's rows exact)."""
    count = len(plan.geometry)
    padding, output_padding = list(_per_dim(padding, count)), list(_per_dim(output_padding, count))
    for dim in sharded:
        padding[dim - 2] = output_padding[dim - 2] = 0
    return stride, padding, dilation, output_padding


def _shared_rows(local: torch.Tensor, owned: torch.Tensor, rows: dict):
    """Views of the rows that the local convolution's output (`local`, global rows rows[dim][1])
    shares with the rank's output rows (`owned`, rows[dim][0]); None when they share none."""
    for dim, ((start, stop), (local_start, local_stop)) in rows.items():
        first, last = max(start, local_start), min(stop, local_stop)
        if last <= first:
            return None
        local = local.narrow(dim, first - local_start, last - first)
        owned = owned.narrow(dim, first - start, last - first)
    return local, owned


def _output_shape(window: torch.Tensor, weight: torch.Tensor, groups: int, plan: _Plan, rows: dict) -> list[int]:
    spatial = [rows[dim][0][1] - rows[dim][0][0] if dim in rows else geometry.output_size
               for dim, geometry in enumerate(plan.geometry, start=2)]
    return [window.size(0), weight.size(1) * groups, *spatial]


def _window(tensor, mesh, plan: _Plan, mesh_shape, coordinate, backward: bool) -> torch.Tensor:
    """The input window: the forward keeps its halo (when a backward may run), the backward reuses it."""
    if mesh is None:
        return tensor.new_empty(exchange_shape(tensor.shape, mesh_shape, coordinate, plan.exchanges))
    return exchange(tensor, mesh, plan.exchanges, keep=not backward and torch.is_grad_enabled(), reuse=backward)


def transposed_rows(call: OpCall, layouts: Sequence[Layout]) -> list[Row]:
    """Per spatial dim the input is sharded on: input and output `Shard(d)`, weight and bias whole."""
    plan = _plan(call, layouts[0], 0)
    bias = (R,) * isinstance(call.argument("bias"), TensorMeta)
    return [Row((Shard(step.dim),), (Shard(step.dim), R) + bias, _collectives(plan, step.dim, call.inputs[0], 1))
            for step in plan.exchanges]


def transposed_local_shape_key(call: OpCall, input_layouts: Sequence[Layout], coordinate) -> object:
    plan = _plan(call, input_layouts[0], 0)
    return tuple(plan.at(input_layouts[0].mesh_shape, coordinate).items()) if plan.exchanges else None


def transposed_local_op(call: OpCall, input_layouts: Sequence[Layout], coordinate):
    """The forward's local op: exchange, convolve locally, cut the rank's rows, add the bias."""
    plan = _plan(call, input_layouts[0], 0)
    if not plan.exchanges:
        return None
    mesh_shape = input_layouts[0].mesh_shape
    rows = plan.at(mesh_shape, coordinate)

    def transposed_convolution(mesh, tensor, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        window = _window(tensor, mesh, plan, mesh_shape, coordinate, backward=False)
        result = window.new_zeros(_output_shape(window, weight, groups, plan, rows))
        if mesh is None:
            return result
        if window.numel() and weight.numel():
            arguments = _local_arguments(plan, rows, stride, padding, dilation, output_padding)
            stride_, padding_, dilation_, output_padding_ = arguments
            local = aten.convolution(window, weight, None, stride_, padding_, dilation_, True, output_padding_, groups)
            shared = _shared_rows(local, result, rows)
            if shared is not None:
                shared[1].copy_(shared[0])
        if bias is not None:
            result = result + bias.reshape(-1, *(1,) * (result.ndim - 2))
        return result

    return transposed_convolution


def transposed_backward_rows(call: OpCall, layouts: Sequence[Layout], outputs: tuple) -> list[Row]:
    """(grad_output, input, weight) -> grads of (input, weight, bias) as `outputs` masks them (None
    stands for grad_input): grad_output `Shard(d)` where it has the forward output's pieces, or
    Replicate; input `Shard(d)`; weight whole; weight and bias gradients Partial(sum)."""
    grad, tensor = layouts[0], layouts[1]
    plan = _plan(call, tensor, 1)
    rows = []
    for step, owned in zip(plan.exchanges, plan.outputs):
        dim = step.dim
        pieces = tuple(stop - start for start, stop in owned)
        matches = grad.shard_order[dim] == tensor.shard_order[dim] and grad.pieces[dim] == pieces
        realigned = grad.shape[dim] == tensor.shape[dim] and pieces != tensor.pieces[dim]
        row_outputs = tuple(Shard(dim) if placement is None else placement for placement in outputs)
        collectives = _collectives(plan, dim, call.inputs[1], 1)  # the window's gradient back (the window: kept)
        for grad_placement in ([Shard(dim), R] if matches and not realigned else [R]):
            rows.append(Row(row_outputs, (grad_placement, Shard(dim), R), collectives))
    return rows


def transposed_backward_local_op(call: OpCall, input_layouts: Sequence[Layout], coordinate):
    """The backward's local op: the window from the forward's halo, the gradient of its local output, the local
    `convolution_backward`, the window's gradient to its owners; the bias gradient from the
    rank's own output rows."""
    grad_layout, input_layout = input_layouts[0], input_layouts[1]
    plan = _plan(call, input_layout, 1)
    if not plan.exchanges:
        return None
    mesh_shape = input_layout.mesh_shape
    rows = plan.at(mesh_shape, coordinate)
    whole = [step.dim for step in plan.exchanges if not grad_layout.shard_order[step.dim]]

    def transposed_backward(mesh, grad, tensor, weight, bias_sizes, stride, padding, dilation, transposed,
                            output_padding, groups, output_mask):
        for dim in whole:
            start, stop = rows[dim][0]
            grad = grad.narrow(dim, start, stop - start)
        window = _window(tensor, mesh, plan, mesh_shape, coordinate, backward=True)
        grad_window, grad_weight = window.new_zeros(window.shape), weight.new_zeros(weight.shape)
        if mesh is not None and window.numel() and weight.numel():
            stride_, padding_, dilation_, output_padding_ = _local_arguments(plan, rows, stride, padding, dilation,
                                                                             output_padding)
            local_shape = list(aten.convolution(window.to("meta"), weight.to("meta"), None, stride_, padding_, dilation_,
                                                True, output_padding_, groups).shape)
            grad_local = grad.new_zeros(local_shape)
            shared = _shared_rows(grad_local, grad, rows)
            if shared is not None:
                shared[0].copy_(shared[1])
            grad_window, grad_weight, _ = aten.convolution_backward(
                grad_local, window, weight, None, stride_, padding_, dilation_, True, output_padding_, groups,
                [True, True, False])
        if mesh is None:
            grad_input = tensor.new_empty(tensor.shape)
        else:
            grad_input = exchange_gradient(grad_window, mesh, plan.exchanges)
        grad_bias = grad.sum([dim for dim in range(grad.ndim) if dim != 1])
        results = (grad_input, grad_weight, grad_bias)
        return tuple(result if wanted else None for result, wanted in zip(results, output_mask))

    return transposed_backward
