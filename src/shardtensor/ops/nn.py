"""Sharding rules: nn ops (softmax, norms, embedding, nll_loss, convolution; attention is `ops/attention.py`).

These are the aten ops that `torch.nn.functional` reaches on CPU, forward and backward. Most keep a
Shard on the dims the op treats independently (batch, heads, non-softmax dims) and give Partial(sum)
for parameter gradients summed over a sharded batch. Three compute differently from the global op
on their shards (`ShardingRule.local_op`):
- softmax / log_softmax over a sharded dim: max and sum of exponentials reduced across the shards
  (two small all_reduces instead of gathering the input);
- embedding with a vocab-sharded table: indices outside this rank's rows give zeros, the output is
  Partial(sum); its backward writes only this rank's rows;
- nll_loss: with a sharded batch and reduction='mean' the local sum is divided by the global total
  weight (exact for any batch size); with a sharded class dim the picked values are masked.
The rows that communicate inside their local op declare it (`Row.collectives`): the cost of the row
counts it, and `explicit_communication()` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from ..rules import LocalCollective, OpCall, Row, ShardingRule, TensorMeta
from .common import dim_argument, on_shards
from .index_checks import IndexArgument, with_index_checks
from .registry import aten, register_rule


R, P = Replicate(), Partial("sum")

_NONE, _MEAN, _SUM = 0, 1, 2  # nll_loss reductions


def _masked_outputs(outputs: Sequence, output_mask: Sequence[bool]) -> tuple:
    """Rows name tensor outputs only: drop the outputs that `output_mask` turns off (None results)."""
    return tuple(placement for placement, wanted in zip(outputs, output_mask) if wanted)


def _sharding_mesh_dims(layout: Layout, dim: int) -> tuple[int, ...]:
    return layout.shard_order[dim]


def _all_reduce(tensor: torch.Tensor, mesh, mesh_dims: Sequence[int], reduce_op: str) -> torch.Tensor:
    for mesh_dim in mesh_dims:
        tensor = comm.all_reduce(tensor, mesh, mesh_dim, reduce_op=reduce_op)
    return tensor


# ---- softmax / log_softmax -------------------------------------------------------------------------


class Softmax(ShardingRule):
    """`_softmax`/`_log_softmax` and their backward: any dim but `dim` stays sharded; a sharded
    `dim` is computed in place with all_reduced max and sum (last row, used when the input is there).

    `inputs` is 1 for the forward (self, dim, ...) and 2 for the backward (grad, output, dim, ...).
    """

    def __init__(self, name: str, log: bool, backward: bool):
        self.__name__, self.log, self.backward = name, log, backward

    def rows(self, call: OpCall) -> list[Row]:
        ndim, inputs = call.inputs[0].ndim, len(call.inputs)
        dim = dim_argument(call)
        rows = [Row((R,), (R,) * inputs)]
        rows += [Row((Shard(d),), (Shard(d),) * inputs) for d in range(ndim) if d != dim]
        if ndim:
            meta = call.inputs[0]
            reduced_bytes = math.prod(meta.shape) // max(meta.shape[dim], 1) * meta.dtype.itemsize
            # Forward: the row maxima and the sums of exponentials; backward: one sum.
            reductions = (LocalCollective("all_reduce", reduced_bytes),) * (1 if self.backward else 2)
            rows.append(Row((Shard(dim),), (Shard(dim),) * inputs, reductions))
        return rows

    def local_op(self, call, input_layouts, coordinate):
        dim = dim_argument(call)
        mesh_dims = _sharding_mesh_dims(input_layouts[0], dim) if call.inputs[0].ndim else ()
        if not mesh_dims:
            return None
        log, backward = self.log, self.backward

        def forward(mesh, tensor, dim, *rest):
            if tensor.size(dim):
                maximum = tensor.amax(dim, keepdim=True)
            else:
                maximum = torch.full_like(tensor.sum(dim, keepdim=True), -float("inf"))
            maximum = _all_reduce(maximum, mesh, mesh_dims, "max")
            shifted = tensor - maximum
            total = _all_reduce(shifted.exp().sum(dim, keepdim=True), mesh, mesh_dims, "sum")
            return shifted - total.log() if log else shifted.exp() / total

        def gradient(mesh, grad, output, dim, input_dtype):
            if log:
                total = _all_reduce(grad.sum(dim, keepdim=True), mesh, mesh_dims, "sum")
                return (grad - output.exp() * total).to(input_dtype)
            total = _all_reduce((grad * output).sum(dim, keepdim=True), mesh, mesh_dims, "sum")
            return (output * (grad - total)).to(input_dtype)

        return on_shards(call.op, gradient if backward else forward)


# ---- normalization ---------------------------------------------------------------------------------


def layer_norm(call: OpCall) -> list[Row]:
    """`native_layer_norm(input, normalized_shape, weight, bias, eps)` -> (out, mean, rstd): batch dims only."""
    batch_dims = call.inputs[0].ndim - len(call.argument("normalized_shape"))
    parameters = (R,) * (len(call.inputs) - 1)
    rows = [Row((R,) * 3, (R,) + parameters)]
    return rows + [Row((Shard(d),) * 3, (Shard(d),) + parameters) for d in range(batch_dims)]


def layer_norm_backward(call: OpCall) -> list[Row]:
    """(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask): weight/bias grads sum over the batch.

    Every gradient is linear in grad_out for given input, statistics and weight, so a Partial
    grad_out (the input gradient of a row-parallel linear) gives Partial gradients without a
    collective: the Megatron block's single backward reduction can come later, on fewer bytes.
    """
    batch_dims = call.inputs[1].ndim - len(call.argument("normalized_shape"))
    parameters = (R,) * (len(call.inputs) - 4)
    output_mask = call.argument("output_mask")
    rows = [Row(_masked_outputs((R,) * 3, output_mask), (R,) * len(call.inputs))]
    for d in range(batch_dims):
        outputs = _masked_outputs((Shard(d), P, P), output_mask)
        rows.append(Row(outputs, (Shard(d),) * 4 + parameters))
    for reduce_op in ("sum", "avg"):
        partial = Partial(reduce_op)
        rows.append(Row(_masked_outputs((partial,) * 3, output_mask), (partial,) + (R,) * 3 + parameters))
    return rows


class GroupNorm(ShardingRule):
    """`native_group_norm` and its backward, sharded on the batch; the argument N becomes local.

    `tensors` is the number of leading batch-shaped tensors.
    """

    def __init__(self, name: str, tensors: int, backward: bool):
        self.__name__, self.tensors, self.backward = name, tensors, backward

    def rows(self, call: OpCall) -> list[Row]:
        parameters = (R,) * (len(call.inputs) - self.tensors)
        if self.backward:
            output_mask = call.argument("output_mask")
            replicated = _masked_outputs((R,) * 3, output_mask)
            sharded = _masked_outputs((Shard(0), P, P), output_mask)
        else:
            replicated, sharded = (R,) * 3, (Shard(0),) * 3
        return [Row(replicated, (R,) * len(call.inputs)), Row(sharded, (Shard(0),) * self.tensors + parameters)]

    def local_arguments(self, call, input_layouts, coordinate):
        return call.with_arguments(N=input_layouts[self.tensors - 1].local_shape(coordinate)[0])

    def local_op(self, call, input_layouts, coordinate):
        """The CPU kernels read their tensors as contiguous without checking; autograd's `.contiguous()`
        sees the wrapper's strides, not the shard's (an expanded gradient has stride 0: garbage)."""
        op = call.op

        def contiguous_shards(mesh, *args):
            return op(*(arg.contiguous() if isinstance(arg, torch.Tensor) else arg for arg in args))

        return contiguous_shards


# ---- embedding ---------------------------------------------------------------------------------------


# Index arguments checked on every rank alike before the local op (`index_checks`).
_TABLE_ROWS = (IndexArgument("indices", indexes="weight", dim=0),)
_TARGET_CLASSES = (IndexArgument("target", dim=-1, ignore="ignore_index"),)


def _vocabulary_range(layout: Layout, coordinate) -> tuple[int, int] | None:
    """(first row, rows) of a table sharded on dim 0 at `coordinate`; None when dim 0 is whole."""
    if not layout.shard_order[0]:
        return None
    return layout.local_offset(coordinate)[0], layout.local_shape(coordinate)[0]


class Embedding(ShardingRule):
    """`embedding(weight, indices, ...)`: batch-sharded indices, or a sharded table.

    A table sharded on the embedding dim gives outputs sharded on their last dim; a table sharded on
    the vocabulary (dim 0) with replicated indices looks up only its own rows, zeros elsewhere, and
    the output is Partial(sum): no rank gathers the table. An index out of range raises on every
    rank alike, whichever shard holds it (`index_checks`).
    """

    __name__ = "embedding"

    def rows(self, call: OpCall) -> list[Row]:
        weight, indices = call.inputs
        rows = [Row((R,), (R, R))]
        rows += [Row((Shard(d),), (R, Shard(d))) for d in range(indices.ndim)]
        return rows + [Row((Shard(indices.ndim),), (Shard(1), R)), Row((P,), (Shard(0), R))]

    def local_op(self, call, input_layouts, coordinate):
        return with_index_checks(self._masked_local_op(call, input_layouts, coordinate), call, input_layouts, _TABLE_ROWS)

    @staticmethod
    def _masked_local_op(call, input_layouts, coordinate):
        vocabulary = _vocabulary_range(input_layouts[0], coordinate)
        if vocabulary is None:
            return None
        first, rows = vocabulary

        def masked_embedding(mesh, weight, indices, *rest):
            local = indices - first
            outside = (local < 0) | (local >= rows)
            if rows == 0:
                return weight.new_zeros((*indices.shape, weight.size(1)))
            result = aten.embedding(weight, local.masked_fill(outside, 0))
            return result.masked_fill_(outside.unsqueeze(-1), 0)

        return on_shards(call.op, masked_embedding)


class EmbeddingBackward(ShardingRule):
    """`embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)`.

    Replicated inputs give a vocab-sharded gradient (each rank writes only its rows, the layout a
    vocab-sharded table wants); batch-sharded ones a Partial(sum) gradient; a gradient sharded on
    the embedding dim a table gradient sharded on dim 1.
    """

    __name__ = "embedding_dense_backward"

    def rows(self, call: OpCall) -> list[Row]:
        grad, indices = call.inputs
        rows = [Row((Shard(0),), (R, R)), Row((P,), (P, R))]
        rows += [Row((P,), (Shard(d), Shard(d))) for d in range(indices.ndim)]
        return rows + [Row((Shard(1),), (Shard(grad.ndim - 1), R))]

    def _table_layout(self, call, input_layouts) -> Layout:
        """Replicated grad and indices on a mesh dim mean Shard(0) of the table there (unique row)."""
        grad, indices = input_layouts
        placements = [
            Shard(0) if isinstance(g, Replicate) and isinstance(i, Replicate) else R
            for g, i in zip(grad.placements, indices.placements)
        ]
        return Layout.create(grad.mesh_shape, placements, (call.argument("num_weights"), call.inputs[0].shape[-1]))

    def local_arguments(self, call, input_layouts, coordinate):
        return call.with_arguments(num_weights=self._table_layout(call, input_layouts).local_shape(coordinate)[0])

    def local_op(self, call, input_layouts, coordinate):
        vocabulary = _vocabulary_range(self._table_layout(call, input_layouts), coordinate)
        if vocabulary is None:
            return None
        first, rows = vocabulary

        def masked_backward(mesh, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
            local = indices - first
            outside = (local < 0) | (local >= rows)
            local_padding = padding_idx - first if padding_idx >= 0 and 0 <= padding_idx - first < rows else -1
            # Indices of other ranks go to one extra row, dropped afterwards.
            result = aten.embedding_dense_backward(
                grad, local.masked_fill(outside, rows), rows + 1, local_padding, scale_grad_by_freq
            )
            return result[:rows].contiguous()

        return on_shards(call.op, masked_backward)


# ---- nll_loss -------------------------------------------------------------------------------------


def _has_weight(call: OpCall) -> bool:
    return isinstance(call.argument("weight"), TensorMeta)


class NllLoss(ShardingRule):
    """`nll_loss_forward(self, target, weight, reduction, ignore_index)` -> (output, total_weight).

    Batch-sharded (N, C) input: 'none' stays sharded, 'sum' is Partial, 'mean' divides each rank's
    sum by the all_reduced total weight (Partial, exact for any batch size). Class-sharded input with
    replicated targets (vocab-parallel loss): each rank picks the targets in its class range. A
    target out of range raises on every rank alike (`index_checks`).
    """

    __name__ = "nll_loss_forward"

    def rows(self, call: OpCall) -> list[Row]:
        weight = (R,) * _has_weight(call)
        reduction = call.argument("reduction")
        rows = [Row((R, R), (R, R) + weight)]
        if call.inputs[0].ndim != 2:
            return rows
        batch_output = {_NONE: (Shard(0), R), _SUM: (P, P), _MEAN: (P, R)}[reduction]
        # 'mean' over a sharded batch divides by the all_reduced total weight (a scalar).
        total_weight = (LocalCollective("all_reduce", call.inputs[0].dtype.itemsize),) * (reduction == _MEAN)
        rows.append(Row(batch_output, (Shard(0), Shard(0)) + weight, total_weight))
        return rows + [Row((P, R), (Shard(1), R) + weight)]

    def local_op(self, call, input_layouts, coordinate):
        return with_index_checks(self._local_op(call, input_layouts, coordinate), call, input_layouts, _TARGET_CLASSES)

    @staticmethod
    def _local_op(call, input_layouts, coordinate):
        self_layout, reduction = input_layouts[0], call.argument("reduction")
        if call.inputs[0].ndim != 2:
            return None
        batch_mesh_dims, class_mesh_dims = self_layout.shard_order[0], self_layout.shard_order[1]
        if class_mesh_dims:
            first, columns = self_layout.local_offset(coordinate)[1], self_layout.local_shape(coordinate)[1]
            return on_shards(_without_weight, _class_sharded_nll(first, columns, batch_mesh_dims))
        if not batch_mesh_dims or reduction != _MEAN:
            return None

        def batch_mean(mesh, tensor, target, weight, reduction, ignore_index):
            total, total_weight = aten.nll_loss_forward(tensor, target, weight, _SUM, ignore_index)
            total_weight = _all_reduce(total_weight, mesh, batch_mesh_dims, "sum")
            return total / total_weight, total_weight

        return on_shards(call.op, batch_mean)


def _picked(tensor, target, weight, ignore_index, first, columns):
    """Per row: (value at the target if it lies in this rank's columns else 0, the target's weight)."""
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0)
    weights = weight[safe_target] if weight is not None else torch.ones(target.shape, dtype=tensor.dtype, device=tensor.device)
    weights = torch.where(valid, weights, 0)
    local = safe_target - first
    inside = valid & (local >= 0) & (local < columns)
    if columns:
        values = tensor.gather(1, local.clamp(0, columns - 1).unsqueeze(1)).squeeze(1)
        values = torch.where(inside, values, 0)
    else:
        values = torch.zeros(target.shape, dtype=tensor.dtype, device=tensor.device)
    return values, weights, inside, local.clamp(0, max(columns - 1, 0))


def _without_weight(tensor, target, weight, reduction, ignore_index):
    """Local output shapes of a class-sharded nll_loss: the op refuses a weight longer than the local classes."""
    return aten.nll_loss_forward(tensor, target, None, reduction, ignore_index)


def _class_sharded_nll(first: int, columns: int, batch_mesh_dims: tuple[int, ...]):
    """The local op for class-sharded logits; with the batch also sharded ('mean'), the divisor is the
    total weight of the whole batch, all_reduced over the batch's mesh dims, not this rank's rows."""

    def class_sharded(mesh, tensor, target, weight, reduction, ignore_index):
        values, weights, _, _ = _picked(tensor, target, weight, ignore_index, first, columns)
        losses = -values * weights
        total_weight = weights.sum()
        if reduction == _NONE:
            return losses, torch.zeros((), dtype=tensor.dtype, device=tensor.device)
        if reduction == _SUM:
            return losses.sum(), total_weight
        total_weight = _all_reduce(total_weight, mesh, batch_mesh_dims, "sum")
        return losses.sum() / total_weight, total_weight

    return class_sharded


class NllLossBackward(ShardingRule):
    """`nll_loss_backward(grad, self, target, weight, reduction, ignore_index, total_weight)`.

    The total weight arrives replicated (global), so batch shards compute their rows exactly; a
    class-sharded input gets its columns, written only where the target lies in them.
    """

    __name__ = "nll_loss_backward"

    def rows(self, call: OpCall) -> list[Row]:
        weight = (R,) * _has_weight(call)
        grad = Shard(0) if call.argument("reduction") == _NONE else R
        rows = [Row((R,), (R, R, R) + weight + (R,))]
        if call.inputs[1].ndim != 2:
            return rows
        rows.append(Row((Shard(0),), (grad, Shard(0), Shard(0)) + weight + (R,)))
        return rows + [Row((Shard(1),), (R, Shard(1), R) + weight + (R,))]

    def local_op(self, call, input_layouts, coordinate):
        self_layout = input_layouts[1]
        if call.inputs[1].ndim != 2 or not self_layout.shard_order[1]:
            return None
        first, columns = self_layout.local_offset(coordinate)[1], self_layout.local_shape(coordinate)[1]

        def class_sharded_backward(mesh, grad, tensor, target, weight, reduction, ignore_index, total_weight):
            _, weights, inside, local = _picked(tensor, target, weight, ignore_index, first, columns)
            scale = grad / total_weight if reduction == _MEAN else grad
            coefficients = torch.where(inside, -weights * scale, 0)
            result = torch.zeros_like(tensor)
            if columns:
                result.scatter_(1, local.unsqueeze(1), coefficients.unsqueeze(1).to(tensor.dtype))
            return result

        def local_shape(grad, tensor, *rest):  # the global op refuses a weight longer than the local classes
            return torch.empty_like(tensor)

        return on_shards(local_shape, class_sharded_backward)


# ---- convolution ------------------------------------------------------------------------------------


def _empty_channels(weight: torch.Tensor) -> bool:
    return weight.size(0) == 0 or weight.size(1) == 0


def _with_channels(weight: torch.Tensor) -> torch.Tensor:
    """A meta stand-in for a weight shard without output or input channels (torch refuses those)."""
    return torch.empty((max(weight.size(0), 1), max(weight.size(1), 1), *weight.shape[2:]), device="meta")


class Convolution(ShardingRule):
    """(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups).

    Registered by `ops/spatial_conv.py`, whose rule adds the spatially sharded rows to these.

    Batch-sharded input is local; an output-channel-sharded weight (and bias) gives S(1); an
    input-channel-sharded input and weight give Partial(sum), the bias then added on one rank only
    (Partial too). Transposed and grouped convolutions shard the batch only. A shard without
    channels (6 channels on 4 ranks) computes zeros of the right shape.
    """

    __name__ = "convolution"

    def rows(self, call: OpCall) -> list[Row]:
        bias = isinstance(call.argument("bias"), TensorMeta)
        rows = [Row((R,), (R, R) + (R,) * bias), Row((Shard(0),), (Shard(0), R) + (R,) * bias)]
        if call.argument("transposed") or call.argument("groups") != 1:
            return rows
        rows.append(Row((Shard(1),), (R, Shard(0)) + (Shard(0),) * bias))
        return rows + [Row((P,), (Shard(1), Shard(1)) + (P,) * bias)]

    def local_op(self, call, input_layouts, coordinate):
        def convolution(mesh, tensor, weight, bias, *rest):
            if not _empty_channels(weight):
                return aten.convolution(tensor, weight, bias, *rest)
            meta_input = torch.empty((tensor.size(0), max(tensor.size(1), 1), *tensor.shape[2:]), device="meta")
            shape = list(aten.convolution(meta_input, _with_channels(weight), None, *rest).shape)
            shape[1] = weight.size(0)
            result = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
            if bias is not None and bias.numel():
                result = result + bias.reshape(-1, *(1,) * (result.ndim - 2))
            return result

        return convolution


class ConvolutionBackward(ShardingRule):
    """(grad_output, input, weight, bias_sizes, ..., groups, output_mask) -> grads of input, weight, bias."""

    __name__ = "convolution_backward"

    def rows(self, call: OpCall) -> list[Row]:
        output_mask = call.argument("output_mask")
        rows = [
            Row(_masked_outputs((R, R, R), output_mask), (R, R, R)),
            Row(_masked_outputs((Shard(0), P, P), output_mask), (Shard(0), Shard(0), R)),
        ]
        if call.argument("transposed") or call.argument("groups") != 1:
            return rows
        rows.append(Row(_masked_outputs((P, Shard(0), Shard(0)), output_mask), (Shard(1), R, Shard(0))))
        return rows + [Row(_masked_outputs((Shard(1), Shard(1), R), output_mask), (R, Shard(1), Shard(1)))]

    def local_arguments(self, call, input_layouts, coordinate):
        values = self.local_values(call, input_layouts, coordinate)
        return call.with_arguments(**values) if values else None

    def local_values(self, call, input_layouts, coordinate) -> dict:
        """The arguments whose local value differs from the call's, by name."""
        if call.argument("bias_sizes") is None:
            return {}
        # bias_sizes: the output channels of the local convolution, which grad_output's local dim 1
        # holds (the weight's dim 0 is not it for a transposed or grouped convolution).
        return {"bias_sizes": [input_layouts[0].local_shape(coordinate)[1]]}

    def local_op(self, call, input_layouts, coordinate):
        def convolution_backward(mesh, grad, tensor, weight, bias_sizes, *rest):
            if not _empty_channels(weight):
                return aten.convolution_backward(grad, tensor, weight, bias_sizes, *rest)
            output_mask = rest[-1]
            grad_bias = grad.sum([dim for dim in range(grad.ndim) if dim != 1])
            results = (torch.zeros_like(tensor), torch.zeros_like(weight), grad_bias)
            return tuple(result if wanted else None for result, wanted in zip(results, output_mask))

        return convolution_backward


register_rule([aten._softmax.default], Softmax("softmax", log=False, backward=False))
register_rule([aten._log_softmax.default], Softmax("log_softmax", log=True, backward=False))
register_rule([aten._softmax_backward_data.default], Softmax("softmax_backward", log=False, backward=True))
register_rule([aten._log_softmax_backward_data.default], Softmax("log_softmax_backward", log=True, backward=True))
# layer norm and group norm are registered by spatial_norm, which extends their rows to spatial shards.
register_rule([aten.embedding.default], Embedding())
register_rule([aten.embedding_dense_backward.default], EmbeddingBackward())
register_rule([aten.nll_loss_forward.default], NllLoss())
register_rule([aten.nll_loss_backward.default], NllLossBackward())
