"""F.pad and F.interpolate on spatially sharded DTensors (issue 14): values and input gradients against
one device, on 2 and 4 ranks and 2x2 (two spatial dims sharded), even and uneven shards, shards
thinner than the halo (and empty ones); the output stays sharded on the same dims with exact shard
sizes, and the communication is a constant pad's nothing, a nearest resample's nothing, and
otherwise point-to-point only, with the exact halo bytes. Antialiased and area interpolation: the
values against one device, the field gathered or moved (antialiased) or pooled with halos (area)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import layout_box
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import DTensor, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.debug.comm_mode import OUTSIDE_OPS
from shardtensor.layout import Layout

# (mesh size, dim size) -> explicit uneven shard sizes: thin shards (1 row, thinner than a pad of 2)
# and empty ones.
UNEVEN = {
    (2, 9): [8, 1], (4, 9): [1, 2, 5, 1],
    (2, 7): [6, 1], (4, 7): [1, 3, 0, 3],
    (2, 6): [1, 5], (4, 6): [2, 0, 1, 3],
    (2, 5): [1, 4], (4, 5): [1, 1, 0, 3],
    (2, 4): [3, 1], (4, 4): [0, 2, 1, 1],
    (2, 8): [7, 1], (4, 8): [1, 4, 0, 3],
}
SHAPES = {1: (2, 3, 9), 2: (2, 3, 7, 6), 3: (1, 2, 8, 6, 5)}


def _full(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layouts(mesh, ndim):
    """(placements, shard_sizes or None) of a tensor with `ndim` dims: its spatial dims sharded, even
    and uneven (on a 1-D mesh the first and the last spatial dim; on 2x2 the first two)."""
    shape = SHAPES[ndim - 2]
    if mesh.ndim == 1:
        size = mesh.size(0)
        even = [([Shard(2)], None), ([Shard(ndim - 1)], None)]
        if size == 1:
            return even
        return even + [([Shard(2)], {0: UNEVEN[size, shape[2]]}), ([Shard(ndim - 1)], {0: UNEVEN[size, shape[-1]]})]
    if ndim == 3:
        return [([Shard(2), Shard(2)], None)]  # one spatial dim: nested over both mesh dims
    return [([Shard(2), Shard(3)], None), ([Shard(2), Shard(3)], {0: UNEVEN[2, shape[2]], 1: UNEVEN[2, shape[3]]})]


def _sharded(full, mesh, placements, shard_sizes):
    """A leaf DTensor of `full` with these placements and explicit shard sizes (None: torch.chunk's)."""
    if shard_sizes is None:
        return distribute_tensor(full, mesh, placements).requires_grad_()
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    local = layout_box(full, layout, mesh.get_coordinate()).clone()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, shard_sizes=shard_sizes).requires_grad_()


def _like(full, reference):
    """`full` laid out exactly like the DTensor `reference` (its placements and shard sizes)."""
    layout = reference.sharding
    local = layout_box(full, layout, reference.device_mesh.get_coordinate()).clone()
    return DTensor.from_local(local, reference.device_mesh, layout.placements, shard_sizes="infer")


def _check(mesh, function, ndim, *, communicates: bool):
    """Forward and backward of `function` on every layout of `_layouts` against one device; the
    output keeps the input's placements; the ops communicate point to point only (not at all if
    `communicates` is False). An evenly sharded input's gradient comes out in its own layout (no
    re-laying at the leaf); an uneven one's may need one when a resample shrinks (the input's pieces
    cannot be read from the output's)."""
    full = _full(SHAPES[ndim - 2])
    reference = full.clone().requires_grad_()
    expected = function(reference)
    grad = _full(expected.shape, seed=1)
    expected.backward(grad)
    allowed = {"batch_p2p"} if communicates else set()
    for placements, shard_sizes in _layouts(mesh, ndim):
        x = _sharded(full, mesh, placements, shard_sizes)
        with shardtensor.strict_mode(), comm.observe() as forward:
            y = function(x)
        assert list(y.placements) == list(placements), (placements, y.placements)
        assert {record.kind for record in forward} <= allowed, (placements, shard_sizes, list(forward))
        assert_close(y.full_tensor(), expected.detach())
        grad_like_y = _like(grad, y)
        with shardtensor.strict_mode(), CommDebugMode() as backward:
            y.backward(grad_like_y)
        assert_close(x.grad.full_tensor(), reference.grad)
        by_op = backward.get_comm_counts_by_op()
        relaid = by_op.pop(OUTSIDE_OPS, {})
        assert all(set(counts) <= allowed for counts in by_op.values()), (placements, shard_sizes, by_op)
        assert shard_sizes is not None or not relaid, (placements, relaid)


