"""`launch.simulate`: every rank of a world in this one process, with what `spawn` would return.

The simulated ranks cover what real processes cannot on a two-core machine: 8, 16 and 64 ranks on 1-D,
2-D and 3-D meshes, for redistribute (every transition of a mesh dim, uneven and empty shards, values
against the global tensor and bytes against the planner), fully_shard on a 2-D (HSDP) mesh and
checkpoints saved at one world size and loaded at another. Simulate itself: the results of spawn's
gloo ranks, a failing rank's traceback, and no hang.
"""

import copy
import itertools
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import test_fsdp as fsdp_tests
import test_redistribute as redistribute_tests
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor, init_device_mesh, launch
from shardtensor.debug import CommDebugMode
from shardtensor.layout import Layout
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardtensor.redistribute import plan, redistribute_local_tensor

R = Replicate()
PLACEMENTS = (Shard(0), Shard(1), R, Partial())


# ---- simulate returns what spawn returns ------------------------------------------------------------
def _program(mesh_shape):
    """Collectives, redistributes, random factories and two tensor-parallel training steps: what each rank
    returns, as plain tensors and numbers (the same program on gloo ranks and on simulated ones)."""
    import shardtensor

    # A worker of the suite's pools has run other tests: start both sides from a fresh process's random state
    # (torch's generator at seed 0, the library's seed not yet drawn), so the unseeded draw below compares.
    torch.manual_seed(0)
    shardtensor.random._restore_rank_state((None, 0, 0))
    mesh = init_device_mesh("cpu", mesh_shape)
    rank = dist.get_rank()
    results = {"rank": rank, "world": dist.get_world_size(), "coordinate": mesh.get_coordinate()}
    own = torch.arange(6.0) + 10 * rank
    results["all_reduce"] = comm.all_reduce(own, mesh, 0, reduce_op="sum")
    results["max"] = comm.all_reduce(own, mesh, 0, reduce_op="max")
    results["objects"] = comm.all_gather_object({"rank": rank}, mesh)
    full = torch.randn(7, 5)  # the same on every rank: each starts from torch.manual_seed(0)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with CommDebugMode() as debug:
        moved = x.redistribute(mesh, [Shard(1)] + [R] * (mesh.ndim - 1))
        summed = (x * x).sum(dim=0)
    results["moved"], results["summed"] = moved.to_local(), summed.full_tensor()
    results["comm_counts"] = {str(key): count for key, count in debug.get_comm_counts().items()}
    results["rand_unseeded"] = shardtensor.rand(5, device_mesh=mesh, placements=[Shard(0)] * mesh.ndim).full_tensor()
    shardtensor.manual_seed(3)
    results["rand"] = shardtensor.rand(6, 4, device_mesh=mesh, placements=[Shard(1)] * mesh.ndim).full_tensor()
    tp = init_device_mesh("cpu", (mesh.size(),))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        batch = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        with CommDebugMode() as module_debug:  # per-module tables: torch's module hooks are global, ranks are not
            model(batch).square().sum().backward()
        results[f"module_counts_{step}"] = module_debug.comm_module_counts
        optimizer.step()
        optimizer.zero_grad()
    results["parameters"] = [parameter.full_tensor() for parameter in model.parameters()]
    return results


PROGRAM = launch.register(_program)


def _assert_same(simulated, spawned, exact: bool, where=""):
    if isinstance(spawned, torch.Tensor):
        if exact or not spawned.is_floating_point():
            assert torch.equal(simulated, spawned), where
        else:
            assert_close(simulated, spawned, msg=where)
    elif isinstance(spawned, dict):
        assert simulated.keys() == spawned.keys(), where
        for key in spawned:
            _assert_same(simulated[key], spawned[key], exact, f"{where}.{key}")
    elif isinstance(spawned, list):
        assert len(simulated) == len(spawned), where
        for index, (mine, theirs) in enumerate(zip(simulated, spawned)):
            _assert_same(mine, theirs, exact, f"{where}[{index}]")
    else:
        assert simulated == spawned, where


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=str)
def test_simulate_returns_what_gloo_ranks_return(spmd_pools, mesh_shape):
    """Values, collectives counted, random draws and two training steps: bit for bit on 2 ranks; on 4
    ranks a floating sum of 4 inexact operands may differ in its last bit (gloo's ring adds them in
    another order than the simulator's rank order), everything else is bit for bit."""
    spawned = spmd_pools.get(len(mesh_shape) * 2).run(PROGRAM, mesh_shape, timeout=120)
    simulated = launch.simulate(_program, len(mesh_shape) * 2, mesh_shape)
    _assert_same(simulated, spawned, exact=len(mesh_shape) == 1)
    assert simulated[-1]["world"] == len(mesh_shape) * 2 and not dist.is_initialized()  # the caller's world is untouched


