"""comm: every collective in coordinate order, even/uneven/empty pieces, bytes recorded, async handles."""

import math

import pytest
import torch

from shardtensor import comm
from shardtensor.mesh import DeviceMesh
from spmd import spmd

SIZES = {"even": [2, 2, 2, 2], "uneven": [3, 1, 0, 2], "empty_first": [0, 2, 1, 1]}
REDUCE_OPS = ["sum", "avg", "max", "min", "product"]


def line_offset(mesh, mesh_dim) -> int:
    """A number that differs between the lines along mesh_dim, so a wrong group shows in the values."""
    coordinate = mesh.get_coordinate()
    others = [c for index, c in enumerate(coordinate) if index != mesh_dim]
    other_shape = [size for index, size in enumerate(mesh.shape) if index != mesh_dim]
    flat = 0
    for c, size in zip(others, other_shape):
        flat = flat * size + c
    return 1000 * flat


def global_tensor(mesh, mesh_dim, sizes, dim, other=3):
    shape = [other, other]
    shape[dim] = sum(sizes)
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + line_offset(mesh, mesh_dim)


def meshes_with_unsorted(mesh):
    """The harness mesh, plus on 4 ranks a mesh whose coordinate order differs from rank order."""
    if mesh.size() == 4 and mesh.ndim == 1:
        return [mesh, DeviceMesh("cpu", [[3, 1], [2, 0]], mesh_dim_names=("a", "b"))]
    return [mesh]


@pytest.mark.parametrize("kind", sorted(SIZES))
@pytest.mark.parametrize("dim", [0, 1])
@spmd()
def test_all_gather(mesh, kind, dim):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            sizes = SIZES[kind][:n]
            full = global_tensor(current, mesh_dim, sizes, dim)
            local = full.split(sizes, dim)[me]
            with comm.observe() as records:
                result = comm.all_gather(local, current, mesh_dim, dim=dim, sizes=sizes)
                handle = comm.all_gather(local, current, mesh_dim, dim=dim, sizes=sizes, async_op=True)
            assert torch.equal(result, full)
            assert torch.equal(handle.wait(), full)
            if n == 1:
                assert records == []
                continue
            row = full.numel() // full.shape[dim]
            others = sum(size for c, size in enumerate(sizes) if c != me)
            expected = comm.CommRecord("all_gather", mesh_dim, n, local.numel() * 4 * (n - 1), others * row * 4)
            assert records == [expected, expected]


def overlap(before, after, first, second):
    """Length of the intersection of piece `first` of `before` with piece `second` of `after`."""
    start = max(sum(before[:first]), sum(after[:second]))
    stop = min(sum(before[: first + 1]), sum(after[: second + 1]))
    return max(0, stop - start)


@pytest.mark.parametrize("kind", sorted(SIZES))
@pytest.mark.parametrize("split_dim, concat_dim", [(0, 1), (1, 0), (0, 0)])
@spmd()
def test_all_to_all(mesh, kind, split_dim, concat_dim):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            before = SIZES[kind][:n]
            if split_dim == concat_dim:  # re-split one dim from the pieces `before` to even pieces `after`
                total = sum(before)
                after = [total // n + (1 if c < total % n else 0) for c in range(n)]
                split_sizes = [overlap(before, after, me, c) for c in range(n)]
                concat_sizes = [overlap(before, after, c, me) for c in range(n)]
            else:  # Shard(concat_dim) with pieces `before` -> Shard(split_dim) with pieces `after`
                after = [1, 2, 0, 3][:n]
                split_sizes, concat_sizes = after, before
            shape = [5, 5]
            shape[concat_dim] = sum(before)
            shape[split_dim] = sum(after)
            full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) + line_offset(current, mesh_dim)
            local = full.split(before, concat_dim)[me]
            expected = full.split(after, split_dim)[me]
            with comm.observe() as records:
                result = comm.all_to_all(local, current, mesh_dim, split_dim=split_dim, split_sizes=split_sizes,
                                         concat_dim=concat_dim, concat_sizes=concat_sizes)
            assert torch.equal(result, expected), (result, expected)
            handle = comm.all_to_all(local, current, mesh_dim, split_dim=split_dim, split_sizes=split_sizes,
                                     concat_dim=concat_dim, concat_sizes=concat_sizes, async_op=True)
            assert torch.equal(handle.wait(), expected)
            if n > 1:
                own = local.split(split_sizes, split_dim)[me].numel() * 4
                assert records == [comm.CommRecord("all_to_all", mesh_dim, n, local.numel() * 4 - own,
                                                   expected.numel() * 4 - own)]


