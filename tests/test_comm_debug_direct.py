"""CommDebugMode counts the collectives a program calls directly through torch.distributed and torch's
functional collectives, as torch's CommDebugMode does: every program runs under both modes (torch's is
the oracle) and the counts per torch key, the total and the expected counts must all agree. Our own
collectives (which call c10d themselves) count once."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import TORCH_VERSION, torch_mesh
from spmd import spmd

import shardtensor
from shardtensor import comm
from shardtensor.debug import CommDebugMode, check_collectives
from shardtensor.debug import direct_collectives
from shardtensor.debug.comm_mode import CommCounts, DirectRecord

ONE_D = [(1,), (2,), (4,)]
# torch 2.15's all_gather_object gathers its pickled objects with all_gather_into_tensor (c10d's
# `_allgather_base_`); earlier versions with all_gather (`allgather_`).
_OBJECT_GATHER_KEY = "c10d._allgather_base_" if TORCH_VERSION >= (2, 15) else "c10d.allgather_"


def _torch_mode():
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    return TorchCommDebugMode()


def _by_key(counts) -> dict[str, int]:
    """torch's counts as {key text: count}, keys like "c10d.allreduce_" (zeros dropped)."""
    return {str(key): count for key, count in counts.items() if count}


def _assert_counts_agree(ours, theirs, expected: dict[str, int], what: str = "") -> None:
    """Our counts read by every torch key equal torch's and the expectation, and the totals agree."""
    their_counts = _by_key(theirs.get_comm_counts())
    assert their_counts == expected, f"{what}: torch counted {their_counts}, expected {expected}"
    our_counts = ours.get_comm_counts()
    read = {key: our_counts[key] for key in direct_collectives.TORCH_KEY_KINDS if our_counts[key]}
    assert read == expected, f"{what}: ours read by torch's keys {read}, expected {expected}"
    assert ours.get_total_counts() == theirs.get_total_counts() == sum(expected.values()), what


def _direct_programs(n: int, rank: int) -> dict:
    """name -> (program, its expected counts by torch key): each call a user makes directly."""
    def ones(size=4):
        return torch.ones(size)

    def root_list(count):
        return [ones() for _ in range(count)] if rank == 0 else None

    def exchange_with_neighbour():
        if n > 1:
            operation = dist.send if rank % 2 == 0 else dist.recv
            operation(ones(), rank + 1 if rank % 2 == 0 else rank - 1)

    world = dist.group.WORLD
    return {
        "all_reduce": (lambda: dist.all_reduce(ones()), {"c10d.allreduce_": 1}),
        "all_reduce async": (lambda: dist.all_reduce(ones(), async_op=True).wait(), {"c10d.allreduce_": 1}),
        "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(ones(4 * n), ones()),
                                   {"c10d._allgather_base_": 1}),
        "reduce_scatter_tensor": (lambda: dist.reduce_scatter_tensor(ones(), ones(4 * n)),
                                  {"c10d._reduce_scatter_base_": 1}),
        "broadcast": (lambda: dist.broadcast(ones(), 0), {"c10d.broadcast_": 1}),
        "all_to_all_single": (lambda: dist.all_to_all_single(ones(4 * n), ones(4 * n)), {"c10d.alltoall_base_": 1}),
        "all_gather": (lambda: dist.all_gather([ones() for _ in range(n)], ones()), {"c10d.allgather_": 1}),
        "reduce_scatter": (lambda: dist.reduce_scatter(ones(), [ones() for _ in range(n)]), {"c10d.reduce_scatter_": 1}),
        "all_to_all": (lambda: dist.all_to_all([ones() for _ in range(n)], [ones() for _ in range(n)]),
                       {"c10d.alltoall_": 1}),
        "gather": (lambda: dist.gather(ones(), root_list(n), dst=0), {"c10d.gather_": 1}),
        "scatter": (lambda: dist.scatter(ones(), root_list(n), src=0), {"c10d.scatter_": 1}),
        "reduce": (lambda: dist.reduce(ones(), 0), {"c10d.reduce_": 1}),
        "all_reduce_coalesced": (lambda: dist.all_reduce_coalesced([ones(), ones(2)]), {"c10d.allreduce_coalesced_": 1}),
        "all_gather_object": (lambda: dist.all_gather_object([None] * n, {"rank": rank}), {_OBJECT_GATHER_KEY: 2}),
        "broadcast_object_list": (lambda: dist.broadcast_object_list([rank, "x"], 0), {"c10d.broadcast_": 2}),
        "barrier (not counted)": (dist.barrier, {}),
        "send and recv (not counted)": (exchange_with_neighbour, {}),
        "funcol all_reduce": (lambda: funcol.all_reduce(ones(), "sum", world).wait(), {"c10d_functional.all_reduce": 1}),
        "funcol all_gather_tensor": (lambda: funcol.all_gather_tensor(ones(), 0, world).wait(),
                                     {"c10d_functional.all_gather_into_tensor": 1}),
        "funcol reduce_scatter_tensor": (lambda: funcol.reduce_scatter_tensor(ones(4 * n), "sum", 0, world).wait(),
                                         {"c10d_functional.reduce_scatter_tensor": 1}),
        "funcol all_to_all_single": (lambda: funcol.all_to_all_single(ones(4 * n), None, None, world).wait(),
                                     {"c10d_functional.all_to_all_single": 1}),
        "funcol broadcast": (lambda: funcol.broadcast(ones(), 0, world).wait(), {"c10d_functional.broadcast": 1}),
        "funcol all_reduce_coalesced": (lambda: [t.wait() for t in funcol.all_reduce_coalesced([ones(), ones()], "sum", world)],
                                        {"c10d_functional.all_reduce_coalesced": 1}),
        "funcol all_to_all_single_autograd": (
            lambda: funcol.all_to_all_single_autograd(ones(4 * n), None, None, world).wait(),
            {"c10d_functional.all_to_all_single": 1}),
        "funcol all_gather_tensor_autograd": (lambda: funcol.all_gather_tensor_autograd(ones(), 0, world).wait(),
                                              {"c10d_functional.all_gather_into_tensor": 1}),
    }


