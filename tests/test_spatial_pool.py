"""Pooling on spatially sharded inputs (ops/spatial_pool.py): forward and backward against the
single-device computation, with only halo exchanges (batched point-to-point) of exactly the rows
each rank's output rows read."""

import torch
import torch.nn.functional as F
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.layout import Layout

R = Replicate()

# (name, function, input shape): max and avg pooling, any kernel, stride, padding, dilation, ceil_mode.
POOLINGS = [
    ("max k3 s2 p1", lambda x: F.max_pool2d(x, 3, 2, 1), (2, 3, 11, 9)),
    ("max k2", lambda x: F.max_pool2d(x, 2), (2, 3, 11, 9)),
    ("max k3 s1 p1 d2", lambda x: F.max_pool2d(x, 3, 1, 1, dilation=2), (1, 2, 11, 9)),
    ("max k(3,2) s(2,1) ceil", lambda x: F.max_pool2d(x, (3, 2), (2, 1), ceil_mode=True), (1, 2, 11, 9)),
    ("max k4 s3 p2 ceil indices", lambda x: F.max_pool2d(x, 4, 3, 2, ceil_mode=True, return_indices=True), (1, 2, 11, 9)),
    ("avg k3 s2 p1", lambda x: F.avg_pool2d(x, 3, 2, 1), (2, 3, 11, 9)),
    ("avg k3 s2 p1 exclude pad ceil", lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
     (1, 2, 11, 9)),
    ("avg k4 s3 p2 ceil", lambda x: F.avg_pool2d(x, 4, 3, 2, ceil_mode=True), (1, 2, 11, 9)),
    ("avg k2 s1 divisor", lambda x: F.avg_pool2d(x, 2, 1, 1, divisor_override=3), (1, 2, 11, 9)),
    ("adaptive avg", lambda x: F.adaptive_avg_pool2d(x, (4, 3)), (1, 2, 12, 9)),
    ("adaptive max", lambda x: F.adaptive_max_pool2d(x, (6, 3), return_indices=True), (1, 2, 12, 9)),
]
POOLINGS_1D = [
    ("max1d k3 s2 p1", lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True)),
    ("avg1d k3 s2 ceil", lambda x: F.avg_pool1d(x, 3, 2, ceil_mode=True)),
    ("adaptive avg1d", lambda x: F.adaptive_avg_pool1d(x, 4)),
]
POOLINGS_3D = [
    ("max3d k3 s2 p1", lambda x: F.max_pool3d(x, 3, 2, 1)),
    ("avg3d k(2,3,2) s(1,2,2) p(1,1,0)", lambda x: F.avg_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 1, 0))),
]


def _sharded(full, mesh, placements, sizes=None):
    """A leaf DTensor of `full`; `sizes`: {mesh_dim: shard sizes} for uneven shards."""
    if sizes is None:
        return distribute_tensor(full, mesh, placements).requires_grad_()
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=sizes)
    local = full
    coordinate = mesh.get_coordinate()
    for dim, (start, size) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        local = local.narrow(dim, start, size)
    dtensor = DTensor.from_local(local.contiguous(), mesh, placements, shape=full.shape, shard_sizes=sizes)
    return dtensor.detach().requires_grad_()


def _like(dtensor, full):
    """`full` laid out exactly like `dtensor` (its shard sizes included; nested ones inferred)."""
    layout, coordinate = dtensor.sharding, dtensor.device_mesh.get_coordinate()
    local = full
    for dim, (start, size) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        local = local.narrow(dim, start, size)
    nested = any(len(order) > 1 for order in layout.shard_order)
    sizes = None if nested else {mesh_dim: layout.sizes_along(mesh_dim, placement.dim, coordinate)
                                 for mesh_dim, placement in enumerate(layout.placements) if isinstance(placement, Shard)}
    shape = None if nested else full.shape
    result = DTensor.from_local(local.contiguous(), dtensor.device_mesh, layout.placements, shape=shape, shard_sizes=sizes)
    assert result.sharding == layout
    return result


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _check(function, full, mesh, placements, sizes=None):
    """Forward and backward equal single device; only halo exchanges; returns the records."""
    x = _sharded(full, mesh, placements, sizes)
    reference = full.detach().clone().requires_grad_()
    with shardtensor.strict_mode(), comm.observe() as forward_records:
        result = function(x)
    expected = function(reference)
    for got, want in zip(result if isinstance(result, tuple) else (result,),
                         expected if isinstance(expected, tuple) else (expected,)):
        assert got.placements == tuple(placements), (got.placements, placements)
        assert_close(got.full_tensor(), want)
    grad = torch.randn_like(_first(expected))
    grad_dtensor = _like(_first(result), grad)
    with shardtensor.strict_mode(), comm.observe() as backward_records:
        _first(result).backward(grad_dtensor)
    _first(expected).backward(grad)
    assert_close(x.grad.full_tensor(), reference.grad)
    for records in (forward_records, backward_records):
        assert {record.kind for record in records} <= {"batch_p2p"}, [record.kind for record in records]
    return forward_records, backward_records


