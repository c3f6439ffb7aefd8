"""Sharding rules that keep spatial dims sharded through padding and resampling (issue 14): reflect,
replicate and circular pads and the nearest / nearest-exact / linear / bilinear / trilinear /
bicubic upsampling ops, forward and backward.

Every rank knows the global geometry (`resample_geometry`): which output rows each coordinate owns
(the coordinate holding the output row's source row, so uneven in gives exact uneven out) and which
input rows, its *window*, they read. The local op fetches the window with `halo.exchange` (point to
point, only the rows a peer holds: a shard thinner than the halo reads from a neighbour's neighbour;
a dim sharded over several mesh dims exchanges over their flattened coordinates) and computes its
output rows from it:

- pads: the window with the pad's edge mode *is* the padded output along a sharded dim (the edge
  shards get the reflected, repeated or wrapped rows; circular wraps across the first and last
  shard; negative widths crop); dims that are not sharded are padded by the local op. A constant
  pad needs no exchange: it stays in `shape_ops` (only the edge shards grow or shrink).
- resampling: each output row gathers its taps from the window with torch's own global indices and
  weights (the kernel's coordinate mapping on the window would differ from the global one), so the
  numbers equal the single-device op's. Nearest reads only rows its owner holds: no exchange.

Backward rules run the adjoint: the local gradient of the window (index_add of the taps, or the
pad's backward with the sharded dims' padding 0), then `halo.exchange_gradient` returns each row's
gradient to the coordinate holding it. The gradient of the output may be sharded with any pieces:
windows follow its rows. The upsampling backward has no input tensor, so its input gradient takes
pieces that own the gradient's rows (`owners_from_outputs`): the forward input's whenever those
are `torch.chunk`'s or every input row is some output row's source (upscaling); otherwise (an uneven
input shrunk) the leaf's gradient is re-laid at the end of backward.

F.pad(mode="circular") decomposes into slices and copies before any aten op is dispatched, so the
`torch_function` layer rewrites it (`ops.registry.FUNCTION_REWRITES`) to the op
`shardtensor::pad_circular` defined here, which has a rule and a backward like the aten pads. A
cropped circular pad (a negative width) wraps over the rows it keeps, which no shard edge marks:
that dim is not kept sharded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..halo import Bounds, Exchange, exchange, exchange_gradient, output_bounds, shard_bounds
from ..layout import Layout
from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..rules import LocalCollective, OpCall, Row, ShardingRule
from .nn_spatial import PlaneRule
from .registry import aten, register_function_rewrite, register_rule
from .resample_geometry import (
    Taps, input_windows, interpolation_taps, owned_outputs, owners_from_outputs,
)

__all__ = ["PadRule", "UpsampleRule"]


R = Replicate()


# ---- the exchange along each sharded spatial dim ------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SpatialDim:
    """One sharded spatial dim: its halo `Exchange` (the input rows each piece holds and reads, which
    may pass the edges for a pad), the output rows each piece owns, and this coordinate's piece."""

    exchange: Exchange
    output_bounds: Bounds
    piece: int

    @property
    def dim(self) -> int:
        return self.exchange.dim

    @property
    def window(self) -> tuple[int, int]:
        return self.exchange.windows[self.piece]

    @property
    def output_rows(self) -> tuple[int, int]:
        return self.output_bounds[self.piece]


def sharded_spatial_dims(layout: Layout, spatial_dims: Sequence[int]) -> list[int]:
    """The spatial dims the layout shards, in the order of their mesh dims (the exchange order)."""
    return sorted((dim for dim in spatial_dims if layout.shard_order[dim]), key=lambda dim: layout.shard_order[dim])


def _spatial_dim(layout: Layout, dim: int, coordinate, bounds: Bounds, windows, outputs, edge: str) -> SpatialDim:
    exchange = Exchange(layout.shard_order[dim], dim, bounds, tuple(windows), edge)
    return SpatialDim(exchange, tuple(outputs), exchange.piece(layout.mesh_shape, coordinate))


def _rows_outside(window: tuple[int, int], held: tuple[int, int]) -> int:
    """Rows of `window` that lie outside `held` (received from peers)."""
    inside = max(min(window[1], held[1]) - max(window[0], held[0]), 0)
    return window[1] - window[0] - inside