# ---- pads -------------------------------------------------------------------------------------------

PADS = {1: (2, 1), 2: (1, 2, 2, 1), 3: (1, 1, 2, 0, 1, 2)}


@pytest.mark.parametrize("spatial", [1, 2, 3])
@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_pad(mesh, mode, spatial):
    _check(mesh, lambda x: F.pad(x, PADS[spatial], mode=mode), spatial + 2, communicates=mode != "constant")


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_pad_that_crops(mesh, mode):
    """Negative widths crop: the edge shards lose rows (a thin one all of them), the others pad."""
    _check(mesh, lambda x: F.pad(x, (-1, 2, 1, -2), mode=mode), 4, communicates=True)


@spmd(meshes=[(2,)])
def test_circular_pad_that_crops_moves_the_cropped_dim(mesh):
    """A cropped circular pad wraps over the rows kept, not over the shards: that dim is not kept
    sharded (the values are right), a dim padded without cropping is."""
    full = _full((2, 3, 7, 6))
    for pad, keeps_shard in (((0, 0, -1, 2), False), ((-1, 2, 1, 2), True)):  # H (dim 2) cropped, then W
        x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
        reference = full.clone().requires_grad_()
        y = F.pad(x, pad, mode="circular")
        expected = F.pad(reference, pad, mode="circular")
        assert_close(y.full_tensor(), expected.detach())
        assert (list(y.placements) == [Shard(2)]) == keeps_shard
        grad = _full(expected.shape, seed=2)
        expected.backward(grad)
        y.backward(_like(grad, y))
        assert_close(x.grad.full_tensor(), reference.grad)


# ---- interpolation -----------------------------------------------------------------------------------

INTERPOLATIONS = {
    "nearest_up": (2, dict(scale_factor=2, mode="nearest")),
    "nearest_down": (2, dict(size=(3, 4), mode="nearest")),
    "nearest_1d": (1, dict(scale_factor=1.7, mode="nearest")),
    "nearest_exact": (1, dict(scale_factor=1.7, mode="nearest-exact")),
    "nearest_exact_down": (2, dict(size=(4, 5), mode="nearest-exact")),
    "nearest_3d": (3, dict(scale_factor=(2, 1.5, 0.7), mode="nearest")),
    "linear_up": (1, dict(size=20, mode="linear")),
    "linear_up_corners": (1, dict(size=20, mode="linear", align_corners=True)),
    "linear_down": (1, dict(scale_factor=0.6, mode="linear")),
    "linear_down_corners": (1, dict(size=4, mode="linear", align_corners=True)),
    "bilinear_up": (2, dict(scale_factor=2, mode="bilinear")),
    "bilinear_up_corners": (2, dict(size=(13, 11), mode="bilinear", align_corners=True)),
    "bilinear_down": (2, dict(size=(4, 3), mode="bilinear")),
    "bilinear_down_corners": (2, dict(scale_factor=0.5, mode="bilinear", align_corners=True)),
    "bicubic_up": (2, dict(size=(11, 9), mode="bicubic")),
    "bicubic_up_corners": (2, dict(scale_factor=1.5, mode="bicubic", align_corners=True)),
    "bicubic_down": (2, dict(size=(4, 4), mode="bicubic")),
    "trilinear_up": (3, dict(scale_factor=1.5, mode="trilinear")),
    "trilinear_corners": (3, dict(size=(3, 7, 4), mode="trilinear", align_corners=True)),
}


@pytest.mark.parametrize("case", list(INTERPOLATIONS))
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_interpolate(mesh, case):
    spatial, keywords = INTERPOLATIONS[case]
    _check(mesh, lambda x: F.interpolate(x, **keywords), spatial + 2, communicates=not case.startswith("nearest"))


# Antialiased bilinear/bicubic has no rule for spatial shards (`ops/nn_spatial.py`: each output row's
# taps span the scale's support, not a fixed halo): the planner gathers the spatial dims or moves the
# field to the batch. 'area' is adaptive average pooling (`ops/spatial_pool.py`): halo exchanges where
# each rank's cells are the global ones, else a move like the antialiased modes.
RESAMPLED_WHOLE_OR_POOLED = {
    "bilinear_aa_down": dict(size=(4, 3), mode="bilinear", antialias=True),
    "bilinear_aa_up": dict(scale_factor=2, mode="bilinear", antialias=True),
    "bicubic_aa_down": dict(scale_factor=0.5, mode="bicubic", antialias=True),
    "bicubic_aa_up_corners": dict(size=(11, 9), mode="bicubic", antialias=True, align_corners=True),
    "area_down": dict(size=(3, 2), mode="area"),
    "area_cells_across_shards": dict(size=(4, 5), mode="area"),
    "area_up": dict(scale_factor=2, mode="area"),
}


