"""Sharding rules: elementwise nn ops (losses with a reduction, shrink activations, prelu, glu,
safe softmax) and the per-sample margin losses.

An elementwise loss with reduction 'none' is pointwise. With 'sum' a sharded input gives each
rank the sum of its elements: Partial(sum). With 'mean' each rank divides its sum by the GLOBAL
element count (a local mean would weigh uneven shards wrongly): Partial(sum) again, exact for any
shard sizes; the backward scales the same way.
"""

from __future__ import annotations

import math

import torch

from ..placement import Partial, Replicate, Shard
from ..rules import OpCall, Row, ShardingRule, schema_positions
from .common import normalized_dim
from .registry import aten, pointwise, register_rule
from .value_checks import ValueRange, with_value_checks


R, P = Replicate(), Partial("sum")

_NONE, _MEAN, _SUM = 0, 1, 2  # loss reductions


class ElementwiseLoss(ShardingRule):
    """A loss computed per element, then reduced by its `reduction` argument.

    A backward (`backward=True`) takes the gradient first: with a reduction it is 0-d, Replicate,
    and the input gradient lies like the input.
    """

    def __init__(self, name: str, backward: bool = False, value_ranges: tuple[ValueRange, ...] = ()):
        self.__name__, self.backward, self.value_ranges = name, backward, value_ranges

    def _reduction(self, call: OpCall) -> int:
        return call.argument("reduction")

    def rows(self, call: OpCall) -> list[Row]:
        rows = pointwise(call)
        if self.backward or self._reduction(call) == _NONE:
            return rows
        # A reduced loss of sharded elements: each rank holds a part of the sum.
        return [rows[0]] + [Row((P,), row.inputs) for row in rows[1:]]

    def _count(self, call: OpCall) -> int:
        """How many losses 'mean' averages: the elements of the (broadcast) input."""
        losses = call.inputs[1:] if self.backward else call.inputs
        return math.prod(torch.broadcast_shapes(*(meta.shape for meta in losses)))

    def local_op(self, call, input_layouts, coordinate):
        """The mean of sharded losses as a sum divided by the global count, after the value checks."""
        return with_value_checks(self._global_mean(call, input_layouts), call, input_layouts, self._value_ranges(call))

    def _value_ranges(self, call: OpCall) -> tuple[ValueRange, ...]:
        return self.value_ranges

    def _global_mean(self, call, input_layouts):
        if self._reduction(call) != _MEAN or not any(any(layout.shard_order) for layout in input_layouts):
            return None
        count = self._count(call)
        op, position, backward = call.op, schema_positions(call.op)["reduction"][0], self.backward

        def global_mean(mesh, *args, **kwargs):
            args = list(args)
            if len(args) > position:
                args[position] = _SUM
            else:
                kwargs["reduction"] = _SUM
            if backward:
                return op(args[0] / count, *args[1:], **kwargs)
            result = op(*args, **kwargs)
            if isinstance(result, tuple):  # (loss, is_target) of multilabel_margin_loss_forward
                return (result[0] / count, *result[1:])
            return result / count

        return global_mean


