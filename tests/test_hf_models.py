"""Hugging Face transformers models laid out by their own tensor-parallel plans (`hf_tp_plan`): losses,
gradients and parameters after AdamW steps equal one device, on 1x4 (tensor parallel) and 2x2
(fully_shard x tensor parallel), tied embeddings included; the plan strings and their errors.

transformers is in the test extra: these tests import it and fail without it (never skip). It is
imported inside the bodies, so only the worker ranks pay for it, once each (the pools live for the
session), and collecting the suite does not.
"""

import shutil
import tempfile
import types

import pytest
import torch
from spmd import spmd
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm
from shardtensor.fsdp import fully_shard
from shardtensor.mesh import DeviceMesh
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, hf_tp_plan, parallelize_module

VOCABULARY, BATCH, LENGTH, STEPS = 98, 4, 12, 3  # 98 rows over 4 ranks: 25, 25, 25, 23


def _tiny_model(family: str, tied: bool) -> nn.Module:
    """A two-layer model of `family` with grouped-query attention (8 query heads, 4 key/value heads), float64."""
    import transformers

    sizes = dict(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=LENGTH,
                 tie_word_embeddings=tied)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    return model_class(config_class(**sizes)).to(torch.float64)


def _named(mesh) -> DeviceMesh:
    """The test mesh as dp x tp: (4,) is 1x4."""
    return DeviceMesh("cpu", mesh.mesh.reshape(-1, mesh.shape[-1]), mesh_dim_names=("dp", "tp"))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_and_compare(mesh: DeviceMesh, family: str, tied: bool, shard_data_parallel: bool,
                       directory: str | None = None) -> nn.Module:
    """Train the model laid out by its own plan (and fully_shard over dp) beside one device: the step's
    loss (averaged over dp), every gradient and, after the steps, every parameter must agree. With a
    `directory`, the model comes from `from_pretrained` there (the reference's weights, saved)."""
    reference = _tiny_model(family, tied)
    if directory is None:
        model = _tiny_model(family, tied)
    else:
        model = type(reference).from_pretrained(directory, dtype=torch.float64)
    parallelize_module(model, mesh["tp"], hf_tp_plan(model, mesh["tp"]))
    if shard_data_parallel:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    dp_rank, dp_size = mesh.get_coordinate()[0], mesh.size(0)
    for step in range(STEPS):
        tokens = torch.randint(0, VOCABULARY, (BATCH, LENGTH), generator=generator)
        local_tokens = tokens.tensor_split(dp_size)[dp_rank]
        loss = model(input_ids=local_tokens, labels=local_tokens).loss
        loss.backward()
        expected = reference(input_ids=tokens, labels=tokens).loss
        expected.backward()
        assert_close(comm.all_reduce(loss.detach().reshape(1), mesh, 0, reduce_op="avg")[0], expected.detach())
        for name, parameter in model.named_parameters():
            assert_close(_full(parameter.grad), reference.get_parameter(name).grad,
                         msg=lambda message, name=name: f"{name} gradient, step {step}: {message}")
        for each in (optimizer, reference_optimizer):
            each.step()
            each.zero_grad()
    for name, parameter in model.named_parameters():
        assert_close(_full(parameter), reference.get_parameter(name).detach(),
                     msg=lambda message, name=name: f"{name} after {STEPS} steps: {message}")
    return model


@spmd(meshes=[(4,)], timeout=240)
def test_llama_and_qwen3_under_their_tensor_parallel_plans_on_four_ranks_train_like_one_device(mesh):
    mesh = _named(mesh)
    llama = _train_and_compare(mesh, "llama", tied=False, shard_data_parallel=False)
    attention = llama.model.layers[0].self_attn
    assert attention.k_proj.weight.placements == (Shard(0),) and attention.o_proj.weight.placements == (Shard(1),)
    assert llama.model.embed_tokens.weight.placements == (Shard(0),) and llama.lm_head.weight.placements == (Shard(0),)
    assert llama.model.norm.weight.__class__ is nn.Parameter and not isinstance(llama.model.norm.weight, DTensor)
    # Megatron's communication: per layer one all_reduce after o_proj and one after down_proj, one
    # after the vocab-parallel embedding, one all_gather of the head's logits.
    with comm.observe() as records:
        llama(input_ids=torch.zeros(2, LENGTH, dtype=torch.long))
    kinds = [record.kind for record in records]
    assert sorted(kinds) == sorted(["all_reduce"] * (1 + 2 * 2) + ["all_gather"]), kinds
    # Qwen3 adds per-head norms of q and k ("replicated_with_grad_allreduce"), and ties its head here
    qwen = _train_and_compare(mesh, "qwen3", tied=True, shard_data_parallel=False)
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert qwen.model.layers[0].self_attn.q_norm.weight.placements == (Replicate(),)
    # The per-head norms read a plain view of q_proj's output, whose layout follows from q_proj's: no
    # collective of their own, Llama's communication exactly (docs/models.md).
    with comm.observe() as records:
        qwen(input_ids=torch.zeros(2, LENGTH, dtype=torch.long))
    kinds = [record.kind for record in records]
    assert sorted(kinds) == sorted(["all_reduce"] * (1 + 2 * 2) + ["all_gather"]), kinds


