"""Sharding rules: batch, group and layer norm on spatially sharded activations (domain parallelism).

A field split along its spatial dims (and often its batch on another mesh dim) normalizes with
statistics of the whole field. Each rank computes count, mean and M2 (sum of squared deviations)
of its shard per statistic (per channel for batch norm, per sample and group for group norm); one
all_reduce over the mesh dims that split the reduced dims shares them (each rank writes its own slot
of a zero buffer, so the sum is a gather), and every rank merges the slots in the same order with
Chan's formula: exact in float64, with no sum-of-squares cancellation, and equal on every rank. The
backward needs the sums of grad and grad * normalized input per channel (per sample and channel for
group norm): one all_reduce of those.

The rules extend `nn_spatial.BatchNorm` / `BatchNormBackward` and `nn.GroupNorm` (whose rows they
keep) by composition:
- batch norm in training: rows sharding the batch (sync batch norm) or a spatial dim, every per-channel
  tensor whole; the running statistics (Replicate) are updated alike on every rank, as torch does
  (unbiased variance). Without training the op is elementwise per channel: any dim but the channels
  shards with no collective (its saved statistics are empty, as the CPU kernel's are), and the
  backward is local with Partial weight and bias gradients.
- group norm: rows sharding a spatial dim; `N` and `HxW` become local. The weight and bias gradients
  come out whole along the spatial mesh dims (Partial along a batch one, as before).
- layer norm (`nn.layer_norm`'s rows kept): rows sharding a normalized dim (LayerNorm([C, H, W])),
  weight and bias sharded like it, per-sample statistics in one all_reduce. Layer norm over the
  channels of a channels-last field (or a permuted NCHW one) normalizes unsharded dims: local.
instance_norm runs batch norm on (1, N * C, ...): it needs nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import comm
from ..layout import contiguous_stride
from ..placement import Partial, Replicate, Shard
from ..rules import DataDependentOutput, LocalCollective, OpCall, Row, ShardingRule, TensorMeta, schema_positions
from .nn import GroupNorm, _masked_outputs, layer_norm, layer_norm_backward
from .nn_spatial import _BATCH_NORM_FORWARD, BatchNorm, BatchNormBackward, _channels_or_zeros, _running_statistics, _training
from .registry import aten, register_rule


R, P = Replicate(), Partial("sum")

_STATISTICS_DTYPE = torch.float64  # counts and the merge: exact counts, no cancellation


# ---- the synchronized statistics -------------------------------------------------------------------


def _bound(op, args: Sequence, kwargs: dict) -> dict:
    """The op's arguments by schema name (positional ones first)."""
    names = list(schema_positions(op))
    return {**dict(zip(names, args)), **kwargs}


def _reducing_mesh_dims(layout, dims: Sequence[int]) -> tuple[int, ...]:
    """The mesh dims that split any of `dims` of a tensor (those its statistics are reduced over)."""
    return tuple(sorted({mesh_dim for dim in dims for mesh_dim in layout.shard_order[dim]}))


def _slot(mesh_shape: Sequence[int], mesh_dims: Sequence[int], coordinate: Sequence[int]) -> tuple[int, int]:
    """(this coordinate's index among the ranks of `mesh_dims`, their number), row-major as comm flattens them."""
    index = 0
    for mesh_dim in mesh_dims:
        index = index * mesh_shape[mesh_dim] + coordinate[mesh_dim]
    return index, math.prod(mesh_shape[mesh_dim] for mesh_dim in mesh_dims)


