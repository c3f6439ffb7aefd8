"""`DeviceMesh._flatten` and `_unflatten`: torchtitan's way of naming several mesh dims as one (dp x cp ->
"dp_cp") and of splitting one (world -> dp x cp x tp).

Every flattened mesh and every slice that names a flattened dim holds exactly the ranks that indexing
the world's rank array gives (torch's `_flatten` gives the same, and refuses the slices in another
order than the mesh dims' that ours also takes); DTensors on a flattened mesh give the
single-device values with the collectives of a 1-D mesh of that size.
"""

import pytest
import torch
import torch.distributed as dist
from spmd import spmd
from test_fsdp import _assert_same_parameters, _batches, _model, _shard, _train_reference, _train_sharded

from shardtensor import Replicate, Shard, distribute_tensor, process_groups
from shardtensor.debug import CommDebugMode
from shardtensor.mesh import DeviceMesh, init_device_mesh

NAMES = ("dp", "cp", "tp")


def _check(mesh: DeviceMesh, ranks: torch.Tensor, names: tuple[str, ...]) -> None:
    """`mesh` holds exactly `ranks` (computed by indexing the world's rank array, not by the library) and this rank at its place."""
    assert mesh.mesh.tolist() == ranks.tolist() and mesh.mesh_dim_names == names, (mesh, ranks, names)
    assert mesh.mesh[tuple(mesh.get_coordinate())].item() == dist.get_rank()


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_flatten_and_slice(mesh):
    """The ranks of torch's docstring example (`mesh_3d["dp", "cp"]._flatten()` is [0, 2, 4, 6] on tp rank 0)."""
    world = init_device_mesh("cpu", mesh.shape, mesh_dim_names=NAMES)
    ranks = torch.arange(8).view(2, 2, 2)
    dp, cp, tp = world.get_coordinate()
    flat = world["dp", "cp"]._flatten()
    _check(flat, ranks[:, :, tp].flatten(), ("dp_cp",))
    # Every tp line's dp_cp group exists on every rank (earlier tests in this process may have made some).
    assert all(process_groups.has_group(tuple(line)) for line in ranks.permute(2, 0, 1).reshape(2, 4).tolist())
    groups = len(process_groups._groups)
    assert world["dp", "cp"]._flatten() == flat and len(process_groups._groups) == groups, "flattening again makes nothing"
    _check(world["dp_cp"], ranks[:, :, tp].flatten(), ("dp_cp",))
    _check(world["dp_cp", "tp"], ranks.reshape(4, 2), ("dp_cp", "tp"))
    _check(world["tp", "dp_cp"], ranks.reshape(4, 2).t(), ("tp", "dp_cp"))
    _check(world["dp_cp", "tp"]["dp_cp"], ranks[:, :, tp].flatten(), ("dp_cp",))
    assert dist.get_process_group_ranks(world["dp_cp"].get_group()) == sorted(flat.mesh.tolist())
    assert world["dp_cp"].get_group() is flat.get_group() is world.get_group("dp_cp") is world["dp", "cp"].get_group("dp_cp")
    _check(world["dp", "tp"]._flatten("dp_tp"), ranks[:, cp, :].flatten(), ("dp_tp",))  # not adjacent in the root
    _check(world["cp", "dp"]._flatten(), ranks[:, :, tp].t().flatten(), ("cp_dp",))
    _check(world._flatten("everyone"), ranks.flatten(), ("everyone",))
    assert world["tp"]._flatten() == world["tp"]  # a 1-D mesh under its own name is itself
    assert world["dp_cp"]._sliced_from_world, "a flattened slice of the world exchanges no values with other ranks"