@pytest.mark.parametrize("reduce_op", REDUCE_OPS)
@spmd()
def test_all_reduce(mesh, reduce_op):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            offset = line_offset(current, mesh_dim)
            contributions = [torch.arange(6.0).view(2, 3) / 4 + c + offset for c in range(n)]
            stacked = torch.stack(contributions)
            expected = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
                        "min": stacked.amin(0), "product": stacked.prod(0)}[reduce_op]
            local = contributions[me].clone()
            with comm.observe() as records:
                result = comm.all_reduce(local, current, mesh_dim, reduce_op=reduce_op)
            torch.testing.assert_close(result, expected)
            assert torch.equal(local, contributions[me]), "the input must not change"
            assert torch.equal(comm.all_reduce(local, current, mesh_dim, reduce_op=reduce_op, async_op=True).wait(), result)
            if n > 1:
                traffic = 2 * (n - 1) * 24 // n
                assert records == [comm.CommRecord("all_reduce", mesh_dim, n, traffic, traffic)]


@spmd()
def test_all_reduce_bool(mesh):
    me = mesh.get_local_rank(0)
    local = torch.tensor([True, me == 0, False])
    assert comm.all_reduce(local, mesh, 0, reduce_op="max").tolist() == [True, True, False]
    expected_all = [True, mesh.size(0) == 1, False]
    assert comm.all_reduce(local, mesh, 0, reduce_op="min").tolist() == expected_all
    assert comm.all_reduce(local, mesh, 0, reduce_op="product").dtype == torch.bool


@pytest.mark.parametrize("reduce_op", REDUCE_OPS)
@pytest.mark.parametrize("kind", sorted(SIZES))
@pytest.mark.parametrize("dim", [0, 1])
@spmd()
def test_reduce_scatter(mesh, reduce_op, kind, dim):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            sizes = SIZES[kind][:n]
            contributions = [global_tensor(current, mesh_dim, sizes, dim) / 8 + c for c in range(n)]
            stacked = torch.stack(contributions)
            reduced = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
                       "min": stacked.amin(0), "product": stacked.prod(0)}[reduce_op]
            expected = reduced.split(sizes, dim)[me]
            local = contributions[me]
            with comm.observe() as records:
                result = comm.reduce_scatter(local, current, mesh_dim, reduce_op=reduce_op, dim=dim, sizes=sizes)
            torch.testing.assert_close(result, expected)
            if n > 1:
                own = expected.numel() * 4
                assert records == [comm.CommRecord("reduce_scatter", mesh_dim, n, local.numel() * 4 - own, (n - 1) * own)]


@pytest.mark.parametrize("src", [0, -1])
@spmd()
def test_broadcast(mesh, src):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            source = src % n
            expected = torch.arange(6).view(2, 3) + line_offset(current, mesh_dim) + 10 * source
            local = expected.clone() if me == source else torch.full((2, 3), -1)
            with comm.observe() as records:
                result = comm.broadcast(local, current, mesh_dim, src=source)
            assert torch.equal(result, expected)
            handle = comm.broadcast(local, current, mesh_dim, src=source, async_op=True)
            assert torch.equal(handle.wait(), expected)
            if n > 1:
                sent, received = (48 * (n - 1), 0) if me == source else (0, 48)
                assert records == [comm.CommRecord("broadcast", mesh_dim, n, sent, received)]