@pytest.mark.parametrize("case", list(RESAMPLED_WHOLE_OR_POOLED))
@spmd(meshes=[(2,), (4,), (2, 2)])
def test_antialiased_and_area_interpolation(mesh, case):
    """Values and input gradients equal one device on every layout (even, uneven, thin and empty
    shards). An antialiased output is never spatially sharded (no rule computes it on spatial shards:
    the field was gathered or moved); an area output that keeps the input's placements moved by halo
    exchanges only, forward and backward; every move is a gather, an all_to_all or a halo."""
    keywords = RESAMPLED_WHOLE_OR_POOLED[case]
    full = _full(SHAPES[2])
    reference = full.clone().requires_grad_()
    expected = F.interpolate(reference, **keywords)
    grad = _full(expected.shape, seed=1)
    expected.backward(grad)
    for placements, shard_sizes in _layouts(mesh, 4):
        x = _sharded(full, mesh, placements, shard_sizes)
        with shardtensor.strict_mode(), comm.observe() as forward:
            y = F.interpolate(x, **keywords)
        assert_close(y.full_tensor(), expected.detach())
        grad_like_y = _like(grad, y)
        with shardtensor.strict_mode(), comm.observe() as backward:
            y.backward(grad_like_y)
        assert_close(x.grad.full_tensor(), reference.grad)
        kinds = [{record.kind for record in records} for records in (forward, backward)]
        spatial = [placement for placement in y.placements if placement in (Shard(2), Shard(3))]
        assert kinds[0] | kinds[1] <= {"batch_p2p", "all_gather", "all_to_all"}, (placements, shard_sizes, kinds)
        if keywords.get("antialias"):
            assert not spatial, (placements, shard_sizes, y.placements)
        if case in ("area_down", "area_up"):  # cells inside the shards or one halo row away: pooled in place
            assert list(y.placements) == list(placements), (placements, shard_sizes, y.placements)
        elif list(y.placements) == list(placements):
            assert kinds[0] | kinds[1] <= {"batch_p2p"}, (placements, shard_sizes, kinds)


# ---- exact communication ------------------------------------------------------------------------------


def _row_bytes(full, dim):
    return full.numel() // full.shape[dim] * full.element_size()


def _neighbours(mesh):
    position, size = mesh.get_coordinate()[0], mesh.size(0)
    return (position > 0) + (position < size - 1)