@spmd(meshes=ONE_D)
def test_each_direct_call_counts_as_torch_counts_it(mesh):
    for name, (program, expected) in _direct_programs(mesh.size(), mesh.get_rank()).items():
        with _torch_mode() as theirs:
            program()
        with CommDebugMode() as ours:
            program()
        _assert_counts_agree(ours, theirs, expected, name)
        kinds = {direct_collectives.TORCH_KEY_KINDS[key]: count for key, count in expected.items()}
        assert ours.get_comm_counts() == kinds, name  # by our kind, as ours always keyed them
        assert all(record.mesh_dim is None and record.group_size == mesh.size() for record in ours.records), name


def _mixed_program(tensor_api, mesh, value: torch.Tensor) -> tuple:
    """DTensor ops (either library's names) and direct calls in one block, run under `mode`: an
    all_gather and an all_reduce through DTensor, a c10d all_reduce and a functional all_reduce of the
    program's own. The DTensors are made outside the block (ours agrees on the sizes of a Shard
    from_local without `shape`, deliberately: test_api_journeys)."""
    sharded = tensor_api.DTensor.from_local(value, mesh, [tensor_api.Shard(0)])
    partial = tensor_api.DTensor.from_local(value, mesh, [tensor_api.Partial()])

    def program():
        gathered = (sharded * 2).full_tensor()
        summed = partial.redistribute(mesh, [tensor_api.Replicate()]).to_local()
        direct = value.clone()
        dist.all_reduce(direct)
        functional = funcol.all_reduce(value, "sum", dist.group.WORLD).wait()
        assert torch.equal(direct, functional) and torch.equal(summed, direct), (direct, summed)
        return gathered, summed, direct

    return program


@spmd(meshes=ONE_D)
def test_mixed_program_counts_as_torch(mesh):
    """Our DTensor's all_reduce and the program's functional all_reduce share torch's key."""
    import torch.distributed.tensor as theirs_api

    many = mesh.size() > 1  # one-rank DTensor moves issue no collective (in torch too); direct calls always do
    value = torch.arange(8.0).reshape(2, 4) + mesh.get_rank()
    their_program, our_program = _mixed_program(theirs_api, torch_mesh(mesh), value), _mixed_program(shardtensor, mesh, value)
    with _torch_mode() as theirs:
        their_results = their_program()
    with CommDebugMode() as ours:
        our_results = our_program()
    for their, our in zip(their_results, our_results):
        assert torch.equal(our, their)
    expected = {"c10d.allreduce_": 1, "c10d_functional.all_reduce": 1 + many}
    if many:
        expected["c10d_functional.all_gather_into_tensor"] = 1
    _assert_counts_agree(ours, theirs, expected)
    assert ours.get_comm_counts() == {"all_reduce": 2 + many, **({"all_gather": 1} if many else {})}
    by_op = ours.get_comm_counts_by_op()
    assert by_op["c10d.allreduce_.default"] == {"all_reduce": 1}
    assert by_op["_c10d_functional.all_reduce.default"] == {"all_reduce": 1}


