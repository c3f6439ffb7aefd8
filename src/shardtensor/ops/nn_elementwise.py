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
from ..propagation import OpCall, Row, ShardingRule, TensorMeta
from .registry import pointwise, register_rule

aten = torch.ops.aten

R, P = Replicate(), Partial("sum")

_NONE, _MEAN, _SUM = 0, 1, 2  # loss reductions


def _argument(call: OpCall, position: int, name: str, default):
    return call.args[position] if len(call.args) > position else call.kwarg(name, default)


class ElementwiseLoss(ShardingRule):
    """A loss computed per element, then reduced by `reduction` (at argument `reduction_argument`).

    A backward (`backward=True`) takes the gradient first: with a reduction it is 0-d, Replicate,
    and the input gradient lies like the input.
    """

    def __init__(self, name: str, reduction_argument: int, backward: bool = False):
        self.__name__, self.reduction_argument, self.backward = name, reduction_argument, backward

    def _reduction(self, call: OpCall) -> int:
        return _argument(call, self.reduction_argument, "reduction", _MEAN)

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
        if self._reduction(call) != _MEAN or not any(any(layout.shard_order) for layout in input_layouts):
            return None
        count = self._count(call)
        op, position, backward = call.op, self.reduction_argument, self.backward

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
    tensor but the class `weight` (at argument `weight_argument`); 'mean' averages over N.

    The backwards (`multi_margin_loss_backward`, `multilabel_margin_loss_backward`) have no meta
    kernel, so no rule can size their shards: they take the replicate fallback.
    """

    def __init__(self, name: str, reduction_argument: int, weight_argument: int | None):
        super().__init__(name, reduction_argument)
        self.weight_argument = weight_argument

    def rows(self, call: OpCall) -> list[Row]:
        outputs, inputs = len(call.op._schema.returns), len(call.inputs)
        rows = [Row((R,) * outputs, (R,) * inputs)]
        if call.inputs[0].ndim != 2:
            return rows
        batched = []
        for position, value in enumerate(call.args):
            if isinstance(value, TensorMeta):
                batched.append(R if position == self.weight_argument else Shard(0))
        loss = Shard(0) if self._reduction(call) == _NONE else P
        return rows + [Row((loss,) + (Shard(0),) * (outputs - 1), tuple(batched))]

    def _count(self, call: OpCall) -> int:
        return call.inputs[0].shape[0]


def glu(call: OpCall) -> list[Row]:
    """`glu(self, dim)`, `glu_backward(grad, self, dim)`, `_safe_softmax(self, dim, dtype)`: every
    dim but `dim` (halved, or normalized over) shards, on every tensor together."""
    inputs, ndim = len(call.inputs), call.inputs[-1].ndim
    dim = _argument(call, inputs, "dim", -1) % max(ndim, 1)
    rows = [Row((R,), (R,) * inputs)]
    return rows + [Row((Shard(d),), (Shard(d),) * inputs) for d in range(ndim) if d != dim]


def prelu_backward(call: OpCall) -> list[Row]:
    """`_prelu_kernel_backward(grad, self, weight)` -> grads of self and of the broadcast weight
    (the input's shape; autograd sums it to the weight afterwards): pointwise with two outputs."""
    return [Row((row.outputs[0],) * 2, row.inputs) for row in pointwise(call)]


# op -> position of `reduction`
_LOSSES = {
    aten.binary_cross_entropy.default: 3,
    aten.binary_cross_entropy_with_logits.default: 4,
    aten.mse_loss.default: 2,
    aten.huber_loss.default: 2,
    aten.smooth_l1_loss.default: 2,
    aten.soft_margin_loss.default: 2,
}
_LOSS_BACKWARDS = {
    aten.binary_cross_entropy_backward.default: 4,
    aten.mse_loss_backward.default: 3,
    aten.huber_loss_backward.default: 3,
    aten.smooth_l1_loss_backward.default: 3,
    aten.soft_margin_loss_backward.default: 3,
}
_POINTWISE = [
    aten.hardshrink.default, aten.hardshrink_backward.default, aten.softshrink.default,
    aten.softshrink_backward.default, aten._prelu_kernel.default,
]

for _op, _position in _LOSSES.items():
    register_rule([_op], ElementwiseLoss(_op._schema.name, _position))
for _op, _position in _LOSS_BACKWARDS.items():
    register_rule([_op], ElementwiseLoss(_op._schema.name, _position, backward=True))
register_rule([aten.multi_margin_loss.default], SampleLoss("multi_margin_loss", 5, weight_argument=4))
register_rule([aten.multilabel_margin_loss_forward.default], SampleLoss("multilabel_margin_loss", 2, None))
register_rule(_POINTWISE, pointwise)
register_rule([aten._prelu_kernel_backward.default], prelu_backward)
register_rule([aten.glu.default, aten.glu_backward.default, aten._safe_softmax.default], glu)