@spmd(meshes=[(2,), (4,)])
def test_exact_halo_bytes(mesh):
    """Even shards of 4 rows: bilinear x2 reads one row from each neighbour (and sends one back in
    backward); a circular pad (2, 1) moves 2 rows from the last shard to the first and 1 back;
    reflect and constant pads and nearest move nothing."""
    full = _full((2, 3, 4 * mesh.size(0), 5))
    row = _row_bytes(full, 2)
    x = distribute_tensor(full, mesh, [Shard(2)]).requires_grad_()
    position, last = mesh.get_coordinate()[0], mesh.size(0) - 1

    def measured(function):
        with CommDebugMode() as forward_mode:
            y = function(x)
        grad = _like(torch.ones(y.shape, dtype=y.dtype), y)
        with CommDebugMode() as backward_mode:
            y.backward(grad)
        return forward_mode, backward_mode

    forward_mode, backward_mode = measured(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"))
    for mode in (forward_mode, backward_mode):
        assert mode.get_comm_counts() == {"batch_p2p": 1}
        total = mode.get_total_bytes()
        assert (total.sent, total.received) == (_neighbours(mesh) * row, _neighbours(mesh) * row)

    forward_mode, backward_mode = measured(lambda x: F.pad(x, (0, 0, 2, 1), mode="circular"))
    expected = {0: (1 * row, 2 * row), last: (2 * row, 1 * row)}.get(position, (0, 0))
    for mode, (sent, received) in ((forward_mode, expected), (backward_mode, expected[::-1])):
        total = mode.get_total_bytes()
        assert (total.sent, total.received) == (sent, received)
        assert set(mode.get_comm_counts()) <= {"batch_p2p"}

    for function in (lambda x: F.pad(x, (0, 0, 2, 1), mode="reflect"), lambda x: F.pad(x, (0, 0, 2, 1)),
                     lambda x: F.interpolate(x, scale_factor=3, mode="nearest")):
        forward_mode, backward_mode = measured(function)
        assert forward_mode.get_total_counts() == 0 and backward_mode.get_total_counts() == 0


@spmd(meshes=[(4,)])
def test_thin_shard_reads_from_a_neighbours_neighbour(mesh):
    """Shards [1, 1, 1, 5]: a reflect pad of 3 gives the first shard rows 3, 2, 1 (two of them from
    coordinates 2 and 3) and the bytes are exactly those rows'."""
    full = _full((1, 2, 8))
    x = _sharded(full, mesh, [Shard(2)], {0: [1, 1, 1, 5]})
    with comm.observe() as records:
        y = F.pad(x, (3, 0), mode="reflect")
    assert_close(y.full_tensor(), F.pad(full, (3, 0), mode="reflect"))
    row = _row_bytes(full, 2)
    # Output rows: coordinate 0 owns the 3 padding rows and row 0 (reads rows 3, 2, 1, 0).
    sent = {0: 0, 1: row, 2: row, 3: row}[mesh.get_coordinate()[0]]
    received = {0: 3 * row}.get(mesh.get_coordinate()[0], 0)
    assert sum(record.bytes_sent for record in records) == sent
    assert sum(record.bytes_received for record in records) == received
    assert y.sharding.sizes_along(0, 2, mesh.get_coordinate()) == [4, 1, 1, 5]


@spmd(meshes=[(2,)])
def test_gradient_with_other_pieces(mesh):
    """An output gradient sharded by torch.chunk, not like the output: the windows follow its rows."""
    full = _full((2, 3, 7, 4))
    for function in (lambda x: F.pad(x, (0, 0, 2, 1), mode="replicate"),
                     lambda x: F.interpolate(x, scale_factor=(1.5, 1), mode="bicubic", align_corners=True)):
        x = _sharded(full, mesh, [Shard(2)], {0: [6, 1]})
        reference = full.clone().requires_grad_()
        expected = function(reference)
        grad = _full(expected.shape, seed=3)
        expected.backward(grad)
        y = function(x)
        y.backward(distribute_tensor(grad, mesh, [Shard(2)]))
        assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_float32_taps(mesh):
    """In float32 torch computes source coordinates in float32: the same indices and weights here."""
    full = _full((1, 2, 9, 7)).float()
    for keywords in (dict(scale_factor=1.7, mode="nearest"), dict(scale_factor=2.3, mode="bilinear"),
                     dict(size=(13, 5), mode="bicubic", align_corners=True)):
        x = _sharded(full, mesh, [Shard(2)], {0: [4, 5]})
        reference = full.clone().requires_grad_()
        expected = F.interpolate(reference, **keywords)
        y = F.interpolate(x, **keywords)
        assert_close(y.full_tensor(), expected.detach())
        expected.sum().backward()
        y.sum().backward()
        assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2, 2)])
def test_channels_and_a_spatial_dim_sharded(mesh):
    """Channels on one mesh dim (one coordinate has none: the kernels refuse such a shard) and H on
    the other: the exchange runs along H only, on whatever channels each coordinate holds."""
    full = _full((2, 1, 7, 6))
    for function in (lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"),
                     lambda x: F.pad(x, (1, 2, 2, 1), mode="circular"),
                     lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
                     lambda x: F.interpolate(x, size=(9, 4), mode="bicubic")):
        x = distribute_tensor(full, mesh, [Shard(1), Shard(2)]).requires_grad_()
        reference = full.clone().requires_grad_()
        expected = function(reference)
        with comm.observe() as records:
            y = function(x)
        assert list(y.placements) == [Shard(1), Shard(2)]
        assert {record.kind for record in records} <= {"batch_p2p"}
        assert_close(y.full_tensor(), expected.detach())
        grad = _full(expected.shape, seed=4)
        expected.backward(grad)
        y.backward(_like(grad, y))
        assert_close(x.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_explicit_communication_refuses_a_halo_but_not_a_local_resample(mesh):
    """The halo is declared (`Row.collectives`): explicit_communication() refuses it, and passes a
    constant pad and a nearest resample, which move nothing."""
    x = distribute_tensor(_full((1, 2, 8, 3)), mesh, [Shard(2)])
    with shardtensor.explicit_communication():
        with comm.observe() as records:
            F.pad(x, (0, 0, 2, 1))
            F.interpolate(x, scale_factor=2, mode="nearest")
        assert list(records) == []
        for op, function in (("upsample_bilinear2d", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
                             ("pad_circular", lambda x: F.pad(x, (0, 0, 2, 1), mode="circular"))):
            with pytest.raises(RuntimeError, match="explicit-communication") as raised:
                function(x)
            assert op in str(raised.value) and "batch_p2p" in str(raised.value)