@spmd(meshes=[], simulated=[(2, 2, 2)])
def test_dtensors_on_flattened_dims(mesh):
    world = init_device_mesh("cpu", mesh.shape, mesh_dim_names=NAMES)
    world["dp", "cp"]._flatten()
    full = torch.arange(8.0 * 6).reshape(8, 6)
    two_d = world["dp_cp", "tp"]
    x = distribute_tensor(full, two_d, [Shard(0), Shard(1)])
    row = 2 * world.get_local_rank("dp") + world.get_local_rank("cp")
    assert torch.equal(x.to_local(), full[2 * row:2 * row + 2, 3 * world.get_local_rank("tp"):][:, :3])
    with CommDebugMode() as comm_mode:
        replicated = x.redistribute(two_d, [Replicate(), Replicate()])
    assert torch.equal(replicated.to_local(), full)
    assert comm_mode.get_comm_counts() == {"all_gather": 2}, comm_mode.get_comm_counts()
    one_d = distribute_tensor(full, world["dp_cp"], [Shard(0)])
    with CommDebugMode() as comm_mode:
        total = one_d.sum().full_tensor()
    assert torch.equal(total, full.sum())
    assert comm_mode.get_comm_counts() == {"all_reduce": 1}


@spmd(meshes=[(2, 2)])
def test_flatten_errors_name_what_is_allowed(mesh):
    world = init_device_mesh("cpu", mesh.shape, mesh_dim_names=("dp", "tp"))
    with pytest.raises(RuntimeError, match="no mesh_dim_names"):
        init_device_mesh("cpu", mesh.shape)._flatten()
    with pytest.raises(ValueError, match="'tp' already names a mesh dim"):
        world["dp", "tp"]._flatten("tp")
    world["dp"]._flatten("replicas")
    with pytest.raises(ValueError, match="already names the flattened root dims \\(0,\\)"):
        world["dp", "tp"]._flatten("replicas")
    with pytest.raises(ValueError, match="overlap"):
        world["replicas", "dp"]
    with pytest.raises(KeyError, match="flattened \\(`_flatten`\\): \\('replicas',\\)"):
        world["pp"]
    with pytest.raises(KeyError, match="known names: \\('tp',\\)"):
        world["tp"]["replicas"]  # the tp slice does not span the flattened dp dim
    assert world["replicas"].mesh.tolist() == world["dp"].mesh.tolist()


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_hsdp_over_a_flattened_shard_dim(mesh):
    """torchtitan's HSDP mesh: `fully_shard(mesh=world["dp_replicate", "dp_shard_cp"])`, the shard dim
    flattened from dp_shard x cp; every rank takes its eighth of the batch; training equals one device."""
    world = init_device_mesh("cpu", mesh.shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    world["dp_shard", "cp"]._flatten("dp_shard_cp")
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    sharded = _shard(_model(), world["dp_replicate", "dp_shard_cp"])
    assert {parameter.placements for parameter in sharded.parameters()} == {(Replicate(), Shard(0))}
    _train_sharded(sharded, batches, dist.get_rank(), dist.get_world_size())
    _assert_same_parameters(sharded, reference)


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_unflatten(mesh):
    """torchtitan's world mesh: one "world" dim unflattened into (dp, cp, tp); and a slice's dim split in
    two, which every rank does for its own slice (groups made for all of them, in one order)."""
    ranks = torch.arange(8).view(2, 2, 2)
    dp, cp, tp = ranks.eq(dist.get_rank()).nonzero()[0].tolist()
    world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    unflattened = world._unflatten(0, (2, 2, 2), ("dp", "cp", "tp"))
    _check(unflattened, ranks, ("dp", "cp", "tp"))
    _check(unflattened["cp", "tp"], ranks[dp], ("cp", "tp"))
    assert dist.get_process_group_ranks(unflattened.get_group("cp")) == ranks[dp, :, tp].tolist()
    _check(unflattened["dp", "cp"]._flatten(), ranks[:, :, tp].flatten(), ("dp_cp",))
    two_d = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    split = two_d["dp"]._unflatten("dp", (2, 2), ("replicate", "shard"))
    _check(split, ranks[:, :, tp], ("replicate", "shard"))
    assert dist.get_process_group_ranks(split.get_group("shard")) == ranks[dp, :, tp].tolist()
    x = distribute_tensor(torch.arange(12.0), split, [Replicate(), Shard(0)])
    assert torch.equal(x.to_local(), torch.arange(12.0).chunk(2)[cp]) and torch.equal(x.full_tensor(), torch.arange(12.0))
    with pytest.raises(ValueError, match="give positive mesh_sizes whose product is that"):
        world._unflatten("world", (3, 3), ("a", "b"))
    with pytest.raises(ValueError, match="repeat a name"):
        two_d._unflatten("dp", (2, 2), ("tp", "x"))
