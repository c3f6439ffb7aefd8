"""Diagonals, padding, rot90, block_diag, _chunk_cat, fill and item on DTensors.

Every case runs under `strict_mode()` (rules only, no replicate fallback) on even and uneven
shards and compares values and gradients with plain torch (the `check` helper of test_views).
"""

import torch
import torch.nn.functional as F
from spmd import spmd
from test_views import check, check_both_shardings, placements_for

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.ops.shape_ops import diagonal_piece

aten = torch.ops.aten


def test_diagonal_piece_is_the_part_of_the_diagonal_inside_a_block():
    whole = torch.arange(42.0).reshape(6, 7)
    for offset in (-7, -3, 0, 2, 6, 8):
        diagonal = whole.diagonal(offset)
        blocks = [(0, 6, 0, 7), (2, 3, 0, 7), (0, 6, 3, 2), (4, 2, 1, 5), (5, 0, 0, 7)]
        for first_row, rows, first_column, columns in blocks:
            block = whole[first_row:first_row + rows, first_column:first_column + columns]
            local_offset, start, length = diagonal_piece(offset, first_row, first_column, rows, columns)
            assert torch.equal(block.diagonal(local_offset), diagonal[start:start + length])


DIAGONALS = [
    ((5, 4), lambda x: torch.diag_embed(x), (0, 1)),
    ((5, 4), lambda x: torch.diag_embed(x, offset=-2, dim1=0, dim2=2), (1, 0)),
    ((7,), lambda x: torch.diag(x, 1), (0, 0)),
    ((5, 6), lambda x: torch.diagflat(x, -1), (1, 0)),
    ((5, 6, 3), lambda x: x.diagonal(offset=1, dim1=0, dim2=1), (0, 2)),  # diagonal_backward
    ((5, 6, 3), lambda x: x.diagonal(offset=-2, dim1=2, dim2=1) * 1, (1, 0)),
    ((6, 5), lambda x: torch.diagonal_copy(x, 1), (1, 0)),
    ((6, 5, 2), lambda x: torch.diagonal_scatter(x, x.diagonal(1) * 3, 1), (0, 1)),
    ((6, 5, 2), lambda x: torch.diagonal_scatter(x, x.diagonal(-2, 0, 2).exp(), -2, 0, 2), (2, 1)),
]


