"""`halo_map`: users' neighbourhood functions on spatially sharded DTensors equal the single-device
computation, forward and backward, with halo rows moved point to point only."""

import pytest
import torch
import torch.nn.functional as F
from helpers import layout_box, seeded_randn as _randn, sharded_leaf as _sharded
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.experimental import halo_map

R = Replicate()


def _laplacian(u):
    """A 5-point finite-difference Laplacian written with roll: periodic on a whole field."""
    return u.roll(1, 2) + u.roll(-1, 2) + u.roll(1, 3) + u.roll(-1, 3) - 4 * u


def _placements(mesh):
    """Uneven H shards (one thinner than nothing: an empty shard on 4 ranks), and H x W on 2x2."""
    if mesh.ndim == 2:
        return [Shard(2), Shard(3)], {0: [4, 1], 1: [2, 4]}
    return [Shard(2)], {0: [3, 2] if mesh.size() == 2 else [1, 0, 3, 1]}


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_circular_laplacian_equals_the_periodic_single_device_one(mesh):
    full = _randn((2, 3, 5, 6), seed=0)
    grad = _randn(full.shape, seed=1)
    placements, sizes = _placements(mesh)
    x, reference = _sharded(full, mesh, placements, sizes), full.clone().requires_grad_()
    laplacian = halo_map(_laplacian, dims=(2, 3), halo=1, edge="circular")
    with CommDebugMode() as mode:
        y = laplacian(x)
    assert y.placements == x.placements and y._spec.layout.pieces == x._spec.layout.pieces
    assert set(mode.get_comm_counts()) <= {"batch_p2p"}
    expected = _laplacian(reference)
    assert_close(y.full_tensor(), expected.detach())
    y.backward(DTensor.from_local(layout_box(grad, y._spec.layout, mesh.get_coordinate()).clone(), mesh, placements,
                                  shape=grad.shape, shard_sizes=sizes))
    expected.backward(grad)
    assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_a_users_valid_3x3_stencil_equals_a_padded_single_device_conv(mesh):
    """`F.conv2d(..., padding=0)` on the widened shard consumes the halo (no trim); the weight, a
    Replicate DTensor, gets a Partial gradient per rank, reduced when backward ends: `.grad` is Replicate
    like the weight, with the single-device values."""
    full, weight_full = _randn((1, 2, 5, 6), seed=2), _randn((3, 2, 3, 3), seed=3)
    placements, sizes = _placements(mesh)
    x = _sharded(full, mesh, placements, sizes)
    weight = distribute_tensor(weight_full, mesh, [R] * mesh.ndim, src_data_rank=None).requires_grad_()
    references = [full.clone().requires_grad_(), weight_full.clone().requires_grad_()]
    stencil = halo_map(lambda tensor, kernel: F.conv2d(tensor, kernel), dims=(2, 3), halo=1)
    y = stencil(x, weight)
    expected = F.conv2d(references[0], references[1], padding=1)
    assert_close(y.full_tensor(), expected.detach())
    (y * y).sum().backward()
    (expected * expected).sum().backward()
    assert_close(x.grad.full_tensor(), references[0].grad)
    assert weight.grad.placements == (R,) * mesh.ndim
    assert_close(weight.grad.to_local(), references[1].grad)


@spmd(meshes=[(2,), (4,)])
def test_replicate_and_reflect_edges_with_asymmetric_halos(mesh):
    """A 3-row box filter over H (window 2 before, 0 after) with each edge mode: the single-device
    result pads the whole field by F.pad."""
    full = _randn((2, 2, 7, 3), seed=4)
    sizes = {0: [5, 2] if mesh.size() == 2 else [2, 1, 1, 3]}
    for edge, mode in (("replicate", "replicate"), ("reflect", "reflect"), ("zeros", "constant")):
        x, reference = _sharded(full, mesh, [Shard(2)], sizes), full.clone().requires_grad_()
        box = halo_map(lambda t: t.unfold(2, 3, 1).mean(-1), dims=(2,), halo=[(2, 0)], edge=edge)
        y = box(x)
        expected = F.pad(reference, (0, 0, 2, 0), mode=mode).unfold(2, 3, 1).mean(-1)
        assert_close(y.full_tensor(), expected.detach())
        (y * y).sum().backward()
        (expected * expected).sum().backward()
        assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_halo_map_explains_what_it_cannot_do(mesh):
    x = distribute_tensor(torch.zeros(1, 1, 4, 4), mesh, [Shard(2)])
    with pytest.raises(ValueError, match="returned 3 rows on dim 2"):
        halo_map(lambda t: t[:, :, :3], dims=(2,), halo=1)(x)
    with pytest.raises(ValueError, match="edge='wrap' is unknown"):
        halo_map(lambda t: t, dims=(2,), halo=1, edge="wrap")
    with pytest.raises(ValueError, match="2 entries for dims"):
        halo_map(lambda t: t, dims=(2,), halo=[1, 1])
    with pytest.raises(TypeError, match="must be a DTensor"):
        halo_map(lambda t: t, dims=(2,), halo=1)(torch.zeros(1, 1, 4, 4))
