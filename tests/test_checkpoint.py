"""torch.distributed.checkpoint with shardtensor DTensors: save on one mesh and layout, load on another.

A model and its AdamW state are saved with tensor parallel 2 on a 2x2 (dp, tp) mesh, then loaded with
tensor parallel 4 on 4 ranks, with other placements on 2 ranks, and as plain tensors on 1 rank; every
value must come back exactly, and one more optimizer step after loading must equal the step the saving
run took. The checkpoint's metadata shows which rank wrote which box: each rank its own shard, each
replica once. Ranks run in the session's worker pools (tests/spmd.py), one pool per world size, so one
test saves in one world and loads in others.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from spmd import _run_body, spmd
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from shardtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, comm, distribute_tensor, launch
from shardtensor.layout import Layout
from shardtensor.spec import DTensorSpec

R = Replicate()

# Placements of every parameter per layout. "tp2" lives on a 2x2 (dp, tp) mesh: the embedding table is
# nested-sharded (both mesh dims split its 7 rows), the rest is tensor parallel on tp and replicated on
# dp. "tp4" and "two" reshard differently, some on other tensor dims; "plain" is a module of plain tensors.
PLANS = {
    "tp2": {
        "embed.weight": [Shard(0), Shard(0)],
        "up.weight": [R, Shard(0)],
        "up.bias": [R, Shard(0)],
        "down.weight": [R, Shard(1)],
        "down.bias": [R, R],
    },
    "tp4": {
        "embed.weight": [Shard(1)],
        "up.weight": [Shard(0)],
        "up.bias": [Shard(0)],
        "down.weight": [Shard(1)],
        "down.bias": [R],
    },
    "two": {
        "embed.weight": [R],
        "up.weight": [Shard(1)],
        "up.bias": [Shard(0)],
        "down.weight": [Shard(0)],
        "down.bias": [Shard(0)],
    },
    "plain": {},
}
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq", "step")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.up = nn.Linear(6, 10)  # 10 rows: uneven over 4 ranks (3, 3, 3, 1)
        self.down = nn.Linear(10, 5)


def _build(mesh, plan_name: str, seed: int):
    """The model laid out by a plan (initial values from `seed`) and its AdamW optimizer."""
    torch.manual_seed(seed)
    model = Net()
    for fqn, placements in PLANS[plan_name].items():
        module_name, _, name = fqn.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), mesh, placements)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def _train_step(model, optimizer, step: int) -> None:
    """One optimizer step with gradients fixed by `step` (the same global values on every layout)."""
    generator = torch.Generator().manual_seed(100 + step)
    for _, parameter in sorted(model.named_parameters()):
        full = torch.randn(parameter.shape, generator=generator)
        if isinstance(parameter, DTensor):
            full = distribute_tensor(full, parameter.device_mesh, parameter.placements)
        parameter.grad = full
    optimizer.step()
    optimizer.zero_grad()


def _full(tensor) -> torch.Tensor:
    """A copy of the global value (`full_tensor()` of a replicated DTensor aliases its shard)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().clone()


