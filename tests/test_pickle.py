"""pickle, torch.save/torch.load and copy.deepcopy of DTensors, DeviceMeshes and modules holding them.

A mesh pickles without its process groups and re-attaches this process's groups when loaded in a
world of the same size; a DTensor pickles this rank's shard with its spec. Loading where the world
or the shard does not match raises a clear error. None of it communicates.
"""

import copy
import io
import math
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from spmd import _run_body, spmd
from torch import nn

from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, comm, distribute_tensor, launch
from shardtensor import process_groups

R = Replicate()


def _full(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _layouts(mesh):
    """Placements to try: sharded on either dim (7 rows are uneven over 2 and 4), replicated, and on
    2x2 nested (both mesh dims split dim 0) and sharded on both tensor dims."""
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [R]]
    return [[Shard(0), Shard(0)], [Shard(1), Shard(0)], [R, Shard(1)]]


def _torch_save_load(value, **load_options):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, **load_options)


def _assert_same_dtensor(copied, original, *, shares_storage: bool):
    assert type(copied) is DTensor
    assert copied.device_mesh == original.device_mesh and copied.sharding == original.sharding
    assert copied.stride() == original.stride() and copied.dtype == original.dtype
    assert copied.requires_grad == original.requires_grad
    assert torch.equal(copied.to_local(), original.to_local())
    same = copied.to_local().untyped_storage().data_ptr() == original.to_local().untyped_storage().data_ptr()
    assert same == shares_storage or original.to_local().numel() == 0


ROUND_TRIPS = {
    "pickle": lambda value: pickle.loads(pickle.dumps(value)),
    "torch.save": _torch_save_load,
    "deepcopy": copy.deepcopy,
}


@spmd()
def test_dtensor_round_trips_keep_layout_and_values_without_communication(mesh):
    full = _full((7, 5))
    for placements in _layouts(mesh):
        for requires_grad in (False, True):
            x = distribute_tensor(full, mesh, placements).requires_grad_(requires_grad)
            for name, round_trip in ROUND_TRIPS.items():
                with comm.observe() as records:
                    copied = round_trip(x)
                assert records == [], name
                _assert_same_dtensor(copied, x, shares_storage=False)
                assert torch.equal(copied.full_tensor(), full), (name, placements)  # the groups work


@spmd(meshes=[(4,)])
def test_uneven_explicit_shard_sizes_and_empty_shards_round_trip(mesh):
    sizes = (3, 0, 1, 2)
    rank = mesh.get_local_rank()
    full = _full((6, 3))
    local = full[sum(sizes[:rank]) : sum(sizes[: rank + 1])]
    x = DTensor.from_local(local, mesh, [Shard(0)], shard_sizes={0: sizes})
    for name, round_trip in ROUND_TRIPS.items():
        copied = round_trip(x)
        _assert_same_dtensor(copied, x, shares_storage=False)
        assert copied.sharding.pieces == ((3, 0, 1, 2), (3,)), name
        assert torch.equal(copied.full_tensor(), full), name


@spmd(meshes=[(2,), (2, 2)])
def test_deepcopy_gives_independent_storage_and_copies_the_gradient(mesh):
    x = distribute_tensor(_full((6, 4)), mesh, _layouts(mesh)[0]).requires_grad_()
    x.grad = distribute_tensor(_full((6, 4), seed=1), mesh, x.placements)
    copied = copy.deepcopy(x)
    assert copied.is_leaf and copied.grad is not None
    _assert_same_dtensor(copied.grad, x.grad, shares_storage=False)
    with torch.no_grad():
        copied.add_(1.0)
    assert torch.equal(x.full_tensor(), _full((6, 4)))  # the original did not move
    assert torch.equal(copied.full_tensor(), _full((6, 4)) + 1.0)
    with pytest.raises(RuntimeError, match="needs a graph leaf"):
        copy.deepcopy(x * 2)


