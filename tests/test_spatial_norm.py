"""Batch, group, instance and layer norm on spatially sharded fields (and batch-sharded ones), forward
and backward, against one device; each issues exactly one all_reduce per forward and per backward."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import layout_box
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import DTensor, Replicate, Shard, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.layout import Layout

R = Replicate()
SHAPE = (3, 4, 7, 6)  # (N, C, H, W): 7 rows leave uneven and empty shards

# mesh shape -> [(placements of the field, explicit shard sizes or None)]: spatial, batch and spatial, uneven.
LAYOUTS = {
    (2,): [([Shard(2)], None), ([Shard(3)], {0: [5, 1]}), ([Shard(0)], None)],
    (4,): [([Shard(2)], {0: [3, 1, 0, 3]}), ([Shard(3)], None), ([Shard(0)], None)],  # 3 samples: one rank has none
    (2, 2): [([Shard(2), Shard(3)], {0: [5, 2], 1: [1, 5]}), ([Shard(0), Shard(2)], {1: [2, 5]}),
             ([Shard(3), Shard(2)], None)],
}


def _field(full, mesh, placements, shard_sizes, requires_grad=False):
    """`full` laid out with `placements` and the given shard sizes (torch.chunk's when None)."""
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    local = layout_box(full, layout, mesh.get_coordinate()).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, shard_sizes=shard_sizes).requires_grad_(requires_grad)


