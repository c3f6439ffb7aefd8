"""Parallel styles and parallelize_module against the single-device module: outputs, gradients and
parameters after AdamW steps, on 1, 2 and 4 ranks and the tp dim of a 2x2 mesh; collective counts."""

import pytest
import torch
import torch.nn.functional as F
from parallel_helpers import data_seed, tp_mesh, train_and_compare
from spmd import spmd
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor, explicit_communication, init_device_mesh
from shardtensor.layout import chunk_sizes
from shardtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    UnsupportedModuleError,
    parallelize_module,
)

MESHES = [(1,), (2,), (4,), (2, 2)]


def _inputs(*shape, requires_grad=True):
    return lambda generator: [torch.randn(*shape, generator=generator).requires_grad_(requires_grad)]


def _indices(vocabulary, *shape):
    return lambda generator: [torch.randint(0, vocabulary, shape, generator=generator)]


class MLP(nn.Module):
    """Megatron's pair: hidden 10 does not divide over 4 ranks."""

    def __init__(self, width=6, hidden=10):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@spmd(meshes=MESHES)
def test_colwise_linear_and_embedding_give_last_dim_shards(mesh):
    tp = tp_mesh(mesh)
    linear = train_and_compare(mesh, lambda: nn.Linear(6, 10), ColwiseParallel(), _inputs(3, 5, 6),
                               output_placements=[Shard(-1)])
    assert linear.weight.placements == (Shard(0),) and linear.bias.placements == (Shard(0),)
    embedding = train_and_compare(mesh, lambda: nn.Embedding(9, 10), ColwiseParallel(), _indices(9, 3, 5),
                                  output_placements=[Shard(-1)])
    assert embedding.weight.placements == (Shard(1),)
    gathered = train_and_compare(mesh, lambda: nn.Linear(6, 10), ColwiseParallel(output_layouts=Replicate()), _inputs(4, 6))
    assert gathered.weight.to_local().shape == (chunk_sizes(10, tp.size())[tp.get_local_rank()], 6)  # 10 over 4: 3, 3, 3, 1


