"""Transposed convolution on spatially sharded inputs (ops/spatial_conv_transpose.py): forward and
backward (input, weight and bias gradients) against the single-device computation, with only halo
exchanges (batched point-to-point) of the field."""

import torch
import torch.nn.functional as F
from spmd import spmd
from test_spatial_pool import _like, _sharded, _uneven
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

R = Replicate()

# (name, function of (x, weight, bias), input shape, weight shape, output channels): kernel, stride,
# padding, dilation, output_padding and groups.
CASES = [
    ("k2 s2 (U-Net up)", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), (2, 4, 7, 5), (4, 3, 2, 2), 3),
    ("k3 s1 p1", lambda x, w, b: F.conv_transpose2d(x, w, b, padding=1), (1, 4, 7, 5), (4, 2, 3, 3), 2),
    ("k3 s2 p1 op1", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1),
     (1, 4, 7, 5), (4, 2, 3, 3), 2),
    ("k2 s3 (gaps) d2 groups2", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=3, dilation=2, groups=2),
     (1, 4, 7, 5), (4, 1, 2, 2), 2),
    ("k4 s2 p2 op1 d1", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 1), padding=(2, 1), output_padding=(1, 0)),
     (1, 4, 7, 5), (4, 2, 4, 3), 2),
]


def _check(function, fulls, mesh, placements, sizes=None):
    x = _sharded(fulls[0], mesh, placements, sizes)
    weight, bias = (distribute_tensor(full, mesh, [R] * mesh.ndim).requires_grad_() for full in fulls[1:])
    references = [full.clone().requires_grad_() for full in fulls]
    with shardtensor.strict_mode(), comm.observe() as forward_records:
        y = function(x, weight, bias)
    expected = function(*references)
    assert y.placements == tuple(placements)
    assert_close(y.full_tensor(), expected)
    grad = torch.randn_like(expected)
    grad_dtensor = _like(y, grad)
    with shardtensor.strict_mode(), comm.observe() as backward_records:
        y.backward(grad_dtensor)
    expected.backward(grad)
    for leaf, reference in zip((x, weight, bias), references):
        assert_close(leaf.grad.full_tensor(), reference.grad)
    kinds = [record.kind for record in forward_records] + [record.kind for record in backward_records]
    # halo exchanges, and the all_reduces of the weight and bias gradients (Partial over the shards)
    assert set(kinds) <= {"batch_p2p", "all_reduce"}, kinds
    # The backward rebuilds the window from the forward's halo and sends only its gradient back: the
    # forward's exchanges reversed, each moving the same bytes the other way.
    forward_halos = [(record.bytes_sent, record.bytes_received) for record in forward_records]
    backward_halos = [(record.bytes_received, record.bytes_sent) for record in backward_records
                      if record.kind == "batch_p2p"]
    assert backward_halos == forward_halos[::-1], (forward_halos, backward_halos)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_conv_transpose_on_spatial_shards(mesh):
    torch.manual_seed(0)
    for name, function, input_shape, weight_shape, channels in CASES:
        fulls = [torch.randn(input_shape, dtype=torch.float64), torch.randn(weight_shape, dtype=torch.float64),
                 torch.randn(channels, dtype=torch.float64)]
        if mesh.ndim == 1:
            layouts = [([Shard(2)], None), ([Shard(3)], None), ([Shard(2)], _uneven(mesh, input_shape[2]))]
        else:
            layouts = [([Shard(2), Shard(3)], {0: [1, 6], 1: [3, 2]})]
        for placements, sizes in layouts:
            try:
                _check(function, fulls, mesh, placements, sizes)
            except BaseException as error:
                error.add_note(f"{name}, placements {placements}, sizes {sizes}")
                raise


@spmd(meshes=[(2,)])
def test_conv_transpose_1d_and_3d_on_spatial_shards(mesh):
    torch.manual_seed(1)
    fulls = [torch.randn(2, 3, 9, dtype=torch.float64), torch.randn(3, 2, 3, dtype=torch.float64),
             torch.randn(2, dtype=torch.float64)]
    _check(lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1), fulls, mesh, [Shard(2)], {0: [2, 7]})
    fulls = [torch.randn(1, 2, 5, 4, 3, dtype=torch.float64), torch.randn(2, 2, 2, 3, 2, dtype=torch.float64),
             torch.randn(2, dtype=torch.float64)]
    for placements in ([Shard(2)], [Shard(3)]):
        _check(lambda x, w, b: F.conv_transpose3d(x, w, b, stride=2, padding=(0, 1, 0)), fulls, mesh, placements)
