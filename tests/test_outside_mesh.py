"""Ranks outside a DTensor's mesh: no crash, no hang, no collective; empty local tensors, right metadata.

A world of 4 ranks and the sub-mesh `DeviceMesh("cpu", [1, 3])`: ranks 1 and 3 compute, ranks 0 and 2
hold local tensors without elements and get DTensors with the same global shape and placements.
Ops whose output shapes depend on data (`nonzero`, boolean-mask indexing) and ops that return Python
values read from the data (`item()`, `equal`, `tolist()`) are the cases where ranks outside the mesh
communicate: they receive the shapes or the values from the mesh's first rank, in an exchange over the
world that every rank on a sub-mesh takes part in (also each rank on its own row of a 2-D mesh).
"""

import collections

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import data_seed, tp_mesh
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


# How the mesh's result reaches the ranks outside it over the world (`comm.share_object`): an all_reduce
# of the number of senders, and a broadcast from the one sender; sibling meshes (each rank on its own row)
# each send, so no broadcast follows.
ONE_MESH_SENDS = {"all_reduce": 1, "broadcast": 1}
SIBLINGS_SEND = {"all_reduce": 1}


def _expected_counts(mesh_counts: dict, ranks: list[int], inside: bool, exchange: dict = ONE_MESH_SENDS) -> dict:
    """This rank's collectives: the mesh's own (`mesh_counts`) inside it, and on a sub-mesh the
    `exchange` over the world that sends the mesh's result to the ranks outside (`sub_mesh`)."""
    counts = collections.Counter(mesh_counts if inside else {})
    if len(ranks) < dist.get_world_size():
        counts.update(exchange)
    return dict(counts)


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
        histogram = torch.histogram(x, bins=3)  # its rule says the outputs: meta tensors cannot run it
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
    for result, value in zip(histogram, torch.histogram(full_x, bins=3)):
        _check(result, value, inside)
    _same_metadata_on_every_rank(x, w, resharded, fallback, *histogram, *results.values())


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
    shapes' all_reduce over the world as the only communication; on the whole world, none."""
    full = _full((5, 4), 3)
    for ranks in _sub_meshes(mesh):
        sub_mesh = DeviceMesh("cpu", ranks)
        inside = sub_mesh.get_coordinate() is not None
        x = distribute_tensor(full, sub_mesh, [Shard(0)])
        for name, (function, gathers) in DATA_DEPENDENT.items():
            with CommDebugMode() as comm_mode:
                results = function(x)
            expected_counts = _expected_counts({"all_gather": gathers}, ranks, inside)
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
    inside = sub_mesh.get_coordinate() is not None
    assert comm_mode.get_comm_counts() == _expected_counts({"all_gather": 1}, MEMBERS, inside)


@spmd(meshes=[(4,), (2, 2)])
def test_data_dependent_out_argument(mesh):
    """`nonzero(x, out=y)` resizes `y` to the data's shape on every rank, keeping `y`'s placements where
    they fit; the ranks outside the mesh receive that shape, as for `nonzero(x)`."""
    full = _full((5, 4), 3)
    expected = torch.nonzero(full)
    for ranks in _sub_meshes(mesh):
        sub_mesh = DeviceMesh("cpu", ranks)
        inside = sub_mesh.get_coordinate() is not None
        x = distribute_tensor(full, sub_mesh, [Shard(0)])
        for placement, shape in [(R, (0, 2)), (Shard(0), (3, 2))]:
            out = distribute_tensor(torch.zeros(shape, dtype=torch.int64), sub_mesh, [placement])
            with CommDebugMode() as comm_mode:
                result = torch.nonzero(x, out=out)
            assert comm_mode.get_comm_counts() == _expected_counts({"all_gather": 1}, ranks, inside)
            assert result is out and out.placements == (placement,)
            _check(out, expected, inside)
            _same_metadata_on_every_rank(out)