class _Reduction:
    """Where a local op's statistics are reduced: the mesh dims (one all_reduce over all of them) and
    this rank's slot among their ranks; `mesh` None (shapes only) reduces nothing."""

    def __init__(self, layout, dims: Sequence[int], coordinate: Sequence[int]):
        self.mesh_dims = _reducing_mesh_dims(layout, dims)
        self.slot, self.slots = _slot(layout.mesh_shape, self.mesh_dims, coordinate)

    def sum(self, tensor: torch.Tensor, mesh) -> torch.Tensor:
        if mesh is None:
            return tensor
        return comm.all_reduce(tensor, mesh, self.mesh_dims, reduce_op="sum")

    def merged_moments(self, grouped: torch.Tensor, dims: tuple[int, ...], mesh) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, biased variance) over `dims` of the whole tensor whose shard is `grouped`, kept dims
        of size 1, in float64: local moments, one all_reduce of every rank's slot, Chan's merge."""
        count = math.prod(grouped.shape[dim] for dim in dims)
        if count:
            variance, mean = torch.var_mean(grouped, dims, correction=0, keepdim=True)
            mean, squares = mean.to(_STATISTICS_DTYPE), variance.to(_STATISTICS_DTYPE) * count
        else:  # an empty shard contributes nothing (var_mean would give NaN)
            shape = [1 if dim in dims else size for dim, size in enumerate(grouped.shape)]
            mean = squares = torch.zeros(shape, dtype=_STATISTICS_DTYPE, device=grouped.device)
        local = torch.stack([torch.full_like(mean, count), mean, squares])
        if mesh is None:
            return mean, squares / max(count, 1)
        slots = local.new_zeros((self.slots, *local.shape))
        slots[self.slot] = local
        slots = comm.all_reduce(slots, mesh, self.mesh_dims, reduce_op="sum")
        total, mean, squares = slots[0].unbind(0)
        for part in slots[1:]:
            part_count, part_mean, part_squares = part.unbind(0)
            merged = total + part_count
            share = torch.where(merged > 0, part_count / merged.clamp(min=1), 0)
            delta = part_mean - mean
            mean = mean + delta * share
            squares = squares + part_squares + delta * delta * total * share
            total = merged
        return mean, squares / total.clamp(min=1)


def _grouped(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    """(N, C, *spatial) viewed as (N, groups, C // groups, spatial positions); sizes given in full,
    since a shard may be empty (no samples, rows or channels) and still joins the all_reduce."""
    per_group = tensor.size(1) // groups if groups else 0
    return tensor.reshape(tensor.size(0), groups, per_group, math.prod(tensor.shape[2:]))


def _per_channel(tensor: torch.Tensor | None, grouped: torch.Tensor) -> torch.Tensor | None:
    """A (C,) tensor shaped to broadcast against `grouped` (N, G, D, S)."""
    return None if tensor is None else tensor.reshape(1, grouped.size(1), grouped.size(2), 1)


def _normalize(tensor, groups, mean, inverse_std, weight, bias) -> torch.Tensor:
    """(x - mean) * inverse_std * weight + bias, the statistics keyed by the grouped view's dims."""
    grouped = _grouped(tensor, groups)
    normalized = (grouped - mean.to(tensor.dtype)) * inverse_std.to(tensor.dtype)
    if weight is not None:
        normalized = normalized * _per_channel(weight, grouped)
    if bias is not None:
        normalized = normalized + _per_channel(bias, grouped)
    return normalized.reshape(tensor.shape)


def _normalize_backward(reduction: _Reduction, mesh, grad, tensor, groups, mean, inverse_std, weight,
                        sum_dims: tuple[int, ...], count: int, output_mask):
    """(grad_input, grad_weight, grad_bias) of `_normalize` with statistics over `count` elements.

    The sums of grad and grad * normalized over `sum_dims` of the grouped view (every dim but the
    channel for batch norm, the spatial one for group norm, per sample and channel) are all_reduced
    in one collective (accumulated in float64, as small as the statistics); the rest is local.
    """
    grouped_grad = _grouped(grad, groups)
    grouped = _grouped(tensor, groups)
    mean, inverse_std = mean.to(tensor.dtype), inverse_std.to(tensor.dtype)
    normalized = (grouped - mean) * inverse_std
    sums = torch.stack([grouped_grad.sum(sum_dims, keepdim=True, dtype=_STATISTICS_DTYPE),
                        (grouped_grad * normalized).sum(sum_dims, keepdim=True, dtype=_STATISTICS_DTYPE)])
    grad_sum, grad_normalized_sum = reduction.sum(sums, mesh).to(tensor.dtype).unbind(0)
    channel_weight = _per_channel(weight, grouped) if weight is not None else torch.ones_like(grad_sum[:1, :, :, :1])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        # Per statistic: the mean of grad * weight and of grad * weight * normalized over its elements.
        mean_grad = (channel_weight * grad_sum).sum(2, keepdim=True) / count
        mean_grad_normalized = (channel_weight * grad_normalized_sum).sum(2, keepdim=True) / count
        grad_input = inverse_std * (grouped_grad * channel_weight - mean_grad - normalized * mean_grad_normalized)
        grad_input = grad_input.reshape(tensor.shape)
    if output_mask[1]:
        grad_weight = grad_normalized_sum.sum(0).reshape(-1)
    if output_mask[2]:
        grad_bias = grad_sum.sum(0).reshape(-1)
    return grad_input, grad_weight, grad_bias


def _synchronized_row(outputs: Sequence, inputs: Sequence, statistic_bytes: int) -> Row:
    return Row(tuple(outputs), tuple(inputs), (LocalCollective("all_reduce", statistic_bytes),))


# ---- batch norm ------------------------------------------------------------------------------------


def _reduced_dims(ndim: int) -> list[int]:
    """Batch norm's statistics reduce every dim but the channels (1)."""
    return [dim for dim in range(ndim) if dim != 1]


class SpatialBatchNorm(ShardingRule):
    """The batch norm forwards: `BatchNorm`'s rows (channels sharded), and rows sharding the batch or
    a spatial dim with every per-channel tensor whole, the statistics merged in one all_reduce."""

    __name__ = "batch_norm"

    def __init__(self):
        self.channels = BatchNorm()

    def rows(self, call: OpCall) -> list[Row]:
        return self.rows_for_layouts(call, None)

    def rows_for_layouts(self, call, layouts):
        training, _ = _BATCH_NORM_FORWARD[call.op]
        if not _training(call, training):
            return self._evaluation_rows(call)
        rows = list(self.channels.rows(call) if layouts is None else self.channels.rows_for_layouts(call, layouts))
        running = _running_statistics(call)
        if layouts is not None and any(R not in layouts[index].placements for index in running):
            return rows  # running statistics sharded on every mesh dim stay with the channels' rows
        meta = call.inputs[0]
        outputs = len(call.op._schema.returns)
        # A rank's count, mean and M2 per channel in float64 (its slot; the buffer holds one per rank).
        statistic_bytes = 3 * meta.shape[1] * _STATISTICS_DTYPE.itemsize
        for dim in _reduced_dims(meta.ndim):
            rows.append(_synchronized_row((Shard(dim),) + (R,) * (outputs - 1),
                                          (Shard(dim),) + (R,) * (len(call.inputs) - 1), statistic_bytes))
        return rows

    @staticmethod
    def _evaluation_rows(call: OpCall) -> list[Row]:
        """Without training each channel is scaled and shifted by running statistics: elementwise. The
        saved statistics are empty (the CPU kernels'), so Replicate."""
        if call.op not in _EVALUATES:
            raise DataDependentOutput(f"{call.op} without training has no spatial rule; it takes the fallback")
        outputs, per_channel = len(call.op._schema.returns), len(call.inputs) - 1
        rows = [Row((R,) * outputs, (R,) * len(call.inputs)),
                Row((Shard(1),) + (R,) * (outputs - 1), (Shard(1),) + (Shard(0),) * per_channel)]
        return rows + [Row((Shard(dim),) + (R,) * (outputs - 1), (Shard(dim),) + (R,) * per_channel)
                       for dim in _reduced_dims(call.inputs[0].ndim)]

    def global_outputs(self, call: OpCall) -> list[TensorMeta | None]:
        metas = super().global_outputs(call)
        training, _ = _BATCH_NORM_FORWARD[call.op]
        if _training(call, training):
            return metas
        return [metas[0]] + [TensorMeta((0,), (1,), meta.dtype) for meta in metas[1:3]] + metas[3:]

    def local_op(self, call, input_layouts, coordinate):
        training, _ = _BATCH_NORM_FORWARD[call.op]
        if not _training(call, training):
            return _evaluation(call.op, input_layouts[0].local_shape(coordinate))
        reduction = _Reduction(input_layouts[0], _reduced_dims(call.inputs[0].ndim), coordinate)
        if not reduction.mesh_dims:
            return self.channels.local_op(call, input_layouts, coordinate)
        compute = _synchronized_batch_norm(call, reduction)
        return self.channels.with_running_statistics(call, input_layouts, coordinate, compute)


# Batch norm overloads whose evaluation (no training) rows `SpatialBatchNorm` gives: out, 2 saved statistics[, reserve].
_EVALUATES = {
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default, aten._batch_norm_no_update.default,
}


def _evaluation(op, local_input_shape: Sequence[int]):
    """The kernel on the shard (zeros for a shard without channels or batch), its saved statistics empty."""
    compute = _channels_or_zeros(op, local_input_shape) or (lambda mesh, *args, **kwargs: op(*args, **kwargs))

    def evaluate(mesh, *args, **kwargs):
        results = compute(mesh, *args, **kwargs)
        output = results[0]
        empty = output.new_empty((0,), dtype=results[1].dtype)
        return (output, empty, empty.clone(), *results[3:])

    return evaluate


def _synchronized_batch_norm(call: OpCall, reduction: _Reduction):
    """The training forward on a batch- or spatially sharded shard: merged statistics, normalized
    output, saved mean and inverse std, running statistics updated in place like torch's kernel."""
    op = call.op
    metas = call.global_output_metas()  # dtypes: a bfloat16 input saves float statistics
    count = math.prod(call.inputs[0].shape) // call.inputs[0].shape[1]
    extra_outputs = metas[3:]

    def batch_norm(mesh, *args, **kwargs):
        arguments = _bound(op, args, kwargs)
        tensor, weight, bias = arguments["input"], arguments.get("weight"), arguments.get("bias")
        channels = tensor.size(1)
        grouped = _grouped(tensor, channels)
        mean, variance = reduction.merged_moments(grouped, (0, 2, 3), mesh)
        inverse_std = (variance + arguments["eps"]).rsqrt()
        output = _normalize(tensor, channels, mean, inverse_std, weight, bias)
        running_mean, running_var = arguments.get("running_mean"), arguments.get("running_var")
        momentum = arguments.get("momentum")
        if mesh is not None and running_mean is not None and running_var is not None:
            unbiased = variance * (count / max(count - 1, 1)) if count > 1 else torch.full_like(variance, math.nan)
            for running, value in ((running_mean, mean), (running_var, unbiased)):
                updated = running * (1 - momentum) + value.reshape(-1).to(running.dtype) * momentum
                running.copy_(updated)
        saved = [mean.reshape(-1).to(metas[1].dtype), inverse_std.reshape(-1).to(metas[2].dtype)]
        rest = [tensor.new_empty(meta.shape, dtype=meta.dtype) for meta in extra_outputs]
        return (output, *saved, *rest)

    return batch_norm


class SpatialBatchNormBackward(ShardingRule):
    """`BatchNormBackward`'s rows, and rows sharding the batch or a spatial dim: in training the grad
    sums are all_reduced once and every gradient of a per-channel tensor is whole; without training
    the backward is local and the weight and bias gradients are Partial."""

    __name__ = "batch_norm_backward"

    def __init__(self):
        self.channels = BatchNormBackward()

    def rows(self, call: OpCall) -> list[Row]:
        rows = list(self.channels.rows(call))
        output_mask = call.argument("output_mask")
        reserve = (R,) * (call.op == aten.batch_norm_backward.default)
        per_channel = (R,) * (len(call.inputs) - 2 - len(reserve))
        meta = call.inputs[1]
        for dim in _reduced_dims(meta.ndim):
            inputs = (Shard(dim), Shard(dim)) + per_channel + reserve
            if self._training(call):
                statistic_bytes = 2 * meta.shape[1] * _STATISTICS_DTYPE.itemsize
                rows.append(_synchronized_row(_masked_outputs((Shard(dim), R, R), output_mask), inputs, statistic_bytes))
            elif dim != 0:  # the batch row is BatchNormBackward's
                rows.append(Row(_masked_outputs((Shard(dim), P, P), output_mask), inputs))
        return rows

    @staticmethod
    def _training(call: OpCall) -> bool:
        return bool(call.argument("train" if call.op == aten.native_batch_norm_backward.default else "update"))

    def local_op(self, call, input_layouts, coordinate):
        reduction = _Reduction(input_layouts[1], _reduced_dims(call.inputs[1].ndim), coordinate)
        if not self._training(call) or not reduction.mesh_dims:
            return self.channels.local_op(call, input_layouts, coordinate)
        op = call.op
        count = math.prod(call.inputs[1].shape) // call.inputs[1].shape[1]

        def batch_norm_backward(mesh, *args, **kwargs):
            arguments = _bound(op, args, kwargs)
            tensor = arguments["input"]
            channels = tensor.size(1)
            statistic_shape = (1, channels, 1, 1)
            mean = arguments["save_mean"].reshape(statistic_shape)
            inverse_std = arguments["save_invstd" if "save_invstd" in arguments else "save_var"].reshape(statistic_shape)
            return _normalize_backward(reduction, mesh, arguments["grad_out"], tensor, channels, mean, inverse_std,
                                       arguments.get("weight"), (0, 2, 3), count, arguments["output_mask"])

        return batch_norm_backward


# ---- group norm ------------------------------------------------------------------------------------


class SpatialGroupNorm(ShardingRule):
    """`native_group_norm(input, weight, bias, N, C, HxW, group, eps)` and its backward: `GroupNorm`'s
    rows (batch), and rows sharding a spatial dim, whose statistics per sample and group (forward) or
    grad sums per sample and channel (backward) are all_reduced once; `N` and `HxW` become local.

    `tensors` is the number of leading input-shaped tensors (forward 1; backward grad, input, mean, rstd).
    """

    def __init__(self, name: str, tensors: int, backward: bool):
        self.batch = GroupNorm(name, tensors, backward)
        self.__name__, self.backward = name, backward
        self.field_tensors = 1 + backward  # input-shaped: input; grad_out and input

    def rows(self, call: OpCall) -> list[Row]:
        rows = list(self.batch.rows(call))
        meta = call.inputs[self.field_tensors - 1]
        samples, channels = meta.shape[0], meta.shape[1]
        if self.backward:
            outputs = _masked_outputs((None, R, R), call.argument("output_mask"))
            statistic_bytes = 2 * samples * channels * _STATISTICS_DTYPE.itemsize
        else:
            outputs = (None, R, R)
            statistic_bytes = 3 * samples * call.argument("group") * _STATISTICS_DTYPE.itemsize  # a rank's slot
        others = (R,) * (len(call.inputs) - self.field_tensors)
        for dim in range(2, meta.ndim):
            placements = tuple(Shard(dim) if placement is None else placement for placement in outputs)
            rows.append(_synchronized_row(placements, (Shard(dim),) * self.field_tensors + others, statistic_bytes))
        return rows

    def local_arguments(self, call, input_layouts, coordinate):
        local_shape = input_layouts[self.field_tensors - 1].local_shape(coordinate)
        return call.with_arguments(N=local_shape[0], HxW=math.prod(local_shape[2:]))

    def local_op(self, call, input_layouts, coordinate):
        layout = input_layouts[self.field_tensors - 1]
        reduction = _Reduction(layout, range(2, layout.ndim), coordinate)
        if not reduction.mesh_dims:
            return self.batch.local_op(call, input_layouts, coordinate)
        op, group = call.op, call.argument("group")
        meta = call.inputs[self.field_tensors - 1]
        count = meta.shape[1] // group * math.prod(meta.shape[2:])

        def group_norm(mesh, *args, **kwargs):
            arguments = _bound(op, args, kwargs)
            tensor, weight = arguments["input"], arguments.get("weight")
            mean, variance = reduction.merged_moments(_grouped(tensor, group), (2, 3), mesh)
            inverse_std = (variance + arguments["eps"]).rsqrt()
            output = _normalize(tensor, group, mean, inverse_std, weight, arguments.get("bias"))
            statistic_shape = (tensor.size(0), group)
            return output, mean.reshape(statistic_shape).to(tensor.dtype), inverse_std.reshape(statistic_shape).to(tensor.dtype)

        def group_norm_backward(mesh, *args, **kwargs):
            arguments = _bound(op, args, kwargs)
            tensor = arguments["input"]
            statistic_shape = (tensor.size(0), group, 1, 1)
            mean, inverse_std = arguments["mean"].reshape(statistic_shape), arguments["rstd"].reshape(statistic_shape)
            return _normalize_backward(reduction, mesh, arguments["grad_out"].contiguous(), tensor, group, mean,
                                       inverse_std, arguments.get("weight"), (3,), count, arguments["output_mask"])

        return group_norm_backward if self.backward else group_norm


# ---- layer norm ------------------------------------------------------------------------------------

_LAYER_NORM_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float32,
                      torch.float64: torch.float64}  # input dtype -> the statistics' on meta tensors