@pytest.mark.parametrize("kind", sorted(SIZES))
@spmd()
def test_scatter(mesh, kind):
    for current in meshes_with_unsorted(mesh):
        for mesh_dim in range(current.ndim):
            n, me = current.size(mesh_dim), current.get_local_rank(mesh_dim)
            sizes = SIZES[kind][:n]
            source = n - 1
            full = global_tensor(current, mesh_dim, sizes, 0)
            pieces = list(full.split(sizes, 0))
            result = comm.scatter(pieces if me == source else None, current, mesh_dim, src=source,
                                  shape=pieces[me].shape, dtype=torch.float32)
            assert torch.equal(result, pieces[me])
            handle = comm.scatter(pieces if me == source else None, current, mesh_dim, src=source,
                                  shape=pieces[me].shape, dtype=torch.float32, async_op=True)
            assert torch.equal(handle.wait(), pieces[me])


@spmd()
def test_bool_moves_exactly(mesh):
    n, me = mesh.size(0), mesh.get_local_rank(0)
    full = torch.arange(4 * n) % 3 == 0
    local = full.split([4] * n)[me]
    assert torch.equal(comm.all_gather(local, mesh, 0, dim=0, sizes=[4] * n), full)
    sizes = [3, 1, 0, 2][:n]
    full = full[: sum(sizes)]
    assert torch.equal(comm.all_gather(full.split(sizes)[me], mesh, 0, dim=0, sizes=sizes), full)


@spmd()
def test_all_gather_object(mesh):
    coordinate = mesh.get_coordinate()
    everything = comm.all_gather_object({"coordinate": coordinate}, mesh)
    expected = [list(divmod(index, mesh.shape[-1])) if mesh.ndim == 2 else [index] for index in range(mesh.size())]
    assert [item["coordinate"] for item in everything] == expected
    for mesh_dim in range(mesh.ndim):
        along = comm.all_gather_object(("x" * coordinate[mesh_dim], mesh.get_rank()), mesh, mesh_dim)
        assert [text for text, _ in along] == ["x" * c for c in range(mesh.size(mesh_dim))]
        assert mesh.get_rank() in [rank for _, rank in along]


@spmd()
def test_all_gather_over_mesh(mesh):
    """Every rank's row in row-major coordinate order, in one all_gather (these meshes span the world)."""
    with comm.observe() as records:
        rows = comm.all_gather_over_mesh(torch.tensor([mesh.get_rank(), 7]), mesh)
    assert rows.tolist() == [[rank, 7] for rank in mesh.mesh.flatten().tolist()]
    assert [record.kind for record in records] == (["all_gather"] if mesh.size() > 1 else [])


@spmd()
def test_broadcast_object(mesh):
    """Every peer gets the source coordinate's object; two broadcasts (length, then bytes), recorded."""
    for mesh_dim in range(mesh.ndim):
        source = mesh.size(mesh_dim) - 1
        mine = {"from": mesh.get_coordinate()} if mesh.get_local_rank(mesh_dim) == source else None
        with comm.observe() as records:
            received = comm.broadcast_object(mine, mesh, mesh_dim, src=source)
        expected = list(mesh.get_coordinate())
        expected[mesh_dim] = source
        assert received == {"from": expected}
        assert [record.kind for record in records] == ["broadcast"] * (2 if mesh.size(mesh_dim) > 1 else 0)


@spmd()
def test_share_object(mesh):
    """Every peer gets the one sender's object and the number of senders (an all_reduce, then a broadcast
    from the sender); with several senders or none, their number and None (the all_reduce only)."""
    for mesh_dim in range(mesh.ndim):
        peers = mesh.size(mesh_dim)
        expected = list(mesh.get_coordinate())
        expected[mesh_dim] = peers - 1
        for padding in (0, 2000):
            sent = {"from": mesh.get_coordinate(), "padding": "x" * padding}
            mine = sent if mesh.get_local_rank(mesh_dim) == peers - 1 else None
            with comm.observe() as records:
                senders, received = comm.share_object(mine, mesh, mesh_dim)
            assert (senders, received) == (1, {"from": expected, "padding": "x" * padding})
            assert [record.kind for record in records] == (["all_reduce", "broadcast"] if peers > 1 else [])
        if peers > 1:
            with comm.observe() as records:
                assert comm.share_object("x" * 3000, mesh, mesh_dim) == (peers, None)
                assert comm.share_object(None, mesh, mesh_dim) == (0, None)
            assert [record.kind for record in records] == ["all_reduce"] * 2


