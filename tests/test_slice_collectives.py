"""Collectives over several mesh dims of a slice of the world (a pipeline stage's mesh, `world["dp", "tp"]`
of a pp x dp x tp mesh): no group over the flattened ranks exists, and its members alone cannot make
one (torch names such a group by hashing its ranks with the number of groups each member has been in),
so each runs as one collective per mesh dim on the mesh's own groups, as torch's DTensor does; the
planner plans and prices those steps. A flattened group made by `_flatten` is used when it exists."""

import contextlib

import torch
import torch.distributed as dist
from helpers import exact_full, local_piece, torch_collectives
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, comm
from shardtensor.collective_check import check_collectives
from shardtensor.debug import CommDebugMode
from shardtensor.layout import Layout
from shardtensor.mesh import DeviceMesh
from shardtensor.process_groups import has_group
from shardtensor.redistribute import cost_model_for, plan
from shardtensor.redistribute.planner import DEFAULT_COST_MODEL, PER_MESH_DIM_COST_MODEL

# Pipeline stage x dp x tp over 8 ranks in an order no other test uses, so that no group over a stage's
# four ranks exists (a flattened group would be used instead of one collective per mesh dim).
STAGES = torch.tensor([[[0, 5], [2, 7]], [[4, 1], [6, 3]]])
# Another order, for the test that flattens a stage (`_flatten` makes groups over its four ranks).
FLATTENED_STAGES = torch.tensor([[[0, 6], [3, 5]], [[1, 7], [2, 4]]])
NAMES = ("pp", "dp", "tp")
P, R = Partial(), Replicate()

# (source, target, collectives on a slice; on the world mesh a [P, P] source reduces in one flattened
# collective instead: an all_reduce for both [P, P] targets)
REDISTRIBUTIONS = [
    ((P, P), (R, R), {"all_reduce": 2}),
    ((P, P), (Shard(0), R), {"reduce_scatter": 1, "all_reduce": 1}),
    ((Shard(0), Shard(1)), (R, R), {"all_gather": 2}),
    ((P, Shard(0)), (Shard(1), R), {"all_gather": 1, "reduce_scatter": 1}),
]


def _stage(stages: torch.Tensor) -> DeviceMesh:
    """This rank's pipeline stage: the dp x tp slice of the world mesh over `stages`."""
    stage = DeviceMesh("cpu", stages, mesh_dim_names=NAMES)["dp", "tp"]
    assert not has_group(tuple(sorted(stage.mesh.flatten().tolist()))), "a group over the stage's ranks exists already"
    return stage


