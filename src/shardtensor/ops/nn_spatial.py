"""Sharding rules: spatial nn ops (pooling, upsampling, unpooling, pixel shuffle, im2col, grid
sampling) and batch norm.

Pooling and upsampling work on each (batch, channel) plane alone: the dims before the spatial ones
shard, the spatial dims stay whole (`ops/spatial_pool.py` adds rows for pooling on spatially
sharded inputs, by halo exchange). An input without a batch dim, (C, H, W) for a 2-d op, has one
such dim; the op's spatial rank tells them apart. Batch norm keeps statistics per channel, so it
shards the channel dim together with every per-channel tensor; the backward without training
(running statistics, global) shards the batch too.

The CPU kernels of most of these ops refuse a shard without channels (6 channels on 4 ranks), and
the meta kernels of some refuse an empty batch: such shards get zeros of the local shape, computed
without the kernel (`_planes_or_zeros`, `_channels_or_zeros`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .. import comm
from ..placement import Partial, Replicate, Shard
from ..rules import DataDependentOutput, LocalCollective, OpCall, Row, ShardingRule, schema_positions
from ..redistribute import redistribute_local_tensor
from .common import empty_shard_results
from .nn import _masked_outputs as _masked
from .registry import aten, register_rule


R, P = Replicate(), Partial("sum")


# ---- pooling, upsampling, unpooling, pixel shuffle, im2col -----------------------------------------


class PlaneRule(ShardingRule):
    """An op on the last `spatial_rank` dims of every tensor: any dim before them shards, on every
    tensor input and output together (batch, channel; pixel shuffle counts its channel as spatial).

    `global_input_size`: the op's `input_size` argument is a global size list (the backward of
    upsampling), made local per coordinate.
    """

    def __init__(self, name: str, spatial_rank: int, global_input_size: bool = False):
        self.__name__, self.spatial_rank, self.global_input_size = name, spatial_rank, global_input_size

    def _leading_dims(self, call: OpCall) -> int:
        return max(call.inputs[0].ndim - self.spatial_rank, 0)

    def rows(self, call: OpCall) -> list[Row]:
        outputs, inputs = len(call.op._schema.returns), len(call.inputs)
        rows = [Row((R,) * outputs, (R,) * inputs)]
        return rows + [Row((Shard(d),) * outputs, (Shard(d),) * inputs) for d in range(self._leading_dims(call))]

    def _local_input_size(self, call: OpCall, input_layouts, coordinate) -> list[int]:
        leading = self._leading_dims(call)
        return [*input_layouts[0].local_shape(coordinate)[:leading], *call.argument("input_size")[leading:]]

    def local_arguments(self, call, input_layouts, coordinate):
        if not self.global_input_size:
            return None
        return call.with_arguments(input_size=self._local_input_size(call, input_layouts, coordinate))

    def local_op(self, call, input_layouts, coordinate):
        leading = self._leading_dims(call)
        local = input_layouts[0].local_shape(coordinate)[:leading]
        if all(local):
            return None
        if self.global_input_size:  # the gradient of upsampling has the local `input_size` shape
            input_size = self._local_input_size(call, input_layouts, coordinate)
            return lambda mesh, grad, *args, **kwargs: grad.new_zeros(input_size)
        return _planes_or_zeros(call.op, dict(enumerate(local)))


def _planes_or_zeros(op, local_sizes: dict[int, int]):
    """The local op of a shard without planes: zeros of the local output shape, no kernel. The op
    runs on meta tensors whose empty dims (`local_sizes`: dim -> size) have size 1, and the real
    sizes go back into every output."""

    def stand_in(tensor):
        shape = [1 if dim in local_sizes and size == 0 else size for dim, size in enumerate(tensor.shape)]
        return torch.empty(shape, dtype=tensor.dtype, device="meta")

    def local_shape(meta):
        return [local_sizes.get(dim, size) for dim, size in enumerate(meta.shape)]

    def empty_planes(mesh, *args, **kwargs):
        return empty_shard_results(op, args, kwargs, stand_in=stand_in, local_shape=local_shape)

    return empty_planes


def channel_shuffle(call: OpCall) -> list[Row]:
    """`channel_shuffle(self, groups)` permutes the channels (dim 1) only: any other dim shards."""
    rows = [Row((R,), (R,))]
    return rows + [Row((Shard(d),), (Shard(d),)) for d in range(call.inputs[0].ndim) if d != 1]


# ---- grid sampling ---------------------------------------------------------------------------------


def grid_sampler(call: OpCall) -> list[Row]:
    """`grid_sampler_{2,3}d(input, grid, ...)`: the batch shards input, grid and output together; the
    channels shard input and output with the grid whole."""
    return [Row((R,), (R, R)), Row((Shard(0),), (Shard(0), Shard(0))), Row((Shard(1),), (Shard(1), R))]


def grid_sampler_backward(call: OpCall) -> list[Row]:
    """(grad_output, input, grid, ..., output_mask) -> grads of input and grid; with the channels
    sharded, each rank's grid gradient sums its channels only: Partial(sum)."""
    output_mask = call.argument("output_mask")
    return [
        Row(_masked((R, R), output_mask), (R, R, R)),
        Row(_masked((Shard(0), Shard(0)), output_mask), (Shard(0), Shard(0), Shard(0))),
        Row(_masked((Shard(1), P), output_mask), (Shard(1), Shard(1), R)),
    ]