# ---- errors and hangs -------------------------------------------------------------------------------
def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one was given a bad value")
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def _mismatched_collectives():
    tensor = torch.ones(2)
    if dist.get_rank() == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, src=1)


def _rank():
    return dist.get_rank()


def test_a_failing_rank_reports_its_traceback_and_the_ranks_waiting_for_it_stop_at_once():
    start = time.monotonic()
    with pytest.raises(launch.RankFailure) as raised:
        launch.simulate(_fails_on_rank_one, 4)
    failure = raised.value
    assert list(failure.failures) == [1] and failure.timed_out == [0, 2, 3]
    assert "_fails_on_rank_one" in failure.failures[1] and "rank one was given a bad value" in failure.failures[1]
    assert "deadlock" in str(failure) and "rank 0 waits in all_reduce over ranks [0, 1, 2, 3]" in str(failure)
    with pytest.raises(launch.RankFailure, match="collective mismatch") as raised:
        launch.simulate(_mismatched_collectives, 2)
    assert "calls broadcast" in raised.value.failures[1] and raised.value.timed_out == [0]
    assert time.monotonic() - start < 30  # no timeout was waited for
    assert launch.simulate(_rank, 3) == [0, 1, 2]  # and the next simulation runs normally


# ---- redistribute: every transition of a mesh dim, values and bytes ---------------------------------------
def _transitions(mesh_shape, transitions, shape):
    """On each rank: each (source, target) placements from the global tensor's pieces; the collectives'
    (kind, bytes received) per transition, checked by the caller against the planner."""
    mesh = init_device_mesh("cpu", mesh_shape)
    coordinate = tuple(mesh.get_coordinate())
    full = redistribute_tests._full(shape, seed=5)
    seen = []
    for source_placements, target_placements in transitions:
        source = Layout.create(mesh.shape, source_placements, shape)
        target = source.with_placements(target_placements)
        local = redistribute_tests._operand(full, source, coordinate)
        with comm.observe() as records:
            result = redistribute_local_tensor(local, source, target, mesh)
        if target.partial_mesh_dims():
            replicated = target.with_placements([R] * mesh.ndim)
            result, target = redistribute_local_tensor(result, target, replicated, mesh), replicated
        assert torch.equal(result, redistribute_tests._box(full, target, coordinate)), (source, target, coordinate)
        seen.append([(record.kind, record.bytes_received) for record in records])
    return seen


def _sampled_transitions(ndim: int, count: int | None, seed: int):
    """Every pair of placement tuples (count None), or `count` of them drawn with a fixed seed."""
    tuples = list(itertools.product(PLACEMENTS, repeat=ndim))
    pairs = [(source, target) for source in tuples for target in tuples if source != target]
    return pairs if count is None else random.Random(seed).sample(pairs, count)


TRANSITION_MESHES = {  # mesh shape: transitions run (None: every pair of placement tuples)
    (8,): None, (16,): None, (64,): None,
    (2, 4): None, (4, 4): 60,
    (2, 2, 2): 60, (4, 4, 4): 12,
}


@pytest.mark.parametrize("mesh_shape", list(TRANSITION_MESHES), ids=str)
def test_every_transition_moves_exact_values_and_the_bytes_the_planner_counts(mesh_shape):
    """(13, 7) float64 over up to 64 ranks: uneven and empty shards, nested shards on 2-D and 3-D meshes.
    Each step's most bytes received by any rank is the step's `bytes_per_rank`."""
    shape = (13, 7)
    transitions = _sampled_transitions(len(mesh_shape), TRANSITION_MESHES[mesh_shape], seed=len(mesh_shape))
    by_rank = launch.simulate(_transitions, torch.Size(mesh_shape).numel(), mesh_shape, transitions, shape)
    for index, (source_placements, target_placements) in enumerate(transitions):
        source = Layout.create(mesh_shape, source_placements, shape)
        chosen = plan(source, source.with_placements(target_placements), 8)
        message = str(chosen)
        steps = [step for step in chosen.steps if step.collective in chosen.collectives]
        for rank_records in by_rank:
            assert [kind for kind, _ in rank_records[index]] == list(chosen.collectives), message
        for number, step in enumerate(steps):
            assert max(records[index][number][1] for records in by_rank) == step.bytes_per_rank, message


