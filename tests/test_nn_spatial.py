"""Pooling, upsampling, grid sampling, pixel shuffle, fold and batch norm on DTensors, forward and
backward, against one device."""

import pytest
import torch
import torch.nn.functional as F
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

R = Replicate()


def _unpool(x):
    pooled, indices = F.max_pool2d(x, 2, return_indices=True)
    return F.max_unpool2d(pooled, indices, 2, output_size=x.shape[-2:])


# case -> (function of the tensors, shapes; the first tensor is (batch, channel, ...)). Batch 3 and
# 5 channels leave empty shards on 4 ranks.
CASES = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, stride=2, padding=1), [(3, 5, 9)]),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2, ceil_mode=True), [(3, 5, 7, 6)]),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), [(3, 5, 4, 4, 4)]),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), [(3, 5, 7, 6)]),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2, ceil_mode=True), [(3, 5, 3, 4, 5)]),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), [(3, 5, 7, 6)]),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, 2), [(3, 5, 3, 4, 5)]),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, (3, 4)), [(3, 5, 7, 6)]),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 2), [(3, 5, 3, 4, 5)]),
    "max_unpool2d": (_unpool, [(3, 5, 6, 6)]),
    "nearest": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), [(3, 5, 4, 3)]),
    "nearest_exact_1d": (lambda x: F.interpolate(x, size=7, mode="nearest-exact"), [(3, 5, 4)]),
    "linear": (lambda x: F.interpolate(x, size=7, mode="linear", align_corners=True), [(3, 5, 4)]),
    "bilinear": (lambda x: F.interpolate(x, size=(5, 7), mode="bilinear"), [(3, 5, 4, 3)]),
    "bilinear_antialias": (lambda x: F.interpolate(x, size=(3, 2), mode="bilinear", antialias=True), [(3, 5, 6, 5)]),
    "bicubic": (lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"), [(3, 5, 4, 4)]),
    "trilinear": (lambda x: F.interpolate(x, size=(3, 4, 5), mode="trilinear"), [(3, 5, 2, 3, 2)]),
    "area": (lambda x: F.interpolate(x, size=(2, 3), mode="area"), [(3, 5, 5, 7)]),
    "pixel_shuffle": (lambda x: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2), [(3, 8, 2, 3)]),
    "channel_shuffle": (lambda x: F.channel_shuffle(x, 2), [(3, 6, 5)]),
    "fold": (lambda x: F.fold(F.unfold(x, 2, padding=1), (5, 4), 2, padding=1), [(3, 5, 5, 4)]),
    "grid_sample": (lambda x, grid: F.grid_sample(x, grid, align_corners=False), [(3, 5, 6, 5), (3, 4, 3, 2)]),
    "grid_sample_3d": (lambda x, grid: F.grid_sample(x, grid, mode="nearest"), [(3, 5, 4, 3, 4), (3, 2, 3, 2, 3)]),
}

# Ops that mix channels with spatial dims: their channel-sharded input moves (batch only is local).
MIXES_CHANNELS = {"pixel_shuffle", "fold"}


def _placements(mesh):
    """(placements of the first tensor, of the others): batch-sharded, channel-sharded, both, uneven."""
    if mesh.ndim == 1:
        return [([Shard(0)], [Shard(0)]), ([Shard(1)], [R])]
    return [
        ([Shard(0), Shard(1)], [Shard(0), R]),
        ([Shard(1), Shard(1)], [R, R]),
        ([Shard(0), Shard(0)], [Shard(0), Shard(0)]),
    ]


def _compare_forward_and_backward(mesh, function, fulls, placements, local):
    leaves = [distribute_tensor(full, mesh, placement).requires_grad_() for full, placement in zip(fulls, placements)]
    references = [full.clone().requires_grad_() for full in fulls]
    with shardtensor.strict_mode(), comm.observe() as records:
        y = function(*leaves)
    if local:
        assert list(records) == [], f"{[record.kind for record in records]}"
    expected = function(*references)
    assert_close(y.full_tensor(), expected)
    grad = torch.randn(expected.shape, dtype=expected.dtype)
    with shardtensor.strict_mode():
        y.backward(distribute_tensor(grad, mesh, [R if p.is_partial() else p for p in y.placements]))
    expected.backward(grad)
    for leaf, reference in zip(leaves, references):
        assert_close(leaf.grad.full_tensor(), reference.grad)


@pytest.mark.parametrize("case", list(CASES))
@spmd()
def test_plane_ops_shard_batch_and_channels_without_communication(mesh, case):
    function, shapes = CASES[case]
    fulls = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    if case.startswith("grid_sample"):
        fulls[1] = fulls[1].tanh()  # sample positions inside the input
    for first, others in _placements(mesh):
        if case == "channel_shuffle" and Shard(1) in first:
            first = [Shard(2) if p == Shard(1) else p for p in first]  # channels move: shard the length
        placements = [first] + [others] * (len(fulls) - 1)
        local = Shard(1) not in first or case not in MIXES_CHANNELS
        _compare_forward_and_backward(mesh, function, fulls, placements, local=local)