def _data(seed, shape=SHAPE, dtype=torch.float64):
    """Values around 3 (not centred: a sum-of-squares variance would lose digits)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 2 + 3).to(dtype)


def _spatial(placements) -> int:
    """One all_reduce when a spatial dim is sharded (per-sample norms keep a batch shard local)."""
    return int(any(placement.dim >= 2 for placement in placements if isinstance(placement, Shard)))


def _spatial_and_batch(placements) -> int:
    """Per-sample norms' backward: the grad sums (spatial shards), then the parameter gradients,
    Partial over a batch shard (as on any batch-sharded layer), reduced where they accumulate."""
    return _spatial(placements) + int(Shard(0) in placements)


def _kinds(mode: CommDebugMode) -> list[str]:
    return [record.kind for record in mode.records]


def _like_field(placements, leading_dims=1):
    """Placements of a parameter shaped like the field without its `leading_dims` (LayerNorm([C, H, W]))."""
    return [Shard(p.dim - leading_dims) if isinstance(p, Shard) and p.dim >= leading_dims else R for p in placements]


def _check_norm(mesh, function, parameters_full, *, collectives=lambda placements: 1, backward_collectives=None,
                dtype=torch.float64, parameters_like_field=False):
    """`function(x, *parameters)` on every layout of `mesh` against one device: values, parameter and
    input gradients, and `collectives(placements)` all_reduces in the forward and in the backward
    (none else; `backward_collectives(placements)` in the backward when given). The parameters are
    Replicate, or sharded like the field (`parameters_like_field`: LayerNorm([C, H, W])'s).

    In float32 the parameter gradients are sums over the whole field (126 products here) that torch
    and the shards add in different orders: their tolerance is that of such a sum (rtol 1e-5)."""
    gradient_tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}
    full, grad_full = _data(0, dtype=dtype), _data(1, dtype=dtype)
    for placements, shard_sizes in LAYOUTS[tuple(mesh.shape)]:
        x = _field(full, mesh, placements, shard_sizes, requires_grad=True)
        if parameters_like_field:
            parameters = [_field(t, mesh, _like_field(placements), shard_sizes, requires_grad=True) for t in parameters_full]
        else:
            parameters = [distribute_tensor(t, mesh, [R] * mesh.ndim).requires_grad_() for t in parameters_full]
        references = [t.clone().requires_grad_() for t in (full, *parameters_full)]
        with shardtensor.strict_mode(), CommDebugMode() as forward:
            y = function(x, *parameters)
        assert _kinds(forward) == ["all_reduce"] * collectives(placements), (placements, _kinds(forward))
        assert y.placements == x.placements and y.sharding == x.sharding
        expected = function(*references)
        assert_close(y.full_tensor(), expected)
        with shardtensor.strict_mode(), CommDebugMode() as backward:
            y.backward(_field(grad_full, mesh, placements, shard_sizes))
        assert _kinds(backward) == ["all_reduce"] * (backward_collectives or collectives)(placements), (
            placements, _kinds(backward))
        expected.backward(grad_full)
        assert_close(x.grad.full_tensor(), references[0].grad)
        for leaf, reference in zip(parameters, references[1:]):
            assert_close(leaf.grad.full_tensor(), reference.grad, **gradient_tolerance)


def _parameters(count, channels=SHAPE[1], dtype=torch.float64):
    return [_data(10 + index, (channels,), dtype) for index in range(count)]


@pytest.mark.parametrize("affine", [True, False])
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_batch_norm_in_training_reduces_statistics_over_spatial_shards_once(mesh, affine):
    full = _data(0, dtype=torch.float32)
    for placements, shard_sizes in LAYOUTS[tuple(mesh.shape)]:
        running = [distribute_tensor(t, mesh, [R] * mesh.ndim) for t in (torch.zeros(4), torch.ones(4))]
        running_mean, running_var = torch.zeros(4), torch.ones(4)
        x = _field(full, mesh, placements, shard_sizes)
        with shardtensor.strict_mode(), CommDebugMode() as forward:
            y = F.batch_norm(x, *running, training=True, momentum=0.2)
        assert _kinds(forward) == ["all_reduce"]
        expected = F.batch_norm(full, running_mean, running_var, training=True, momentum=0.2)
        assert_close(y.full_tensor(), expected)
        assert_close(running[0].full_tensor(), running_mean)  # torch's update, unbiased variance
        assert_close(running[1].full_tensor(), running_var)
    count = 2 if affine else 0
    _check_norm(mesh, lambda x, *p: F.batch_norm(x, None, None, *p, training=True), _parameters(count))


@spmd(meshes=[(2,), (2, 2)])
def test_float32_batch_norm_and_group_norm_match_torch(mesh):
    parameters = _parameters(2, dtype=torch.float32)
    _check_norm(mesh, lambda x, *p: F.batch_norm(x, None, None, *p, training=True), parameters, dtype=torch.float32)
    _check_norm(mesh, lambda x, *p: F.group_norm(x, 2, *p), parameters, collectives=_spatial,
                backward_collectives=_spatial_and_batch, dtype=torch.float32)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_batch_norm_statistics_match_in_float64_exactly_enough(mesh):
    """float64 through the same merge: agreement far below float32's tolerance."""
    full = _data(0) * 1000 + 1e4
    for placements, shard_sizes in LAYOUTS[tuple(mesh.shape)]:
        y = F.batch_norm(_field(full, mesh, placements, shard_sizes), None, None, training=True)
        assert_close(y.full_tensor(), F.batch_norm(full, None, None, training=True), rtol=1e-10, atol=1e-10)


@spmd(meshes=[(2,), (2, 2)])
def test_batch_norm_without_training_is_local(mesh):
    full, grad_full = _data(0), _data(1)
    running_mean, running_var = _data(5, (4,)), _data(6, (4,)).abs() + 0.5
    weight_full = _data(7, (4,))
    for placements, shard_sizes in LAYOUTS[tuple(mesh.shape)]:
        x = _field(full, mesh, placements, shard_sizes, requires_grad=True)
        weight = distribute_tensor(weight_full, mesh, [R] * mesh.ndim).requires_grad_()
        running = [distribute_tensor(t, mesh, [R] * mesh.ndim) for t in (running_mean, running_var)]
        references = [t.clone().requires_grad_() for t in (full, weight_full)]
        with shardtensor.strict_mode(), CommDebugMode() as forward:
            y = F.batch_norm(x, *running, weight, training=False)
        assert _kinds(forward) == []
        with shardtensor.strict_mode(), CommDebugMode() as backward:
            y.backward(_field(grad_full, mesh, placements, shard_sizes))
        assert _kinds(backward) == ["all_reduce"]  # the weight gradient, Partial over the shards
        expected = F.batch_norm(references[0], running_mean, running_var, references[1], training=False)
        assert_close(y.full_tensor(), expected)
        expected.backward(grad_full)
        assert_close(x.grad.full_tensor(), references[0].grad)
        assert_close(weight.grad.full_tensor(), references[1].grad)


@pytest.mark.parametrize("groups", [1, 2, 4])
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_group_norm_reduces_statistics_over_spatial_shards_once(mesh, groups):
    def group_norm(x, weight, bias):
        return F.group_norm(x, groups, weight, bias, eps=1e-4)

    if mesh.ndim == 2 or groups == 2:
        _check_norm(mesh, group_norm, _parameters(2), collectives=_spatial, backward_collectives=_spatial_and_batch)
    else:
        _check_norm(mesh, lambda x: F.group_norm(x, groups), [], collectives=_spatial)


@spmd(meshes=[(2,), (2, 2)])
def test_group_norm_on_a_batch_shard_stays_local(mesh):
    """The batch row (nn.GroupNorm's) is kept: no collective, Partial parameter gradients."""
    full = _data(0)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with CommDebugMode() as mode:
        y = F.group_norm(x, 2)
    assert _kinds(mode) == []
    assert_close(y.full_tensor(), F.group_norm(full, 2))


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_instance_norm_reduces_over_spatial_shards_once(mesh):
    """instance_norm is batch norm on (1, N * C, H, W): per sample and channel statistics."""
    _check_norm(mesh, lambda x, weight, bias: F.instance_norm(x, weight=weight, bias=bias), _parameters(2),
                collectives=_spatial, backward_collectives=_spatial_and_batch)


@spmd(meshes=[(2,), (2, 2)])
def test_one_dimensional_and_three_dimensional_fields(mesh):
    for shape, placement in (((2, 4, 9), Shard(2)), ((2, 4, 3, 5, 4), Shard(3))):
        full = _data(0, shape)
        x = distribute_tensor(full, mesh, [placement] * mesh.ndim)
        with CommDebugMode() as mode:
            batch = F.batch_norm(x, None, None, training=True)
            group = F.group_norm(x, 2)
        assert _kinds(mode) == ["all_reduce"] * 2
        assert_close(batch.full_tensor(), F.batch_norm(full, None, None, training=True))
        assert_close(group.full_tensor(), F.group_norm(full, 2))


@spmd(meshes=[(2,), (2, 2)])
def test_layer_norm_over_channels_is_local(mesh):
    """LayerNorm over C of an NCHW field (permuted channels-last, as ConvNeXt does): H and W are
    batch dims of layer_norm, so spatial shards need no collective."""

    def channel_layer_norm(x, weight, bias):
        return F.layer_norm(x.permute(0, 2, 3, 1), (SHAPE[1],), weight, bias).permute(0, 3, 1, 2)

    # Backward: the weight and bias gradients, Partial over the shards, reduced where they accumulate.
    _check_norm(mesh, channel_layer_norm, _parameters(2), collectives=lambda placements: 0,
                backward_collectives=lambda placements: 1)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_layer_norm_over_channels_and_space_reduces_over_spatial_shards_once(mesh):
    """LayerNorm([C, H, W]) on a split field: weight and bias sharded like it; per-sample statistics
    in one all_reduce forward, the grad sums in one backward (plus the Partial parameter gradients'
    reduction over a batch shard)."""
    normalized = SHAPE[1:]
    parameters = [_data(10 + index, normalized) for index in range(2)]
    _check_norm(mesh, lambda x, weight, bias: F.layer_norm(x, normalized, weight, bias), parameters,
                collectives=_spatial, backward_collectives=_spatial_and_batch, parameters_like_field=True)
    _check_norm(mesh, lambda x: F.layer_norm(x, normalized[1:]), [], collectives=_spatial)  # (H, W) per (n, c)


def test_layer_norm_metadata_is_torchs_meta_kernels():
    """`native_layer_norm`'s output metadata, said without running torch's meta kernel, equals that
    kernel's on every shape (sizes 0, 1 and 3), dtype and affine case it serves: contiguous floating
    inputs with parameters of their dtype and shape; anything else is left to the kernel (None)."""
    from shardtensor.layout import contiguous_stride
    from shardtensor.ops.spatial_norm import _layer_norm_outputs
    from shardtensor.rules import TensorMeta, run_on_meta

    op = torch.ops.aten.native_layer_norm.default
    served = 0
    for shape in [shape for ndim in (1, 2, 3) for shape in itertools.product((0, 1, 3), repeat=ndim)]:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.complex64):
            strides = [contiguous_stride(shape)] + ([torch.empty(shape[::-1]).mT.stride()] if len(shape) == 2 else [])
            for stride, count in itertools.product(strides, range(1, len(shape) + 1)):
                normalized = list(shape[len(shape) - count:])
                for weight_dtype, weight_shape in [(dtype, normalized), (torch.float64, normalized), (dtype, [*normalized, 1])]:
                    weight = TensorMeta(tuple(weight_shape), contiguous_stride(weight_shape), weight_dtype)
                    for parameters in [(None, None), (weight, None), (weight, weight)]:
                        arguments = ((TensorMeta(shape, stride, dtype), normalized, *parameters, 1e-5), {})
                        found = _layer_norm_outputs(arguments)
                        usual = (stride == contiguous_stride(shape) and dtype.is_floating_point
                                 and (parameters[0] is None or (weight_dtype, weight_shape) == (dtype, normalized)))
                        assert (found is not None) == usual, (shape, stride, dtype, normalized, parameters)
                        if found is not None:
                            served += 1
                            assert found == run_on_meta(op, *arguments), (shape, dtype, normalized, parameters)
    assert served > 300
    # Local inputs replace the placeholders in order, as in `run_on_meta`.
    weight = TensorMeta((6,), (1,), torch.float32)
    arguments = ((TensorMeta((4, 6), (6, 1), torch.float32), [6], weight, weight, 1e-5), {})
    local = [TensorMeta((2, 3), (3, 1), torch.float32), TensorMeta((3,), (1,), torch.float32), TensorMeta((3,), (1,), torch.float32)]
    local_arguments = ((arguments[0][0], [3], weight, weight, 1e-5), {})
    assert _layer_norm_outputs(local_arguments, local) == run_on_meta(op, *local_arguments, local)