def _tensor_parallel_linear(mesh):
    torch.manual_seed(0)
    linear = nn.Linear(5, 6)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)] * mesh.ndim))
    linear.bias = nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [R] * mesh.ndim))
    return linear


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_module_deepcopy_and_save_keep_parameters_distributed_and_independent(mesh):
    linear = _tensor_parallel_linear(mesh)
    inputs = distribute_tensor(_full((3, 5), seed=2), mesh, [R] * mesh.ndim)
    expected = linear(inputs).full_tensor()
    for name, copied in {
        "deepcopy": copy.deepcopy(linear),
        "torch.save": _torch_save_load(linear, weights_only=False),
    }.items():
        for parameter_name, parameter in copied.named_parameters():
            original = getattr(linear, parameter_name)
            assert isinstance(parameter, nn.Parameter) and isinstance(parameter, DTensor), name
            _assert_same_dtensor(parameter, original, shares_storage=False)
        assert torch.equal(copied(inputs).full_tensor(), expected), name
        with torch.no_grad():
            copied.weight.zero_()
        assert torch.equal(linear(inputs).full_tensor(), expected), name  # the original is untouched

    state = _torch_save_load(linear.state_dict())
    fresh = _tensor_parallel_linear(mesh)
    with torch.no_grad():
        fresh.weight.zero_()
    fresh.load_state_dict(state)
    assert torch.equal(fresh(inputs).full_tensor(), expected)


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_mesh_and_sub_mesh_round_trip_and_keep_working(mesh):
    named = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=tuple(f"d{i}" for i in range(mesh.ndim)))
    meshes = [mesh, named, named[named.mesh_dim_names[-1]]]
    for original in meshes:
        for name, round_trip in ROUND_TRIPS.items():
            with comm.observe() as records:
                copied = round_trip(original)
            assert records == [], name
            assert copied == original and copied.mesh_dim_names == original.mesh_dim_names, name
            assert copied.get_coordinate() == original.get_coordinate(), name
            for mesh_dim in range(copied.ndim):
                assert copied.get_group(mesh_dim) is original.get_group(mesh_dim), (name, mesh_dim)
                peers = [1] * copied.shape[mesh_dim]
                ranks = comm.all_gather(torch.tensor([dist.get_rank()]), copied, mesh_dim, dim=0, sizes=peers)
                assert tuple(ranks.tolist()) == original.group_ranks(mesh_dim), (name, mesh_dim)


@spmd(meshes=[(4,)])
def test_a_pickled_shard_loads_only_on_a_rank_holding_the_same_shard(mesh):
    full = _full((8, 2))
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = distribute_tensor(full, mesh, [R])
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()], shape=(2,))
    pickles = comm.all_gather_object(
        [pickle.dumps(sharded), pickle.dumps(replicated), pickle.dumps(partial)], mesh
    )
    neighbour = pickles[(dist.get_rank() + 1) % 4]
    assert torch.equal(pickle.loads(neighbour[1]).full_tensor(), full)  # a replica is the same anywhere
    for other in (neighbour[0], neighbour[2]):
        with pytest.raises(RuntimeError, match=r"shard of mesh coordinate \[\d\], but this rank is at mesh coordinate"):
            pickle.loads(other)
    assert torch.equal(pickle.loads(pickles[dist.get_rank()][2]).to_local(), torch.ones(2))  # its own shard


def _pickles(mesh):
    """A mesh and a DTensor pickled in this world (for loading in another)."""
    x = distribute_tensor(torch.arange(6.0), mesh, [R] * mesh.ndim)
    return pickle.dumps(mesh), pickle.dumps(x)


def _load_pickles(mesh, pickles):
    """Try to load each pickle here; return the error messages."""
    messages = []
    for data in pickles:
        try:
            pickle.loads(data)
        except RuntimeError as error:
            messages.append(str(error))
    return messages


PICKLES, LOAD_PICKLES = launch.register(_pickles), launch.register(_load_pickles)


def _run(spmd_pools, mesh_shape, body, **params) -> list:
    pool = spmd_pools.get(math.prod(mesh_shape))
    return pool.run(_run_body, body, tuple(mesh_shape), params, timeout=120)


def test_loading_in_another_world_raises_clearly(spmd_pools):
    pickles = _run(spmd_pools, (2,), PICKLES)[0]
    for data in pickles:  # this pytest process has no distributed world
        with pytest.raises(RuntimeError, match="saved in a world of 2 ranks, but torch.distributed is not initialized"):
            pickle.loads(data)
    for mesh_shape in [(1,), (4,)]:
        for messages in _run(spmd_pools, mesh_shape, LOAD_PICKLES, pickles=pickles):
            assert len(messages) == 2
            for message in messages:
                assert f"saved in a world of 2 ranks, but this world has {mesh_shape[0]} ranks" in message
                assert "torch.distributed.checkpoint" in message  # how to move between worlds


@spmd(meshes=[(2, 2)])
def test_loading_a_mesh_whose_groups_this_process_lacks_raises_clearly(mesh):
    named = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
    data = pickle.dumps(named["tp"])
    key = tuple(sorted(named["tp"].mesh.tolist()))
    group = process_groups._groups.pop(key)  # as in a fresh process that has not built the 2x2 mesh yet
    try:
        missing = re.escape(str(list(key)))
        with pytest.raises(RuntimeError, match=rf"no process group over ranks {missing}.*Build the mesh"):
            pickle.loads(data)
    finally:
        process_groups._groups[key] = group
    assert pickle.loads(data) == named["tp"]