def _halo_collective(shape, itemsize: int, dim: int, rows: int, layout: Layout | None) -> tuple[LocalCollective, ...]:
    """The point-to-point exchange of a halo of `rows` rows of `dim` (one side's) into a rank: rows
    as wide as a local shard's when the input's `layout` is known (the other dims' sharding kept)."""
    if rows <= 0:
        return ()
    row_bytes = math.prod(shape) // max(shape[dim], 1) * itemsize
    if layout is not None:
        for other, order in enumerate(layout.shard_order):
            if other != dim:
                row_bytes //= math.prod(layout.mesh_shape[mesh_dim] for mesh_dim in order)
    return (LocalCollective("batch_p2p", rows * row_bytes),)


# ---- pads -----------------------------------------------------------------------------------------

# kind of pad -> the halo edge mode that fills its rows outside the input.
_EDGES = {"reflection": "reflect", "replication": "replicate", "circular": "circular"}


def _pad_widths(padding: Sequence[int], ndim: int) -> dict[int, tuple[int, int]]:
    """dim -> (before, after) from a pad list that starts with the last dim."""
    return {ndim - 1 - pair: (padding[2 * pair], padding[2 * pair + 1]) for pair in range(len(padding) // 2)}


def _pad_dims(layout: Layout, padding: Sequence[int], coordinate, edge: str) -> list[SpatialDim]:
    widths = _pad_widths(padding, layout.ndim)
    found = []
    for dim in sharded_spatial_dims(layout, sorted(widths)):
        before, after = widths[dim]
        bounds = shard_bounds(layout, dim)
        outputs = output_bounds(bounds, layout.shape[dim] + before + after, offset=-before)
        windows = [(start - before, stop - before) for start, stop in outputs]
        found.append(_spatial_dim(layout, dim, coordinate, bounds, windows, outputs, edge))
    return found


def _unsharded_padding(padding: Sequence[int], ndim: int, sharded: Sequence[SpatialDim]) -> list[int]:
    """The pad list with the sharded dims' widths set to 0 (the window holds their padding)."""
    local = list(padding)
    for spatial in sharded:
        pair = ndim - 1 - spatial.dim
        local[2 * pair] = local[2 * pair + 1] = 0
    return local


def _circular_rows(size: int, before: int, after: int, device) -> torch.Tensor:
    """The input row each output row of a circular pad reads. Negative widths crop first, and the
    rest wraps around the rows kept (as torch does): row `cropped + (o - before) mod kept`."""
    cropped, kept = max(-before, 0), size + min(before, 0) + min(after, 0)
    return cropped + (torch.arange(size + before + after, device=device) - max(before, 0)) % kept


def circular_pad(tensor: torch.Tensor, padding: Sequence[int]) -> torch.Tensor:
    """F.pad(mode="circular") as one gather per padded dim (`_circular_rows`)."""
    for dim, (before, after) in _pad_widths(padding, tensor.ndim).items():
        tensor = tensor.index_select(dim, _circular_rows(tensor.shape[dim], before, after, tensor.device))
    return tensor


def circular_pad_backward(grad: torch.Tensor, input_shape: Sequence[int], padding: Sequence[int]) -> torch.Tensor:
    """The adjoint of `circular_pad`: every output row's gradient added to the row it read."""
    for dim, (before, after) in reversed(list(_pad_widths(padding, grad.ndim).items())):
        shape = list(grad.shape)
        shape[dim] = input_shape[dim]
        rows = _circular_rows(input_shape[dim], before, after, grad.device)
        grad = grad.new_zeros(shape).index_add_(dim, rows, grad)
    return grad


class PadRule(ShardingRule):
    """reflection_pad{1,2,3}d, replication_pad{1,2,3}d and pad_circular, forward (self, padding) and
    backward (grad_output, self, padding), padding the last len(padding) / 2 dims.

    Leading dims shard; a padded dim shards too, the edge shards receiving the padding rows (from
    neighbours when they do not hold them). A Partial passes (a pad copies values); in the backward
    only with self Replicate. grad_input lies like self. The kernels refuse an empty channel dim,
    which an uneven shard can be, so an empty shard's result is built directly.
    """

    def __init__(self, kind: str, backward: bool):
        self.edge, self.backward = _EDGES[kind], backward
        self.__name__ = f"{kind}_pad{'_backward' if backward else ''}"

    def rows(self, call: OpCall) -> list[Row]:
        return self._rows(call, None)

    def rows_for_layouts(self, call, layouts):
        return self._rows(call, layouts[1] if self.backward else layouts[0])

    def _rows(self, call: OpCall, self_layout: Layout | None) -> list[Row]:
        meta = call.inputs[1] if self.backward else call.inputs[0]
        inputs = len(call.inputs)
        widths = _pad_widths(call.argument("padding"), meta.ndim)
        rows = [Row((R,), (R,) * inputs)]
        rows += [Row((Shard(dim),), (Shard(dim),) * inputs) for dim in range(meta.ndim - len(widths))]
        for dim, (before, after) in sorted(widths.items()):
            if self.edge == "circular" and min(before, after) < 0:
                continue  # a cropped circular pad wraps over the rows kept, not the shards: the dim moves
            halo = max(before, after, 0)  # an edge shard's side
            collectives = _halo_collective(meta.shape, meta.dtype.itemsize, dim, halo, self_layout)
            rows.append(Row((Shard(dim),), (Shard(dim),) * inputs, collectives))
        if self.backward:  # the gradients of overlapping borders add up: only sums pass
            return rows + [Row((Partial(op),), (Partial(op), R)) for op in ("sum", "avg")]
        return rows + [Row((Partial(op),), (Partial(op),)) for op in REDUCE_OPS]

    def local_arguments(self, call, input_layouts, coordinate):
        """The forward's padding as this coordinate applies it: on a sharded dim, the rows its window
        adds before and after its shard (negative: shard rows another coordinate outputs). It gives
        the local output shape, so coordinates with equal local shapes and padding agree."""
        if self.backward:
            return None
        padding = list(call.argument("padding"))
        sharded = _pad_dims(input_layouts[0], padding, coordinate, self.edge)
        if not sharded:
            return None
        for spatial in sharded:
            pair = input_layouts[0].ndim - 1 - spatial.dim
            (start, stop), (window_start, window_stop) = spatial.exchange.shard_bounds[spatial.piece], spatial.window
            padding[2 * pair], padding[2 * pair + 1] = start - window_start, window_stop - stop
        return call.with_arguments(padding=padding)

    def local_op(self, call, input_layouts, coordinate):
        self_layout = input_layouts[1] if self.backward else input_layouts[0]
        padding = list(call.argument("padding"))
        sharded = _pad_dims(self_layout, padding, coordinate, self.edge)
        local_padding = _unsharded_padding(padding, self_layout.ndim, sharded)
        if self.backward:
            return self._backward(call, input_layouts, coordinate, sharded, local_padding)
        pad = circular_pad if self.edge == "circular" else call.op
        exchanges = [spatial.exchange for spatial in sharded]

        def exchange_and_pad(mesh, local, padding):
            if mesh is None:  # shapes only: `padding` is this coordinate's (`local_arguments`)
                return local.new_empty(_padded_shape(local.shape, padding))
            local = exchange(local, mesh, exchanges)
            if not any(local_padding):
                return local
            if local.numel() == 0:
                return local.new_zeros(_padded_shape(local.shape, local_padding))
            return pad(local, local_padding)

        return exchange_and_pad

    def _backward(self, call, input_layouts, coordinate, sharded, local_padding):
        """grad_output may have other pieces than the forward output: the windows follow its rows."""
        grad_layout = input_layouts[0]
        widths = _pad_widths(call.argument("padding"), grad_layout.ndim)
        exchanges = []
        for spatial in sharded:
            before = widths[spatial.dim][0]
            windows = tuple((start - before, stop - before) for start, stop in shard_bounds(grad_layout, spatial.dim))
            exchanges.append(dataclasses.replace(spatial.exchange, windows=windows))
        if self.edge == "circular":
            def pad_backward(grad, like, padding):
                return circular_pad_backward(grad, like.shape, padding)
        else:
            pad_backward = call.op

        def pad_backward_and_return(mesh, grad, local_self, padding):
            if mesh is None:
                return local_self.new_empty(local_self.shape)
            if any(local_padding):
                shape = _padded_shape(grad.shape, [-width for width in local_padding])
                if grad.numel() == 0:
                    grad = grad.new_zeros(shape)
                else:
                    grad = pad_backward(grad, grad.new_empty(shape), local_padding)
            return exchange_gradient(grad, mesh, exchanges)

        return pad_backward_and_return


def _padded_shape(shape: Sequence[int], padding: Sequence[int]) -> list[int]:
    padded = list(shape)
    for dim, (before, after) in _pad_widths(padding, len(shape)).items():
        padded[dim] += before + after
    return padded


# ---- the circular pad as an op ----------------------------------------------------------------------

_library = torch.library.Library("shardtensor", "FRAGMENT")
_library.define("pad_circular(Tensor self, SymInt[] padding) -> Tensor")
_library.define("pad_circular_backward(Tensor grad_output, Tensor self, SymInt[] padding) -> Tensor")
_library.impl("pad_circular", circular_pad, "CompositeExplicitAutograd")
_library.impl(
    "pad_circular_backward",
    lambda grad, tensor, padding: circular_pad_backward(grad, tensor.shape, padding),
    "CompositeExplicitAutograd",
)
pad_circular = torch.ops.shardtensor.pad_circular.default
pad_circular_backward = torch.ops.shardtensor.pad_circular_backward.default


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.padding = inputs[1]


def _pad_circular_gradient(ctx, grad):
    (tensor,) = ctx.saved_tensors
    return pad_circular_backward(grad, tensor, ctx.padding), None


torch.library.register_autograd("shardtensor::pad_circular", _pad_circular_gradient, setup_context=_save_input)


def _rewrite_circular_pad(args: tuple, kwargs: dict):
    """F.pad(input, pad, mode="circular") -> pad_circular(input, pad); other modes stay."""
    names = ("input", "pad", "mode", "value")
    given = dict(zip(names, args), **kwargs)
    if given.get("mode") != "circular":
        return None
    return pad_circular, (given["input"], list(given["pad"])), {}


# ---- upsampling -----------------------------------------------------------------------------------

# op name -> (mode, spatial rank): nearest, nearest_exact, linear and cubic taps.
_UPSAMPLE_OPS = {
    "upsample_nearest1d": ("nearest", 1), "upsample_nearest2d": ("nearest", 2), "upsample_nearest3d": ("nearest", 3),
    "_upsample_nearest_exact1d": ("nearest_exact", 1), "_upsample_nearest_exact2d": ("nearest_exact", 2),
    "_upsample_nearest_exact3d": ("nearest_exact", 3),
    "upsample_linear1d": ("linear", 1), "upsample_bilinear2d": ("linear", 2), "upsample_trilinear3d": ("linear", 3),
    "upsample_bicubic2d": ("cubic", 2),
}
_HALO_ROWS = {"nearest": 0, "nearest_exact": 0, "linear": 1, "cubic": 2}  # rows read past one side of a shard


def _scales(call: OpCall, rank: int) -> list[float | None]:
    names = [name for name in call.op._schema.arguments if name.name.startswith("scales")]
    return [call.argument(argument.name) for argument in names] or [None] * rank


def gather_taps(window: torch.Tensor, dim: int, taps: Taps, rows: tuple[int, int], window_start: int) -> torch.Tensor:
    """Output rows [rows) of `dim` from `window` (global rows from `window_start`): the weighted taps."""
    indices = (taps.indices[rows[0]:rows[1]] - window_start).to(window.device)
    if taps.weights is None:
        return window.index_select(dim, indices[:, 0])
    weights = taps.weights[rows[0]:rows[1]].to(device=window.device, dtype=window.dtype)
    shape = [1] * window.ndim
    shape[dim] = -1
    result = None
    for tap in range(indices.shape[1]):
        term = window.index_select(dim, indices[:, tap]) * weights[:, tap].reshape(shape)
        result = term if result is None else result + term
    return result


def scatter_taps(
    grad: torch.Tensor, dim: int, taps: Taps, rows: tuple[int, int], window: tuple[int, int]
) -> torch.Tensor:
    """The adjoint of `gather_taps`: the gradient of the window rows [window)."""
    indices = (taps.indices[rows[0]:rows[1]] - window[0]).to(grad.device)
    shape = list(grad.shape)
    shape[dim] = window[1] - window[0]
    result = grad.new_zeros(shape)
    if taps.weights is None:
        return result.index_add_(dim, indices[:, 0], grad)
    weights = taps.weights[rows[0]:rows[1]].to(device=grad.device, dtype=grad.dtype)
    weight_shape = [1] * grad.ndim
    weight_shape[dim] = -1
    for tap in range(indices.shape[1]):
        result.index_add_(dim, indices[:, tap], grad * weights[:, tap].reshape(weight_shape))
    return result


class UpsampleRule(PlaneRule):
    """upsample_{nearest,linear,bilinear,trilinear,bicubic} and nearest-exact, forward (self,
    output_size, ...) and backward (grad_output, output_size, input_size, ...): besides the leading
    dims (`PlaneRule`), a spatial dim shards; each coordinate computes the output rows whose source
    row it holds from a window fetched from its neighbours."""

    def __init__(self, name: str, mode: str, spatial_rank: int, backward: bool):
        super().__init__(name + "_backward" * backward, spatial_rank, global_input_size=backward)
        self.mode, self.backward = mode, backward

    def rows(self, call: OpCall) -> list[Row]:
        return self._rows(call, None)

    def rows_for_layouts(self, call, layouts):
        return self._rows(call, layouts[0])

    def _rows(self, call: OpCall, layout: Layout | None) -> list[Row]:
        """The halo is of input rows: the gradient's, in the backward (as wide as `input_size`'s). On
        a dim the input is sharded on already, the most rows any coordinate receives (a nearest
        forward none; its backward some when the gradient has other pieces than the output)."""
        rows = list(super().rows(call))
        meta = call.inputs[0]
        shape = call.argument("input_size") if self.backward else meta.shape
        first_spatial = meta.ndim - self.spatial_rank
        geometry = self._geometry(call, meta.dtype) if layout is not None else None
        for dim in range(first_spatial, meta.ndim):
            halo = _HALO_ROWS[self.mode]
            if geometry is not None and layout.shard_order[dim]:
                bounds, _, windows = self._dim_geometry(call, layout, dim, geometry)
                halo = max(_rows_outside(window, held) for window, held in zip(windows, bounds))
            collectives = _halo_collective(shape, meta.dtype.itemsize, dim, halo, layout)
            rows.append(Row((Shard(dim),), (Shard(dim),), collectives))
        return rows

    def _dim_geometry(self, call, layout: Layout, dim: int, geometry) -> tuple[Bounds, Bounds, Bounds]:
        """(input rows each coordinate holds, output rows it computes, input rows it reads) on `dim`."""
        input_size, _, taps = geometry
        dim_taps = taps[dim - (layout.ndim - self.spatial_rank)]
        if self.backward:  # windows follow the gradient's rows; the input gradient's pieces own them
            outputs = shard_bounds(layout, dim)
            size = input_size[dim - (layout.ndim - self.spatial_rank)]
            # It prefers the pieces an evenly sharded input has.
            preferred = Layout.create(layout.mesh_shape, layout.placements, call.argument("input_size")).pieces[dim]
            bounds = tuple(owners_from_outputs(dim_taps.sources, size, outputs, preferred))
        else:
            bounds = shard_bounds(layout, dim)
            outputs = tuple(owned_outputs(dim_taps.sources, bounds))
        return bounds, outputs, tuple(input_windows(dim_taps.indices, outputs))

    def _geometry(self, call: OpCall, dtype: torch.dtype) -> tuple[list[int], list[int], list[Taps]]:
        """(global input sizes, output sizes, taps) of the spatial dims."""
        output_size = list(call.argument("output_size"))
        input_size = list(call.argument("input_size") if self.backward else call.inputs[0].shape)[-self.spatial_rank:]
        align_corners = bool(call.argument("align_corners"))
        taps = [
            interpolation_taps(self.mode, size, out, align_corners, scale, dtype)
            for size, out, scale in zip(input_size, output_size, _scales(call, self.spatial_rank))
        ]
        return input_size, output_size, taps

    def _spans(self, call, input_layouts, coordinate):
        """(taps, spans, exchanges): per spatial dim its taps and (output rows this coordinate computes,
        input rows of its window, input rows it holds); the exchanges of the sharded ones, in order.
        None when no spatial dim is sharded."""
        layout = input_layouts[0]
        first_spatial = layout.ndim - self.spatial_rank
        dims = sharded_spatial_dims(layout, range(first_spatial, layout.ndim))
        if not dims:
            return None
        geometry = self._geometry(call, call.inputs[0].dtype)
        input_size, output_size, taps = geometry
        sharded = {}
        for dim in dims:
            bounds, outputs, windows = self._dim_geometry(call, layout, dim, geometry)
            sharded[dim] = _spatial_dim(layout, dim, coordinate, bounds, windows, outputs, "none")
        spans = []
        for index, dim in enumerate(range(first_spatial, layout.ndim)):
            if dim in sharded:
                spatial = sharded[dim]
                spans.append((spatial.output_rows, spatial.window, spatial.exchange.shard_bounds[spatial.piece]))
            else:
                spans.append(((0, output_size[index]), (0, input_size[index]), (0, input_size[index])))
        return taps, spans, [spatial.exchange for spatial in sharded.values()]

    def local_arguments(self, call, input_layouts, coordinate):
        """The local sizes: output rows (forward) or held input rows (backward) per spatial dim, so
        the local output shape follows from the arguments as the engine expects."""
        geometry = self._spans(call, input_layouts, coordinate)
        if geometry is None:
            return super().local_arguments(call, input_layouts, coordinate)
        _, spans, _ = geometry
        if not self.backward:
            return call.with_arguments(output_size=[rows[1] - rows[0] for rows, _, _ in spans])
        leading = list(input_layouts[0].local_shape(coordinate)[: input_layouts[0].ndim - self.spatial_rank])
        return call.with_arguments(input_size=leading + [held[1] - held[0] for _, _, held in spans])

    def local_op(self, call, input_layouts, coordinate):
        geometry = self._spans(call, input_layouts, coordinate)
        if geometry is None:
            return super().local_op(call, input_layouts, coordinate)
        taps, spans, exchanges = geometry
        first_spatial = input_layouts[0].ndim - self.spatial_rank
        if self.backward:
            return _upsample_backward(exchanges, taps, spans, first_spatial)
        return _upsample_forward(exchanges, taps, spans, first_spatial)


def _upsample_forward(exchanges, taps, spans, first_spatial: int):
    def exchange_and_gather(mesh, local, output_size, *arguments, **keywords):
        if mesh is None:  # shapes only: `output_size` is this coordinate's (`local_arguments`)
            return local.new_empty([*local.shape[:first_spatial], *output_size])
        window = exchange(local, mesh, exchanges)
        for index, (rows, window_rows, _) in enumerate(spans):
            window = gather_taps(window, first_spatial + index, taps[index], rows, window_rows[0])
        return window

    return exchange_and_gather


def _upsample_backward(exchanges, taps, spans, first_spatial: int):
    def scatter_and_return(mesh, grad, output_size, input_size, *arguments, **keywords):
        if mesh is None:  # shapes only: `input_size` is this coordinate's (`local_arguments`)
            return grad.new_empty(input_size)
        for index in reversed(range(len(spans))):
            rows, window_rows, _ = spans[index]
            grad = scatter_taps(grad, first_spatial + index, taps[index], rows, window_rows)
        return exchange_gradient(grad, mesh, exchanges)

    return scatter_and_return


# ---- registration ---------------------------------------------------------------------------------

for _kind in ("reflection", "replication"):
    for _spatial in (1, 2, 3):
        register_rule([getattr(aten, f"{_kind}_pad{_spatial}d").default], PadRule(_kind, backward=False))
        register_rule([getattr(aten, f"{_kind}_pad{_spatial}d_backward").default], PadRule(_kind, backward=True))
register_rule([pad_circular], PadRule("circular", backward=False))
register_rule([pad_circular_backward], PadRule("circular", backward=True))
for _pad in (torch.nn.functional.pad, torch._C._nn.pad):  # the Python wrapper and the binding it calls
    register_function_rewrite(_pad, _rewrite_circular_pad)
for _name, (_mode, _rank) in _UPSAMPLE_OPS.items():
    register_rule([getattr(aten, _name).default], UpsampleRule(_name, _mode, _rank, backward=False))
    register_rule([getattr(aten, _name + "_backward").default], UpsampleRule(_name, _mode, _rank, backward=True))
