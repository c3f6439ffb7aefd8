"""Convolution on spatially sharded inputs: halo exchange only, forward and backward equal to the
single-device computation (input, weight and bias gradients), on 2 and 4 ranks and 2x2, even and
uneven shards, shards thinner than the halo, stride, dilation, groups, 'same' padding, 1-d to 3-d."""

import pytest
import torch
import torch.nn.functional as F
from helpers import layout_box, seeded_randn as _randn, sharded_leaf as _sharded
from spmd import example_note, spmd
from torch.utils.checkpoint import checkpoint
from torch.testing import assert_close

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, halo
from shardtensor.debug import CommDebugMode
from shardtensor.debug.comm_mode import CommBytes

R = Replicate()


def _like(full, dtensor):
    """`full` laid out exactly as `dtensor` (its pieces included)."""
    layout = dtensor._spec.layout
    local = layout_box(full, layout, dtensor.device_mesh.get_coordinate()).clone()
    sizes = {mesh_dim: layout.sizes_along(mesh_dim, placement.dim, dtensor.device_mesh.get_coordinate())
             for mesh_dim, placement in enumerate(dtensor.placements) if isinstance(placement, Shard)
             and len(layout.shard_order[placement.dim]) == 1}
    return DTensor.from_local(local, dtensor.device_mesh, dtensor.placements, shape=full.shape,
                              shard_sizes=sizes or None)


def _check(mesh, convolution, input_shape, weight_shape, placements, shard_sizes=None, *, grad="sharded", seed=0,
           weight_placements=None, output_placements=None):
    """Forward and backward of `convolution(x, weight, bias)` with x sharded as given (the weight
    Replicate unless given), against one device; only point-to-point collectives in both, and the
    parameter gradients' all_reduce. Returns the CommDebugMode of the run."""
    x_full, weight_full = _randn(input_shape, seed), _randn(weight_shape, seed + 1)
    bias_full = _randn(weight_shape[:1], seed + 2)
    x = _sharded(x_full, mesh, placements, shard_sizes)
    weight = distribute_tensor(weight_full, mesh, weight_placements or [R] * mesh.ndim).requires_grad_()
    bias = distribute_tensor(bias_full, mesh, [R] * mesh.ndim).requires_grad_()
    references = [tensor.clone().requires_grad_() for tensor in (x_full, weight_full, bias_full)]
    expected = convolution(*references)
    grad_full = _randn(expected.shape, seed + 3)
    with CommDebugMode() as mode:
        y = convolution(x, weight, bias)
        if grad == "sharded":
            y.backward(_like(grad_full, y))
        else:  # a Replicate gradient: each rank slices its output rows
            y.backward(distribute_tensor(grad_full, mesh, [R] * mesh.ndim, src_data_rank=None))
    # The field moves only point to point; the one all_reduce is the weight and bias gradients' (Partial
    # over the spatial shards, reduced into their Replicate leaves): fewer bytes than the parameters' twice.
    assert set(mode.get_comm_counts()) <= {"batch_p2p", "all_reduce"}, mode.generate_comm_debug_tracing_table(1)
    parameter_bytes = (weight_full.numel() + bias_full.numel()) * 8
    assert mode.get_comm_bytes().get("all_reduce", CommBytes(0, 0)).sent <= 2 * parameter_bytes
    assert y.placements == tuple(output_placements or x.placements)
    assert_close(y.full_tensor(), expected.detach())
    expected.backward(grad_full)
    assert_close(x.grad.full_tensor(), references[0].grad)
    assert_close(weight.grad.full_tensor(), references[1].grad)
    assert_close(bias.grad.full_tensor(), references[2].grad)
    return mode


def _conv2d(**options):
    return lambda x, weight, bias: F.conv2d(x, weight, bias, **options)