@spmd(meshes=[(2,), (4,)])
def test_distribute_tensor_answers_the_keys_torch_counts_it_under(mesh):
    """distribute_tensor broadcasts (Replicate) and scatters (Shard) under torch's c10d keys."""
    import torch.distributed.tensor as theirs_api

    full = torch.arange(16.0).reshape(4, 4)
    results, modes = [], []
    for tensor_api, api_mesh, mode in ((theirs_api, torch_mesh(mesh), _torch_mode()), (shardtensor, mesh, CommDebugMode())):
        with mode:
            replicated = tensor_api.distribute_tensor(full, api_mesh, [tensor_api.Replicate()])
            sharded = tensor_api.distribute_tensor(full, api_mesh, [tensor_api.Shard(0)])
            dist.broadcast(full.clone(), 0)
        results.append((replicated.to_local(), sharded.to_local()))
        modes.append(mode)
    assert all(torch.equal(our, their) for our, their in zip(results[1], results[0]))
    _assert_counts_agree(modes[1], modes[0], {"c10d.broadcast_": 2, "c10d.scatter_": 1})


@spmd(meshes=ONE_D)
def test_our_comm_is_counted_once_though_it_calls_c10d(mesh):
    """comm's collectives call c10d (and, when checked, gather fingerprints with it): one record each,
    under the key torch's DTensor would use, never under the c10d op it called."""
    n = mesh.size()
    with check_collectives(), CommDebugMode() as mode:
        total = comm.all_reduce(torch.ones(4), mesh, 0, reduce_op="sum")
        gathered = comm.all_gather(torch.ones(2), mesh, 0, dim=0, sizes=[2] * n)
        pending = comm.all_reduce(torch.ones(4), mesh, 0, reduce_op="sum", async_op=True)
        waited = pending.wait()
    assert torch.equal(total, torch.full((4,), float(n))) and torch.equal(waited, total)
    assert torch.equal(gathered, torch.ones(2 * n))
    if n == 1:
        assert mode.get_total_counts() == 0
        return
    counts = mode.get_comm_counts()
    assert counts == {"all_reduce": 2, "all_gather": 1}
    assert counts[torch.ops.c10d_functional.all_reduce] == 2 and counts[torch.ops.c10d.allreduce_] == 0
    assert counts["c10d_functional.all_gather_into_tensor"] == 1 and counts[torch.ops.c10d.allgather_] == 0
    assert mode.get_total_counts() == 3


class _DirectInForward(torch.nn.Module):
    """A module whose forward all-reduces its input directly and whose child moves a DTensor."""

    def __init__(self, tensor_api, mesh):
        super().__init__()
        self.tensor_api, self.mesh = tensor_api, mesh
        self.child = torch.nn.Identity()

    def forward(self, value):
        direct = value.clone()
        dist.all_reduce(direct)
        partial = self.tensor_api.DTensor.from_local(self.child(value), self.mesh, [self.tensor_api.Partial()])
        return direct, partial.redistribute(self.mesh, [self.tensor_api.Replicate()]).to_local()


@spmd(meshes=[(2,), (4,)])
def test_module_counts_of_direct_calls_as_torch(mesh):
    import torch.distributed.tensor as theirs_api

    value = torch.arange(4.0) + mesh.get_rank()
    modes = []
    for tensor_api, api_mesh, mode in ((theirs_api, torch_mesh(mesh), _torch_mode()), (shardtensor, mesh, CommDebugMode())):
        with mode:
            direct, summed = _DirectInForward(tensor_api, api_mesh)(value)
        assert torch.equal(direct, summed)
        modes.append(mode)
    theirs, ours = (mode.comm_module_counts["_DirectInForward"]["forward"] for mode in modes)
    expected = {"c10d.allreduce_": 1, "c10d_functional.all_reduce": 1}
    assert _by_key(theirs) == expected
    assert {key: ours[key] for key in expected} == expected and ours == {"all_reduce": 2}
    table = modes[1].generate_comm_debug_tracing_table(noise_level=1)
    assert "Called directly through torch.distributed (bytes not measured):\n  c10d.allreduce_: 1" in table, table


@spmd(meshes=ONE_D)
def test_nested_and_reentered_modes_count_as_torch(mesh):
    """Nested modes each count what ran inside them; a mode entered again counts its new block only."""
    n = mesh.size()

    def run(make_mode):
        outer, inner = make_mode(), make_mode()
        with outer:
            dist.all_reduce(torch.ones(2))
            with inner:
                dist.broadcast(torch.ones(2), 0)
                funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait()
        with inner:  # entered again: a fresh recording
            dist.all_gather_into_tensor(torch.ones(2 * n), torch.ones(2))
        return outer, inner

    their_outer, their_inner = run(_torch_mode)
    our_outer, our_inner = run(CommDebugMode)
    _assert_counts_agree(our_outer, their_outer, {"c10d.allreduce_": 1, "c10d.broadcast_": 1,
                                                  "c10d_functional.all_reduce": 1}, "outer")
    _assert_counts_agree(our_inner, their_inner, {"c10d._allgather_base_": 1}, "inner, entered again")


