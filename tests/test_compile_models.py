"""torch.compile of tensor-parallel models (fullgraph=True, aot_eager): the sequence-parallel transformer
block, fully_shard x TP+SP with each block compiled (torchtitan's pattern), styles on the "tp" dim of a
2x2 mesh, and local tensors passed between styles. Losses per step and parameters after 3 AdamW steps
equal one device; no graph break. docs/compile.md says what compiles; tests/test_compile.py has the
smaller programs and the helpers used here.
"""

import collections
import copy
import dataclasses

import pytest
import torch
from parallel_helpers import tp_mesh
from spmd import spmd
from test_compile import _collectives, _fresh_counter, _graph_breaks, _train_tp_mlp
from torch.testing import assert_close

from shardtensor import Replicate, Shard, comm, distribute_tensor
from shardtensor.demo.model import GPT, Block, GPTConfig, tensor_parallel_plan
from shardtensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module

CONFIG = GPTConfig(vocab_size=13, block_size=16, layers=2, heads=4, width=16)


def _block_plan() -> dict:
    """The demo's TP + SP plan for one block (torchtitan's layout): SequenceParallel norms,
    PrepareModuleInput gathering the sequence, Colwise projections, Rowwise back onto the sequence."""
    prefix = "blocks.*."
    return {name[len(prefix):]: style for name, style in tensor_parallel_plan().items() if name.startswith(prefix)}


def _torchtitan_plan() -> dict:
    """torchtitan's own form of the plan: the styles that put the residual stream back onto the
    sequence return local tensors (use_local_output=True), so the residual sums are plain tensors."""
    plan = tensor_parallel_plan()
    for name in ("token_embedding", "position_embedding", "blocks.*.attention.out", "blocks.*.mlp.proj"):
        plan[name] = dataclasses.replace(plan[name], use_local_output=True)
    return plan


def _frozen_key_bias(model):
    """The key projection's bias has a zero gradient up to rounding (softmax ignores a constant per row),
    which AdamW turns into +-lr steps of noise: frozen so that parameters can be compared."""
    for block in model.blocks if hasattr(model, "blocks") else [model]:
        block.attention.key.bias.requires_grad_(False)
    return model


