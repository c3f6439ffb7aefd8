"""Sharding rules: pooling on inputs sharded along their spatial dims, by halo exchange.

max_pool2d/3d (with indices), avg_pool2d/3d and the adaptive poolings, forward and backward
(`F.max_pool1d`, `avg_pool1d` and the 1-d adaptive ones reach the 2-d ops with a height of 1). Each
keeps the rows of `PlaneRule` (batch and channels shard, spatial dims whole) and adds a row per
spatial dim the input is sharded on: the output is sharded there too and each rank computes its
own output rows from a window of input rows that its neighbours send (`halo.exchange`).

Output ownership is `halo.output_bounds`'s (shared with convolution): output row o belongs to the
coordinate owning the input row at the centre of its window (adaptive pooling: the window's first
row). Each rank's window is exactly the rows its outputs read, `[o0 * stride - padding, ...)`,
so the local op runs with padding 0 on the sharded dims and gives exactly its output rows:
- max pooling: rows outside the input are filled with the dtype's lowest value, which the
  kernel never prefers to a real one (torch ignores padding); the kernel's window indices become
  the single-device ones (flat over the global spatial plane);
- avg pooling: rows outside the input are zeros and the kernel only sums them
  (`divisor_override=1`); each output is divided by its single-device divisor, computed from the
  global geometry (count_include_pad, ceil_mode's windows that pass the padding, divisor_override);
- adaptive pooling: offered where each rank's local adaptive cells are exactly the global cells
  of its output rows (the output grid maps onto the shards, e.g. size divisible by output size);
  otherwise the `PlaneRule` rows apply.
The backwards need no input values (the kernels read only its shape): the gradient of each
window is scattered locally and `halo.exchange_gradient` adds the halo rows' gradients into
their owners' rows. A gradient or indices tensor that arrives Replicate is sliced to the rank's
output rows; a sharded one must have the forward's output shard sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..halo import Bounds, Exchange, SlidingWindow, exchange, exchange_gradient, exchange_shape, exchanged_bytes
from ..halo import output_bounds, shard_bounds
from ..layout import Layout
from ..placement import Replicate, Shard
from ..rules import LocalCollective, OpCall, Row
from .nn_spatial import PlaneRule
from .registry import aten, register_rule

__all__ = ["PoolDim", "AdaptiveDim", "SpatialPool", "SpatialPoolBackward"]


R = Replicate()


# ---- per-dim geometry -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolDim:
    """One spatial dim of a max or avg pooling: its sliding window over `size` input rows."""

    window: SlidingWindow
    size: int
    ceil_mode: bool

    @property
    def output_size(self) -> int:
        """torch's pooling output size (ceil_mode keeps a last window that starts inside the input)."""
        window, extra = self.window, self.window.stride - 1 if self.ceil_mode else 0
        rows = (self.size + 2 * window.padding - window.span + extra) // window.stride + 1
        if self.ceil_mode and (rows - 1) * window.stride >= self.size + window.padding:
            rows -= 1
        return rows

    def output_bounds(self, bounds: Bounds) -> Bounds:
        return self.window.output_bounds(bounds, self.output_size)

    def input_windows(self, outputs: Bounds) -> Bounds:
        return self.window.input_windows(outputs)

    def maps_onto(self, outputs: Bounds) -> bool:
        return True

    def divisors(self, start: int, stop: int, count_include_pad: bool) -> list[int]:
        """avg pooling's divisor along this dim for output rows [start, stop): torch's window size,
        the padding counted but not the rows past it (ceil_mode), or only the input rows."""
        window, divisors = self.window, []
        for output in range(start, stop):
            first = output * window.stride - window.padding
            last = min(first + window.kernel_size, self.size + window.padding)
            inside = min(last, self.size) - max(first, 0)
            divisors.append(last - first if count_include_pad else inside)
        return divisors


@dataclass(frozen=True, slots=True)
class AdaptiveDim:
    """One spatial dim of an adaptive pooling: output cell o reads input rows
    `[floor(o * size / outputs), ceil((o + 1) * size / outputs))`."""

    size: int
    output_size: int

    def cell(self, output: int) -> tuple[int, int]:
        return (output * self.size) // self.output_size, -((-(output + 1) * self.size) // self.output_size)

    def output_bounds(self, bounds: Bounds) -> Bounds:
        return output_bounds(bounds, self.output_size, Fraction(self.size, self.output_size))

    def input_windows(self, outputs: Bounds) -> Bounds:
        return tuple((self.cell(start)[0], self.cell(stop - 1)[1]) if stop > start else (0, 0) for start, stop in outputs)

    def maps_onto(self, outputs: Bounds) -> bool:
        """Whether the local adaptive pooling of each window gives exactly the global cells."""
        for (start, stop), (first, last) in zip(outputs, self.input_windows(outputs)):
            local = AdaptiveDim(last - first, stop - start)
            for output in range(start, stop):
                cell = self.cell(output)
                if local.cell(output - start) != (cell[0] - first, cell[1] - first):
                    return False
        return True


