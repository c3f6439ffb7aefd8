"""Lookups and indexed writes on DTensors (index_fill/copy/reduce, take/put, masked_scatter, the
masked-index pair, linalg_cross, bucketize/searchsorted/isin): single-device results forward and
backward with rules only (strict mode), even and uneven shards, and no collective where local."""

import torch
from helpers import index_agreement, partial_and_value
from spmd import spmd
from test_views import check, check_both_shardings, placements_for

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor

aten = torch.ops.aten

ROWS = torch.tensor([4, 0, 2])
COLUMNS = torch.tensor([3, 1])
TAKE_INDEX = torch.tensor([[0, 19, 7], [3, 3, 12]])
MASK = torch.tensor([True, False, True, False, True])[:, None]
PERMUTED_ROWS = torch.tensor([[0], [1], [4], [3], [2]]).expand(5, 2)
REPEATED_ROWS = torch.tensor([[0], [1], [4], [4], [2]]).expand(5, 2)


def _plain_or_like(x, value):
    """`value` as a Replicate DTensor when `x` is one (a second operand built from global data)."""
    if isinstance(x, DTensor):
        return distribute_tensor(value, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return value


# Each case maps x (5, 4) to a result; the sources are built from x so gradients reach it twice.
CASES = [
    lambda x: x.index_fill(1, COLUMNS, -1.5),
    lambda x: x.index_fill(0, ROWS, torch.tensor(2.0, dtype=torch.float64)),
    lambda x: x.index_copy(1, COLUMNS, x[:, :2] * 3),
    lambda x: x.index_copy(0, ROWS, x[1:4].flip(0)),
    lambda x: x.index_reduce(0, ROWS, x[:3] * 2, "amax"),
    lambda x: x.index_reduce(1, COLUMNS, x[:, 2:] + 1, "amin", include_self=False),
    lambda x: x.index_reduce(0, torch.tensor([4, 4, 1]), x[2:] - 1, "prod"),
    lambda x: x.index_reduce(0, ROWS, x[:3], "mean"),
    lambda x: x.take(TAKE_INDEX),
    lambda x: x.put(TAKE_INDEX[0], x[0, :3] * 2),
    lambda x: x.put(TAKE_INDEX, x[:2, 1:] - 1, accumulate=True),
    lambda x: x.masked_scatter(MASK, x * 2),
    lambda x: aten._unsafe_masked_index(x, MASK.expand(5, 2), [PERMUTED_ROWS, COLUMNS.expand(5, 2)], 0.0),
    lambda x: aten._unsafe_masked_index_put_accumulate(
        x, MASK.expand(5, 2), [REPEATED_ROWS, COLUMNS.expand(5, 2)], x[:, :2] * 2),
    lambda x: torch.linalg.cross(x[:, :3], _plain_or_like(x, torch.linspace(-1, 1, 15, dtype=torch.float64).view(5, 3))),
    lambda x: torch.cross(x[:, 1:], x[:, :3].flip(0), dim=1),
]


@spmd()
def test_indexing_forward_and_backward(mesh):
    full = torch.randn(5, 4)
    for case in CASES:
        check_both_shardings(mesh, full, case)
        if mesh.ndim == 1 and mesh.size() == 4:  # uneven explicit pieces, one empty
            check(mesh, full, [Shard(0)], case, shard_sizes={0: [0, 3, 1, 1]})


@spmd(meshes=[(4,), (2, 2)])
def test_local_rules_issue_no_collective(mesh):
    full = torch.randn(6, 4, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    index = distribute_tensor(TAKE_INDEX.repeat(4, 1), mesh, [Shard(0)] * mesh.ndim)
    whole = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    local_cases = [
        (lambda: x.index_fill(1, COLUMNS, 0.5), lambda: full.index_fill(1, COLUMNS, 0.5), False),
        (lambda: x.index_copy(1, COLUMNS, x[:, :2] * 2), lambda: full.index_copy(1, COLUMNS, full[:, :2] * 2), False),
        (lambda: x.index_reduce(1, COLUMNS, x[:, 1:3], "amax"), lambda: full.index_reduce(1, COLUMNS, full[:, 1:3], "amax"),
         False),
        (lambda: whole.take(index), lambda: full.take(TAKE_INDEX.repeat(4, 1)), True),  # a sharded index
        (lambda: torch.bucketize(x, BOUNDARIES), lambda: torch.bucketize(full, BOUNDARIES), False),
        (lambda: torch.isin(x, TEST_ELEMENTS), lambda: torch.isin(full, TEST_ELEMENTS), False),
        (lambda: torch.linalg.cross(x[:, :3], x[:, 1:]), lambda: torch.linalg.cross(full[:, :3], full[:, 1:]), False),
    ]
    for function, reference, sharded_index in local_cases:
        with shardtensor.strict_mode(), comm.observe() as records:
            result = function()
        # no data moves; a sharded index only agrees on its range
        assert list(records) == (index_agreement(mesh) if sharded_index else [])
        assert result.placements == (Shard(0),) * mesh.ndim
        assert torch.equal(result.full_tensor(), reference())


BOUNDARIES = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
TEST_ELEMENTS = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)


@spmd()
def test_lookups_shard_the_values_and_keep_the_table_whole(mesh):
    full = torch.randn(4, 5, dtype=torch.float64).round(decimals=1)
    sequences = torch.randn(4, 6, dtype=torch.float64).sort(1).values
    boundaries = distribute_tensor(BOUNDARIES, mesh, [Shard(0)] * mesh.ndim)  # moved to Replicate
    lookups = [
        lambda x, boundaries: torch.bucketize(x, boundaries, right=True),
        lambda x, boundaries: torch.bucketize(0.3, boundaries, out_int32=True),
        lambda x, boundaries: torch.searchsorted(boundaries, x),
        lambda x, boundaries: torch.searchsorted(boundaries, x, side="right", out_int32=True),
        lambda x, boundaries: torch.isin(x, boundaries.round(), invert=True),
        lambda x, boundaries: torch.isin(x, 0.5),
    ]
    for placements in (placements_for(mesh, 0, 1), placements_for(mesh, 1, 0)):
        x = distribute_tensor(full, mesh, placements)
        with shardtensor.strict_mode():
            for lookup in lookups:
                assert torch.equal(lookup(x, boundaries).full_tensor(), lookup(full, BOUNDARIES))
            # a batched sorted sequence shards its leading dim with the values (and its sorter with it)
            sequence = distribute_tensor(sequences, mesh, placements)
            order = distribute_tensor(sequences.argsort(1), mesh, placements)
            for result, reference in (
                (torch.searchsorted(sequence, x), torch.searchsorted(sequences, full)),
                (torch.searchsorted(sequence, x, sorter=order), torch.searchsorted(sequences, full, sorter=sequences.argsort(1))),
            ):
                assert torch.equal(result.full_tensor(), reference)


@spmd()
def test_partial_inputs_pass_where_exact(mesh):
    partial, full = partial_and_value(mesh, (5, 4))
    ones_full = torch.ones(5, 3, dtype=torch.float64)
    cases = [
        (lambda x: x.index_fill(0, ROWS, 0.0), Partial()),
        (lambda x: x.index_fill(0, ROWS, 2.0), None),  # 2.0 would be added once per rank: reduced first
        (lambda x: x.take(TAKE_INDEX), Partial()),
        (lambda x: torch.linalg.cross(x[:, :3], ones if isinstance(x, DTensor) else ones_full), Partial()),
    ]
    ones = distribute_tensor(ones_full, mesh, [Replicate()] * mesh.ndim)
    for function, placement in cases:
        fresh, _ = partial_and_value(mesh, (5, 4))  # the same operands, no reduction kept from a case before
        with shardtensor.strict_mode(), comm.observe() as records:
            result = function(fresh)
        if mesh.size() > 1 and placement is None:
            assert not any(p.is_partial() for p in result.placements) and list(records) != []
        elif mesh.size() > 1:
            assert result.placements == (placement,) * mesh.ndim and list(records) == []
        torch.testing.assert_close(result.full_tensor(), function(full))
    # once a Partial was reduced (index_fill with 2.0), the kept reduction is reused: Replicate, free
    cases[1][0](partial)
    for function, placement in cases:
        with shardtensor.strict_mode(), comm.observe() as records:
            result = function(partial)
        assert all(p.is_replicate() for p in result.placements) and list(records) == []
        torch.testing.assert_close(result.full_tensor(), function(full))


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_put_accumulate_of_sharded_values_adds_parts_into_a_partial(mesh):
    full = torch.randn(5, 4, dtype=torch.float64)
    index_full, source_full = TAKE_INDEX.repeat(3, 1), torch.randn(6, 3, dtype=torch.float64)
    whole = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    index, source = (distribute_tensor(t, mesh, [Shard(0)] * mesh.ndim) for t in (index_full, source_full))
    with shardtensor.strict_mode(), comm.observe() as records:
        result = whole.put(index, source, accumulate=True)
    assert list(records) == index_agreement(mesh) and result.placements == (Partial(),) * mesh.ndim
    torch.testing.assert_close(result.full_tensor(), full.put(index_full, source_full, accumulate=True))
