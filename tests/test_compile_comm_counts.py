"""A compiled step's collectives are counted as the eager step's: `comm.observe()` and `CommDebugMode` see
the same kinds, mesh dims and bytes per call, forward and backward, on aot_eager and inductor, fullgraph,
for the TP MLP and the sequence-parallel block.
A traced collective leaves `shardtensor::record_collective` in its graph (`comm/records.py`), which records
each time the graph runs; tracing records nothing. docs/compile.md ("Counting a compiled step's
collectives") says how.
"""

import collections
import dataclasses

import torch
from spmd import spmd
from test_compile import _MLP, _fresh_counter, _graph_breaks
from test_compile_models import CONFIG, _block_plan, _frozen_key_bias

from shardtensor import Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.demo.model import Block
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


@spmd(meshes=[(2,)], timeout=180)
def test_compiled_sequence_parallel_block_counts_as_eager(mesh):
    """The demo's block under TP + SP (a sequence of 7 over 2 ranks: uneven gathers and scatters as
    all_to_alls), forward, loss through `full_tensor` and backward: record by record as eager."""
    with CommDebugMode():  # its global module hook, kept from then on, is there before compiling: no recompile
        pass
    torch.manual_seed(0)
    block = _frozen_key_bias(Block(CONFIG)).double()
    parallelize_module(block, mesh, _block_plan())
    counter = _fresh_counter("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    x = torch.randn(2, 7, CONFIG.width, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def step(module):  # forward, loss through full_tensor (eager: outside the graph), backward
        return lambda: module(distribute_tensor(x, mesh, [Shard(1)])).full_tensor().square().sum().backward()

    eager = _observed(step(block))
    kinds = collections.Counter(record[0] for record in eager)  # distribute_tensor's scatter (outside the graph),
    assert kinds == {"scatter": 1, "all_gather": 5, "reduce_scatter": 4, "all_reduce": 1}, kinds  # SP's, both ways
    assert _observed(step(compiled)) == eager  # the call that compiles
    assert _observed(step(compiled)) == eager
    assert _under_comm_debug_mode(step(compiled)) == _under_comm_debug_mode(step(block))
    assert counter.frame_count == 1 and _graph_breaks() == 0, counter.frame_count