def _three_adamw_steps_as_one_device(model, reference, losses, check_gradients=None) -> None:
    """Three AdamW steps of `model` (DTensor parameters) and its one-device `reference`, `losses(step)`
    giving both losses of a step: the losses and then the parameters agree. `check_gradients(step,
    records)`, if given, runs after both backward passes, with the collectives `comm` recorded during
    `model`'s (a compiled graph's too: each records as it runs)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for step in range(3):
        loss, expected = losses(step)
        assert_close(loss, expected, msg=lambda m: f"loss of step {step}: {m}")
        with comm.observe() as records:
            loss.backward()
        expected.backward()
        if check_gradients is not None:
            check_gradients(step, records)
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        assert_close(parameter.full_tensor(), wanted, msg=lambda m: f"{name} after 3 steps: {m}")


@spmd(meshes=[(2,)], timeout=180)
def test_sequence_parallel_block_compiles_in_one_graph(mesh):
    """The demo's block under TP + SP (a sequence of 7 over 2 ranks: uneven shards) compiled with
    fullgraph=True: one graph whose forward has the 4 collectives of Megatron SP (gather the sequence
    before attention and the MLP, reduce-scatter after each), losses and parameters as one device.

    Every gradient is laid out as eager mode lays it (the same block run eagerly beside it), which is its
    parameter's layout: the LayerNorms' Replicate weights and biases get Partial gradients from the
    sequence-sharded stream, and the end of backward sums them in one all_reduce over "tp" in both modes
    (`gradients.watch_graph_input` hooks the parameters dynamo takes as graph inputs). Gradients equal one
    device's; a compiled backward issues as many collectives as eager's (its graph's plus that one)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    counter = _fresh_counter("aot_eager")
    recorder = AotEagerAndRecordGraphs()
    counter.backend = recorder
    torch.manual_seed(0)
    block = _frozen_key_bias(Block(CONFIG)).double()
    reference = copy.deepcopy(block)
    eager = parallelize_module(copy.deepcopy(block), mesh, _block_plan())
    parallelize_module(block, mesh, _block_plan())
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    batches = []

    def losses(step: int):
        x = torch.randn(2, 7, CONFIG.width, generator=generator, dtype=torch.float64)
        weights = torch.randn(2, 7, CONFIG.width, generator=generator, dtype=torch.float64)
        batches.append((x, weights))
        return (compiled(distribute_tensor(x, mesh, [Shard(1)])).full_tensor() * weights).sum(), (reference(x) * weights).sum()

    def gradients_as_eager(step: int, compiled_records) -> None:
        x, weights = batches[step]
        eager.zero_grad()
        eager_loss = (eager(distribute_tensor(x, mesh, [Shard(1)])).full_tensor() * weights).sum()
        with comm.observe() as eager_records:
            eager_loss.backward()
        compared = [(name, parameter, twin) for (name, parameter), twin in zip(block.named_parameters(), eager.parameters())
                    if parameter.requires_grad]
        for (name, parameter, twin), wanted in zip(compared, (p for p in reference.parameters() if p.requires_grad)):
            assert parameter.grad.placements == twin.grad.placements == parameter.placements, (name, parameter.grad.placements)
            assert_close(parameter.grad.full_tensor(), wanted.grad, msg=lambda m: f"gradient of {name}: {m}")
        assert sum(p.grad.placements != p.placements for p in eager.parameters() if p.grad is not None) == 0
        graph_collectives = [name for name in _collectives(recorder.bw_graphs) if name != "wait_tensor"]
        assert "all_reduce" not in graph_collectives, graph_collectives
        kinds = [record.kind for record in compiled_records]  # the graph's collectives recorded as they ran
        assert kinds.count("all_reduce") == [r.kind for r in eager_records].count("all_reduce") == 1, kinds
        assert len(graph_collectives) == len(compiled_records) - 1, (graph_collectives, kinds)
        assert sorted(kinds) == sorted(record.kind for record in eager_records), kinds

    _three_adamw_steps_as_one_device(block, reference, losses, gradients_as_eager)
    assert counter.frame_count == 1 and _graph_breaks() == 0, (counter.frame_count, _graph_breaks())
    assert _collectives(recorder.fw_graphs[:1]) == ["all_to_all_single", "wait_tensor", "all_to_all_single", "wait_tensor"] * 2


@spmd(meshes=[(2, 2)], timeout=300)
def test_fully_shard_over_tp_sp_with_compiled_blocks_in_torchtitans_form(mesh):
    """torchtitan's recipe on the demo's GPT: TP + SP on "tp" with local tensors between the styles,
    each block `.compile()`d (fullgraph), then fully_shard per block and at the root over "dp". The
    residual sums reach the norms as plain tensors: inside the graph, from_local assumes equal shards
    and checks every rank's shape. Losses and parameters after 3 AdamW steps as one device; each step's
    collectives (the compiling one too) are recorded as an eager copy's, in order, with mesh dims and bytes."""
    from shardtensor.demo.train import forward_backward, mean_loss
    from shardtensor.fsdp import fully_shard
    from shardtensor.mesh import DeviceMesh

    counter = _fresh_counter("aot_eager")
    mesh = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _frozen_key_bias(GPT(dataclasses.replace(CONFIG, layers=1)))  # one block: one compile to pay for
    reference, eager = copy.deepcopy(model), copy.deepcopy(model)
    for each in (model, eager):
        parallelize_module(each, mesh["tp"], _torchtitan_plan())
        for block in each.blocks:
            if each is model:
                block.compile(backend=counter, fullgraph=True)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(each, mesh=mesh["dp"])
    optimizers = [torch.optim.AdamW(each.parameters(), lr=0.01) for each in (model, eager, reference)]
    generator = torch.Generator().manual_seed(1)
    dp = mesh.get_coordinate()[0]

    def observed_step(each, tokens, targets):  # the step's loss and its collectives (kind, mesh dims, bytes)
        with comm.observe() as records:
            loss = mean_loss(forward_backward(each, tokens.tensor_split(2)[dp], targets.tensor_split(2)[dp]), mesh)
        return loss, [(r.kind, r.mesh_dim_names, r.bytes_sent, r.bytes_received) for r in records]

    for step in range(3):
        tokens, targets = torch.randint(0, CONFIG.vocab_size, (2, 4, 8), generator=generator)
        loss, records = observed_step(model, tokens, targets)
        eager_loss, eager_records = observed_step(eager, tokens, targets)
        expected = forward_backward(reference, tokens, targets).item()
        assert abs(loss - expected) < 1e-5 and abs(eager_loss - expected) < 1e-5, (step, loss, eager_loss, expected)
        assert records == eager_records, step  # the compiled block's collectives count as eager's, each step
        assert collections.Counter((kind, dims) for kind, dims, _, _ in records) == {
            ("all_gather", ("tp",)): 10, ("reduce_scatter", ("tp",)): 7, ("all_reduce", ("tp",)): 5,  # styles and loss
            ("all_gather", ("dp",)): 3, ("reduce_scatter", ("dp",)): 2, ("all_reduce", ("dp",)): 1}, step  # fully_shard, mean_loss
        for each in optimizers:
            each.step()
            each.zero_grad()
    for (name, parameter), wanted in zip(model.named_parameters(), reference.parameters()):
        assert_close(parameter.full_tensor(), wanted, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert counter.frame_count == 1 and _graph_breaks() == 0, (counter.frame_count, _graph_breaks())


@spmd(meshes=[(2, 2)], timeout=180)
def test_tp_on_the_tp_dim_of_a_2x2_mesh_compiles(mesh):
    """Multi-dim meshes under compile: the TP MLP on the "tp" dim of 2x2 (one graph, 3 AdamW steps as
    one device), and a 2-D DTensor moved between layouts over both mesh dims, uneven shards included."""
    counter = _fresh_counter("aot_eager")
    _train_tp_mlp(tp_mesh(mesh), {"backend": counter, "fullgraph": True}, hidden=15)
    assert counter.frame_count == 1 and _graph_breaks() == 0

    counter = _fresh_counter("aot_eager")
    function = lambda t: (t.redistribute(mesh, [Replicate(), Shard(0)]) * 2).full_tensor()  # noqa: E731
    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).requires_grad_()
    out = torch.compile(function, backend=counter, fullgraph=True)(x)
    assert_close(out, full * 2)
    out.sum().backward()
    assert_close(x.grad.full_tensor(), torch.full((5, 3), 2.0))
    assert x.grad.placements == (Shard(0), Shard(1))
    assert counter.frame_count == 1 and _graph_breaks() == 0


class _Cut(torch.nn.Module):
    """Keeps the first 10 of 16 features: over 2 ranks, shards of 8 and 2, not torch.chunk's 5 and 5."""

    def forward(self, x):
        return x[..., :10]


class _CutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.cut, self.down = torch.nn.Linear(8, 16), _Cut(), torch.nn.Linear(10, 8)

    def forward(self, x):
        return self.down(self.cut(torch.relu(self.up(x))))


def _parallel_cut_mlp(mesh):
    """`_CutMLP` under Colwise (DTensor output), the cut (local output of 8 and 2 columns), Rowwise; and a
    one-device copy."""
    torch.manual_seed(0)
    model = _CutMLP()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, {
        "up": ColwiseParallel(use_local_output=False),
        "cut": PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Shard(-1)),
        "down": RowwiseParallel(),
    })
    return model, reference


