"""Exact output layouts without visiting every coordinate: propagation evaluates a rule whose local
output shapes follow from its local input shapes on a few coordinates per group of mesh dims
(`propagation._coordinates_covering`), and must decide exactly what visiting every coordinate decides,
uneven and nested shards included. No processes: decisions on layouts alone."""

from __future__ import annotations

import math

import pytest
import torch

from shardtensor import propagation
from shardtensor.layout import Layout
from shardtensor.ops.registry import RULES
from shardtensor.placement import Partial, Replicate, Shard
from shardtensor.rules import OpCall, TensorMeta

aten = torch.ops.aten
R = Replicate()


class _EveryCoordinate:
    """A rule as it is, but evaluated on every coordinate of the mesh (the reference)."""

    def __init__(self, rule):
        self._rule = rule

    def __getattr__(self, name):
        return getattr(self._rule, name)

    def shapes_follow_local_inputs(self, call) -> bool:
        return False


def _meta(shape) -> TensorMeta:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return TensorMeta(tuple(shape), tuple(reversed(stride)), torch.float32)


def _call(op, shapes, other_args=(), kwargs=()):
    metas = tuple(_meta(shape) for shape in shapes)
    return OpCall(op, metas, metas + tuple(other_args), tuple(kwargs))


# (op, input shapes, non-tensor arguments, placements per input, shard_order per input or None)
CASES = [
    (aten.add.Tensor, [(13, 7), (13, 7)], (), [[Shard(0), Shard(1), Shard(0)]] * 2, [[(2, 0), (1,)]] * 2),
    (aten.add.Tensor, [(13, 7), (7,)], (), [[Shard(0), R, Shard(1)], [R, R, Shard(0)]], None),
    (aten.mul.Tensor, [(11, 5)], (2.0,), [[Shard(1), Shard(0), Partial("sum")]], None),
    (aten.addcmul.default, [(9, 10)] * 3, (), [[Shard(0), Shard(0), Shard(1)]] * 3, None),
    (aten.sqrt.default, [(3, 17)], (), [[Shard(1), Shard(1), Shard(1)]], [[(), (2, 1, 0)]]),
    (aten.view.default, [(10, 6)], ([10, 2, 3],), [[Shard(0), Shard(0), R]], None),
    (aten.view.default, [(10, 6)], ([60],), [[Shard(0), R, R]], None),
    (aten.t.default, [(5, 9)], (), [[Shard(1), Shard(0), Shard(1)]], None),
    (aten.sum.dim_IntList, [(7, 11)], ([1],), [[Shard(0), Shard(1), Shard(0)]], None),
    (aten.zeros_like.default, [(7, 3)], (), [[Shard(0), Shard(0), Shard(0)]], [[(1, 2, 0), ()]]),
]


@pytest.mark.parametrize("mesh_shape", [(2, 3, 2), (3, 1, 4)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decisions_equal_those_visiting_every_coordinate(mesh_shape, case):
    op, shapes, other_args, placements, orders = CASES[case]
    call = _call(op, shapes, other_args)
    layouts = [
        Layout.create(mesh_shape, placement, shape, shard_order=None if orders is None else orders[index])
        for index, (placement, shape) in enumerate(zip(placements, shapes))
    ]
    rule = RULES[op]
    assert rule.shapes_follow_local_inputs(call)
    coordinate = (0,) * len(mesh_shape)
    fast = propagation.decide(call, layouts, rule, coordinate, None)
    every = propagation.decide(call, layouts, _EveryCoordinate(rule), coordinate, None)
    assert fast.output_layouts == every.output_layouts and fast.input_layouts == every.input_layouts
    assert any(layout is not None and any(layout.shard_order) for layout in fast.output_layouts)


def test_a_16384_rank_mesh_is_covered_by_a_few_coordinates_per_mesh_dim():
    mesh_shape = (16, 16, 64)
    even = Layout.create(mesh_shape, [Shard(0), Shard(0), Shard(1)], (256, 1024))
    uneven = Layout.create(mesh_shape, [Shard(0), Shard(0), Shard(1)], (250, 1000))
    outputs = [([Shard(0), Shard(0), Shard(1)], 2)]
    # groups: mesh dims (0, 1) shard dim 0 together, mesh dim 2 alone; each coordinate of a group once
    assert len(propagation._coordinates_covering(mesh_shape, [even], outputs)) == 16 * 16 + 64
    covering = propagation._coordinates_covering(mesh_shape, [uneven], outputs)
    assert len(covering) < 4 * (16 * 16 + 64) < math.prod(mesh_shape) // 10
    call = _call(aten.relu.default, [(250, 1000)])
    decision = propagation.decide(call, [uneven], RULES[aten.relu.default], (0, 0, 0), None)
    assert decision.output_layouts == (uneven,)


def test_rules_with_per_coordinate_arguments_still_visit_every_coordinate():
    # slice's local arguments read each piece's offset, not only its size; view's read the size alone
    assert not RULES[aten.slice.Tensor].shapes_follow_local_inputs(_call(aten.slice.Tensor, [(10, 4)], (0, 1, 9, 1)))
    assert RULES[aten.view.default].shapes_follow_local_inputs(_call(aten.view.default, [(10, 4)], ([40],)))