# (conv options, weight shape) families for a (2, 4, H, W) input.
FAMILIES_2D = [
    ({"padding": 1}, (3, 4, 3, 3)),
    ({"padding": "same"}, (3, 4, 3, 2)),  # even kernel width: asymmetric 'same' goes through F.pad
    ({"stride": 2, "padding": 1}, (3, 4, 3, 3)),
    ({"dilation": 2, "padding": 1}, (3, 4, 3, 3)),
    ({"groups": 2, "padding": (2, 0)}, (4, 2, 5, 3)),
    ({}, (3, 4, 2, 4)),  # valid: the output is smaller than the input
]


@spmd(meshes=[(2,), (4,)])
def test_conv2d_on_height_shards_even_and_uneven(mesh):
    sizes = {2: [[4, 4], [6, 2]], 4: [[2, 2, 2, 2], [3, 1, 0, 4]]}[mesh.size()]
    for options, weight_shape in FAMILIES_2D:
        for shard_sizes in sizes:
            with example_note(mesh, (options, shard_sizes)):
                _check(mesh, _conv2d(**options), (2, 4, 8, 5), weight_shape, [Shard(2)], {0: shard_sizes})


@spmd(meshes=[(2,), (4,)])
def test_shards_thinner_than_the_halo_take_rows_from_farther_coordinates(mesh):
    sizes = [1, 5] if mesh.size() == 2 else [1, 1, 0, 4]
    _check(mesh, _conv2d(padding=3), (1, 2, 6, 3), (2, 2, 7, 3), [Shard(2)], {0: sizes})
    _check(mesh, _conv2d(padding=2, dilation=2), (1, 2, 6, 3), (2, 2, 3, 1), [Shard(2)], {0: sizes}, grad="replicate")
    # Stride 3 on a 6-row field: some coordinates own no output rows.
    _check(mesh, _conv2d(stride=3), (1, 2, 6, 3), (2, 2, 2, 3), [Shard(2)], {0: sizes})


@spmd(meshes=[(2, 2)])
def test_conv2d_with_height_and_width_sharded_on_a_2d_mesh(mesh):
    for options, weight_shape in FAMILIES_2D:
        _check(mesh, _conv2d(**options), (2, 4, 7, 6), weight_shape, [Shard(2), Shard(3)], {0: [5, 2], 1: [1, 5]})
    _check(mesh, _conv2d(padding=1), (2, 4, 6, 5), (3, 4, 3, 3), [Shard(0), Shard(2)], grad="replicate")
    _check(mesh, _conv2d(padding=1), (1, 4, 9, 5), (3, 4, 3, 3), [Shard(2), Shard(2)])  # H over all four ranks
    # H with input channels (and the weight's) sharded: the output is Partial over the channels.
    _check(mesh, _conv2d(padding=1, stride=(2, 1)), (2, 4, 7, 5), (3, 4, 3, 3), [Shard(2), Shard(1)],
           weight_placements=[R, Shard(1)], output_placements=[Shard(2), Partial()], grad="replicate")


@spmd(meshes=[(2,), (2, 2)])
def test_conv1d_and_conv3d(mesh):
    conv1d = lambda x, weight, bias: F.conv1d(x, weight, bias, padding=2, stride=2)  # noqa: E731
    conv3d = lambda x, weight, bias: F.conv3d(x, weight, bias, padding=1)  # noqa: E731
    if mesh.ndim == 1:
        _check(mesh, conv1d, (2, 3, 11), (4, 3, 5), [Shard(2)], {0: [7, 4]})
        _check(mesh, conv3d, (1, 2, 5, 4, 3), (2, 2, 3, 3, 3), [Shard(3)], {0: [1, 3]})
    else:
        _check(mesh, conv3d, (1, 2, 5, 4, 3), (2, 2, 3, 3, 3), [Shard(2), Shard(4)], {0: [3, 2], 1: [2, 1]})


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_halo_bytes_are_exact_forward_and_backward(mesh):
    """A 3x3 'same' conv on even H (and W on 2x2) shards: each neighbour pair swaps one row (then
    one column) of the local plane, once forward and once backward (the window's gradient back; the
    window is rebuilt from the forward's halo), in one batch_p2p per sharded dim each. The column
    exchange runs on the tensor widened along H: its columns are two rows taller (the halo rows, or
    the zero padding at an edge)."""
    batch, channels, height, width, itemsize = 2, 4, 8, 8, 8
    placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    mode = _check(mesh, _conv2d(padding=1), (batch, channels, height, width), (3, channels, 3, 3), placements)
    coordinate = mesh.get_coordinate()
    neighbours = [sum(1 for side in (0, mesh.size(mesh_dim) - 1) if coordinate[mesh_dim] != side)
                  for mesh_dim in range(mesh.ndim)]
    local_height, local_width = height // mesh.size(0), width // (1 if mesh.ndim == 1 else mesh.size(1))
    halo = [neighbours[0] * batch * channels * local_width * itemsize]  # rows of H
    if mesh.ndim == 2:
        halo.append(neighbours[1] * batch * channels * (local_height + 2) * itemsize)  # columns of W
    forward, backward = halo, halo[::-1]  # backward: the window's gradient, dims in reverse order
    records = [record for record in mode.records if record.kind == "batch_p2p"]
    assert [(record.bytes_sent, record.bytes_received) for record in records] == [(size, size) for size in forward + backward]