@spmd(meshes=[(2,)], timeout=180)
def test_local_tensors_between_styles_keep_their_layout_when_compiled(mesh):
    """A local tensor returned by a style carries its DTensor's exact layout to the next style inside a
    compiled graph too (shards of 8 and 2 columns reach RowwiseParallel, whose in_features alone would
    give 5 and 5): 3 AdamW steps as one device. A plain tensor a style cannot know the layout of (not
    straight out of a style) is read as equal shards and checked in the graph: uneven shards raise
    on every rank, naming the fix."""
    counter = _fresh_counter("aot_eager")
    model, reference = _parallel_cut_mlp(mesh)
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    def losses(step: int):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        return compiled(x).square().sum(), reference(x).square().sum()

    _three_adamw_steps_as_one_device(model, reference, losses)
    assert counter.frame_count == 1 and _graph_breaks() == 0

    _fresh_counter("aot_eager")
    norm = parallelize_module(torch.nn.LayerNorm(4), mesh, SequenceParallel())
    rows = 4 - mesh.get_coordinate()[0]  # a sequence of 7 over 2 ranks: 4 and 3 rows
    with pytest.raises(RuntimeError, match="inside a torch.compile graph: the graph was traced for the local shapes"):
        torch.compile(norm, backend="aot_eager", fullgraph=True)(torch.randn(2, rows, 4))


@pytest.mark.parametrize("compiled_part", ["cut", "down"])
@spmd(meshes=[(2,)], timeout=180)
def test_a_layout_tag_crosses_between_eager_and_compiled_styles(mesh, compiled_part):
    """A style's local output is tagged in one form eagerly (its layout) and in another inside a graph (its
    sizes as values); each side reads the other's. "cut" compiled: its graph tags the local output, which eager
    RowwiseParallel reads (no size learnt with an all_gather). "down" compiled: its graph reads the tag eager
    code wrote, shards of 8 and 2 columns (the 5 and 5 of its in_features would fail its in-graph shape
    check), and the gradient eager code gets back for them (shards of 5 and 5, from the weight's layout) is
    moved to 8 and 2 for the backward of the input hook's graph. Outputs and gradients as one device over 3
    calls; the frames are compiled on the first call only (torch 2.13 compiles a module's hooks and forward
    as frames of their own: "cut" 2, "down" 3; torch 2.14: 2 and 1)."""
    counter = _fresh_counter("aot_eager")
    model, reference = _parallel_cut_mlp(mesh)
    getattr(model, compiled_part).compile(backend=counter, fullgraph=True)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model.zero_grad(), reference.zero_grad()
        with comm.observe() as records:
            out = model(x)
        assert "all_gather" not in [record.kind for record in records], records
        assert_close(out, reference(x), msg=lambda m: f"step {step}: {m}")
        out.square().sum().backward()
        reference(x).square().sum().backward()
        for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
            assert_close(parameter.grad.full_tensor(), expected.grad, msg=lambda m: f"step {step}, {name}.grad: {m}")
        if step == 0:
            frames = counter.frame_count
    assert counter.frame_count == frames <= 3, (frames, counter.frame_count)  # no recompilation after the first call
    assert _graph_breaks() == 0, _graph_breaks()
