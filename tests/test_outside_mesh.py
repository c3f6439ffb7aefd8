"""Ranks outside a DTensor's mesh: no crash, no hang, no collective; empty local tensors, right metadata.

A world of 4 ranks and the sub-mesh `DeviceMesh("cpu", [1, 3])`: ranks 1 and 3 compute, ranks 0 and 2
hold local tensors without elements and get DTensors with the same global shape and placements.
Ops whose output shapes depend on data (`nonzero`, boolean-mask indexing) are the one case where
ranks outside the mesh communicate: they receive the shapes from the mesh's first rank.
"""

import pytest
import torch
import torch.distributed as dist
from spmd import spmd

import shardtensor
from shardtensor import DeviceMesh, DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode

R = Replicate()
MEMBERS = [1, 3]


def _full(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, shape, generator=generator).to(torch.float64)


def _same_metadata_on_every_rank(*dtensors):
    """Every rank of the world (members or not) sees the same global shape and layout."""
    mine = [(tuple(d.shape), d.dtype, d.sharding) for d in dtensors]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    assert all(entry == mine for entry in gathered), gathered


def _check(dtensor, expected, inside):
    assert dtensor.shape == expected.shape and dtensor.dtype == expected.dtype
    if inside:
        assert torch.equal(dtensor.full_tensor(), expected)
    else:
        assert dtensor.to_local().numel() == 0 and dtensor.full_tensor().numel() == 0


@spmd(meshes=[(4,)])
def test_distribute_ops_and_redistribute(mesh):
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    inside = sub_mesh.get_coordinate() is not None
    full_x, full_w = _full((5, 4), 1), _full((4, 3), 2)
    with comm.observe() as records:
        x = distribute_tensor(full_x, sub_mesh, [Shard(0)])
        w = distribute_tensor(full_w, sub_mesh, [R])
        with shardtensor.strict_mode():
            results = {
                "add": x + 1,
                "mm": torch.mm(x, w),
                "sum": x.sum(),
                "view": x.view(20),
                "transpose": x.t(),
                "relu": torch.relu(x - 1),
            }
        resharded = x.redistribute(placements=[Shard(1)])
        fallback = torch.linalg.matrix_norm(x)  # no rule: the replicate fallback
    if not inside:
        assert records == []
    expected = {
        "add": full_x + 1, "mm": full_x @ full_w, "sum": full_x.sum(), "view": full_x.view(20),
        "transpose": full_x.t(), "relu": torch.relu(full_x - 1),
    }
    for name, result in results.items():
        _check(result, expected[name], inside)
    _check(resharded, full_x, inside)
    _check(fallback, torch.linalg.matrix_norm(full_x), inside)
    _same_metadata_on_every_rank(x, w, resharded, fallback, *results.values())


@spmd(meshes=[(4,)])
def test_in_place_ops_return_their_dtensor(mesh):
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    full = _full((4, 2))
    x = distribute_tensor(full, sub_mesh, [Shard(1)])
    assert x.mul_(2) is x
    _check(x, full * 2, sub_mesh.get_coordinate() is not None)


@spmd(meshes=[(4,)])
def test_from_local_and_backward(mesh):
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    coordinate = sub_mesh.get_coordinate()
    inside = coordinate is not None
    full = _full((6, 2))
    shard_sizes = {0: [4, 2]}
    local = full[:4] if coordinate == [0] else full[4:]
    if not inside:
        local = torch.empty(0, 2, dtype=full.dtype)  # its dtype is the DTensor's; the data is not kept
    local = local.clone().requires_grad_()
    x = DTensor.from_local(local, sub_mesh, [Shard(0)], shape=(6, 2), shard_sizes=shard_sizes)
    assert x.sharding.pieces[0] == (4, 2)
    y = (x * x).sum()
    y.backward()
    if inside:
        assert torch.equal(local.grad, 2 * local.detach())
        assert torch.equal(y.full_tensor(), (full * full).sum())
    else:
        assert local.grad is None and y.to_local().numel() == 0
    # to_local's backward on every rank: the gradient of the empty local tensor is an empty DTensor
    leaf = distribute_tensor(full, sub_mesh, [Shard(0)]).requires_grad_()
    (leaf.to_local() * 3).sum().backward()
    assert leaf.grad.shape == full.shape
    if inside:
        assert torch.equal(leaf.grad.full_tensor(), torch.full_like(full, 3))
    _same_metadata_on_every_rank(x, y, leaf.grad)


