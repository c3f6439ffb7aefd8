"""A compiled step's collectives are counted as the eager step's: `comm.observe()` and `CommDebugMode` see
the same kinds, mesh dims and bytes per call, forward and backward, on aot_eager and inductor, fullgraph
(the sequence-parallel block's: `test_compile_models.py`, beside the test that compiles it).
A traced collective leaves `shardtensor::record_collective` in its graph (`comm/records.py`), which records
each time the graph runs; tracing records nothing. docs/compile.md ("Counting a compiled step's
collectives") says how.
"""

import dataclasses

import torch
from spmd import spmd
from test_compile import _MLP, _fresh_counter, _graph_breaks

from shardtensor import comm
from shardtensor.debug import CommDebugMode
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _observed(step) -> list[tuple]:
    """The records `comm.observe()` collects from `step()`, as (kind, mesh dim, group size, sent, received)."""
    with comm.observe() as records:
        step()
    return [(r.kind, r.mesh_dim, r.group_size, r.bytes_sent, r.bytes_received) for r in records]


def _under_comm_debug_mode(step) -> tuple:
    """(counts by kind, bytes by kind, per-module counts of the outermost modules) of `step()` under CommDebugMode."""
    mode = CommDebugMode()
    with mode:
        step()
    modules = {name: phases for name, phases in mode.get_comm_module_counts().items() if "." not in name}
    return mode.get_comm_counts(), mode.get_comm_bytes(), modules


def _tp_mlp(mesh):
    torch.manual_seed(0)
    model = _MLP()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _mlp_step(model, rows: int):
    """One forward and backward; the input requires grad, so the backward has Colwise's all_reduce too."""
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows), requires_grad=True)
    return lambda: model(x).square().sum().backward()


@spmd(meshes=[(2,)], timeout=180)
def test_compiled_tp_mlp_step_counts_as_eager(mesh):
    """aot_eager, fullgraph: the compiling call and every later one record the eager step's collectives
    (one all_reduce forward, one backward, bytes of the batch's rows); a step run while nothing observes
    adds no record to a list closed before it; a new batch size recompiles (symbolic bytes) and still
    counts as eager at each size. CommDebugMode agrees, per kind, in bytes and for the compiled module."""
    with CommDebugMode():  # its global module hook, kept from then on: one graph per shape, not two
        pass
    model = _tp_mlp(mesh)
    counter = _fresh_counter("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager = _observed(_mlp_step(model, 4))
    assert eager == [("all_reduce", 0, 2, 128, 128)] * 2
    assert _observed(_mlp_step(compiled, 4)) == eager  # the call that compiles: tracing records nothing
    with comm.observe() as closed:
        pass
    before = comm.call_counts["all_reduce"]
    _mlp_step(compiled, 4)()
    assert closed == [] and comm.call_counts["all_reduce"] == before + 2  # counted, as eager, but not observed
    assert _under_comm_debug_mode(_mlp_step(compiled, 4)) == _under_comm_debug_mode(_mlp_step(model, 4))
    assert _observed(_mlp_step(compiled, 6)) == _observed(_mlp_step(model, 6))  # recompiles: a symbolic batch
    counts, sent_received, modules = _under_comm_debug_mode(_mlp_step(compiled, 9))  # the symbolic graph
    assert counts == {"all_reduce": 2} and dataclasses.astuple(sent_received["all_reduce"]) == (2 * 9 * 8 * 4,) * 2
    assert modules["_MLP"] == {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}
    assert (counts, sent_received, modules) == _under_comm_debug_mode(_mlp_step(model, 9))
    assert counter.frame_count == 2 and _graph_breaks() == 0, counter.frame_count


@spmd(meshes=[(2,)], timeout=300)
def test_compiled_tp_mlp_step_counts_as_eager_with_inductor(mesh):
    """inductor, fullgraph: the record op survives its passes (one all_reduce forward, one backward)."""
    model = _tp_mlp(mesh)
    counter = _fresh_counter("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    assert _under_comm_debug_mode(_mlp_step(compiled, 4)) == _under_comm_debug_mode(_mlp_step(model, 4))
    assert _observed(_mlp_step(compiled, 4)) == _observed(_mlp_step(model, 4)) == [("all_reduce", 0, 2, 128, 128)] * 2
    assert counter.frame_count == 1 and _graph_breaks() == 0