@spmd()
def test_diagonals(mesh):
    for shape, function, dims in DIAGONALS:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 7
        check(mesh, full, placements_for(mesh, *dims), function)
        check(mesh, full, [Replicate()] * mesh.ndim, function)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_diagonal_of_a_replicated_vector_shards_the_rows_without_communication(mesh):
    vector = distribute_tensor(torch.arange(7.0), mesh, [Replicate()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        square = torch.diag_embed(vector, offset=2)
    assert list(records) == [] and square.placements == (Shard(0),) * mesh.ndim
    assert torch.equal(square.full_tensor(), torch.diag_embed(torch.arange(7.0), offset=2))


PADS = [
    lambda x: F.pad(x, (1, 2)),
    lambda x: F.pad(x, (0, 0, 2, 3), value=1.5),
    lambda x: F.pad(x, (-1, 2, 3, -4)),  # negative pads crop, across piece boundaries
    lambda x: F.pad(x, (2, -3, -2, 1)),
    lambda x: F.pad(x[None], (1, 1, 1, 1, 1, 0)),
]


@spmd()
def test_constant_pad(mesh):
    full = torch.arange(42.0).reshape(7, 6)
    for function in PADS:
        check_both_shardings(mesh, full, function)
    if mesh.ndim == 1 and mesh.size() > 1:
        sizes = {0: [1, 6]} if mesh.size() == 2 else {0: [0, 5, 0, 2]}
        for function in PADS:
            check(mesh, full, [Shard(0)], function, shard_sizes=sizes)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_padding_a_sharded_dim_is_local_and_zero_padding_keeps_partial(mesh):
    full = torch.arange(42.0).reshape(7, 6)
    x = distribute_tensor(full, mesh, placements_for(mesh, 0, 1))
    with shardtensor.strict_mode(), comm.observe() as records:
        padded = F.pad(x, (2, -1, -3, 4))
    assert list(records) == [] and padded.placements == x.placements
    assert torch.equal(padded.full_tensor(), F.pad(full, (2, -1, -3, 4)))
    partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        zero_padded = F.pad(partial, (1, 1))
        embedded = torch.diag_embed(partial)
    assert list(records) == [] and zero_padded.placements == embedded.placements == (Partial(),) * mesh.ndim
    assert torch.equal(zero_padded.full_tensor(), F.pad(full * mesh.size(), (1, 1)))
    assert torch.equal(embedded.full_tensor(), torch.diag_embed(full * mesh.size()))
    with shardtensor.strict_mode():
        one_padded = F.pad(partial, (1, 1), value=1.0)  # the pad value must not be summed per rank
    assert torch.equal(one_padded.full_tensor(), F.pad(full * mesh.size(), (1, 1), value=1.0))


SPATIAL_PADS = [
    ((3, 2, 5), lambda x: F.pad(x, (2, 1), mode="reflect"), (0, 1)),
    ((3, 2, 5), lambda x: F.pad(x, (2, 3), mode="replicate"), (1, 0)),
    ((3, 5), lambda x: F.pad(x, (1, 2), mode="reflect"), (0, None)),  # unbatched: dim 0 is channels
    ((3, 2, 4, 4), lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), (0, 1)),
    ((3, 2, 4, 4), lambda x: F.pad(x, (1, -1, 0, 2), mode="replicate"), (1, 0)),
    ((2, 3, 3, 3, 3), lambda x: F.pad(x, (1, 1, 2, 0, 0, 1), mode="replicate"), (1, 0)),
]


@spmd()
def test_reflection_and_replication_pads(mesh):
    for shape, function, dims in SPATIAL_PADS:
        full = torch.randn(shape)
        check(mesh, full, placements_for(mesh, *dims), function)


ROTATIONS = [
    lambda x: torch.rot90(x),
    lambda x: torch.rot90(x, 2),
    lambda x: torch.rot90(x, -1, (2, 0)),
    lambda x: torch.rot90(x, 4, (1, 2)),
    lambda x: torch.rot90(x, 3, (0, 2)),
]


@spmd()
def test_rot90_block_diag_chunk_cat(mesh):
    full = torch.arange(60.0).reshape(5, 3, 4)
    for function in ROTATIONS:
        check(mesh, full, placements_for(mesh, 0, 2), function)
        check(mesh, full, placements_for(mesh, 1, 0), function)
    check(mesh, full, placements_for(mesh, 1, 2), lambda x: torch.block_diag(x[0], x[1, 0], x[2:, :, 0]))
    for dim, num_chunks in [(1, 2), (2, 3), (2, 5)]:  # _chunk_cat has no derivative: forward only
        expected = aten._chunk_cat([full, full[:, :, :3] * 2], dim, num_chunks)
        for placements in (placements_for(mesh, 0, 1), placements_for(mesh, 2, 0)):
            x = distribute_tensor(full, mesh, placements)
            with shardtensor.strict_mode():
                assert torch.equal(aten._chunk_cat([x, x[:, :, :3] * 2], dim, num_chunks).full_tensor(), expected)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_rotating_onto_a_kept_dim_is_local(mesh):
    x = distribute_tensor(torch.arange(60.0).reshape(5, 3, 4), mesh, placements_for(mesh, 0, 2))
    with shardtensor.strict_mode(), comm.observe() as records:
        rotated = torch.rot90(x, 1, (0, 1))
    assert list(records) == [] and rotated.placements == tuple(placements_for(mesh, 1, 2))


@spmd()
def test_fill_and_item(mesh):
    full = torch.arange(12.0).reshape(4, 3)
    check(mesh, full, placements_for(mesh, 1, 0), lambda x: torch.fill(x, 2.5) + x)
    check(mesh, full, placements_for(mesh, 0, 1), lambda x: torch.fill(x, x.sum() / 10) * x)  # a Partial value
    partial = DTensor.from_local(torch.tensor([[1.0, 2.0]]), mesh, [Partial()] * mesh.ndim)
    with shardtensor.strict_mode():
        filled = torch.fill(partial, 3.0)  # every rank holds 3, not 3 / ranks
        assert torch.equal(filled.full_tensor(), torch.full((1, 2), 3.0))
        assert partial.sum().item() == 3.0 * mesh.size()
        one = distribute_tensor(torch.tensor([7.0]), mesh, placements_for(mesh, 0, 0))  # pieces 1, 0, 0, 0
        assert one.item() == 7.0
        start = distribute_tensor(torch.tensor(1), mesh, [Replicate()] * mesh.ndim)
        x = distribute_tensor(full, mesh, placements_for(mesh, 1))
        assert torch.equal(torch.narrow(x, 0, start, 2).full_tensor(), full[1:3])