@spmd(meshes=MESHES)
def test_rowwise_linear_and_embedding_reduce_a_partial_sum(mesh):
    tp = tp_mesh(mesh)
    linear = train_and_compare(mesh, lambda: nn.Linear(10, 6), RowwiseParallel(input_layouts=Replicate()),
                               _inputs(3, 5, 10))
    assert linear.weight.placements == (Shard(1),) and linear.bias.placements == (Replicate(),)
    embedding = train_and_compare(mesh, lambda: nn.Embedding(11, 4), RowwiseParallel(input_layouts=Replicate()),
                                  _indices(11, 3, 7))
    assert embedding.weight.placements == (Shard(0),)
    # The vocab-parallel lookup: no gather of the table, one all_reduce of the (3, 7, 4) output.
    with comm.observe() as records:
        embedding(torch.randint(0, 11, (3, 7)))
    assert [(record.kind, record.bytes_sent) for record in records] == (
        [("all_reduce", 2 * (tp.size() - 1) * 3 * 7 * 4 * 4 // tp.size())] if tp.size() > 1 else []
    )
    sequence = train_and_compare(mesh, lambda: nn.Embedding(11, 4), RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                                 _indices(11, 2, 7), output_placements=[Shard(1)])
    assert sequence.weight.to_local().shape == (chunk_sizes(11, tp.size())[tp.get_local_rank()], 4)


@spmd(meshes=MESHES, simulated=[(8,), (2, 8)])
def test_megatron_mlp_trains_exactly_with_one_all_reduce_each_way(mesh):
    tp = tp_mesh(mesh)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    model = train_and_compare(mesh, MLP, plan, _inputs(4, 3, 6))
    x = torch.randn(4, 3, 6, requires_grad=True)
    with comm.observe() as forward:
        y = model(x)
    with comm.observe() as backward:
        y.sum().backward()
    expected = ["all_reduce"] if tp.size() > 1 else []
    assert [record.kind for record in forward] == expected  # fc2's partial sums
    assert [record.kind for record in backward] == expected  # fc1's input gradient
    assert not isinstance(y, DTensor) and not isinstance(x.grad, DTensor)


@spmd(meshes=MESHES, simulated=[(8,), (16,)])
def test_sequence_parallel_norm_and_dropout_on_an_uneven_sequence(mesh):
    tp = tp_mesh(mesh)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(13, 8)
            self.norm = nn.LayerNorm(8)
            self.rms = nn.RMSNorm(8)
            self.dropout = nn.Dropout(0.0)
            self.up = nn.Linear(8, 12)
            self.down = nn.Linear(12, 8)

        def forward(self, tokens):
            x = self.rms(self.norm(self.embedding(tokens)))
            return self.dropout(self.down(F.gelu(self.up(x))))

    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # a local tensor, tagged
        "norm": SequenceParallel(),
        "rms": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "dropout": SequenceParallel(),
    }
    model = train_and_compare(mesh, Stack, plan, _indices(13, 2, 7))  # sequence 7 over 1, 2, 4 ranks
    assert model.norm.weight.placements == (Replicate(),)
    output = model(torch.randint(0, 13, (2, 7)))
    assert output.placements == (Shard(1),)
    assert output.sharding.pieces[1] == chunk_sizes(7, tp.size())


class _LlamaRMSNorm(nn.Module):
    """The RMSNorm written in Python by Llama (and PyTorch's tensor-parallel tutorial), not nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@spmd(meshes=[(2,), (4,)])
def test_sequence_parallel_lays_out_a_norm_written_in_python(mesh):
    """PyTorch's SequenceParallel takes any module (its docs name Llama's Python RMSNorm): so does ours."""

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(13, 8)
            self.norm = _LlamaRMSNorm(8)
            self.head = nn.Linear(8, 5)

        def forward(self, tokens):
            return self.head(self.norm(self.embedding(tokens)))

    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1)),
    }
    model = train_and_compare(mesh, Stack, plan, _indices(13, 2, 7), output_placements=[Shard(-1)])
    assert model.norm.weight.placements == (Replicate(),)


@spmd(meshes=[(2,), (4,)])
def test_sequence_parallel_norm_gradients_are_replicate_after_one_all_reduce(mesh):
    """Under torch's SequenceParallel the LayerNorm weight and bias gradients come out Partial(sum),
    each reduced later by the optimizer; ours have the parameters' Replicate layout when backward
    ends, both reduced in one all_reduce, and equal one device's (sequence 7 over 2 and 4 ranks)."""
    torch.manual_seed(0)
    norm = parallelize_module(nn.LayerNorm(8), mesh, SequenceParallel())
    reference = nn.LayerNorm(8)
    x_full, weights_full = torch.randn(2, 7, 8), torch.randn(2, 7, 8)
    x, weights = (distribute_tensor(full, mesh, [Shard(1)]) for full in (x_full, weights_full))
    with comm.observe() as forward:
        y = norm(x)
    with comm.observe() as backward:
        (y * weights).sum().backward()
    assert list(forward) == [] and [record.kind for record in backward] == ["all_reduce"], backward
    (reference(x_full) * weights_full).sum().backward()
    for parameter, expected in ((norm.weight, reference.weight), (norm.bias, reference.bias)):
        assert parameter.grad.placements == (Replicate(),)
        assert_close(parameter.grad.to_local(), expected.grad)