def _per_dim(values, rank: int, default: Sequence[int] | None = None) -> list[int]:
    """A pooling argument per spatial dim: one value for all, one per dim, or (empty) the default."""
    values = [values] if isinstance(values, int) else list(values)
    if not values and default is not None:
        return list(default)
    return values * rank if len(values) == 1 else values


# op -> (pooling kind, spatial rank): kind "max", "avg", "adaptive_max" or "adaptive_avg".
_FORWARD = {
    aten.max_pool2d_with_indices.default: ("max", 2), aten.max_pool3d_with_indices.default: ("max", 3),
    aten.avg_pool2d.default: ("avg", 2), aten.avg_pool3d.default: ("avg", 3),
    aten.adaptive_max_pool2d.default: ("adaptive_max", 2), aten.adaptive_max_pool3d.default: ("adaptive_max", 3),
    aten._adaptive_avg_pool2d.default: ("adaptive_avg", 2), aten._adaptive_avg_pool3d.default: ("adaptive_avg", 3),
}
# backward op -> its forward op
_BACKWARD = {
    aten.max_pool2d_with_indices_backward.default: aten.max_pool2d_with_indices.default,
    aten.max_pool3d_with_indices_backward.default: aten.max_pool3d_with_indices.default,
    aten.avg_pool2d_backward.default: aten.avg_pool2d.default,
    aten.avg_pool3d_backward.default: aten.avg_pool3d.default,
    aten.adaptive_max_pool2d_backward.default: aten.adaptive_max_pool2d.default,
    aten.adaptive_max_pool3d_backward.default: aten.adaptive_max_pool3d.default,
    aten._adaptive_avg_pool2d_backward.default: aten._adaptive_avg_pool2d.default,
    aten._adaptive_avg_pool3d_backward.default: aten._adaptive_avg_pool3d.default,
}


def _geometry(kind: str, rank: int, call: OpCall, input_shape: Sequence[int]) -> list:
    """The per-dim geometry of every spatial dim (a backward call reads its forward's arguments,
    which it shares by name; adaptive backwards take the output size from grad_output)."""
    spatial = input_shape[len(input_shape) - rank:]
    if kind.startswith("adaptive"):
        output_size = call.argument("output_size") or call.inputs[0].shape[-rank:]
        return [AdaptiveDim(size, outputs) for size, outputs in zip(spatial, _per_dim(output_size, rank))]
    kernel = _per_dim(call.argument("kernel_size"), rank)
    stride = _per_dim(call.argument("stride"), rank, default=kernel)
    padding = _per_dim(call.argument("padding"), rank)
    dilation = _per_dim(call.argument("dilation") or 1, rank)
    ceil_mode = bool(call.argument("ceil_mode"))
    return [
        PoolDim(SlidingWindow(*arguments), size, ceil_mode)
        for *arguments, size in zip(kernel, stride, padding, dilation, spatial)
    ]


def _lowest(dtype: torch.dtype):
    """A value max pooling never prefers to an input value: the padding torch ignores."""
    return float("-inf") if dtype.is_floating_point else torch.iinfo(dtype).min


# ---- the plan of one call on one layout -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Sharded:
    """A sharded spatial dim: its exchange (windows exactly the rows each coordinate's outputs
    read) and each coordinate's output rows."""

    exchange: Exchange
    outputs: Bounds


