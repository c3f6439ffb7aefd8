"""CommDebugMode: exact collective counts and bytes for redistributes and ops, fallbacks, the table."""

import torch
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug.comm_mode import C10D_NAMES, OUTSIDE_OPS, CommBytes, CommDebugMode

ONE_D = [(1,), (2,), (4,)]
FLOAT = 4  # bytes per float32 element


@spmd(meshes=ONE_D)
def test_shard_to_replicate_is_one_all_gather_with_exact_bytes(mesh):
    ranks = mesh.size()
    x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        full = x.full_tensor()
    assert torch.equal(full, torch.arange(32.0).reshape(8, 4))
    if ranks == 1:
        assert mode.get_total_counts() == 0 and mode.get_comm_counts() == {}
        return
    moved = (8 // ranks) * 4 * FLOAT * (ranks - 1)
    assert mode.get_total_counts() == 1
    assert mode.get_comm_counts() == {"all_gather": 1}
    assert mode.get_comm_bytes() == {"all_gather": CommBytes(moved, moved)}
    assert mode.get_total_bytes() == CommBytes(moved, moved)
    assert mode.get_comm_counts_by_op() == {OUTSIDE_OPS: {"all_gather": 1}}


@spmd(meshes=ONE_D)
def test_partial_to_replicate_is_one_all_reduce_with_ring_bytes(mesh):
    ranks = mesh.size()
    partial = DTensor.from_local(torch.ones(8, 4), mesh, [Partial()])
    with CommDebugMode() as mode:
        total = partial.redistribute(placements=[Replicate()])
    assert torch.equal(total.to_local(), torch.full((8, 4), float(ranks)))
    if ranks == 1:
        assert mode.get_total_counts() == 0
        return
    ring = 2 * (ranks - 1) * 8 * 4 * FLOAT // ranks
    assert mode.get_comm_counts() == {"all_reduce": 1}
    assert mode.get_comm_bytes() == {"all_reduce": CommBytes(ring, ring)}


@spmd(meshes=[(2,), (4,)])
def test_shard_to_other_shard_is_one_all_to_all_moving_only_foreign_pieces(mesh):
    ranks = mesh.size()
    x = distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        y = x.redistribute(placements=[Shard(1)])
    assert torch.equal(y.full_tensor(), torch.arange(64.0).reshape(8, 8))
    piece = (8 // ranks) * (8 // ranks) * FLOAT
    assert mode.get_comm_counts() == {"all_to_all": 1}
    assert mode.get_comm_bytes() == {"all_to_all": CommBytes(piece * (ranks - 1), piece * (ranks - 1))}


@spmd(meshes=[(2, 2)])
def test_two_dimensional_mesh_counts_per_mesh_dim(mesh):
    x = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Replicate(), Shard(0)])
    with CommDebugMode() as mode:
        full = x.full_tensor()
    assert torch.equal(full, torch.arange(32.0).reshape(8, 4))
    assert [(record.kind, record.mesh_dim, record.group_size) for record in mode.records] == [("all_gather", 1, 2)]
    assert mode.get_comm_bytes() == {"all_gather": CommBytes(4 * 4 * FLOAT, 4 * 4 * FLOAT)}
    assert "all_gather on mesh dim 1: 1" in mode.generate_comm_debug_tracing_table(noise_level=1)


@spmd(meshes=[(2,), (4,)])
def test_local_ops_issue_nothing_and_fallback_ops_are_named(mesh):
    a = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        total = a + b
    assert mode.get_total_counts() == 0 and mode.get_fallback_counts() == {}
    assert torch.equal(total.full_tensor(), torch.arange(16.0).reshape(4, 4) + 1)

    matrix = 2 * torch.eye(4) + 0.5
    sharded_matrix = distribute_tensor(matrix, mesh, [Shard(0)])
    with CommDebugMode() as mode:
        reflectors, _ = torch.geqrf(sharded_matrix)  # no sharding rule (no meta kernel): replicate fallback
    assert mode.get_fallback_counts() == {"aten.geqrf.default": 1}
    assert mode.get_comm_counts_by_op() == {"aten.geqrf.default": {"all_gather": 1}}
    torch.testing.assert_close(reflectors.full_tensor(), torch.geqrf(matrix)[0])
    table = mode.generate_comm_debug_tracing_table(noise_level=1)
    assert "aten.geqrf.default: all_gather x1" in table
    assert "Replicate fallback (no sharding rule):\n  aten.geqrf.default: 1" in table


@spmd(meshes=[(2,)])
def test_mode_is_reusable_nests_with_observe_and_prints_c10d_names(mesh):
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    mode = CommDebugMode()
    with comm.observe() as outer:
        with mode:
            x.full_tensor()
        with mode:
            x.full_tensor()
            x.full_tensor()
    assert len(outer) == 3
    assert mode.get_comm_counts() == {"all_gather": 2}
    table = mode.generate_comm_debug_tracing_table()
    assert table.splitlines() == [
        "Global: 2 collectives, sent 32 B, received 32 B",
        "  all_gather (c10d all_gather_into_tensor): 2, sent 32 B, received 32 B",
    ]
    assert C10D_NAMES["all_gather"] == "all_gather_into_tensor"