def _layer_norm_outputs(arguments: tuple[tuple, dict], local_inputs: Sequence[TensorMeta] | None = None):
    """(out, mean, rstd) metadata of `native_layer_norm` on meta tensors, without running torch's
    meta kernel (a Python decomposition of ~10 ops, ~0.5 ms a call; a first call on a new shape ran it
    up to four times). Only for contiguous floating inputs and parameters of the input's dtype and
    shape (checked against torch's kernel in tests); None otherwise: the meta kernel decides, and
    raises torch's errors. `local_inputs` replace the placeholders in order, as in `run_on_meta`."""
    bound = _bound(aten.native_layer_norm.default, *arguments)
    tensors = [bound.get(name) for name in ("input", "weight", "bias")]
    if local_inputs is not None:
        queue = iter(local_inputs)
        tensors = [next(queue) if isinstance(meta, TensorMeta) else meta for meta in tensors]
    tensor, normalized = tensors[0], tuple(bound["normalized_shape"])
    for meta in tensors:
        if meta is not None and (not isinstance(meta, TensorMeta) or meta.stride != contiguous_stride(meta.shape)):
            return None
    if tensor is None or tensor.dtype not in _LAYER_NORM_DTYPES or not normalized \
            or tensor.shape[tensor.ndim - len(normalized):] != normalized:
        return None
    if any(meta is not None and (meta.shape != normalized or meta.dtype != tensor.dtype) for meta in tensors[1:]):
        return None
    statistics_dtype = _LAYER_NORM_DTYPES[tensor.dtype]
    statistics_shape = tensor.shape[: tensor.ndim - len(normalized)] + (1,) * len(normalized)
    statistics = TensorMeta(statistics_shape, contiguous_stride(statistics_shape), statistics_dtype)
    return [tensor, statistics, statistics]