@spmd(meshes=[(2,), (4,)])
def test_a_plain_tensor_of_unknown_global_size_learns_it_from_every_rank(mesh):
    """A plain tensor that did not come out of a style (a residual sum) has no known global size: the
    style learns the exact uneven shapes from every rank (one all_gather, as `from_local` infers
    them), or raises under explicit_communication() without communicating. A DTensor needs neither."""
    norm = parallelize_module(nn.LayerNorm(4), mesh, SequenceParallel())
    full = torch.randn(2, 7, 4)  # 7 over 2 or 4 ranks: uneven shards
    local = distribute_tensor(full, mesh, [Shard(1)]).to_local().clone()  # untagged: a residual sum loses the tag
    with comm.observe() as records:
        output = norm(local)
    assert [record.kind for record in records] == ["all_gather"]
    assert output.placements == (Shard(1),) and output.shape == full.shape
    assert_close(output.full_tensor(), nn.functional.layer_norm(full, (4,)))
    with comm.observe() as records, explicit_communication(), pytest.raises(ValueError, match="global size along dim 1"):
        norm(local)
    assert list(records) == []
    for placements in ([Shard(1)], [Replicate()]):  # a replicated DTensor is moved to the sequence shards
        output = norm(distribute_tensor(full, mesh, placements))
        assert output.placements == (Shard(1),)
        assert_close(output.full_tensor(), nn.functional.layer_norm(full, (4,)))


class _PerHeadNorm(nn.Module):
    """Qwen3's attention in miniature: q_proj split by heads, an RMSNorm over each head's features of the
    view `q_proj(x).view(..., -1, head_dim)`, and o_proj over the heads."""

    def __init__(self, heads: int, head_dim: int = 3, width: int = 8):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x):
        heads = self.q_proj(x).view(*x.shape[:-1], -1, self.head_dim)
        return self.o_proj(self.q_norm(heads).flatten(-2))


@spmd(meshes=[(2,), (4,)])
def test_a_per_head_norm_of_a_view_of_a_colwise_output_learns_no_size_with_a_collective(mesh):
    """The norm's input is a view of q_proj's local output: its layout follows from q_proj's (heads 3/3 on
    2 ranks, 2/2/2/1 of 7 on 4), so a forward issues o_proj's all_reduce and nothing else, as one without
    the norm does (it took one all_gather of shapes per norm); training equals one device."""
    heads = 7 if mesh.size() == 4 else 6  # whole heads in torch.chunk's pieces of heads * 3 features
    plan = {"q_proj": ColwiseParallel(), "q_norm": SequenceParallel(sequence_dim=-2, use_local_output=True),
            "o_proj": RowwiseParallel()}
    model = train_and_compare(mesh, lambda: _PerHeadNorm(heads), plan, lambda generator: [torch.randn(2, 5, 8, generator=generator)])
    with comm.observe() as records:
        model(torch.randn(2, 5, 8))
    assert [record.kind for record in records] == ["all_reduce"]
    assert model.q_norm.weight.placements == (Replicate(),)