def _values(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor as a full tensor, keyed by name."""
    values = {}
    for fqn, parameter in sorted(model.named_parameters()):
        values[fqn] = _full(parameter)
        for key in OPTIMIZER_STATE:
            values[f"{fqn}.{key}"] = _full(optimizer.state[parameter][key])
    return values


def _save(mesh, path: str, plan_name: str):
    """Train two steps, save model and optimizer state, then take a third step.

    Returns the values at the save, the values after the third step, and the collectives of the save.
    """
    model, optimizer = _build(mesh, plan_name, seed=1)
    for step in range(2):
        _train_step(model, optimizer, step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with comm.observe() as records:
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=path)
    saved = _values(model, optimizer)
    _train_step(model, optimizer, 2)
    return saved, _values(model, optimizer), len(records)


def _load(mesh, path: str, plan_name: str):
    """Build the model on another layout with other values, load the checkpoint, take the third step."""
    model, optimizer = _build(mesh, plan_name, seed=2)
    with comm.observe() as records:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _values(model, optimizer)
    _train_step(model, optimizer, 2)
    return loaded, _values(model, optimizer), len(records)


SAVE, LOAD = launch.register(_save), launch.register(_load)


def _run(spmd_pools, mesh_shape, body, **params) -> list:
    """Run a registered body on every rank of the pool for `mesh_shape`; results in rank order."""
    pool = spmd_pools.get(math.prod(mesh_shape))
    return pool.run(_run_body, body, tuple(mesh_shape), params, timeout=120)


def _assert_equal(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{where}: {key} differs"


# The boxes (offsets, sizes) of every parameter on the 2x2 (dp, tp) mesh and the ranks holding each
# (rank = 2 * dp + tp): replicas along dp hold the same box; the fully replicated bias is on all four.
HOLDERS_TP2 = {
    "embed.weight": {((0, 0), (2, 6)): {0}, ((2, 0), (2, 6)): {1}, ((4, 0), (2, 6)): {2}, ((6, 0), (1, 6)): {3}},
    "up.weight": {((0, 0), (5, 6)): {0, 2}, ((5, 0), (5, 6)): {1, 3}},
    "up.bias": {((0,), (5,)): {0, 2}, ((5,), (5,)): {1, 3}},
    "down.weight": {((0, 0), (5, 5)): {0, 2}, ((0, 5), (5, 5)): {1, 3}},
    "down.bias": {((0,), (5,)): {0, 1, 2, 3}},
}


def _assert_each_box_written_once_by_a_holder(writers: dict[int, tuple], holders: dict[tuple, set], name: str):
    """Every box is in the checkpoint once, written by a rank that holds it (its own shard, no gather)."""
    written = {box: rank for rank, box in writers.items()}
    assert len(written) == len(writers) and written.keys() == holders.keys(), (name, writers)
    for box, rank in written.items():
        assert rank in holders[box], (name, box, rank)


def _writers(path) -> tuple[dict[str, dict[int, tuple]], dict[int, int]]:
    """From the checkpoint metadata: for every saved tensor, which rank wrote which box; and the
    bytes each rank wrote."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    writers, bytes_by_rank = {}, {}
    for index, storage in metadata.storage_data.items():
        if index.offset is None:  # not a tensor (optimizer hyperparameters)
            continue
        rank = int(storage.relative_path.split("_")[2])
        chunk = next(
            chunk for chunk in metadata.state_dict_metadata[index.fqn].chunks if chunk.offsets == index.offset
        )
        box = (tuple(chunk.offsets), tuple(chunk.sizes))
        assert rank not in writers.setdefault(index.fqn, {}), f"rank {rank} wrote {index.fqn} twice"
        writers[index.fqn][rank] = box
        bytes_by_rank[rank] = bytes_by_rank.get(rank, 0) + storage.length
    return writers, bytes_by_rank


def test_save_tp2_on_2x2_load_tp4_on_4_ranks_two_ranks_and_plain_on_1_rank(spmd_pools, tmp_path):
    path = str(tmp_path / "checkpoint")
    saved_by_rank = _run(spmd_pools, (2, 2), SAVE, path=path, plan_name="tp2")
    saved, after_step, save_collectives = saved_by_rank[0]
    assert all(collectives == 0 for _, _, collectives in saved_by_rank)  # nothing gathered to save
    for _, other_after_step, _ in saved_by_rank[1:]:
        _assert_equal(other_after_step, after_step, "ranks of the saving run disagree")

    writers, bytes_by_rank = _writers(tmp_path / "checkpoint")
    for fqn, holders in HOLDERS_TP2.items():
        for name in (f"model.{fqn}", f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            _assert_each_box_written_once_by_a_holder(writers[name], holders, name)
        assert len(writers[f"optim.state.{fqn}.step"]) == 1  # a plain tensor: one copy
    assert sorted(bytes_by_rank) == [0, 1, 2, 3]  # DCP spreads the replicas' writing over their ranks

    # The checkpoint is ordinary DCP: one process without a world turns it into plain full tensors.
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(path, converted)
    plain = torch.load(converted)
    for fqn in HOLDERS_TP2:
        assert torch.equal(plain["model"][fqn], saved[fqn]), fqn
        assert torch.equal(plain["optim"]["state"][fqn]["exp_avg"], saved[f"{fqn}.exp_avg"]), fqn

    for mesh_shape, plan_name in [((4,), "tp4"), ((2,), "two"), ((1,), "plain")]:
        for rank, (loaded, loaded_after_step, collectives) in enumerate(
            _run(spmd_pools, mesh_shape, LOAD, path=path, plan_name=plan_name)
        ):
            where = f"{plan_name} on {mesh_shape}, rank {rank}"
            _assert_equal(loaded, saved, where)
            _assert_equal(loaded_after_step, after_step, where + " after one more step")
            assert collectives == 0, where


def _uneven_and_partial_state(mesh):
    """Explicit uneven shard sizes (one shard empty) and a Partial tensor with its value."""
    full = torch.arange(40.0).view(10, 4)
    sizes = (5, 0, 1, 4)[: mesh.size()] if mesh.size() == 4 else None
    if sizes is None:
        uneven = distribute_tensor(full, mesh, [Shard(0)])
    else:
        offset = sum(sizes[: mesh.get_local_rank()])
        local = full[offset : offset + sizes[mesh.get_local_rank()]]
        uneven = DTensor.from_local(local, mesh, [Shard(0)], shard_sizes={0: sizes})
    summand = torch.full((3,), float(dist.get_rank() + 1))
    partial = DTensor.from_local(summand, mesh, [Partial()], shape=(3,))
    return full, uneven, partial


def _assert_refused_on_every_rank(error: CheckpointException, beginning: str) -> None:
    """DCP gathers every rank's exception into one CheckpointException, raised on every rank."""
    assert sorted(error.failures) == list(range(dist.get_world_size()))
    for exception, _ in error.failures.values():
        assert isinstance(exception, RuntimeError) and str(exception).startswith(beginning), exception
        assert "Partial on mesh dims [0]" in str(exception)
        assert "x.redistribute(placements=[Replicate()])" in str(exception)


@spmd(meshes=[(4,)])
def test_uneven_shards_save_exactly_and_partial_is_refused_then_saves_reduced(mesh, tmp_path):
    path = str(tmp_path / "uneven")
    full, uneven, partial = _uneven_and_partial_state(mesh)
    with pytest.raises(CheckpointException) as refused:
        dcp.save({"partial": partial}, checkpoint_id=str(tmp_path / "refused"))
    _assert_refused_on_every_rank(refused.value, "cannot save the DTensor 'partial'")
    reduced = partial.redistribute(placements=[R])
    empty = distribute_tensor(torch.zeros(0, 4), mesh, [Shard(0)])
    with comm.observe() as records:
        dcp.save({"uneven": uneven, "reduced": reduced, "empty": empty}, checkpoint_id=path)
    assert records == []
    writers, _ = _writers(path)
    # Rank 1's shard is empty and writes nothing (its offset is rank 2's); an empty tensor is listed once.
    assert writers["uneven"] == {0: ((0, 0), (5, 4)), 2: ((5, 0), (1, 4)), 3: ((6, 0), (4, 4))}
    _assert_each_box_written_once_by_a_holder(writers["reduced"], {((0,), (3,)): {0, 1, 2, 3}}, "reduced")
    assert writers["empty"] == {0: ((0, 0), (0, 4))}

    target = {
        "uneven": distribute_tensor(torch.zeros(10, 4), mesh, [Shard(1)]),
        "reduced": torch.zeros(3),
        "empty": distribute_tensor(torch.zeros(0, 4), mesh, [Shard(1)]),
    }
    dcp.load(target, checkpoint_id=path)
    assert torch.equal(target["uneven"].full_tensor(), full)
    assert torch.equal(target["reduced"], torch.full((3,), 10.0))  # 1 + 2 + 3 + 4
    assert target["empty"].shape == (0, 4) and target["empty"].placements == (Shard(1),)
    into_partial = {"reduced": DTensor.from_local(torch.zeros(3), mesh, [Partial()], shape=(3,))}
    with pytest.raises(CheckpointException) as refused:
        dcp.load(into_partial, checkpoint_id=path)
    _assert_refused_on_every_rank(refused.value, "cannot load into the DTensor")


@spmd(meshes=[(4,)])
def test_ranks_outside_a_dtensors_mesh_take_part_without_data(mesh, tmp_path):
    path = str(tmp_path / "sub_mesh")
    full = torch.arange(30.0).view(5, 6)
    members = DeviceMesh("cpu", [1, 3])
    state = {"sub": distribute_tensor(full, members, [Shard(0)]), "world": distribute_tensor(full, mesh, [Shard(1)])}
    with comm.observe() as records:
        dcp.async_save(state, checkpoint_id=path).result()  # staged copies save the same boxes
    assert records == []
    writers, _ = _writers(path)
    assert writers["sub"] == {1: ((0, 0), (3, 6)), 3: ((3, 0), (2, 6))}
    assert writers["world"] == {0: ((0, 0), (5, 2)), 1: ((0, 2), (5, 2)), 2: ((0, 4), (5, 2))}  # rank 3's is empty

    other_members = DeviceMesh("cpu", [2, 0])  # another sub-mesh, in another rank order
    target = {
        "sub": distribute_tensor(torch.zeros(5, 6), other_members, [Shard(1)]),
        "world": distribute_tensor(torch.zeros(5, 6), members, [R]),
    }
    dcp.load(target, checkpoint_id=path)
    for name, tensor in target.items():
        if tensor.device_mesh.get_coordinate() is None:
            assert tensor.to_local().numel() == 0, name
        else:
            assert torch.equal(tensor.full_tensor(), full), name


def test_a_plain_single_process_checkpoint_loads_into_nested_and_tensor_parallel_shards(spmd_pools, tmp_path):
    path = str(tmp_path / "plain")
    saved, after_step, _ = _run(spmd_pools, (1,), SAVE, path=path, plan_name="plain")[0]
    for rank, (loaded, loaded_after_step, collectives) in enumerate(
        _run(spmd_pools, (2, 2), LOAD, path=path, plan_name="tp2")
    ):
        _assert_equal(loaded, saved, f"rank {rank}")
        _assert_equal(loaded_after_step, after_step, f"rank {rank} after one more step")
        assert collectives == 0


@spmd(meshes=[(2, 2)])
def test_nested_sharding_in_either_shard_order_saves_its_boxes_and_loads_elsewhere(mesh, tmp_path):
    """Both mesh dims split dim 0 (7 rows); with shard order (1, 0) mesh dim 1 splits first, so rank 1
    at coordinate (0, 1) holds rows 4-5, not rows 2-3 as in the default order."""
    full = torch.arange(21.0).view(7, 3)
    coordinate = mesh.get_coordinate()
    expected = {
        (0, 1): {0: ((0, 0), (2, 3)), 1: ((2, 0), (2, 3)), 2: ((4, 0), (2, 3)), 3: ((6, 0), (1, 3))},
        (1, 0): {0: ((0, 0), (2, 3)), 1: ((4, 0), (2, 3)), 2: ((2, 0), (2, 3)), 3: ((6, 0), (1, 3))},
    }
    for order, boxes in expected.items():
        layout = Layout.create(mesh.shape, [Shard(0), Shard(0)], full.shape, shard_order=[order, ()])
        offset, size = layout.local_offset(coordinate)[0], layout.local_shape(coordinate)[0]
        spec = DTensorSpec(mesh, layout, (3, 1), full.dtype)
        nested = DTensor(full[offset : offset + size].clone(), spec)
        path = str(tmp_path / f"order{order[0]}{order[1]}")
        dcp.save({"nested": nested}, checkpoint_id=path)
        assert _writers(path)[0]["nested"] == boxes, order
        target = {"nested": distribute_tensor(torch.zeros(7, 3), mesh, [Shard(1), R])}
        dcp.load(target, checkpoint_id=path)
        assert torch.equal(target["nested"].full_tensor(), full), order