class SpatialLayerNorm(ShardingRule):
    """`native_layer_norm(input, normalized_shape, weight, bias, eps)` and its backward: `nn`'s rows
    (batch dims), and rows sharding a normalized dim (LayerNorm([C, H, W]) on a split field) with
    weight and bias sharded alike; per-sample statistics (forward) or grad sums (backward) are
    all_reduced once, the weight and bias gradients stay sharded like them. `normalized_shape`
    becomes local.
    """

    def __init__(self, name: str, rows, backward: bool):
        self.__name__, self.batch_rows, self.backward = name, rows, backward
        self.field_tensors = 1 + backward  # input; grad_out and input

    def _batch_dims(self, call: OpCall) -> int:
        return call.inputs[self.field_tensors - 1].ndim - len(call.argument("normalized_shape"))

    def rows(self, call: OpCall) -> list[Row]:
        rows = list(self.batch_rows(call))
        meta, batch_dims = call.inputs[self.field_tensors - 1], self._batch_dims(call)
        samples = math.prod(meta.shape[:batch_dims])
        parameters = len(call.inputs) - self.field_tensors - 2 * self.backward  # weight, bias (after mean, rstd)
        for dim in range(batch_dims, meta.ndim):
            shards = (Shard(dim),) * self.field_tensors + (R, R) * self.backward + (Shard(dim - batch_dims),) * parameters
            if self.backward:
                outputs = _masked_outputs((Shard(dim),) + (Shard(dim - batch_dims),) * 2, call.argument("output_mask"))
                rows.append(_synchronized_row(outputs, shards, 2 * samples * _STATISTICS_DTYPE.itemsize))
            else:
                rows.append(_synchronized_row((Shard(dim), R, R), shards, 3 * samples * _STATISTICS_DTYPE.itemsize))
        return rows

    def local_arguments(self, call, input_layouts, coordinate):
        local_shape = input_layouts[self.field_tensors - 1].local_shape(coordinate)
        return call.with_arguments(normalized_shape=list(local_shape[self._batch_dims(call):]))

    def global_outputs(self, call: OpCall) -> list[TensorMeta | None]:
        found = None if self.backward else _layer_norm_outputs((call.args, dict(call.kwargs)))
        return found or super().global_outputs(call)

    def local_output_shapes(self, op, arguments, local_inputs) -> list:
        """The forward's local op (native or synchronized) gives `native_layer_norm`'s shapes on the
        local arguments (its `normalized_shape` made local)."""
        found = None if self.backward else _layer_norm_outputs(arguments, local_inputs)
        if found is None:
            return super().local_output_shapes(op, arguments, local_inputs)
        return [meta.shape for meta in found]

    def local_op(self, call, input_layouts, coordinate):
        batch_dims = self._batch_dims(call)
        layout = input_layouts[self.field_tensors - 1]
        reduction = _Reduction(layout, range(batch_dims, layout.ndim), coordinate)
        if not reduction.mesh_dims:
            return None
        op, metas = call.op, self.global_outputs(call)
        count = math.prod(call.inputs[self.field_tensors - 1].shape[batch_dims:])

        def flat(tensor):  # (samples, 1, 1, normalized elements): one statistic per sample
            return tensor.reshape(math.prod(tensor.shape[:batch_dims]), 1, 1, math.prod(tensor.shape[batch_dims:]))

        def layer_norm(mesh, *args, **kwargs):
            arguments = _bound(op, args, kwargs)
            tensor, weight, bias = arguments["input"], arguments.get("weight"), arguments.get("bias")
            mean, variance = reduction.merged_moments(flat(tensor), (2, 3), mesh)
            inverse_std = (variance + arguments["eps"]).rsqrt()
            output = ((flat(tensor) - mean.to(tensor.dtype)) * inverse_std.to(tensor.dtype)).reshape(tensor.shape)
            output = output * weight if weight is not None else output
            output = output + bias if bias is not None else output
            statistic_shape = (*tensor.shape[:batch_dims], *(1,) * (tensor.ndim - batch_dims))
            return (output, mean.reshape(statistic_shape).to(metas[1].dtype),
                    inverse_std.reshape(statistic_shape).to(metas[2].dtype))

        def layer_norm_backward(mesh, *args, **kwargs):
            arguments = _bound(op, args, kwargs)
            grad, tensor, weight = arguments["grad_out"], arguments["input"], arguments.get("weight")
            normalized = (tensor - arguments["mean"]) * arguments["rstd"]
            weighted = grad * weight if weight is not None else grad
            dims = tuple(range(batch_dims, tensor.ndim))
            sums = torch.stack([weighted.sum(dims, keepdim=True, dtype=_STATISTICS_DTYPE),
                                (weighted * normalized).sum(dims, keepdim=True, dtype=_STATISTICS_DTYPE)])
            weighted_sum, weighted_normalized_sum = reduction.sum(sums, mesh).to(tensor.dtype).unbind(0)
            output_mask, batch = arguments["output_mask"], tuple(range(batch_dims))
            grad_input = grad_weight = grad_bias = None
            if output_mask[0]:
                grad_input = arguments["rstd"] * (weighted - weighted_sum / count - normalized * weighted_normalized_sum / count)
            if output_mask[1]:
                grad_weight = (grad * normalized).sum(batch) if batch else grad * normalized
            if output_mask[2]:
                grad_bias = grad.sum(batch) if batch else grad.clone()
            return grad_input, grad_weight, grad_bias

        return layer_norm_backward if self.backward else layer_norm


register_rule(list(_BATCH_NORM_FORWARD), SpatialBatchNorm())
register_rule([aten.native_batch_norm_backward.default, aten.batch_norm_backward.default], SpatialBatchNormBackward())
register_rule([aten.native_group_norm.default], SpatialGroupNorm("group_norm", 1, backward=False))
register_rule([aten.native_group_norm_backward.default], SpatialGroupNorm("group_norm_backward", 4, backward=True))
register_rule([aten.native_layer_norm.default], SpatialLayerNorm("layer_norm", layer_norm, backward=False))
register_rule([aten.native_layer_norm_backward.default], SpatialLayerNorm("layer_norm_backward", layer_norm_backward, backward=True))
