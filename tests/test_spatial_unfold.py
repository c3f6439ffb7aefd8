"""unfold/fold (im2col/col2im) of images sharded on their height (ops/spatial_unfold.py): forward
and backward against the single-device computation, the field moved by halo exchanges only; an
image sharded on its width (no layout of L holds a width shard) gathers the width, and only it."""

import torch
import torch.nn.functional as F
from spmd import spmd
from test_spatial_pool import _like, _sharded, _uneven
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, comm

# (name, function, input shape, stride 1: the backward's image shards are the input's)
CASES = [
    ("unfold k3 p1", lambda x: F.unfold(x, 3, padding=1), (2, 3, 9, 5), True),
    ("unfold k(2,3) d(2,1) p(1,0)", lambda x: F.unfold(x, (2, 3), dilation=(2, 1), padding=(1, 0)), (1, 2, 9, 5), True),
    ("unfold k2 s2 (patches)", lambda x: F.unfold(x, 2, stride=2), (1, 2, 10, 6), False),
    ("unfold k3 s2 p1", lambda x: F.unfold(x, 3, stride=2, padding=1), (1, 2, 9, 5), False),
    ("fold of unfold k3 p1", lambda x: F.fold(F.unfold(x, 3, padding=1), x.shape[-2:], 3, padding=1), (2, 3, 9, 5),
     True),
    ("unbatched unfold k3", lambda x: F.unfold(x, 3), (3, 9, 5), True),
]


def _forward_and_backward(function, full, mesh, placements, sizes):
    """`function` of `full` sharded as given, forward and backward (strict mode) against one device;
    returns the output and the forward's and backward's communication records."""
    x = _sharded(full, mesh, placements, sizes)
    reference = full.clone().requires_grad_()
    with shardtensor.strict_mode(), comm.observe() as records:
        y = function(x)
    expected = function(reference)
    assert_close(y.full_tensor(), expected)
    grad = torch.randn_like(expected)
    with shardtensor.strict_mode(), comm.observe() as backward_records:
        y.backward(_like(y, grad))
    expected.backward(grad)
    assert_close(x.grad.full_tensor(), reference.grad)
    return y, records, backward_records


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_unfold_and_fold_on_height_shards(mesh):
    torch.manual_seed(0)
    for name, function, shape, same_shards in CASES:
        height = len(shape) - 2
        full = torch.randn(shape, dtype=torch.float64)
        if mesh.ndim == 1:
            layouts = [([Shard(height)], None), ([Shard(height)], _uneven(mesh, shape[height]))]
        else:  # the batch on the second mesh dim (an unbatched image: whole there)
            second = Shard(0) if len(shape) == 4 else Replicate()
            layouts = [([Shard(height), second], {0: [2, shape[height] - 2]})]
        for placements, sizes in layouts:
            try:
                y, records, backward_records = _forward_and_backward(function, full, mesh, placements, sizes)
                assert y.placements[0] == Shard(height)
                assert {record.kind for record in records} <= {"batch_p2p"}, [record.kind for record in records]
                if same_shards:
                    kinds = {record.kind for record in backward_records}
                    assert kinds <= {"batch_p2p"}, kinds
            except BaseException as error:
                error.add_note(f"{name}, placements {placements}, sizes {sizes}")
                raise


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_unfold_and_fold_on_width_shards_gather_the_width_only(mesh):
    """A width shard is a strided set of L (a run of block columns in every block row): the width is
    gathered over its mesh dim (one all_gather of exactly the others' columns, even or uneven; or the
    planner moves it to the batch, one all_to_all), the height keeps its halo exchange (2x2: H on mesh
    dim 0), and the backward moves halos only (or the batch back to the width)."""
    torch.manual_seed(0)
    shape, itemsize = (1, 3, 8, 10), 8
    full = torch.randn(shape, dtype=torch.float64)
    width_mesh_dim = mesh.ndim - 1
    placements = [Shard(3)] if mesh.ndim == 1 else [Shard(2), Shard(3)]
    parts = mesh.size(width_mesh_dim)
    for name, function, _, _ in CASES[:5]:
        for sizes in (None, {width_mesh_dim: _uneven(mesh, shape[3])[width_mesh_dim]}):
            try:
                y, records, backward_records = _forward_and_backward(function, full, mesh, placements, sizes)
                local = _sharded(full, mesh, placements, sizes).to_local()
                local_bytes = local.numel() * itemsize
                rows_bytes = local.numel() // local.size(3) * shape[3] * itemsize  # this rank's rows, all columns
                move, *halos = records
                assert (move.kind, move.mesh_dim) in {("all_gather", width_mesh_dim), ("all_to_all", width_mesh_dim)}
                assert move.bytes_received <= rows_bytes - local_bytes, move  # never more than the others' columns
                if move.kind == "all_gather":
                    assert move == comm.CommRecord("all_gather", width_mesh_dim, parts, local_bytes * (parts - 1),
                                                   rows_bytes - local_bytes)
                assert {record.kind for record in halos} <= {"batch_p2p"} and not (halos and mesh.ndim == 1), records
                assert {record.kind for record in backward_records} <= {"batch_p2p", "all_to_all"}, backward_records
                if mesh.ndim == 2 and move.kind == "all_gather":  # H keeps its halo exchange on mesh dim 0
                    assert y.placements == (Shard(2), Replicate())
            except BaseException as error:
                error.add_note(f"{name}, placements {placements}, sizes {sizes}")
                raise