@spmd(meshes=[(2,)])
def test_outside_the_mode_nothing_looks_at_collectives(mesh):
    """The hot path pays nothing: no dispatch mode is pushed and no collective is examined outside the mode."""
    depth = torch._C._len_torch_dispatch_stack()
    partial = shardtensor.DTensor.from_local(torch.ones(4), mesh, [shardtensor.Partial()])
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(direct_collectives, "direct_record", _refuse)
        total = torch.ones(4)
        dist.all_reduce(total)
        summed = partial.redistribute(mesh, [shardtensor.Replicate()]).to_local()
        assert torch._C._len_torch_dispatch_stack() == depth
    assert torch.equal(total, summed) and torch.equal(summed, torch.full((4,), 2.0))
    with CommDebugMode():
        assert torch._C._len_torch_dispatch_stack() == depth + 1
    assert torch._C._len_torch_dispatch_stack() == depth


def _refuse(*args, **kwargs):
    raise AssertionError("a collective was examined outside CommDebugMode")


def test_keys_read_by_op_overload_and_text():
    """A torch op, its overload and its key as text read one count: ours under torch DTensor's key for
    the kind, a direct call under its own op; kinds read everything; unknown keys teach."""
    direct = DirectRecord("all_reduce", None, 2, 0, 0, torch_key="c10d.allreduce_")
    counts = CommCounts.of([comm.CommRecord("all_reduce", 0, 2, 8, 8), direct, comm.CommRecord("send", None, 2, 4, 0)])
    assert counts == {"all_reduce": 2, "send": 1} and counts["gather"] == 0
    for key in (torch.ops.c10d.allreduce_, torch.ops.c10d.allreduce_.default, "c10d.allreduce_"):
        assert counts[key] == 1, key
    for key in (torch.ops._c10d_functional.all_reduce.default, "c10d_functional.all_reduce"):
        assert counts[key] == 1, key
    assert counts[torch.ops._c10d_functional.broadcast] == 0
    assert direct_collectives.torch_key(torch.ops._c10d_functional_autograd.all_to_all_single.default) \
        == "c10d_functional.all_to_all_single"
    for key in (torch.ops.aten.add, torch.ops.c10d.barrier, "allreduce"):
        with pytest.raises(KeyError, match="torch's collective ops"):
            counts[key]


@spmd(meshes=[(1,), (2,)])
def test_direct_calls_in_backward_count_as_torch(mesh):
    """A gradient hook that all-reduces directly (hand-written data parallelism) counts in backward."""
    def step(make_mode):
        weight = torch.arange(4.0, requires_grad=True)
        weight.register_hook(lambda grad: dist.all_reduce(grad) or grad)
        with make_mode() as mode:
            (weight * (mesh.get_rank() + 1.0)).sum().backward()
        return mode, weight.grad

    (theirs, their_grad), (ours, our_grad) = step(_torch_mode), step(CommDebugMode)
    ranks = mesh.size()
    assert torch.equal(our_grad, their_grad), (our_grad, their_grad)
    assert torch.equal(our_grad, torch.full((4,), ranks * (ranks + 1) / 2)), our_grad
    _assert_counts_agree(ours, theirs, {"c10d.allreduce_": 1})
    # No module ran. torch counts the hook's all_reduce under Global backward; ours, as for our own
    # collectives, under Global forward (backward work before the gradient reaches a module: docs/debug.md).
    their_phases = {phase: _by_key(counts) for phase, counts in theirs.comm_module_counts["Global"].items()}
    our_phases = {phase: dict(counts) for phase, counts in ours.get_comm_module_counts()["Global"].items()}
    assert their_phases == {"forward": {}, "backward": {"c10d.allreduce_": 1}}, their_phases
    assert our_phases == {"forward": {"all_reduce": 1}, "backward": {}}, our_phases


@spmd(meshes=ONE_D)
def test_entering_an_active_mode_again_raises_and_leaves_it_recording(mesh):
    """`with m: ... with m:` raises on every rank (it would replace the outer block's recording and leave
    its observer attached forever); the outer block keeps counting, and after it nothing is attached."""
    from shardtensor import comm

    x = shardtensor.distribute_tensor(torch.arange(4.0 * mesh.size()), mesh, [shardtensor.Shard(0)])
    mode = CommDebugMode()
    with mode:
        with pytest.raises(RuntimeError, match="already active"):
            with mode:
                pass
        assert torch.equal(x.full_tensor(), torch.arange(4.0 * mesh.size()))
    expected = 1 if mesh.size() > 1 else 0
    assert mode.get_total_counts() == expected
    assert not comm.records._observers