class SampleLoss(ElementwiseLoss):
    """A loss per sample of an (N, C) input (a margin over the classes): the batch shards every
    tensor but the class `weight`; 'mean' averages over N.

    The backwards (`multi_margin_loss_backward`, `multilabel_margin_loss_backward`) have no meta
    kernel, so no rule can size their shards: they take the replicate fallback. The kernel refuses a
    target class outside [`lowest_target`, C): every rank refuses together (`value_checks`).
    """

    def __init__(self, name: str, lowest_target: int):
        super().__init__(name)
        self.lowest_target = lowest_target

    def _value_ranges(self, call: OpCall) -> tuple[ValueRange, ...]:
        classes = call.inputs[0].shape[-1] if call.inputs[0].ndim else 1
        return (ValueRange("target", self.lowest_target, classes - 1, "target"),)

    def rows(self, call: OpCall) -> list[Row]:
        outputs, inputs = len(call.op._schema.returns), len(call.inputs)
        rows = [Row((R,) * outputs, (R,) * inputs)]
        if call.inputs[0].ndim != 2:
            return rows
        batched = [R if name == "weight" else Shard(0) for name in call.input_names()]
        loss = Shard(0) if self._reduction(call) == _NONE else P
        return rows + [Row((loss,) + (Shard(0),) * (outputs - 1), tuple(batched))]

    def _count(self, call: OpCall) -> int:
        return call.inputs[0].shape[0]

    def _global_mean(self, call, input_layouts):
        """The sum (or global mean) of this rank's samples, which is 0 for a shard without samples:
        torch's kernels return uninitialized memory for an empty batch reduced by 'sum' or 'mean'
        (`multi_margin_loss`, `multilabel_margin_loss_forward` in torch 2.13), which would enter the Partial sum."""
        if self._reduction(call) == _NONE or not any(any(layout.shard_order) for layout in input_layouts):
            return None
        reduced = super()._global_mean(call, input_layouts)
        op = call.op

        def without_empty_batches(mesh, *args, **kwargs):
            result = op(*args, **kwargs) if reduced is None else reduced(mesh, *args, **kwargs)
            if args[0].shape[0]:
                return result
            if isinstance(result, tuple):  # (loss, is_target): the empty is_target is fine
                return (torch.zeros_like(result[0]), *result[1:])
            return torch.zeros_like(result)

        return without_empty_batches


def glu(call: OpCall) -> list[Row]:
    """`glu(self, dim)`, `glu_backward(grad, self, dim)`, `_safe_softmax(self, dim, dtype)`: every
    dim but `dim` (halved, or normalized over) shards, on every tensor together."""
    inputs, ndim = len(call.inputs), call.inputs[-1].ndim
    dim = normalized_dim(call.argument("dim"), ndim)
    rows = [Row((R,), (R,) * inputs)]
    return rows + [Row((Shard(d),), (Shard(d),) * inputs) for d in range(ndim) if d != dim]


def prelu_backward(call: OpCall) -> list[Row]:
    """`_prelu_kernel_backward(grad, self, weight)` -> grads of self and of the broadcast weight
    (the input's shape; autograd sums it to the weight afterwards): pointwise with two outputs."""
    return [Row((row.outputs[0],) * 2, row.inputs) for row in pointwise(call)]


_LOSSES = [
    aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default, aten.mse_loss.default,
    aten.huber_loss.default, aten.smooth_l1_loss.default, aten.soft_margin_loss.default,
]
_LOSS_BACKWARDS = [
    aten.binary_cross_entropy_backward.default, aten.mse_loss_backward.default, aten.huber_loss_backward.default,
    aten.smooth_l1_loss_backward.default, aten.soft_margin_loss_backward.default,
]
_POINTWISE = [
    aten.hardshrink.default, aten.hardshrink_backward.default, aten.softshrink.default,
    aten.softshrink_backward.default, aten._prelu_kernel.default,
]

# The kernel refuses values outside [0, 1]: on shards, every rank must refuse together.
_PROBABILITIES = (ValueRange("self", 0.0, 1.0, "input"), ValueRange("target", 0.0, 1.0, "target"))
for _op in _LOSSES:
    _ranges = _PROBABILITIES if _op == aten.binary_cross_entropy.default else ()
    register_rule([_op], ElementwiseLoss(_op._schema.name, value_ranges=_ranges))
for _op in _LOSS_BACKWARDS:
    register_rule([_op], ElementwiseLoss(_op._schema.name, backward=True))
register_rule([aten.multi_margin_loss.default], SampleLoss("multi_margin_loss", lowest_target=0))
# -1 ends a sample's list of target classes
register_rule([aten.multilabel_margin_loss_forward.default], SampleLoss("multilabel_margin_loss", lowest_target=-1))
register_rule(_POINTWISE, pointwise)
register_rule([aten._prelu_kernel_backward.default], prelu_backward)
register_rule([aten.glu.default, aten.glu_backward.default, aten._safe_softmax.default], glu)