@spmd(meshes=[(4,)])
def test_factories(mesh):
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    inside = sub_mesh.get_coordinate() is not None
    shardtensor.manual_seed(5)  # every rank: the random counter stays in step on ranks outside the mesh
    made = {
        "zeros": shardtensor.zeros(3, 2, device_mesh=sub_mesh, placements=[Shard(0)]),
        "ones": shardtensor.ones(3, 2, device_mesh=sub_mesh, placements=[R]),
        "full": shardtensor.full((3, 2), 7.0, device_mesh=sub_mesh, placements=[Shard(1)]),
        "empty": shardtensor.empty(3, 2, device_mesh=sub_mesh, placements=[Shard(0)]),
        "rand": shardtensor.rand(3, 2, device_mesh=sub_mesh, placements=[Shard(0)]),
    }
    expected = {"zeros": torch.zeros(3, 2), "ones": torch.ones(3, 2), "full": torch.full((3, 2), 7.0)}
    for name, dtensor in made.items():
        assert dtensor.shape == (3, 2)
        if name in expected:
            _check(dtensor, expected[name], inside)
        elif not inside:
            assert dtensor.to_local().numel() == 0
    # the next random call agrees on every rank of the world, members or not
    world_rand = shardtensor.rand(4, device_mesh=mesh, placements=[R]).to_local()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, world_rand)
    assert all(torch.equal(values, world_rand) for values in gathered)
    _same_metadata_on_every_rank(*made.values())


# Ops whose output shapes depend on the data: the replicate fallback's all_gathers on the mesh's
# ranks for a Shard(0) input (the boolean mask `x > 0` is a second sharded input).
DATA_DEPENDENT = {
    "mask": (lambda x: x[x > 0], 2),
    "nonzero": (torch.nonzero, 1),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), 2),
    "unique": (lambda x: torch.unique(x, return_inverse=True, return_counts=True), 1),
    "where": (lambda x: torch.where(x > 0), 1),
}
def _sub_meshes(world) -> list[list[int]]:
    """The sub-meshes checked in a 4-rank world, as lists of ranks, the whole world last."""
    if world.ndim == 2:
        return [world.mesh[0].tolist(), world.mesh.flatten().tolist()]  # the 2x2 mesh's first row
    return [[1, 3], [0, 1, 2], world.mesh.tolist()]


@spmd(meshes=[(4,), (2, 2)])
def test_data_dependent_output_shapes(mesh):
    """Inside the mesh: the single-device values. Outside: the same global shapes, no elements, and the
    shapes' two broadcasts over the world as the only communication; on the whole world, no broadcast."""
    full = _full((5, 4), 3)
    for ranks in _sub_meshes(mesh):
        sub_mesh = DeviceMesh("cpu", ranks)
        inside = sub_mesh.get_coordinate() is not None
        x = distribute_tensor(full, sub_mesh, [Shard(0)])
        broadcasts = {"broadcast": 2} if len(ranks) < dist.get_world_size() else {}
        for name, (function, gathers) in DATA_DEPENDENT.items():
            with CommDebugMode() as comm_mode:
                results = function(x)
            expected_counts = {"all_gather": gathers, **broadcasts} if inside else broadcasts
            assert comm_mode.get_comm_counts() == expected_counts, (ranks, name, comm_mode.get_comm_counts())
            results = results if isinstance(results, tuple) else (results,)
            expected = function(full)
            expected = expected if isinstance(expected, tuple) else (expected,)
            assert len(results) == len(expected)
            for result, value in zip(results, expected):
                _check(result, value, inside)
            _same_metadata_on_every_rank(*results)


@spmd(meshes=[(4,)])
def test_data_dependent_op_failing_on_the_mesh(mesh):
    """When the op fails on the mesh's ranks, the ranks outside raise its error type instead of waiting."""
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    x = distribute_tensor(_full((8,)), sub_mesh, [Shard(0)])
    mask = distribute_tensor(torch.ones(5, dtype=torch.bool), sub_mesh, [R])
    with CommDebugMode() as comm_mode:
        with pytest.raises(IndexError, match="shape of the mask"):
            x[mask]
    assert comm_mode.get_comm_counts().get("broadcast") == 2