@spmd(meshes=[(4,)])
def test_unsorted_mesh_coordinates(mesh):
    unsorted = DeviceMesh("cpu", [[3, 1], [2, 0]])
    rank = mesh.get_rank()
    coordinate = unsorted.get_coordinate()
    assert unsorted.group_ranks(0) == tuple(unsorted.mesh[:, coordinate[1]].tolist())
    gathered = comm.all_gather(torch.tensor([rank]), unsorted, 1, dim=0, sizes=[1, 1])
    assert gathered.tolist() == unsorted.mesh[coordinate[0]].tolist()
    assert comm.all_gather_object(rank, unsorted) == [3, 1, 2, 0]
    assert comm.all_gather_over_mesh(torch.tensor(rank), unsorted).tolist() == [3, 1, 2, 0]


@spmd(meshes=[(2,)])
def test_point_to_point(mesh):
    rank = mesh.get_rank()
    peer = 1 - rank
    if rank == 0:
        comm.send(torch.arange(3), 1)
    else:
        assert comm.recv((3,), torch.int64, 0, device=mesh.device_type).tolist() == [0, 1, 2]
    buffer = torch.empty(2, dtype=torch.bool)
    with comm.observe() as records:
        received = comm.batch_p2p([comm.PointToPoint("send", torch.tensor([rank == 0, True]), peer),
                                   comm.PointToPoint("recv", buffer, peer)])
    assert received[0].tolist() == [peer == 0, True]
    assert records == [comm.CommRecord("batch_p2p", None, 2, 2, 2)]


@spmd(meshes=[(2,)])
def test_observe_nests_and_counts(mesh):
    before = comm.call_counts["all_reduce"]
    with comm.observe() as outer:
        comm.all_reduce(torch.ones(4), mesh, 0, reduce_op="sum")
        with comm.observe() as inner:
            comm.all_reduce(torch.ones(4), mesh, 0, reduce_op="sum")
    assert len(outer) == 2 and len(inner) == 1
    assert comm.call_counts["all_reduce"] == before + 2


@spmd(meshes=[(4,)])
def test_records_name_the_mesh_dims_they_ran_over(mesh):
    """A record carries the names of its group's mesh dims on the issuing mesh (a sub-mesh names its own)."""
    named = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    with comm.observe() as records:
        comm.all_reduce(torch.ones(2), named, "tp", reduce_op="sum")
        comm.all_reduce(torch.ones(2), named, ("dp", "tp"), reduce_op="sum")
        comm.all_reduce(torch.ones(2), named["dp"], 0, reduce_op="sum")
        comm.all_reduce(torch.ones(2), DeviceMesh("cpu", [[0, 1], [2, 3]]), 1, reduce_op="sum")
    assert [record.mesh_dim_names for record in records] == [("tp",), ("dp", "tp"), ("dp",), None]
    assert [record.mesh_dim for record in records] == [1, (0, 1), 0, 1]


@spmd(meshes=[(2,)])
def test_size_errors_teach(mesh):
    with pytest.raises(ValueError, match="2 non-negative sizes"):
        comm.all_gather(torch.ones(2), mesh, 0, dim=0, sizes=[2])
    with pytest.raises(ValueError, match="reduce_op 'mean' is not one of"):
        comm.all_reduce(torch.ones(2), mesh, 0, reduce_op="mean")
    with pytest.raises(ValueError, match="sum\\(split_sizes\\)"):
        comm.all_to_all(torch.ones(3, 2), mesh, 0, split_dim=0, split_sizes=[1, 1], concat_dim=1, concat_sizes=[2, 2])