# ---- batch norm ------------------------------------------------------------------------------------

# Per op: whether it trains (True: always, False: never, None: its `training` argument says), and
# the outputs other than the first that are per channel (the rest, a `reserve` buffer, stays whole).
_BATCH_NORM_FORWARD = {
    aten.native_batch_norm.default: (None, 2),
    aten._native_batch_norm_legit.default: (None, 2),
    aten._native_batch_norm_legit.no_stats: (None, 2),
    aten._native_batch_norm_legit_no_training.default: (False, 2),
    aten._native_batch_norm_legit_functional.default: (None, 4),
    aten._batch_norm_with_update.default: (True, 2),
    aten._batch_norm_with_update_functional.default: (True, 4),
    aten._batch_norm_no_update.default: (False, 2),
}
_UPDATES_RUNNING_STATISTICS = {
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default, aten._batch_norm_with_update.default,
}


def _training(call: OpCall, flag: bool | None) -> bool:
    return bool(call.argument("training")) if flag is None else flag


class BatchNorm(ShardingRule):
    """The batch norm forwards: the channel dim (1) of the input and output shards with weight,
    bias and the saved per-channel statistics (dim 0).

    In training the kernels update the running statistics in place (`native_batch_norm` without
    saying so in its schema, so a moved copy would never be written back): they never move. One
    sharded exactly like the channels is updated where it lies; otherwise (Replicate, the usual
    case) each rank updates its channels and an all_reduce shares them.

    Without training the CPU kernels return empty saved statistics where the meta kernels say one
    per channel: no output layout is right for both, so those calls take the replicate fallback.
    """

    __name__ = "batch_norm"

    def rows(self, call: OpCall) -> list[Row]:
        return self._rows(call, [(R,)] * len(_running_statistics(call)))

    def rows_for_layouts(self, call, layouts):
        choices = []  # per running statistic: the placements it has now, Replicate first
        for index in _running_statistics(call):
            placements = set(layouts[index].placements)
            if not placements <= {R, Shard(0)}:
                raise NotImplementedError(
                    f"{call.op} updates its running statistics in place, so they cannot move; one is "
                    f"{list(layouts[index].placements)}, and the rule updates only Replicate or Shard(0) "
                    f"ones. Distribute running_mean and running_var like that (Replicate is the usual choice)"
                )
            choices.append(tuple(sorted(placements, key=lambda placement: placement != R)))
        return self._rows(call, choices)

    def _rows(self, call: OpCall, choices: Sequence[tuple]) -> list[Row]:
        """`choices`: per running statistic updated in place, the placements it may take: the ones
        it has, so that it never moves (a Replicate one is as cheap to keep as to shard: first)."""
        training, per_channel = _BATCH_NORM_FORWARD[call.op]
        if not _training(call, training):
            raise DataDependentOutput(
                f"{call.op} without training: the CPU kernel returns empty saved statistics where the "
                f"meta kernel gives one per channel, so its output shapes are known only after it runs"
            )
        outputs = len(call.op._schema.returns)
        channel_outputs = (Shard(1),) + (Shard(0),) * per_channel + (R,) * (outputs - 1 - per_channel)
        running = _running_statistics(call)
        rows = [Row((R,) * outputs, (R,) * len(call.inputs))] if all(R in choice for choice in choices) else []
        statistic_bytes = call.inputs[0].shape[1] * call.inputs[0].dtype.itemsize
        for combination in itertools.product(*choices):
            kept = dict(zip(running, combination))
            channel_inputs = tuple(kept.get(index, Shard(0)) for index in range(1, len(call.inputs)))
            # A running statistic kept whole while the channels shard: the updated channels are all_reduced.
            shared = tuple(LocalCollective("all_reduce", statistic_bytes) for kept_placement in combination
                           if kept_placement == R)
            rows.append(Row(channel_outputs, (Shard(1),) + channel_inputs, shared))
        return rows

    def local_op(self, call, input_layouts, coordinate):
        compute = _channels_or_zeros(call.op, input_layouts[0].local_shape(coordinate))
        return self.with_running_statistics(call, input_layouts, coordinate, compute)

    def with_running_statistics(self, call, input_layouts, coordinate, compute):
        """`compute` (a local op, None for the kernel), made to update running statistics that are
        not sharded like the channels (so that rules built on this one update them alike)."""
        channels = input_layouts[0]
        channel_pieces = (channels.shard_order[1], channels.pieces[1])
        apart = tuple(
            (input_layouts[index].shard_order[0], input_layouts[index].pieces[0]) != channel_pieces
            for index in _running_statistics(call)
        )
        if not any(apart):  # running statistics sharded exactly like the channels (or nothing sharded): in place
            return compute
        running = _running_statistics(call)
        return _update_running_statistics(call.op, compute, input_layouts, running, apart, coordinate)