@spmd(meshes=[(4,)])
def test_out_argument_of_another_shape(mesh):
    """`add(x, 1, out=y)` with `y` of another shape: every rank resizes `y` as the mesh's ranks do (the
    ranks outside raised the rule's internal verdict instead), without communicating."""
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    full = _full((5, 4), 6)
    x = distribute_tensor(full, sub_mesh, [Shard(0)])
    out = distribute_tensor(torch.zeros(0, 4, dtype=full.dtype), sub_mesh, [Shard(0)])
    with CommDebugMode() as comm_mode:
        result = torch.add(x, 1, out=out)
    assert comm_mode.get_comm_counts() == {}
    assert result is out and out.placements == (Shard(0),)
    _check(out, full + 1, sub_mesh.get_coordinate() is not None)
    _same_metadata_on_every_rank(out)


# Ops that return Python values, and the collectives the mesh's ranks issue for them with a Shard(0) `x` and
# a Replicate `y`; on a sub-mesh the all_reduce that sends the value to every rank of the world comes on top.
PYTHON_VALUES = {
    "item": (lambda x, y: x.sum().item(), {"all_reduce": 1}),  # the Partial sum reduced
    "float": (lambda x, y: float(x.amax()), {"all_reduce": 1}),
    "bool": (lambda x, y: bool((x > 4).any()), {"all_reduce": 1}),
    "tolist": (lambda x, y: x.tolist(), {"all_gather": 1}),
    "equal": (lambda x, y: torch.equal(x, y), {"all_reduce": 1}),  # y sliced where it lies; each shard's answer ANDed
    "unequal": (lambda x, y: torch.equal(x, y + 1), {"all_reduce": 1}),
    "allclose": (lambda x, y: torch.allclose(x, y * 1.5), {"all_reduce": 1}),
}


@spmd(meshes=[(4,), (2, 2)])
def test_python_values_on_every_rank(mesh):
    """Every rank of the world, inside the mesh or not, gets the single-device value (torch's DTensor
    gives the ranks outside None), called twice: a sub-mesh never serves these from a plan, which
    would not send the value. On the whole world nothing is sent."""
    full = _full((5, 4), 4)
    for ranks in _sub_meshes(mesh):
        sub_mesh = DeviceMesh("cpu", ranks)
        inside = sub_mesh.get_coordinate() is not None
        x = distribute_tensor(full, sub_mesh, [Shard(0)])
        y = distribute_tensor(full, sub_mesh, [R])
        for name, (function, counts) in PYTHON_VALUES.items():
            expected = function(full, full)
            for _ in range(2):
                with CommDebugMode() as comm_mode:
                    value = function(x, y)
                assert comm_mode.get_comm_counts() == _expected_counts(counts, ranks, inside), (
                    ranks, name, comm_mode.get_comm_counts())
                assert type(value) is type(expected) and value == expected, (ranks, name, value, expected)


@spmd(meshes=[(4,), (2, 2)])
def test_tensor_split_reads_dtensor_indices_on_every_rank(mesh):
    """`tensor_split` reads a DTensor `indices` as Python values (`tolist()`): the ranks outside the mesh
    receive them, so their pieces have the single-device shapes too."""
    full = _full((5, 7), 5)
    indices_full = torch.tensor([1, 4])
    for ranks in _sub_meshes(mesh):
        sub_mesh = DeviceMesh("cpu", ranks)
        inside = sub_mesh.get_coordinate() is not None
        x = distribute_tensor(full, sub_mesh, [Shard(0)])
        indices = distribute_tensor(indices_full, sub_mesh, [R])
        with CommDebugMode() as comm_mode:
            pieces = torch.tensor_split(x, indices, 1)
        assert comm_mode.get_comm_counts() == _expected_counts({}, ranks, inside)
        expected = torch.tensor_split(full, indices_full, 1)
        assert len(pieces) == len(expected)
        for piece, value in zip(pieces, expected):
            _check(piece, value, inside)
        _same_metadata_on_every_rank(*pieces)


def _own_row(mesh, built: str):
    """This rank's row of the 2x2 mesh: sliced (`mesh["tp"]`) or built explicitly (every rank builds both
    rows), and the exchange its first rank takes part in for the ranks outside (none for a slice)."""
    if built == "sliced":
        return tp_mesh(mesh), {}
    rows = [DeviceMesh("cpu", ranks) for ranks in mesh.mesh.tolist()]
    return next(row for row in rows if row.get_coordinate() is not None), SIBLINGS_SEND


