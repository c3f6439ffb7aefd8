"""`DeviceMesh.from_group`: meshes over the user's own process groups, 1-D and N-D, and the errors that teach."""

import pytest
import torch
import torch.distributed as dist

from helpers import exact_full
from shardtensor import Replicate, Shard, distribute_tensor
from shardtensor import process_groups
from shardtensor.comm.peers import _peers
from shardtensor.mesh import DeviceMesh, init_device_mesh
from spmd import spmd


def _pair_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """On a world of 4 laid out [[0, 1], [2, 3]]: this rank's row group (tp) and column group (dp)
    (every rank creates every group, in the same order)."""
    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    rank = dist.get_rank()
    return rows[rank // 2], columns[rank % 2]


@spmd(meshes=[(4,)])
def test_one_group_gives_a_1d_mesh_over_it(mesh):
    row, _ = _pair_groups()
    created_before = len(process_groups._created_groups)
    tp = DeviceMesh.from_group(row, "cpu", mesh_dim_names=("tp",))
    assert tp.mesh.tolist() == dist.get_process_group_ranks(row) and tp.mesh_dim_names == ("tp",)
    assert tp.get_group() is row and tp.get_group("tp") is row and tp.get_all_groups() == [row]
    assert _peers(tp, 0).group is row, "collectives must run over the user's group"
    again = DeviceMesh.from_group(row, "cpu", tp.mesh.tolist(), mesh_dim_names=("tp",))
    assert again == tp and hash(again) == hash(tp), "meshes over the same group and ranks are equal"
    assert len(process_groups._created_groups) == created_before, "from_group creates no group"
    library_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    assert library_tp.mesh.tolist() == tp.mesh.tolist() and library_tp != tp, "their groups differ"
    full = exact_full((4, 3))
    sharded = distribute_tensor(full, tp, [Shard(0)])
    assert torch.equal(sharded.full_tensor(), full)
    assert torch.equal(sharded.redistribute(tp, [Replicate()]).to_local(), full)
    world = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    assert world.mesh.tolist() == [0, 1, 2, 3] and world.get_group() is dist.group.WORLD


@spmd(meshes=[(2, 2)])
def test_list_of_groups_gives_an_nd_mesh(mesh):
    row, column = _pair_groups()
    mesh_2d = DeviceMesh.from_group([column, row], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert mesh_2d.get_group("dp") is column and mesh_2d.get_group("tp") is row
    assert mesh_2d["tp"].get_group() is row and mesh_2d["dp"].get_group() is column
    assert mesh_2d.get_coordinate() == mesh.get_coordinate()
    full = exact_full((4, 6))
    sharded = distribute_tensor(full, mesh_2d, [Shard(0), Shard(1)])
    assert torch.equal(sharded.full_tensor(), full)
    moved = sharded.redistribute(mesh_2d, [Shard(1), Replicate()])
    assert torch.equal(moved.full_tensor(), full)
    assert _peers(mesh_2d, "tp").group is row and _peers(mesh_2d, 0).group is column


@spmd(meshes=[(2, 2)])
def test_from_group_errors_teach(mesh):
    row, column = _pair_groups()
    ranks = [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="group for mesh dim 0 holds ranks .* along mesh dim 0"):
        DeviceMesh.from_group([row, column], "cpu", ranks, mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="group for mesh dim 1 holds ranks"):
        DeviceMesh.from_group([column, dist.group.WORLD], "cpu", ranks, mesh_dim_names=("dp", "tp"))
    with pytest.raises(TypeError, match="this rank is not a member"):
        DeviceMesh.from_group([column, dist.GroupMember.NON_GROUP_MEMBER], "cpu", ranks, mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="need the mesh .* and mesh_dim_names"):
        DeviceMesh.from_group([column, row], "cpu", ranks)
    with pytest.raises(ValueError, match="has 1 mesh dims but 2 process groups"):
        DeviceMesh.from_group([column, row], "cpu", [0, 1, 2, 3], mesh_dim_names=("all",))
    with pytest.raises(ValueError, match="does not list the group's ranks"):
        DeviceMesh.from_group(row, "cpu", list(reversed(dist.get_process_group_ranks(row))))
    with pytest.raises(TypeError, match="a ProcessGroup or a non-empty list"):
        DeviceMesh.from_group([], "cpu", ranks, mesh_dim_names=("dp", "tp"))
