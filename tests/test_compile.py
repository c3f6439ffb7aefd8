"""torch.compile of shardtensor programs: compiled values and gradients equal eager / one device.

Each body resets dynamo first (`torch._dynamo.reset()`): the worker pools are shared by the session.
Graph-break counts come from `torch._dynamo.utils.counters["graph_break"]`, so a regression that
silently falls back to eager shows as a changed count. docs/compile.md says what compiles.
"""

import contextlib
import copy
import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.testing import assert_close

from shardtensor import Replicate, Shard, distribute_tensor
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd import spmd


def _fresh_counter(backend: str) -> CompileCounterWithBackend:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return CompileCounterWithBackend(backend)


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@spmd(meshes=[(2,)])
def test_to_local_keeps_autograd(mesh):
    """The first bug of issue 24: `to_local` inside a compiled function dropped autograd silently."""
    for backend in ("eager", "aot_eager"):
        counter = _fresh_counter(backend)
        function = lambda t: (t.to_local() * 2).sum()  # noqa: E731
        full = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        out = torch.compile(function, backend=counter, fullgraph=True)(x)
        assert out.requires_grad, backend
        out.backward()
        y = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        function(y).backward()
        assert_close(x.grad.full_tensor(), y.grad.full_tensor())
        assert_close(x.grad.full_tensor(), torch.full((6, 3), 2.0))
        assert counter.frame_count == 1 and _graph_breaks() == 0, backend


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(8, hidden)
        self.down = torch.nn.Linear(hidden, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _train_tp_mlp(mesh, compile_options: dict, steps: int = 3, hidden: int = 16):
    """A TP MLP (Colwise, Rowwise) compiled with `compile_options` and trained with AdamW next to the
    same MLP on one device: outputs, and parameters after every step, are equal."""
    torch.manual_seed(0)
    model = _MLP(hidden)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(model, **compile_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out, expected = compiled(x), reference(x)
        assert_close(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        assert_close(parameter.full_tensor(), wanted, msg=lambda m: f"{name} after {steps} steps: {m}")


@spmd(meshes=[(2,)])
def test_metadata_guard_passes_equal_layouts_and_recompiles_for_others(mesh):
    """A compiled call's guard on a DTensor input is an identity check of its metadata (one object per
    spec, which deep copies to itself, as a guard stores it); equal layouts reuse the graph, another
    layout recompiles, values as eager."""
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    y = distribute_tensor(torch.arange(8.0) + 1, mesh, [Shard(0)])
    z = distribute_tensor(torch.arange(8.0), mesh, [Replicate()])
    metadata = x.__tensor_flatten__()[1]
    assert y.__tensor_flatten__()[1] is metadata and copy.deepcopy(metadata) is metadata
    assert z.__tensor_flatten__()[1] != metadata
    counter = _fresh_counter("aot_eager")
    double = torch.compile(lambda t: t * 2, backend=counter, fullgraph=True)
    for t in (x, y, z, y):
        assert_close(double(t).full_tensor(), t.full_tensor() * 2)
    assert counter.frame_count == 2


@spmd(meshes=[(2,)])
def test_tp_mlp_eager_backend(mesh):
    """Issue 24's first row: was a dynamo internal error (`'dict' object has no attribute 'node'`)."""
    counter = _fresh_counter("eager")
    _train_tp_mlp(mesh, {"backend": counter, "fullgraph": True})
    assert counter.frame_count == 1 and _graph_breaks() == 0


@spmd(meshes=[(2,), (4,)])
def test_tp_mlp_aot_eager_fullgraph(mesh):
    """Issue 24's second row: the styles' from_local / redistribute and every op are in one graph,
    compiled once for 3 steps, with functional collectives (forward: the Rowwise all_reduce)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    counter = _fresh_counter("aot_eager")
    recorder = AotEagerAndRecordGraphs()
    counter.backend = recorder
    _train_tp_mlp(mesh, {"backend": counter, "fullgraph": True})
    assert counter.frame_count == 1 and _graph_breaks() == 0
    assert _collectives(recorder.fw_graphs) == ["all_reduce", "wait_tensor"]


def _collectives(graphs) -> list[str]:
    """The collective ops of traced graphs, in order (functional `_c10d_functional` or in-place `c10d`)."""
    names = []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function" and "c10d" in str(node.target):
                names.append(str(node.target).split("::")[-1].replace(".default", "").split(".")[-1])
    return names


@spmd(meshes=[(2,)])
def test_traced_collectives_are_functional(mesh):
    """Inside a compiled function every collective is a `_c10d_functional` op followed by its
    `wait_tensor` (uneven shards through all_to_all_single with split sizes); values and gradients
    equal eager, with fullgraph=True and no graph break."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    cases = [
        ("gather", lambda t: t.full_tensor() * 2, [Shard(0)], 6, ["all_gather_into_tensor", "wait_tensor"]),
        ("partial", lambda t: (t.T @ t).full_tensor(), [Shard(0)], 6, ["all_reduce", "wait_tensor"]),
        ("uneven", lambda t: (t * 3).full_tensor(), [Shard(0)], 5, ["all_to_all_single", "wait_tensor"]),
    ]
    for name, function, placements, rows, expected in cases:
        _fresh_counter("aot_eager")
        backend = AotEagerAndRecordGraphs()
        full = torch.randn(rows, 4, generator=torch.Generator().manual_seed(0))
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        y = distribute_tensor(full, mesh, placements).requires_grad_()
        out, wanted = torch.compile(function, backend=backend, fullgraph=True)(x), function(y)
        assert_close(out, wanted)
        out.square().sum().backward()
        wanted.square().sum().backward()
        assert_close(x.grad.full_tensor(), y.grad.full_tensor(), msg=lambda m: f"{name}: {m}")
        assert _collectives(backend.fw_graphs) == expected, (name, _collectives(backend.fw_graphs))
        assert _graph_breaks() == 0, name


@spmd(meshes=[(2,)])
def test_tp_mlp_uneven_shards_aot_eager_fullgraph(mesh):
    """15 hidden features over 2 ranks (8 + 7): the uneven shards compile in one graph too."""
    counter = _fresh_counter("aot_eager")
    _train_tp_mlp(mesh, {"backend": counter, "fullgraph": True}, hidden=15)
    assert counter.frame_count == 1 and _graph_breaks() == 0


@spmd(meshes=[(2,)])
def test_loss_parallel_compiled(mesh):
    """`loss_parallel` inside a compiled function (fullgraph, aot_eager): loss and gradient as one device."""
    import torch.nn.functional as F

    from shardtensor.parallel import loss_parallel

    counter = _fresh_counter("aot_eager")
    generator = torch.Generator().manual_seed(0)
    logits, target = torch.randn(6, 10, generator=generator), torch.randint(0, 10, (6,), generator=generator)

    def loss_of(x, target):
        with loss_parallel():
            return F.cross_entropy(x, target)

    x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    reference = logits.clone().requires_grad_()
    loss = torch.compile(loss_of, backend=counter, fullgraph=True)(x, target)
    expected = F.cross_entropy(reference, target)
    assert_close(loss.full_tensor(), expected)
    loss.backward()
    expected.backward()
    assert_close(x.grad.full_tensor(), reference.grad)
    assert counter.frame_count == 1 and _graph_breaks() == 0


@spmd(meshes=[(2,)], timeout=600)
def test_tp_mlp_inductor(mesh):
    """The default backend (inductor, C++ code through gcc): 3 AdamW steps as one device, one graph."""
    counter = _fresh_counter("inductor")
    _train_tp_mlp(mesh, {"backend": counter, "fullgraph": True})
    assert counter.frame_count == 1 and _graph_breaks() == 0


@spmd(meshes=[(2,)])
def test_unsupported_parts_graph_break_and_stay_correct(mesh):
    """What cannot be traced yet (a point-to-point exchange, here a Python side effect forcing a break)
    breaks the graph and runs eagerly: values as eager, and the break is counted, so a silent fallback
    shows in this count."""
    counter = _fresh_counter("aot_eager")

    def function(t):
        doubled = (t * 2).redistribute(mesh, [Replicate()])
        torch._dynamo.graph_break()
        return doubled.to_local().sum()

    full = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    out = torch.compile(function, backend=counter)(x)
    out.backward()
    assert_close(out, full.sum() * 2)
    assert_close(x.grad.full_tensor(), torch.full((6, 3), 2.0))
    assert counter.frame_count == 2 and _graph_breaks() == 1


@spmd(meshes=[(2, 2)])
def test_compiled_blocks_under_fully_shard_train_like_one_device(mesh):
    """The torchtitan pattern: TP on "tp", each block `.compile()`d, then fully_shard per block and at the
    root over "dp". FSDP's hooks run eagerly (`torch.compiler.disable`), the blocks' math is compiled:
    losses and parameters as one device after 3 AdamW steps."""
    from test_fsdp import _assert_same_parameters, _batches, _local_batch, _loss, _model, _train_reference
    from test_fsdp_2d import _named_mesh

    from shardtensor.fsdp import fully_shard

    counter = _fresh_counter("aot_eager")
    mesh = _named_mesh(mesh)
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    batches = _batches(3)
    reference = _model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    model = _model()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        block.compile(backend=counter)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    dp = mesh.get_coordinate()[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        local_inputs, local_target = _local_batch(inputs, dp, 2), _local_batch(target, dp, 2)
        loss = _loss(model(local_inputs), local_target)
        loss.backward()
        with torch.no_grad():  # this dp rank's half of the batch through the one-device model
            assert_close(loss, _loss(reference(local_inputs), local_target))
        _loss(reference(inputs), target).backward()
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    _assert_same_parameters(model, reference)
    # One graph for both blocks, none per step (two while the TP styles' hooks read their function's
    # signature on every call: dynamo then guarded each block's hook function by identity). FSDP's hooks
    # are not traced at all (dynamo starts at each block's `forward`, below nn.Module.__call__ and the
    # disabled hooks), so no graph break shows; a break here is a regression.
    assert counter.frame_count == 1 and _graph_breaks() == 0, (counter.frame_count, _graph_breaks())
    # A compiled function calling the fully_shard model must break at its hooks: fullgraph names why.
    with pytest.raises(torch._dynamo.exc.Unsupported, match="fully_shard's forward hooks"):
        torch.compile(lambda t: model(t), backend="aot_eager", fullgraph=True)(local_inputs)


@contextlib.contextmanager
def _no_ignored_guards():
    """Fail if a graph compiled inside wanted a guard that torch could not add any more (a backward compiled
    after its forward: "Ignored guard ..."), which would let the graph run for sizes it is wrong for."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    ignored = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "Ignored guard" in record.getMessage():
                ignored.append(record.getMessage())

    handler, level = Catch(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not ignored, ignored


def _mlp_on_changing_shapes(mesh, shapes, *, hidden: int, mark_dim: int | None = None) -> int:
    """The TP MLP compiled once (aot_eager, fullgraph) and fed inputs of `shapes` (+ 8 features): the output
    and every parameter's gradient equal one device's at each shape. Returns how many graphs were compiled."""
    counter = _fresh_counter("aot_eager")
    torch.manual_seed(0)
    model = _MLP(hidden)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for index, shape in enumerate(shapes):
        x = torch.randn(*shape, 8, generator=torch.Generator().manual_seed(index))
        if mark_dim is not None:
            torch._dynamo.mark_dynamic(x, mark_dim)
        with _no_ignored_guards():
            out, expected = compiled(x), reference(x)
            assert_close(out, expected)
            out.square().sum().backward()
        expected.square().sum().backward()
        # The layout RowwiseParallel leaves on its local output, returned by the graph, holds this call's sizes
        # (torch 2.15 raised NameError for the trace's symbol; 2.13 and 2.14 kept it as a stale SymInt).
        tagged_shape = out._shardtensor_layout[2]
        assert tagged_shape == (*shape, 8) and all(type(size) is int for size in tagged_shape), tagged_shape
        for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
            assert_close(parameter.grad.full_tensor(), wanted.grad, msg=lambda m: f"{name} at {shape}: {m}")
        model.zero_grad()
        reference.zero_grad()
    assert _graph_breaks() == 0
    return counter.frame_count


@spmd(meshes=[(2,)])
def test_tp_mlp_changing_batch_recompiles_once(mesh):
    """Issue 24 item 5: batches of 4, 6, 8 and 5 rows, uneven hidden features (15 over 2 ranks). Automatic
    dynamic shapes: the second size recompiles once with a symbolic batch, and that graph serves every
    later size (no guard fires per call)."""
    assert _mlp_on_changing_shapes(mesh, [(4,), (6,), (8,), (5,)], hidden=15) == 2


@spmd(meshes=[(2,)])
def test_tp_mlp_changing_sequence_length_marked_dynamic_compiles_once(mesh):
    """(batch, sequence, features) inputs whose sequence length changes (3, 5, 7, 4), marked dynamic up front
    (`torch._dynamo.mark_dynamic`): one graph, no recompile."""
    assert _mlp_on_changing_shapes(mesh, [(2, 3), (2, 5), (2, 7), (2, 4)], hidden=16, mark_dim=1) == 1


@spmd(meshes=[(2,)])
def test_dtensor_argument_with_changing_unsharded_dim(mesh):
    """A DTensor argument with explicit uneven shards on dim 1 (1 + 4 columns) whose dim 0 changes (4, 6, 8,
    5 rows): the metadata guard leaves out the sizes dynamo guards itself but keeps the explicit pieces, so
    one recompile serves every row count; values and gradients as one device."""
    from shardtensor import DTensor

    counter = _fresh_counter("aot_eager")
    compiled = torch.compile(lambda t: (t.exp() * 2).sum(dim=0).full_tensor(), backend=counter, fullgraph=True)
    for rows in (4, 6, 8, 5):
        full = torch.randn(rows, 5, generator=torch.Generator().manual_seed(rows))
        columns = (slice(0, 1), slice(1, 5))[mesh.get_coordinate()[0]]
        local = full[:, columns].clone()
        x = DTensor.from_local(local, mesh, [Shard(1)], shape=(rows, 5), shard_sizes={0: (1, 4)}).detach()
        x.requires_grad_()
        with _no_ignored_guards():
            out = compiled(x)
            assert_close(out, (full.exp() * 2).sum(dim=0))
            out.sum().backward()
        assert x.grad.sharding.pieces[1] == (1, 4)
        assert_close(x.grad.full_tensor(), full.exp() * 2)
    assert counter.frame_count == 2 and _graph_breaks() == 0


@spmd(meshes=[(2,)])
def test_changing_sharded_dim_recompiles_once(mesh):
    """The changing dim is the sharded one (rows 4, 6, 8, 5, 7 over 2 ranks: torch.chunk pieces, uneven for odd
    counts): the pieces are SymInt expressions, the gather takes symbolic split sizes, so one recompile serves
    every count, the backward (compiled after its forward) adds no guard, and values and gradients are right."""
    counter = _fresh_counter("aot_eager")
    weight_full = torch.randn(3, 4, generator=torch.Generator().manual_seed(9))
    weight = distribute_tensor(weight_full, mesh, [Replicate()])
    compiled = torch.compile(
        lambda t: (t @ weight).exp().redistribute(mesh, [Replicate()]).to_local(), backend=counter, fullgraph=True
    )
    for rows in (4, 6, 8, 5, 7):
        full = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows))
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        with _no_ignored_guards():
            out = compiled(x)
            assert_close(out, (full @ weight_full).exp())
            out.sum().backward()
        assert_close(x.grad.full_tensor(), (full @ weight_full).exp() @ weight_full.T)
    assert counter.frame_count == 2 and _graph_breaks() == 0