@spmd()
def test_pooling_an_unbatched_input_shards_its_channels(mesh):
    full = torch.randn(5, 6, 6, dtype=torch.float64)
    for function in (lambda x: F.max_pool2d(x, 2), lambda x: F.interpolate(x, size=4, mode="linear")):
        _compare_forward_and_backward(mesh, function, [full], [[Shard(0)] * mesh.ndim], local=True)


@pytest.mark.parametrize("running_placement", ["replicate", "shard", "mixed", "per_mesh_dim"])
@spmd()
def test_batch_norm_in_training_shards_channels_and_updates_running_statistics(mesh, running_placement):
    """A replicated running statistic costs one all_reduce (per mesh dim); a channel-sharded one none."""
    full = torch.randn(4, 5, 3, 2, dtype=torch.float64)
    weight_full, bias_full = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    channel_placements = [Shard(1)] * mesh.ndim
    running_mean, running_var = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    replicated = {"replicate": (True, True), "shard": (False, False)}.get(running_placement, (True, False))
    statistics_placements = [[R if whole else Shard(0)] * mesh.ndim for whole in replicated]
    if running_placement == "per_mesh_dim" and mesh.ndim == 2:  # gathered, updated, reduced: not local
        statistics_placements = [[Shard(0), R], [R, Shard(0)]]
    running = [distribute_tensor(t.clone(), mesh, placements)
               for t, placements in zip((running_mean, running_var), statistics_placements)]
    parameters = [distribute_tensor(t, mesh, [Shard(0)] * mesh.ndim).requires_grad_() for t in (weight_full, bias_full)]
    x = distribute_tensor(full, mesh, channel_placements).requires_grad_()
    references = [t.clone().requires_grad_() for t in (full, weight_full, bias_full)]
    with shardtensor.strict_mode(), comm.observe() as records:
        y = F.batch_norm(x, *running, *parameters, training=True, momentum=0.3)
    reductions = sum(replicated) * mesh.ndim if mesh.size() > 1 else 0
    if running_placement != "per_mesh_dim" or mesh.ndim == 1:
        assert [record.kind for record in records] == ["all_reduce"] * reductions
    assert y.placements == x.placements
    expected = F.batch_norm(references[0], running_mean, running_var, references[1], references[2], training=True,
                            momentum=0.3)
    assert_close(y.full_tensor(), expected)
    assert_close(running[0].full_tensor(), running_mean)
    assert_close(running[1].full_tensor(), running_var)
    grad = torch.randn(full.shape, dtype=torch.float64)
    grad_dtensor = distribute_tensor(grad, mesh, channel_placements)
    with shardtensor.strict_mode(), comm.observe() as records:
        y.backward(grad_dtensor)
    if running_placement != "per_mesh_dim" or mesh.ndim == 1:
        assert list(records) == []
    expected.backward(grad)
    for leaf, reference in zip([x, *parameters], references):
        assert_close(leaf.grad.full_tensor(), reference.grad)


@spmd()
def test_batch_norm_without_training_and_instance_norm(mesh):
    full = torch.randn(3, 5, 4, dtype=torch.float64)
    weight_full, bias_full = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    running_mean, running_var = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    grad = torch.randn(full.shape, dtype=torch.float64)
    for placements in ([Shard(0)] * mesh.ndim, [Shard(1)] * mesh.ndim):
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        weight = distribute_tensor(weight_full, mesh, [R] * mesh.ndim).requires_grad_()
        running = [distribute_tensor(t, mesh, [R] * mesh.ndim) for t in (running_mean, running_var)]
        references = [t.clone().requires_grad_() for t in (full, weight_full)]
        # The forward takes the replicate fallback (see nn_spatial.BatchNorm); the backward has rules.
        y = F.batch_norm(x, *running, weight, training=False)
        expected = F.batch_norm(references[0], running_mean, running_var, references[1], training=False)
        assert_close(y.full_tensor(), expected)
        with shardtensor.strict_mode():
            y.backward(distribute_tensor(grad, mesh, [R if p.is_partial() else p for p in y.placements]))
        expected.backward(grad)
        assert_close(x.grad.full_tensor(), references[0].grad)
        assert_close(weight.grad.full_tensor(), references[1].grad)
    # instance_norm runs batch norm on (1, N * C, ...): a batch-sharded input is channel-sharded there.
    function = lambda x, weight, bias: F.instance_norm(x, weight=weight, bias=bias)  # noqa: E731
    _compare_forward_and_backward(mesh, function, [full, weight_full, bias_full],
                                  [[Shard(0)] * mesh.ndim] + [[R] * mesh.ndim] * 2, local=False)