def _operand(full: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor:
    """This rank's local tensor of `full` under `placements`: its shard, and over the Partial mesh dims
    an operand that differs on every rank (k + 1 times the shard on the k-th rank along them, the first
    making the sum the shard), in small integers so that any summation order is exact."""
    coordinate = mesh.get_coordinate()
    piece = local_piece(full, mesh.shape, placements, coordinate)
    partial_dims = [mesh_dim for mesh_dim, placement in enumerate(placements) if isinstance(placement, Partial)]
    index, count = 0, 1
    for mesh_dim in partial_dims:
        index, count = index * mesh.size(mesh_dim) + coordinate[mesh_dim], count * mesh.size(mesh_dim)
    if index:
        return piece * (index + 1)
    return piece * (1 - sum(range(2, count + 1)))


def _redistribute_on(mesh: DeviceMesh, source, target) -> dict:
    full = exact_full((8, 12))
    moved = DTensor.from_local(_operand(full, mesh, source), mesh, source)
    with CommDebugMode() as comm_mode:
        result = moved.redistribute(mesh, target)
    assert torch.equal(result.to_local(), local_piece(full, mesh.shape, target, mesh.get_coordinate()))
    return dict(comm_mode.get_comm_counts())


@spmd(meshes=[(2, 2, 2)], timeout=120.0)
def test_stages_whose_members_were_in_different_groups(mesh):
    """Before the first collective over both mesh dims of each stage, one member of each stage has been
    in a group the other members were not in (a group every rank creates, of ranks 0 and 3): a group
    made by a stage's members alone got different names on them and hung. Each stage runs its own op."""
    stage = _stage(STAGES)
    extra = dist.new_group([int(STAGES[0, 0, 0]), int(STAGES[1, 1, 1])])
    try:
        if DeviceMesh("cpu", STAGES, mesh_dim_names=NAMES).get_local_rank("pp") == 0:
            assert _redistribute_on(stage, (P, P), (R, R)) == {"all_reduce": 2}
        else:
            with CommDebugMode() as comm_mode:
                gathered = comm.all_gather(torch.tensor([dist.get_rank()]), stage, ("dp", "tp"), dim=0, sizes=[1] * 4)
            assert gathered.tolist() == stage.mesh.flatten().tolist()
            assert comm_mode.get_comm_counts() == {"all_gather": 2}
    finally:
        if extra is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(extra)


@spmd(meshes=[(2, 2, 2)], timeout=120.0)
def test_redistribute_on_a_slice(mesh):
    """Values against one device and the exact collectives, per case, on a stage's 2x2 mesh; torch's
    DTensor on the same slice of its own mesh issues as many collectives."""
    stage = _stage(STAGES)
    for source, target, counts in REDISTRIBUTIONS:
        assert _redistribute_on(stage, source, target) == counts, (source, target)
        assert _torch_collectives_on_a_stage(source, target) == sum(counts.values()), (source, target)


def _torch_collectives_on_a_stage(source, target) -> int:
    """How many collectives torch's DTensor issues for the redistribute on this rank's stage of a torch
    DeviceMesh over `STAGES` (the oracle of counts only: torch 2.13 all_gathers a mesh dim whose ranks
    descend, as [4, 1] here, in global-rank order, so its values are not those of one device)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    def to_torch(placements):
        return [TorchShard(placement.dim) if isinstance(placement, Shard) else
                TorchPartial() if isinstance(placement, Partial) else TorchReplicate() for placement in placements]

    if "stage" not in _torch_stages:
        _torch_stages["stage"] = TorchDeviceMesh("cpu", STAGES, mesh_dim_names=NAMES)["dp", "tp"]
    torch_stage, stage = _torch_stages["stage"], _stage(STAGES)
    full = exact_full((8, 12))
    moved = TorchDTensor.from_local(_operand(full, stage, source), torch_stage, to_torch(source))
    _, count = torch_collectives(lambda: moved.redistribute(torch_stage, to_torch(target)))
    return count


_torch_stages: dict = {}  # torch's mesh over STAGES, made once per worker (collective)


@spmd(meshes=[(2, 2)])
def test_redistribute_on_the_world_mesh_reduces_in_one_collective(mesh):
    """The same cases on a 2x2 mesh over the whole world: a [P, P] source reduces in one collective."""
    world_counts = [{"all_reduce": 1}, {"all_reduce": 1}, {"all_gather": 2}, {"all_gather": 1, "reduce_scatter": 1}]
    for (source, target, _), counts in zip(REDISTRIBUTIONS, world_counts):
        assert _redistribute_on(mesh, source, target) == counts, (source, target)


def test_the_planner_prices_what_runs_on_a_slice():
    """Without flattened groups the planner plans one step per Partial mesh dim (what runs); with them, one."""
    source = Layout.create((2, 2), [P, P], (8, 12))
    target = source.with_placements([R, R])
    assert plan(source, target, 8, DEFAULT_COST_MODEL).collectives == ("all_reduce",)
    per_mesh_dim = plan(source, target, 8, PER_MESH_DIM_COST_MODEL)
    assert per_mesh_dim.collectives == ("all_reduce", "all_reduce")
    assert all(isinstance(step.mesh_dim, int) for step in per_mesh_dim.steps)
    big = Layout.create((2, 2), [P, P], (1024, 1024))  # bytes outweigh latency: reduce_scatter, all_reduce, all_gather
    assert plan(big, big.with_placements([R, R]), 8, PER_MESH_DIM_COST_MODEL).collectives == (
        "reduce_scatter", "all_reduce", "all_gather")


@spmd(meshes=[(2, 2, 2)])
def test_cost_model_follows_the_mesh(mesh):
    assert cost_model_for(mesh) is DEFAULT_COST_MODEL
    assert cost_model_for(_stage(STAGES)) is PER_MESH_DIM_COST_MODEL


def _in_flattened_order(stage: DeviceMesh, mesh_dims) -> list[int]:
    ranks = stage.mesh if mesh_dims == ("dp", "tp") else stage.mesh.T
    return ranks.flatten().tolist()


@spmd(meshes=[(2, 2, 2)], timeout=120.0)
def test_comm_over_both_mesh_dims_of_a_slice(mesh):
    """Every collective over a tuple of a stage's mesh dims, in both orders (row-major in the order given),
    with uneven pieces, against the values computed here; one collective per mesh dim, each over one.
    Checked collectives (each rank's fingerprint gathered first) fingerprint each over one mesh dim."""
    stage = _stage(STAGES)
    for mesh_dims, checked in [(("dp", "tp"), False), (("tp", "dp"), False), (("dp", "tp"), True)]:
        with check_collectives() if checked else contextlib.nullcontext():
            _all_collectives_over(stage, mesh_dims)


def _all_collectives_over(stage: DeviceMesh, mesh_dims) -> None:
    """Each collective over `mesh_dims` of `stage`, its value and the kinds and mesh dims of its records."""
    rank = dist.get_rank()
    order = _in_flattened_order(stage, mesh_dims)
    me = order.index(rank)
    with comm.observe() as records:
        total = comm.all_reduce(torch.tensor([float(rank)]), stage, mesh_dims, reduce_op="sum", async_op=True)
        assert total.wait().item() == sum(order)

        sizes = [1, 2, 0, 3]
        gathered = comm.all_gather(torch.full((sizes[me], 2), rank), stage, mesh_dims, dim=0, sizes=sizes)
        assert torch.equal(gathered, torch.cat([torch.full((size, 2), peer) for size, peer in zip(sizes, order)]))

        def operand(peer):
            return torch.arange(12).view(6, 2) * (peer + 1)

        scattered = comm.reduce_scatter(operand(rank), stage, mesh_dims, reduce_op="sum", dim=0, sizes=[2, 0, 3, 1])
        assert torch.equal(scattered, sum(operand(peer) for peer in order).split([2, 0, 3, 1])[me])

        split_sizes, concat_sizes = [1, 0, 2, 1], [2, 1, 0, 3]  # Shard(0) with concat_sizes -> Shard(1)

        def held(peer):
            return torch.arange(concat_sizes[order.index(peer)] * 4).view(-1, 4) + 100 * peer

        moved = comm.all_to_all(held(rank), stage, mesh_dims, split_dim=1, split_sizes=split_sizes,
                                concat_dim=0, concat_sizes=concat_sizes)
        assert torch.equal(moved, torch.cat([held(peer).split(split_sizes, 1)[me] for peer in order]))

        pieces = [[(source + 2 * target) % 3 for target in range(4)] for source in range(4)]  # a re-split

        def rows(peer):
            return torch.arange(sum(pieces[order.index(peer)])) + 100 * peer

        resplit = comm.all_to_all(rows(rank), stage, mesh_dims, split_dim=0, split_sizes=pieces[me], concat_dim=0,
                                  concat_sizes=[pieces[source][me] for source in range(4)])
        expected = [rows(peer).split(pieces[source])[me] for source, peer in enumerate(order)]
        assert torch.equal(resplit, torch.cat(expected))

        broadcast = comm.broadcast(torch.tensor([rank, rank]), stage, mesh_dims, src=2)
        assert broadcast.tolist() == [order[2]] * 2

        output = torch.empty(8, dtype=torch.int64)
        comm.all_gather_into(output, torch.full((2,), rank), stage, mesh_dims, sizes=[2] * 4)
        assert output.tolist() == [peer for peer in order for _ in range(2)]
    kinds = [record.kind for record in records]
    assert kinds == ["all_reduce"] * 2 + ["all_gather"] * 2 + ["reduce_scatter"] * 2 + ["all_to_all"] * 2 \
        + ["all_gather"] * 2 + ["all_to_all"] * 2 + ["broadcast"] * kinds.count("broadcast") + ["all_gather"]
    # the outer broadcast runs only where the inner coordinate is src's (0)
    assert kinds.count("broadcast") == (2 if me % 2 == 0 else 1)
    assert all(isinstance(record.mesh_dim, int) for record in records[:-1])  # all_gather_into: one batch of sends
    assert records[-1].mesh_dim == tuple(stage._mesh_dim_index(name) for name in mesh_dims)


@spmd(meshes=[(2, 2, 2)])
def test_a_flattened_stage_reduces_in_one_collective(mesh):
    """After `_flatten` (collective: every rank makes every stage's group), the flattened group is used."""
    stage = _stage(FLATTENED_STAGES)
    operand = torch.tensor([float(dist.get_rank())])
    for flattened, counts in [(False, {"all_reduce": 2}), (True, {"all_reduce": 1})]:  # the first call is before it
        if flattened:
            stage._flatten("dp_tp")
        with CommDebugMode() as comm_mode:
            total = comm.all_reduce(operand, stage, ("dp", "tp"), reduce_op="sum")
        assert total.item() == sum(stage.mesh.flatten().tolist())
        assert comm_mode.get_comm_counts() == counts
