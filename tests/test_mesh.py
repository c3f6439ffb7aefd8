"""mesh: coordinates, groups, names and slicing, the current-mesh stack, errors that teach."""

import pytest
import torch
import torch.distributed as dist

from shardtensor import process_groups
from shardtensor.mesh import DeviceMesh, current_mesh, init_device_mesh
from spmd import spmd


@spmd()
def test_coordinates_and_groups(mesh):
    rank = mesh.get_rank()
    assert rank == dist.get_rank()
    assert mesh.mesh.dtype == torch.int64 and mesh.size() == dist.get_world_size()
    coordinate = mesh.get_coordinate()
    assert mesh.mesh[tuple(coordinate)].item() == rank
    for mesh_dim in range(mesh.ndim):
        assert mesh.get_local_rank(mesh_dim) == coordinate[mesh_dim]
        ranks = mesh.group_ranks(mesh_dim)
        assert len(ranks) == mesh.size(mesh_dim) and ranks[coordinate[mesh_dim]] == rank
        group = mesh.get_group(mesh_dim)
        assert dist.get_process_group_ranks(group) == sorted(ranks)
    assert len(mesh.get_all_groups()) == mesh.ndim


@spmd(meshes=[(2, 2)])
def test_names_slicing_and_group_reuse(mesh):
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups_before = len(process_groups._groups)
    tp = named["tp"]
    assert tp.mesh_dim_names == ("tp",) and tp.ndim == 1
    assert tp.mesh.tolist() == named.mesh[named.get_local_rank("dp")].tolist()
    assert tp.get_group() is named.get_group("tp")
    swapped = named["tp", "dp"]
    assert swapped.mesh.tolist() == named.mesh.t().tolist()
    assert swapped.get_local_rank("dp") == named.get_local_rank(0)
    assert named["dp", "tp"] == named and hash(named["dp", "tp"]) == hash(named)
    assert named != mesh  # names differ
    assert len(process_groups._groups) == groups_before, "slicing must not create groups"
    assert repr(named) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    with pytest.raises(KeyError, match="known names: \\('dp', 'tp'\\)"):
        named["pp"]
    with pytest.raises(ValueError, match="needs a mesh_dim on a 2-D mesh"):
        named.get_group()


@spmd(meshes=[(4,)])
def test_unsorted_mesh(mesh):
    unsorted = DeviceMesh("cpu", [[3, 1], [2, 0]], mesh_dim_names=("a", "b"))
    rank = mesh.get_rank()
    expected = {3: [0, 0], 1: [0, 1], 2: [1, 0], 0: [1, 1]}[rank]
    assert unsorted.get_coordinate() == expected
    assert unsorted.group_ranks("b") == tuple(unsorted.mesh[expected[0]].tolist())
    assert unsorted["b"].mesh.tolist() == unsorted.mesh[expected[0]].tolist()


@spmd(meshes=[(4,)])
def test_submesh_and_outside_ranks(mesh):
    pair = DeviceMesh("cpu", [0, 1])  # every rank builds it; ranks 2 and 3 are outside
    inside = mesh.get_rank() < 2
    assert (pair.get_coordinate() is not None) == inside
    if not inside:
        with pytest.raises(RuntimeError, match="does not hold it"):
            pair.get_local_rank()


@spmd(meshes=[(2,)])
def test_current_mesh_stack(mesh):
    with pytest.raises(RuntimeError, match="no current mesh"):
        current_mesh()
    named = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with mesh:
        with named:
            assert current_mesh() is named
        assert current_mesh() is mesh
    with pytest.raises(RuntimeError):
        current_mesh()


@spmd(meshes=[(2,)])
def test_errors_teach(mesh):
    with pytest.raises(ValueError, match="holds 4 ranks but the world has 2"):
        init_device_mesh("cpu", (2, 2))
    with pytest.raises(ValueError, match="has 1 names but the mesh has 2 mesh dims"):
        init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="repeat a name"):
        init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="device_type 'tpu' is not supported"):
        init_device_mesh("tpu", (2,))
    with pytest.raises(ValueError, match="outside the world of 2 ranks"):
        DeviceMesh("cpu", [0, 5])
    with pytest.raises(ValueError, match="more than once"):
        DeviceMesh("cpu", [1, 1])
    with pytest.raises(KeyError, match="has no mesh_dim_names"):
        mesh["tp"]
    with pytest.raises(IndexError, match="out of range"):
        mesh.get_group(3)


@spmd(meshes=[(1, 2)])
def test_one_rank_mesh_dim(mesh):
    assert mesh.size(0) == 1 and mesh.group_ranks(0) == (mesh.get_rank(),)
    assert dist.get_process_group_ranks(mesh.get_group(0)) == [mesh.get_rank()]


def test_plain_process_world_of_one():
    """A plain python process gets a world of 1 (runs in a fresh interpreter to keep this one clean)."""
    import os
    import subprocess
    import sys

    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    code = ("from shardtensor.mesh import init_device_mesh; import torch.distributed as dist; "
            "m = init_device_mesh('cpu', (1,)); print(dist.get_world_size(), m.get_coordinate())")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=environment)
    assert output.stdout.split() == ["1", "[0]"], output.stderr