@dataclass(frozen=True, slots=True)
class _Plan:
    """A pooling on one input layout: the geometry of every spatial dim (the first is tensor dim
    `first`) and the exchange of every sharded one."""

    kind: str
    first: int
    geometry: tuple
    sharded: tuple[_Sharded, ...]

    @classmethod
    def of(cls, kind: str, rank: int, call: OpCall, layout: Layout, dtype: torch.dtype) -> _Plan:
        """The plan of `call` on its input (of `dtype`) laid out as `layout`: windows of max pooling
        filled with the lowest value outside the input, of avg pooling with zeros."""
        geometry = tuple(_geometry(kind, rank, call, layout.shape))
        first = layout.ndim - rank
        edge = {"max": _lowest(dtype), "avg": "zeros"}.get(kind, "none")
        sharded = []
        for dim, dim_geometry in enumerate(geometry, start=first):
            if layout.shard_order[dim]:
                bounds = shard_bounds(layout, dim)
                outputs = dim_geometry.output_bounds(bounds)
                windows = dim_geometry.input_windows(outputs)
                sharded.append(_Sharded(Exchange(layout.shard_order[dim], dim, bounds, windows, edge), outputs))
        return cls(kind, first, geometry, tuple(sharded))

    @property
    def exchanges(self) -> tuple[Exchange, ...]:
        return tuple(step.exchange for step in self.sharded)

    def step(self, dim: int) -> _Sharded:
        return next(step for step in self.sharded if step.exchange.dim == dim)

    def maps_onto(self, dim: int) -> bool:
        """Whether the sharded spatial dim `dim` can be computed on its shards' windows."""
        return self.geometry[dim - self.first].maps_onto(self.step(dim).outputs)

    def received_bytes(self, dim: int, row_bytes: int) -> int:
        """The most bytes a coordinate receives in the exchange of `dim` (row: `row_bytes`)."""
        step = self.step(dim).exchange
        return max(exchanged_bytes(step.shard_bounds, step.windows, step.edge, piece, row_bytes)[1]
                   for piece in range(len(step.shard_bounds)))

    def at(self, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> _Local:
        outputs, starts = {}, {}
        for step in self.sharded:
            piece = step.exchange.piece(mesh_shape, coordinate)
            outputs[step.exchange.dim] = step.outputs[piece]
            starts[step.exchange.dim] = step.exchange.windows[piece][0]
        return _Local(self, tuple(mesh_shape), tuple(coordinate), outputs, starts)


@dataclass(frozen=True)
class _Local:
    """A plan at one mesh coordinate: per sharded dim its output rows and its window's first
    global row (below 0 where the window starts in the padding)."""

    plan: _Plan
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    outputs: dict[int, tuple[int, int]]
    starts: dict[int, int]

    def window(self, local: torch.Tensor, mesh) -> torch.Tensor:
        """This rank's window of input rows (mesh None: an empty tensor of its shape)."""
        if mesh is None:
            return local.new_empty(self.window_shape(local.shape))
        return exchange(local, mesh, self.plan.exchanges)

    def window_shape(self, local_shape: Sequence[int]) -> list[int]:
        return exchange_shape(local_shape, self.mesh_shape, self.coordinate, self.plan.exchanges)

    def output_sizes(self) -> list[int]:
        """This rank's output size of each spatial dim."""
        return [
            self.outputs[dim][1] - self.outputs[dim][0] if dim in self.outputs else geometry.output_size
            for dim, geometry in enumerate(self.plan.geometry, start=self.plan.first)
        ]

    def input_sizes(self) -> list[int]:
        return [geometry.size for geometry in self.plan.geometry]

    def own_rows(self, tensor: torch.Tensor, sharded: Sequence[bool]) -> torch.Tensor:
        """`tensor` (laid out like the output) narrowed to this rank's output rows on each sharded
        dim where it arrived whole (`sharded[i]` False for the i-th exchange)."""
        for step, is_sharded in zip(self.plan.sharded, sharded):
            if not is_sharded:
                start, stop = self.outputs[step.exchange.dim]
                tensor = tensor.narrow(step.exchange.dim, start, stop - start)
        return tensor

    def global_indices(self, indices: torch.Tensor, window_spatial: Sequence[int]) -> torch.Tensor:
        """Indices flat over the window's spatial plane -> flat over the global plane; a row of the
        window outside the input (chosen only when every value is the lowest) -> the nearest row,
        as torch's kernel starts its search there."""
        coordinates = _unravel(indices, window_spatial)
        flat = torch.zeros_like(indices)
        for dim, (coordinate, size) in enumerate(zip(coordinates, self.input_sizes()), start=self.plan.first):
            row = (coordinate + self.starts[dim]).clamp(0, size - 1) if dim in self.starts else coordinate
            flat = flat * size + row
        return flat

    def window_indices(self, indices: torch.Tensor, window_spatial: Sequence[int]) -> torch.Tensor:
        """The inverse of `global_indices`: flat over the global plane -> flat over the window's."""
        coordinates = _unravel(indices, self.input_sizes())
        flat = torch.zeros_like(indices)
        for dim, (coordinate, size) in enumerate(zip(coordinates, window_spatial), start=self.plan.first):
            flat = flat * size + (coordinate - self.starts.get(dim, 0))
        return flat

    def divisors(self, count_include_pad: bool, like: torch.Tensor) -> torch.Tensor:
        """avg pooling's single-device divisor of each of this rank's outputs, shaped to broadcast
        over them (spatial dims last)."""
        result = None
        for position, (dim, geometry) in enumerate(enumerate(self.plan.geometry, start=self.plan.first)):
            start, stop = self.outputs.get(dim, (0, geometry.output_size))
            values = torch.tensor(geometry.divisors(start, stop, count_include_pad), dtype=torch.int64,
                                  device=like.device)
            values = values.reshape([-1] + [1] * (len(self.plan.geometry) - position - 1))
            result = values if result is None else result * values
        return result.to(like.dtype)


def _unravel(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    coordinates = []
    for size in reversed(sizes):
        coordinates.append(flat % size)
        flat = flat // size
    return coordinates[::-1]


# ---- local ops --------------------------------------------------------------------------------------


def _local_pooling_arguments(local: _Local) -> list[list[int]]:
    """kernel_size, stride, padding (0 on the sharded dims: the window holds their padding), dilation."""
    windows = [geometry.window for geometry in local.plan.geometry]
    padding = [0 if dim in local.outputs else window.padding
               for dim, window in enumerate(windows, start=local.plan.first)]
    return [[window.kernel_size for window in windows], [window.stride for window in windows], padding,
            [window.dilation for window in windows]]


def _pool_forward(call: OpCall, local: _Local):
    """The local op of a pooling forward: exchange the window, pool it, make indices global."""
    op, kind, first = call.op, local.plan.kind, local.plan.first
    count_include_pad, divisor_override = call.argument("count_include_pad"), call.argument("divisor_override")
    returns_indices = kind in ("max", "adaptive_max")

    def pool(mesh, tensor, *args, **kwargs):
        window = local.window(tensor, mesh)
        shape = [*window.shape[:first], *local.output_sizes()]
        if window.numel() == 0 or 0 in shape:
            output = window.new_zeros(shape)
            return (output, torch.zeros(shape, dtype=torch.int64, device=window.device)) if returns_indices else output
        if kind == "max":
            kernel, stride, padding, dilation = _local_pooling_arguments(local)
            output, indices = op(window, kernel, stride, padding, dilation, call.argument("ceil_mode"))
        elif kind == "avg":
            kernel, stride, padding, _ = _local_pooling_arguments(local)
            sums = op(window, kernel, stride, padding, call.argument("ceil_mode"), count_include_pad,
                      divisor_override or 1)
            return sums if divisor_override else sums / local.divisors(count_include_pad, sums)
        else:
            results = op(window, local.output_sizes())
            if kind == "adaptive_avg":
                return results
            output, indices = results
        return output, local.global_indices(indices, window.shape[first:])

    return pool


def _pool_backward(call: OpCall, local: _Local, grad_sharded: Sequence[bool], indices_sharded: Sequence[bool]):
    """The local op of a pooling backward: the gradient of this rank's window from its output
    rows' gradient, then the halo rows' gradients added into their owners' rows."""
    op, kind, first = call.op, local.plan.kind, local.plan.first
    count_include_pad, divisor_override = call.argument("count_include_pad"), call.argument("divisor_override")

    def pool_backward(mesh, grad, tensor, *args, **kwargs):
        if mesh is None:
            return tensor.new_empty(tensor.shape)
        grad = local.own_rows(grad, grad_sharded)
        window_shape = local.window_shape(tensor.shape)
        if grad.numel() == 0:
            grad_window = grad.new_zeros(window_shape)
        elif kind in ("max", "adaptive_max"):
            local_call = OpCall(op, (), (grad, tensor, *args), tuple(kwargs.items()))
            indices = local.own_rows(local_call.argument("indices"), indices_sharded)
            window_indices = local.window_indices(indices, window_shape[first:])
            grad_window = grad.new_zeros(window_shape)
            grad_window.flatten(first).scatter_add_(first, window_indices.flatten(first), grad.flatten(first))
        elif kind == "avg":
            kernel, stride, padding, _ = _local_pooling_arguments(local)
            scaled = grad if divisor_override else grad / local.divisors(count_include_pad, grad)
            grad_window = op(scaled, grad.new_empty(window_shape), kernel, stride, padding, call.argument("ceil_mode"),
                             count_include_pad, divisor_override or 1)
        else:
            grad_window = op(grad, grad.new_empty(window_shape))
        return exchange_gradient(grad_window, mesh, local.plan.exchanges)

    return pool_backward


# ---- rules ------------------------------------------------------------------------------------------


def _halo_collectives(plan: _Plan, dim: int, meta) -> tuple[LocalCollective, ...]:
    """The exchange of `dim`'s window rows (or of their gradients): one batched point-to-point."""
    row_bytes = math.prod(meta.shape) // max(meta.shape[dim], 1) * meta.dtype.itemsize
    received = plan.received_bytes(dim, row_bytes)
    return (LocalCollective("batch_p2p", received),) if received else ()


class SpatialPool(PlaneRule):
    """A pooling forward: `PlaneRule`'s rows, and one per spatial dim the input is sharded on
    (where the op can be computed there): output sharded on it too, by halo exchange."""

    def __init__(self, op):
        self.kind, rank = _FORWARD[op]
        super().__init__(op._schema.name.split("::")[1], rank)

    def rows_for_layouts(self, call, layouts):
        rows = list(self.rows(call))
        plan = _Plan.of(self.kind, self.spatial_rank, call, layouts[0], call.inputs[0].dtype)
        outputs = len(call.op._schema.returns)
        for step in plan.sharded:
            dim = step.exchange.dim
            if plan.maps_onto(dim):
                rows.append(Row((Shard(dim),) * outputs, (Shard(dim),), _halo_collectives(plan, dim, call.inputs[0])))
        return rows

    def local_shape_key(self, call, input_layouts, coordinate):
        plan = _Plan.of(self.kind, self.spatial_rank, call, input_layouts[0], call.inputs[0].dtype)
        return tuple(plan.at(input_layouts[0].mesh_shape, coordinate).outputs.items())

    def local_op(self, call, input_layouts, coordinate):
        plan = _Plan.of(self.kind, self.spatial_rank, call, input_layouts[0], call.inputs[0].dtype)
        if not plan.sharded:
            return super().local_op(call, input_layouts, coordinate)
        return _pool_forward(call, plan.at(input_layouts[0].mesh_shape, coordinate))


class SpatialPoolBackward(PlaneRule):
    """A pooling backward `(grad_output, self, ...[, indices])`: `PlaneRule`'s rows, and per spatial
    dim `self` is sharded on, rows with grad_output and indices sharded like the forward's output
    (when they are already) or whole (sliced locally)."""

    def __init__(self, op):
        self.kind, rank = _FORWARD[_BACKWARD[op]]
        super().__init__(op._schema.name.split("::")[1], rank)

    def _plan(self, call: OpCall, tensor: Layout) -> _Plan:
        return _Plan.of(self.kind, self.spatial_rank, call, tensor, call.inputs[1].dtype)

    def rows_for_layouts(self, call, layouts):
        rows = list(self.rows(call))
        grad, tensor, *indices = layouts
        plan = self._plan(call, tensor)
        for step in plan.sharded:
            dim = step.exchange.dim
            if not plan.maps_onto(dim):
                continue
            pieces = tuple(stop - start for start, stop in step.outputs)

            # A gradient may stay sharded if it has the output's pieces, and the engine, which gives a
            # dim of the input's size the input's pieces, would not realign them.

            def options(layout: Layout) -> list:
                matches = layout.shard_order[dim] == tensor.shard_order[dim] and layout.pieces[dim] == pieces
                realigned = layout.shape[dim] == tensor.shape[dim] and pieces != tensor.pieces[dim]
                return [Shard(dim), R] if matches and not realigned else [R]

            collectives = _halo_collectives(plan, dim, call.inputs[1])
            for grad_placement in options(grad):
                for indices_placements in ([(placement,) for placement in options(indices[0])] if indices else [()]):
                    rows.append(Row((Shard(dim),), (grad_placement, Shard(dim), *indices_placements), collectives))
        return rows

    def local_op(self, call, input_layouts, coordinate):
        plan = self._plan(call, input_layouts[1])
        if not plan.sharded:
            return super().local_op(call, input_layouts, coordinate)
        dims = [step.exchange.dim for step in plan.sharded]
        grad_sharded = [bool(input_layouts[0].shard_order[dim]) for dim in dims]
        indices_sharded = [bool(input_layouts[-1].shard_order[dim]) for dim in dims]
        return _pool_backward(call, plan.at(input_layouts[1].mesh_shape, coordinate), grad_sharded, indices_sharded)


for _op in _FORWARD:
    register_rule([_op], SpatialPool(_op))
for _op in _BACKWARD:
    register_rule([_op], SpatialPoolBackward(_op))