@pytest.mark.parametrize("built", ["sliced", "explicit"])
@spmd(meshes=[(2, 2)])
def test_each_rank_on_its_own_row(mesh, built):
    """Each rank runs the ops on its own row of the 2x2 mesh, inside its mesh, each row with its own data:
    every rank gets its row's single-device results. A row sliced from the world mesh sends nothing (every
    rank is in a row it sliced itself); on explicit rows both rows' first ranks send in one all_reduce over
    the world, which keeps the world in step (a broadcast from each would not match) and, with two
    senders, ends the exchange."""
    row, exchange = _own_row(mesh, built)
    full = _full((5, 4), data_seed(mesh))
    x = distribute_tensor(full, row, [Shard(0)])
    y = distribute_tensor(full, row, [R])
    ranks = row.mesh.tolist()
    for name, (function, counts) in PYTHON_VALUES.items():
        with CommDebugMode() as comm_mode:
            value = function(x, y)
        assert comm_mode.get_comm_counts() == _expected_counts(counts, ranks, True, exchange), name
        assert value == function(full, full), name
    for name, (function, gathers) in DATA_DEPENDENT.items():
        with CommDebugMode() as comm_mode:
            results = function(x)
        expected_counts = _expected_counts({"all_gather": gathers}, ranks, True, exchange)
        assert comm_mode.get_comm_counts() == expected_counts, name
        results = results if isinstance(results, tuple) else (results,)
        expected = function(full)
        for result, value in zip(results, expected if isinstance(expected, tuple) else (expected,)):
            _check(result, value, True)


@spmd(meshes=[(2, 2)])
def test_only_one_row_reads_values(mesh):
    """Rows sliced from the world mesh may run different ops (pipeline stages: only the last reads its
    loss): a value or data-dependent shape read on one row alone communicates on that row only."""
    row = tp_mesh(mesh)
    full = _full((5, 4), 7)
    x = distribute_tensor(full, row, [Shard(0)])
    if mesh.get_coordinate()[0] == 1:
        with CommDebugMode() as comm_mode:
            assert x.sum().item() == full.sum().item()
            _check(x[x > 0], full[full > 0], True)
        assert comm_mode.get_comm_counts() == {"all_reduce": 1, "all_gather": 2}
    dist.barrier()


@spmd(meshes=[(4,)])
def test_python_value_failing_on_the_mesh(mesh):
    """An op failing on the mesh's ranks raises on the ranks outside too (its error is sent instead of
    the value); a call refused by explicit-communication mode raises on every rank without sending."""
    sub_mesh = DeviceMesh("cpu", MEMBERS)
    x = distribute_tensor(_full((8,)), sub_mesh, [Shard(0)])
    y = distribute_tensor(_full((8,)).float(), sub_mesh, [Shard(0)])
    with CommDebugMode() as comm_mode:
        with pytest.raises(RuntimeError, match="did not match"):
            torch.allclose(x, y)
    assert comm_mode.get_comm_counts() == ONE_MESH_SENDS
    with CommDebugMode() as comm_mode:
        with shardtensor.explicit_communication(), pytest.raises(RuntimeError, match="communicate implicitly"):
            torch.equal(x, x)
    assert comm_mode.get_comm_counts() == {}


@spmd(meshes=[(4,)])
def test_outside_rank_while_several_sub_meshes_send(mesh):
    """Not SPMD: ranks 0-1 and 2 each read a value on their own mesh while rank 3 reads it outside the
    first: two first ranks send, so rank 3 raises instead of reading one of them (no hang anywhere)."""
    first, second = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2])
    own = second if dist.get_rank() == 2 else first
    x = distribute_tensor(_full((4,)), own, [Shard(0)])
    if dist.get_rank() == 3:
        with pytest.raises(RuntimeError, match="2 ranks sent one"):
            x.sum().item()
    else:
        assert x.sum().item() == _full((4,)).sum().item()