def _running_statistics(call: OpCall) -> tuple[int, ...]:
    """Input indices (among the DTensors) of running_mean and running_var when the op updates them."""
    training, _ = _BATCH_NORM_FORWARD[call.op]
    if call.op not in _UPDATES_RUNNING_STATISTICS or not _training(call, training):
        return ()
    names = call.input_names()
    if "running_mean" not in names or "running_var" not in names:
        return ()
    return names.index("running_mean"), names.index("running_var")


def _update_running_statistics(
    op, compute, input_layouts, running: tuple[int, ...], apart: tuple[bool, ...], coordinate
):
    """The local op when a running statistic is not sharded like the channels (`apart`): each rank
    gathers it, its kernel updates its channels, an all_reduce of the updated channels (zeros
    elsewhere) over the channels' mesh dims gives all of them, and each rank keeps its own shard."""
    channels = input_layouts[0]
    first, count = channels.local_offset(coordinate)[1], channels.local_shape(coordinate)[1]
    statistic_layouts = [input_layouts[index] for index in running]

    def update(mesh, tensor, weight, bias, running_mean, running_var, *rest):
        run = compute if compute is not None else lambda mesh, *args: op(*args)
        statistics = (running_mean, running_var)
        if mesh is None:  # shapes only
            return run(mesh, tensor, weight, bias, running_mean.new_empty(count), running_var.new_empty(count), *rest)
        local = []
        for statistic, layout, gather in zip(statistics, statistic_layouts, apart):
            replicated = layout.with_placements([R] * layout.mesh_ndim)
            if gather:
                if layout != replicated:
                    whole = redistribute_local_tensor(statistic, layout, replicated, mesh)
                else:
                    whole = statistic.clone()
                statistic_channels = whole.narrow(0, first, count)
            else:
                statistic_channels = statistic
            local.append(statistic_channels)
        results = run(mesh, tensor, weight, bias, *local, *rest)
        for statistic, layout, gather, updated_channels in zip(statistics, statistic_layouts, apart, local):
            if not gather:
                continue
            updated = statistic.new_zeros(layout.shape[0])
            updated.narrow(0, first, count).copy_(updated_channels)
            for mesh_dim in channels.shard_order[1]:
                updated = comm.all_reduce(updated, mesh, mesh_dim, reduce_op="sum")
            offset, size = layout.local_offset(coordinate)[0], layout.local_shape(coordinate)[0]
            statistic.copy_(updated.narrow(0, offset, size))
        return results

    return update


