"""Process groups that come and go: a mesh belongs to the world it was built in.

After destroy_process_group and a new init_process_group, new meshes get the new world's groups,
old meshes and DTensors raise a clear error when used, and no cache keeps the old world's groups.
Runs in its own spawned world (it destroys the world, which the shared test pools must keep).
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from shardtensor import DeviceMesh, Replicate, Shard, comm, distribute_tensor, init_device_mesh, launch
from shardtensor import plan_cache, process_groups, spec


def _raises_old_world(function) -> bool:
    with pytest.raises(RuntimeError, match="belongs to a process-group world that was destroyed"):
        function()
    return True


def _new_world(port: int):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    old_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    full = torch.arange(12.0).reshape(6, 2)
    old = distribute_tensor(full, old_mesh, [Shard(0)])
    old_one_rank = DeviceMesh("cpu", [rank]).get_group()
    assert torch.equal(old.full_tensor(), full)
    old_world = dist.group.WORLD

    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    new_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    assert new_mesh != old_mesh and new_mesh.get_group() is dist.group.WORLD is not old_world
    assert DeviceMesh("cpu", [rank]).get_group() is not old_one_rank
    new = distribute_tensor(full, new_mesh, [Shard(0)])
    assert new.device_mesh is new_mesh
    assert torch.equal(new.redistribute(new_mesh, [Replicate()]).to_local(), full)

    raised = [
        _raises_old_world(old.full_tensor),
        _raises_old_world(lambda: old + 1),
        _raises_old_world(old_mesh.get_group),
    ]
    held = [key[0] for key in comm.peers._peers_cache] + [cached.mesh for cached in spec._interned_specs.values()]
    held += [plan.mesh for plan in plan_cache.plans.values()]
    return all(raised), any(mesh is old_mesh for mesh in held), old_one_rank in process_groups._created_groups


def test_a_new_world_gets_new_groups_and_old_dtensors_raise():
    workers = launch.LocalWorkers(2, timeout=60.0)
    try:
        assert workers.run(_new_world, launch._free_port()) == [(True, False, False)] * 2
    finally:
        exit_codes = workers.close(timeout=30.0)  # a process that re-initialized c10d takes ~5 s to exit
    assert exit_codes == [0, 0]