@spmd(meshes=[(2,), (4,)])
def test_the_tensor_parallel_tutorial_s_local_residual_stream_trains_like_one_device(mesh):
    """PyTorch's tensor-parallel tutorial keeps its residual stream as local tensors (the styles'
    default `use_local_output=True`) and adds them: `x + attention(norm(x))`. Sizes of the residual
    sums are learnt from every rank (uneven sequence 7 over 2 and 4 ranks); values equal one device."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(13, 8)
            self.norm = _LlamaRMSNorm(8)
            self.up = nn.Linear(8, 12)
            self.down = nn.Linear(12, 8)
            self.final_norm = nn.LayerNorm(8)

        def forward(self, tokens):
            x = self.embedding(tokens)
            x = x + self.down(F.silu(self.up(self.norm(x))))
            return self.final_norm(x)

    plan = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "final_norm": SequenceParallel(),
    }
    train_and_compare(mesh, Block, plan, _indices(13, 2, 7))


@spmd(meshes=MESHES)
def test_prepare_module_input_and_output_with_keyword_inputs(mesh):
    tp = tp_mesh(mesh)

    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x, scale, *, shift):
            return self.proj(x) * scale + shift

    model = Mix()
    reference = Mix()
    reference.load_state_dict(model.state_dict())
    parallelize_module(model, tp, {"proj": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    parallelize_module(model, tp, PrepareModuleInput(
        input_layouts=(Replicate(), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"shift": Replicate()},
        desired_input_kwarg_layouts={"shift": Shard(1)},
    ))
    parallelize_module(model, tp, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                                     use_local_output=True))
    generator = torch.Generator().manual_seed(data_seed(mesh))
    x, shift = torch.randn(5, 6, generator=generator), torch.randn(5, 6, generator=generator)
    with comm.observe() as records:
        output = model(x, 2.0, shift=shift)
    assert not isinstance(output, DTensor)
    assert_close(output, reference(x, 2.0, shift=shift))
    assert [record.kind for record in records] == (["all_gather"] if tp.size() > 1 else [])
    # Both at once: the same conversions from one plan entry.
    both = Mix()
    both.load_state_dict(reference.state_dict())
    parallelize_module(both, tp, {"proj": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    parallelize_module(both, tp, PrepareModuleInputOutput(
        input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"shift": Replicate()}, desired_input_kwarg_layouts={"shift": Shard(1)},
        output_layouts=Shard(1), desired_output_layouts=Replicate(),
    ))
    assert_close(both(x, 2.0, shift=shift), reference(x, 2.0, shift=shift))
    with pytest.raises(ValueError, match="pair up"):
        PrepareModuleInput(input_layouts=(Shard(0), Replicate()), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="pair up"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={})


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)  # left alone by the plans: it runs on plain replicated activations
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@spmd(meshes=MESHES)
def test_parallelize_module_with_wildcards_and_nested_plans(mesh):
    flat = {"layers.*.mlp.fc1": ColwiseParallel(), "layers.*.mlp.fc2": RowwiseParallel()}
    nested = {"layers": {"*": {"mlp": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}}}}
    for plan in (flat, nested):
        model = train_and_compare(mesh, Stack, plan, _inputs(4, 6))
        for layer in model.layers:
            assert layer.mlp.fc1.weight.placements == (Shard(0),) and layer.mlp.fc2.weight.placements == (Shard(1),)
            assert not isinstance(layer.norm.weight, DTensor)


@spmd(meshes=[(2,)])
def test_plan_errors_name_the_module_and_the_style(mesh):
    with pytest.raises(UnsupportedModuleError, match=r"'layers.0.norm'.*ColwiseParallel.*LayerNorm"):
        parallelize_module(Stack(), mesh, {"layers.*.norm": ColwiseParallel()})
    with pytest.raises(KeyError, match=r"'layers.0.attention' matches no submodule.*\['norm', 'mlp'\]"):
        parallelize_module(Stack(), mesh, {"layers.0.attention": ColwiseParallel()})
    with pytest.raises(TypeError, match="ParallelStyle"):
        parallelize_module(Stack(), mesh, {"layers.0.norm": "colwise"})


@spmd(meshes=[(2, 2)])
def test_a_two_dimensional_mesh_is_refused_with_the_fix(mesh):
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"1-D device mesh.*mesh\['tp'\]"):
        parallelize_module(nn.Linear(2, 2), named, ColwiseParallel())


class TiedLanguageModel(nn.Module):
    """An embedding and an output head that share one weight (tied embeddings); 11 rows over 4 ranks."""

    def __init__(self, vocabulary=11, width=6):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.embedding(tokens)))


@spmd(meshes=[(4,)])
def test_tied_parameters_stay_tied_and_train_like_one_device(mesh):
    plan = {"embedding": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}
    model = train_and_compare(mesh, TiedLanguageModel, plan, _indices(11, 3, 5))
    assert model.head.weight is model.embedding.weight and model.head.weight.placements == (Shard(0),)
    assert len(list(model.parameters())) == 1
    # A Linear under RowwiseParallel wants Shard(1) of the weight the embedding holds as Shard(0): no tie possible.
    differently = (r"a tied parameter would be laid out differently where it is shared "
                   r"\(embedding.weight: \(Shard\(dim=0\),\); head.weight: \(Shard\(dim=1\),\)\)")
    with pytest.raises(ValueError, match=differently):
        parallelize_module(TiedLanguageModel(), tp_mesh(mesh),
                           {"embedding": plan["embedding"], "head": RowwiseParallel()})
    with pytest.raises(ValueError, match=r"head.weight: a plain tensor \(no style laid it out\)"):
        parallelize_module(TiedLanguageModel(), tp_mesh(mesh), {"embedding": plan["embedding"]})