class BatchNormBackward(ShardingRule):
    """`native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
    save_invstd, train, eps, output_mask)` and `batch_norm_backward(..., update, eps, output_mask,
    reserve)`: channels shard like the forward; without training the batch shards too, and the
    weight and bias gradients are sums over it (Partial)."""

    __name__ = "batch_norm_backward"

    def rows(self, call: OpCall) -> list[Row]:
        # `train` of native_batch_norm_backward, `update` of batch_norm_backward
        training = call.argument("train" if call.op == aten.native_batch_norm_backward.default else "update")
        output_mask = call.argument("output_mask")
        reserve = (R,) * (call.op == aten.batch_norm_backward.default)
        per_channel = len(call.inputs) - 2 - len(reserve)
        rows = [
            Row(_masked((R,) * 3, output_mask), (R,) * len(call.inputs)),
            Row(_masked((Shard(1), Shard(0), Shard(0)), output_mask),
                (Shard(1), Shard(1)) + (Shard(0),) * per_channel + reserve),
        ]
        if not training:  # running statistics normalize: each sample alone
            rows.append(Row(_masked((Shard(0), P, P), output_mask),
                            (Shard(0), Shard(0)) + (R,) * per_channel + reserve))
        return rows

    def local_op(self, call, input_layouts, coordinate):
        return _channels_or_zeros(call.op, input_layouts[1].local_shape(coordinate))


def _channels_or_zeros(op, local_input_shape: Sequence[int]):
    """The kernels refuse an input without elements: a shard without channels (or batch) gets zeros
    (an empty output, empty per-channel results, zero weight and bias gradients)."""
    if all(local_input_shape[:2]):
        return None
    input_position = schema_positions(op)["input"][0]
    no_channels = local_input_shape[1] == 0

    def empty_shard(mesh, *args):
        input_ndim = args[input_position].ndim

        def stand_in(tensor):
            if tensor.ndim == input_ndim:
                shape = [max(size, 1) if dim < 2 else size for dim, size in enumerate(tensor.shape)]
                return tensor.new_empty(shape, device="meta")
            if tensor.ndim == 1 and tensor.numel() == 0 and no_channels:
                return tensor.new_empty((1,), device="meta")
            return tensor.new_empty(tensor.shape, device="meta")

        def local_shape(meta):
            if meta.ndim == input_ndim:
                return local_input_shape
            return (0,) if no_channels and meta.ndim == 1 else meta.shape

        return empty_shard_results(op, args, stand_in=stand_in, local_shape=local_shape)

    return empty_shard


# ---- registration ----------------------------------------------------------------------------------

# op name -> spatial rank: the trailing dims each op reads whole (pooling: ops/spatial_pool.py, which adds
# rows for spatially sharded inputs to these).
_PLANE_OPS = {
    "max_unpool2d": 2, "max_unpool3d": 3,
    "pixel_shuffle": 3, "pixel_unshuffle": 3,  # (*, C, H, W): channels mix with the spatial dims
    # im2col, col2im (N, C, H, W) <-> (N, C * kernel, blocks): ops/spatial_unfold.py
}
# Upsampling forwards (and their `.vec` overloads) and backwards, whose `input_size` is global.
_UPSAMPLE_OPS = {
    "upsample_nearest1d": 1, "_upsample_nearest_exact1d": 1, "upsample_linear1d": 1,
    "upsample_nearest2d": 2, "_upsample_nearest_exact2d": 2, "upsample_bilinear2d": 2, "upsample_bicubic2d": 2,
    "_upsample_bilinear2d_aa": 2, "_upsample_bicubic2d_aa": 2,
    "upsample_nearest3d": 3, "_upsample_nearest_exact3d": 3, "upsample_trilinear3d": 3,
}
# The antialiased ones keep their spatial dims whole; `ops/spatial_resample.py` registers the
# `.default` overloads and backwards of the others, with rows for spatially sharded inputs.
_PLANES_ONLY = {"_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"}

for _name, _rank in _PLANE_OPS.items():
    register_rule([getattr(aten, _name).default], PlaneRule(_name, _rank))
for _name, _rank in _UPSAMPLE_OPS.items():
    register_rule([getattr(aten, _name).vec], PlaneRule(_name, _rank))
    if _name in _PLANES_ONLY:
        register_rule([getattr(aten, _name).default], PlaneRule(_name, _rank))
        _backward = getattr(aten, _name + "_backward").default
        register_rule([_backward], PlaneRule(_name + "_backward", _rank, global_input_size=True))
register_rule([aten.channel_shuffle.default, aten.native_channel_shuffle.default], channel_shuffle)
register_rule([aten.grid_sampler_2d.default, aten.grid_sampler_3d.default], grid_sampler)
register_rule([aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default], grid_sampler_backward)
# Batch norm (BatchNorm, BatchNormBackward) is registered by spatial_norm, which extends its rows.