# ---- fully_shard on many ranks and on a 2-D mesh (HSDP) -------------------------------------------------
def _hsdp_trains_like_one_device(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    batches = fsdp_tests._batches(3)
    reference = fsdp_tests._train_reference(fsdp_tests._model(), batches)
    sharded = fsdp_tests._shard(fsdp_tests._model(), mesh)
    head = sharded.head.weight
    chunks = torch.arange(head.shape[0]).chunk(mesh_shape[1])  # torch.chunk's pieces; the last ones may be missing
    column = mesh.get_coordinate()[1]
    assert head.placements == (R, Shard(0))
    assert head.to_local().shape[0] == (len(chunks[column]) if column < len(chunks) else 0)
    fsdp_tests._train_sharded(sharded, batches, mesh.get_rank(), mesh.size())
    fsdp_tests._assert_same_parameters(sharded, reference)
    inputs, target = (fsdp_tests._local_batch(tensor, mesh.get_rank(), mesh.size()) for tensor in batches[0])
    forward, backward, _ = fsdp_tests._step_records(sharded, inputs, target)
    assert forward == {"all_gather": 3} and backward == {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 3}


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)], ids=str)
def test_hsdp_on_8_ranks_trains_like_one_device(mesh_shape):
    launch.simulate(_hsdp_trains_like_one_device, torch.Size(mesh_shape).numel(), mesh_shape)


# ---- checkpoints saved at one world size, loaded at another --------------------------------------------
def _layouts(ndim: int):
    """Placements per parameter of a small model, for a mesh of `ndim` dims: nested, uneven, mixed."""
    return {
        "0.weight": [Shard(0)] * ndim,  # 10 rows nested over every mesh dim
        "0.bias": [R] * (ndim - 1) + [Shard(0)],
        "1.weight": [Shard(1)] + [R] * (ndim - 1),
        "1.bias": [R] * ndim,
    }


def _checkpoint_model(mesh, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
    for name, placements in _layouts(mesh.ndim).items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        local = distribute_tensor(getattr(module, attribute).detach(), mesh, placements)
        setattr(module, attribute, torch.nn.Parameter(local))
    return model


def _save_checkpoint(mesh_shape, path):
    model = _checkpoint_model(init_device_mesh("cpu", mesh_shape), seed=1)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return {name: parameter.full_tensor() for name, parameter in model.named_parameters()}


def _load_checkpoint(mesh_shape, path):
    model = _checkpoint_model(init_device_mesh("cpu", mesh_shape), seed=2)
    state = model.state_dict()
    with comm.observe() as records:
        dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    assert records == []  # each rank reads its own boxes: nothing gathered
    return {name: parameter.full_tensor() for name, parameter in model.named_parameters()}


def test_a_checkpoint_saved_on_8_ranks_loads_on_16_and_on_4(tmp_path):
    path = str(tmp_path / "checkpoint")
    saved = launch.simulate(_save_checkpoint, 8, (2, 2, 2), path)[0]
    for mesh_shape in [(4, 4), (4,)]:
        for loaded in launch.simulate(_load_checkpoint, torch.Size(mesh_shape).numel(), mesh_shape, path):
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (mesh_shape, name)
            assert not torch.equal(loaded["0.weight"], _checkpoint_model_values(seed=2)), mesh_shape


def _checkpoint_model_values(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 10).weight.detach()


# ---- 16 ranks: fully_shard with mostly empty shards; 64 ranks: tensor parallel on a 3-D mesh's tp dim ----
def _fully_shard_on_16_ranks():
    mesh = init_device_mesh("cpu", (16,))
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 5, generator=generator, dtype=torch.float64),
                torch.randn(16, 7, generator=generator, dtype=torch.float64)) for _ in range(2)]
    reference = fsdp_tests._train_reference(fsdp_tests._model(), batches)
    sharded = fsdp_tests._shard(fsdp_tests._model(), mesh)  # 7 head rows over 16 ranks: 9 empty shards
    fsdp_tests._train_sharded(sharded, batches, mesh.get_rank(), mesh.size())  # one row per rank
    fsdp_tests._assert_same_parameters(sharded, reference)


def test_fully_shard_on_16_ranks_trains_like_one_device():
    launch.simulate(_fully_shard_on_16_ranks, 16)


def _tensor_parallel_on_a_4x4x4_mesh():
    cube = init_device_mesh("cpu", (4, 4, 4), mesh_dim_names=("dp", "cp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6)).double()
    single = copy.deepcopy(model)
    parallelize_module(model, cube["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # 10 = 3 + 3 + 3 + 1
    batch = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(cube.get_coordinate()[0]))
    with comm.observe() as records:
        output = model(batch)
    assert [(record.kind, record.group_size) for record in records] == [("all_reduce", 4)]
    expected = single(batch)
    assert_close(output, expected)
    output.square().sum().backward()
    expected.square().sum().backward()
    for (name, parameter), wanted in zip(model.named_parameters(), single.parameters()):
        assert_close(parameter.grad.full_tensor(), wanted.grad, msg=name)


def test_tensor_parallel_on_a_4x4x4_mesh_of_64_ranks_equals_one_device():
    launch.simulate(_tensor_parallel_on_a_4x4x4_mesh, 64)