@spmd(meshes=[(2,), (2, 2)])
def test_backward_rebuilds_the_window_from_the_forwards_halo(mesh):
    """The forward keeps the halo it received with the input's shard, and the backward exchanges only
    the window's gradient (one batch_p2p per sharded dim): for two convolutions of one input (each its
    own halo) and for a second backward through the same graph. Nothing is kept under no_grad,
    activation checkpointing gives the single-device gradient, and an input written in place after
    the forward fails in backward as it does on one device."""
    placements = [Shard(2)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    x_full = _randn((2, 4, 8, 7), 0)
    weights = [_randn((3, 4, 3, 3), 1), _randn((3, 4, 5, 5), 2)]
    x = _sharded(x_full, mesh, placements, {0: [5, 3]})
    reference = x_full.clone().requires_grad_()
    replicated = [distribute_tensor(weight, mesh, [R] * mesh.ndim) for weight in weights]

    def two_convolutions(field, weights):
        return [F.conv2d(field, weight, padding=weight.size(-1) // 2) for weight in weights]

    with comm.observe() as records:
        outputs = two_convolutions(x, replicated)
    assert [record.kind for record in records] == ["batch_p2p"] * 2 * mesh.ndim
    expected = two_convolutions(reference, weights)
    grads = [_randn(output.shape, 5 + index) for index, output in enumerate(expected)]
    total = sum((output * _like(grad, output)).sum() for output, grad in zip(outputs, grads))
    expected_total = sum((output * grad).sum() for output, grad in zip(expected, grads))
    for attempt in range(2):  # the second backward reads the same kept halo
        with comm.observe() as records:
            total.backward(retain_graph=True)
        assert [record.kind for record in records] == ["batch_p2p"] * 2 * mesh.ndim, (attempt, records)
        expected_total.backward(retain_graph=True)
        assert_close(x.grad.full_tensor(), reference.grad)

    kept = len(halo._kept_halos)
    with torch.no_grad():
        two_convolutions(x.detach(), replicated)
    assert len(halo._kept_halos) == kept

    # Activation checkpointing recomputes the forward in backward (keeping the halo again); the
    # recomputed inner input is saved as a detached alias, so its window is exchanged again: correct.
    def checkpointed(field, weight):
        return checkpoint(lambda t: F.conv2d(F.relu(F.conv2d(t, weight, padding=1)), weight, padding=1), field,
                          use_reentrant=False)

    square = _randn((4, 4, 3, 3), 3)
    for field, weight in ((x, distribute_tensor(square, mesh, [R] * mesh.ndim)), (reference, square)):
        field.grad = None
        checkpointed(field, weight).sum().backward()
    assert_close(x.grad.full_tensor(), reference.grad)

    for field in (x, reference):
        hidden = field * 1
        output = F.conv2d(hidden, weights[0] if field is reference else replicated[0], padding=1)
        hidden.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.sum().backward()