@spmd(meshes=[(2, 2)], timeout=240)
def test_pretrained_llama_with_tied_embeddings_under_fully_shard_x_tensor_parallel_trains_like_one_device(mesh):
    mesh = _named(mesh)
    directory = tempfile.mkdtemp(prefix="hf_llama_") if mesh.get_rank() == 0 else None
    if directory is not None:
        _tiny_model("llama", tied=True).save_pretrained(directory)
    directory = comm.all_gather_object(directory, mesh)[0]  # after rank 0 has saved
    try:
        llama = _train_and_compare(mesh, "llama", tied=True, shard_data_parallel=True, directory=directory)
    finally:
        comm.all_gather_object(None, mesh)  # every rank has read the files before rank 0 removes them
        if mesh.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    embedding = llama.model.embed_tokens.weight
    assert llama.lm_head.weight is embedding and embedding.placements == (Shard(0), Shard(0))
    assert sum(1 for _ in llama.parameters()) == 1 + 2 * 9 + 1  # the tied weight counted once


@spmd(meshes=[(4,)])
def test_heads_that_do_not_divide_over_the_tp_ranks_raise(mesh):
    model = nn.Module()
    model.config = types.SimpleNamespace(num_attention_heads=8, num_key_value_heads=2)
    model.tp_plan = {"layers.*.self_attn.k_proj": "colwise"}
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 must both divide over the 4 tensor-parallel ranks"):
        hf_tp_plan(model, mesh)
    assert isinstance(hf_tp_plan(model)["layers.*.self_attn.k_proj"], ColwiseParallel)  # without a mesh: not checked


def test_plan_strings_become_styles_with_their_layouts():
    plan = hf_tp_plan({
        "q": "colwise", "o": "rowwise", "head": "colwise_gather_output", "down": "rowwise_split_input",
        "embed": "embedding_rowwise", "embed_columns": "embedding_colwise", "norm": "sequence_parallel",
        "q_norm": "replicated_with_grad_allreduce", "scale": "replicate",
    })
    assert plan == {
        "q": ColwiseParallel(),
        "o": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
        "down": RowwiseParallel(input_layouts=Replicate()),
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "embed_columns": ColwiseParallel(output_layouts=Replicate()),
        "norm": SequenceParallel(use_local_output=True),
        "q_norm": SequenceParallel(sequence_dim=-2, use_local_output=True),
    }  # "replicate": the parameter stays whole on every rank, as without a style


def test_unknown_and_unsupported_strings_raise_naming_them_and_the_known_ones():
    with pytest.raises(ValueError, match=r"tp_plan\['layers.\*.mlp'\] = 'colwize' is not a tensor-parallel style string"
                                         r" known here; the known strings are 'colwise', .*'rowwise_split_input'"):
        hf_tp_plan({"layers.*.mlp": "colwize"})
    with pytest.raises(ValueError, match=r"'packed_colwise' has no shardtensor style yet"):
        hf_tp_plan({"layers.*.mlp.experts.gate_up_proj": "packed_colwise"})
    with pytest.raises(ValueError, match=r"Module has no tensor-parallel plan"):
        hf_tp_plan(nn.Module())


def test_the_input_embedding_is_split_by_vocabulary_unless_the_plan_names_it():
    """transformers < 5.21 leaves it out of the plan; >= 5.21 adds "embedding_rowwise" itself."""
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(10, 4)
    model.lm_head = nn.Linear(4, 10, bias=False)
    model.get_input_embeddings = lambda: model.model.embed_tokens
    model.tp_plan = {"lm_head": "colwise_gather_output"}
    assert hf_tp_plan(model) == {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                 "lm_head": ColwiseParallel(output_layouts=Replicate())}
    model.tp_plan = {"model.embed_tokens": "embedding_colwise"}
    assert hf_tp_plan(model) == {"model.embed_tokens": ColwiseParallel(output_layouts=Replicate())}