def _uneven(mesh, size):
    """Uneven shard sizes of `size` rows along each mesh dim, thin ones included (a shard of 1 row)."""
    parts = {2: [1, size - 1], 4: [1, size - 6, 2, 3]}
    return {mesh_dim: parts[mesh.shape[mesh_dim]] for mesh_dim in range(mesh.ndim)}


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_pooling_on_spatial_shards_even_and_uneven(mesh):
    torch.manual_seed(0)
    for index, (name, function, shape) in enumerate(POOLINGS):
        full = torch.randn(shape, dtype=torch.float64)
        if mesh.ndim == 1:  # even shards of the height or the width, in turn
            layouts = [([Shard(2 + index % 2)], None), ([Shard(2)], _uneven(mesh, shape[2]))]
        else:
            layouts = [([Shard(2), Shard(3)], None), ([Shard(2), Shard(3)], {0: [1, shape[2] - 1], 1: [6, shape[3] - 6]})]
        for placements, sizes in layouts:
            try:
                _check(function, full, mesh, placements, sizes)
            except BaseException as error:
                error.add_note(f"{name}, placements {placements}, sizes {sizes}")
                raise


@spmd(meshes=[(2,), (4,)])
def test_pooling_1d_and_3d_on_spatial_shards(mesh):
    torch.manual_seed(1)
    for name, function in POOLINGS_1D:
        full = torch.randn(2, 3, 12, dtype=torch.float64)
        for sizes in (None, _uneven(mesh, 12)):
            _check(function, full, mesh, [Shard(2)], sizes)
    for name, function in POOLINGS_3D:
        full = torch.randn(1, 2, 7, 9, 6, dtype=torch.float64)
        for placements in ([Shard(2)], [Shard(3)]):
            _check(function, full, mesh, placements)


def _rows_between(window, shard, size):
    """How many rows of `window` (clipped to the input's `size` rows) lie in `shard`."""
    return max(0, min(window[1], size, shard[1]) - max(window[0], 0, shard[0]))


@spmd(meshes=[(2,), (4,)])
def test_max_pool_moves_exactly_the_halo_rows(mesh):
    """k=3, s=2, p=1 over 11 rows in uneven shards: output row o belongs to the shard holding input
    row 2o (its window's centre) and reads rows 2o-1..2o+1; each rank receives the rows of its
    window that others hold, in one batch_p2p forward, and sends their gradients back."""
    full = torch.randn(2, 3, 11, 5, dtype=torch.float32)
    sizes = _uneven(mesh, 11)[0]
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    shards = [(start, start + size) for start, size in zip(starts, sizes)]
    owner = [next(c for c, (a, b) in enumerate(shards) if a <= min(2 * o, 10) < b) for o in range(6)]
    outputs = [[o for o in range(6) if owner[o] == c] for c in range(len(sizes))]
    windows = [(2 * rows[0] - 1, 2 * rows[-1] + 2) if rows else (0, 0) for rows in outputs]
    me, row_bytes = mesh.get_coordinate()[0], 2 * 3 * 5 * 4
    received = sum(_rows_between(windows[me], shards[peer], 11) for peer in range(len(sizes)) if peer != me)
    sent = sum(_rows_between(windows[peer], shards[me], 11) for peer in range(len(sizes)) if peer != me)
    forward, backward = _check(lambda x: F.max_pool2d(x, 3, 2, 1), full, mesh, [Shard(2)], {0: sizes})
    for records, (bytes_received, bytes_sent) in ((forward, (received, sent)), (backward, (sent, received))):
        assert len(records) == (1 if received or sent else 0)
        assert sum(record.bytes_received for record in records) == bytes_received * row_bytes
        assert sum(record.bytes_sent for record in records) == bytes_sent * row_bytes


@spmd(meshes=[(2,)])
def test_adaptive_pooling_whose_grid_does_not_map_onto_the_shards_falls_back(mesh):
    """11 rows into 4 cells: no rank's window pools into exactly its global cells, so the input
    moves off the spatial dim (the plane rows) and the values stay exact."""
    full = torch.randn(1, 2, 11, 6, dtype=torch.float64)
    x = _sharded(full, mesh, [Shard(2)])
    result = F.adaptive_avg_pool2d(x, (4, 3))
    assert_close(result.full_tensor(), F.adaptive_avg_pool2d(full, (4, 3)))
    assert Shard(2) not in result.placements


@spmd(meshes=[(2, 2)])
def test_pooling_a_dim_sharded_by_both_mesh_dims(mesh):
    """H split by both mesh dims (four pieces, the innermost split uneven): the exchange runs over
    the flattened peers of both."""
    full = torch.randn(1, 2, 13, 5, dtype=torch.float64)
    for function in (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), lambda x: F.avg_pool2d(x, 2, 3, 1)):
        _check(function, full, mesh, [Shard(2), Shard(2)])
