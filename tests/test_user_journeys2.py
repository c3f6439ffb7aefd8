"""More programs users run, with shardtensor's imports instead of torch's, each against one device.

A llama-style model as torchtitan parallelizes it (RMSNorm, rotary embeddings in complex numbers,
grouped-query attention with `repeat_kv`, SwiGLU) on a 2x2 mesh: tensor parallel on "tp" with
sequence-parallel norms and a class-sharded output under `loss_parallel`, `fully_shard` on "dp",
AdamW and `clip_grad_norm_`, a few steps.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from spmd import spmd
from test_parallel_styles import _LlamaRMSNorm as RMSNorm
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard
from shardtensor.fsdp import fully_shard
from shardtensor.mesh import DeviceMesh
from shardtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, KV_HEADS, SEQUENCE, BATCH = 30, 16, 4, 2, 6, 4


def _rotary_frequencies(head_dim: int, sequence: int, theta: float = 10000.0) -> torch.Tensor:
    frequencies = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(sequence, dtype=torch.float64), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x, frequencies):
    """torchtitan's `apply_rotary_emb` for one tensor: pairs of features as complex numbers."""
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * frequencies[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def _repeat_kv(x, repeats: int):
    batch, sequence, kv_heads, head_dim = x.shape
    return x[:, :, :, None, :].expand(batch, sequence, kv_heads, repeats, head_dim).reshape(
        batch, sequence, kv_heads * repeats, head_dim)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, frequencies):
        batch, sequence, _ = x.shape
        # -1: the heads this rank holds under tensor parallelism (local outputs), all of them on one device
        q = self.wq(x).view(batch, sequence, -1, self.head_dim)
        k = self.wk(x).view(batch, sequence, -1, self.head_dim)
        v = self.wv(x).view(batch, sequence, -1, self.head_dim)
        q, k = _rotate(q, frequencies), _rotate(k, frequencies)
        repeats = HEADS // KV_HEADS
        k, v = _repeat_kv(k, repeats), _repeat_kv(v, repeats)
        output = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(batch, sequence, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int = 24):
        super().__init__()
        self.w1 = nn.Linear(DIM, hidden, bias=False)
        self.w2 = nn.Linear(hidden, DIM, bias=False)
        self.w3 = nn.Linear(DIM, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(DIM), FeedForward()

    def forward(self, x, frequencies):
        h = x + self.attention(self.attention_norm(x), frequencies)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(layers))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("frequencies", _rotary_frequencies(DIM // HEADS, SEQUENCE), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.frequencies)
        return self.output(self.norm(h))


def _llama(model_class=Llama, dtype=torch.float64) -> Llama:
    """The model made in `dtype`, its rotary frequencies complex (`.to` would drop their imaginary part)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return model_class()
    finally:
        torch.set_default_dtype(default)


def _token_batches(steps: int):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=generator) for _ in range(steps)]


def _named_2d(mesh) -> DeviceMesh:
    return DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))


def _parallelize_like_torchtitan(model: Llama, mesh: DeviceMesh) -> Llama:
    """torchtitan's llama3 `apply_tp` then `apply_fsdp`, verbatim but for the imports."""
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def _next_token_loss(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _train_step(model, optimizer, tokens, foreach: bool, parallel: bool):
    if parallel:
        with loss_parallel():
            loss = _next_token_loss(model(tokens[:, :-1]), tokens)
            loss.backward()
    else:
        loss = _next_token_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5, foreach=foreach)
    optimizer.step()
    optimizer.zero_grad()
    return loss, norm


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


@pytest.mark.parametrize("foreach", [True, False])
@spmd(meshes=[(2, 2)])
def test_llama_with_tensor_and_data_parallel_trains_like_one_device(mesh, foreach):
    mesh = _named_2d(mesh)
    dp = mesh.get_coordinate()[0]
    reference = _llama()
    model = _parallelize_like_torchtitan(copy.deepcopy(reference), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=foreach)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, foreach=foreach)
    for tokens in _token_batches(3):
        local_tokens = tokens.chunk(2)[dp]
        with torch.no_grad():
            expected_loss = _next_token_loss(reference(local_tokens[:, :-1]), local_tokens)
        loss, norm = _train_step(model, optimizer, local_tokens, foreach, parallel=True)
        _, expected_norm = _train_step(reference, reference_optimizer, tokens, foreach, parallel=False)
        assert_close(_full(loss), expected_loss)
        assert_close(_full(norm), expected_norm)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


def _flat_mesh(mesh) -> DeviceMesh:
    return DeviceMesh("cpu", mesh.mesh.flatten())


@spmd(meshes=[(2, 2)])
def test_llama_checkpoint_saved_with_tensor_parallel_resumes_with_fsdp_only(mesh):
    """torchtitan's checkpointer: sharded state dicts of model and optimizer through DCP; resumed on
    another layout (2-D TP + FSDP -> 1-D FSDP over 4 ranks) before the optimizer has any state."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    from shardtensor import comm
    from shardtensor.checkpoint import get_state_dict, set_state_dict

    mesh = _named_2d(mesh)
    dp, rank = mesh.get_coordinate()[0], mesh.get_rank()
    batches = _token_batches(3)
    reference = _llama()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for tokens in batches:
        _train_step(reference, reference_optimizer, tokens, foreach=True, parallel=False)

    directory = comm.all_gather_object(tempfile.mkdtemp(prefix="llama_dcp_") if rank == 0 else None, _flat_mesh(mesh), 0)[0]
    saved = _parallelize_like_torchtitan(_llama(), mesh)
    optimizer = torch.optim.AdamW(saved.parameters(), lr=0.01)
    for tokens in batches[:2]:
        _train_step(saved, optimizer, tokens.chunk(2)[dp], foreach=True, parallel=True)
    model_state, optimizer_state = get_state_dict(saved, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)

    four_shards = _flat_mesh(mesh)
    resumed = _llama()
    for layer in resumed.layers:
        fully_shard(layer, mesh=four_shards)
    fully_shard(resumed, mesh=four_shards)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    tokens = batches[2]
    _train_step(resumed, resumed_optimizer, tokens.chunk(4)[rank], foreach=True, parallel=False)
    for (name, parameter), expected in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(2, 2)])
def test_llama_gradient_accumulation_without_sync_then_eval_and_greedy_decoding(mesh):
    mesh = _named_2d(mesh)
    dp = mesh.get_coordinate()[0]
    reference = _llama()
    model = _parallelize_like_torchtitan(copy.deepcopy(reference), mesh)
    micro_batches = _token_batches(2)
    for index, tokens in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        with loss_parallel():
            (_next_token_loss(model(tokens.chunk(2)[dp][:, :-1]), tokens.chunk(2)[dp]) / 2).backward()
        (_next_token_loss(reference(tokens[:, :-1]), tokens) / 2).backward()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.grad.full_tensor(), expected.grad, msg=lambda message, name=name: f"{name}: {message}")

    model.eval()
    reference.eval()
    prompt = micro_batches[0][:, :3]
    generated, expected = prompt, prompt
    with torch.no_grad():
        for _ in range(3):  # sequence lengths 3, 4, 5: uneven over the tensor-parallel ranks
            logits = model(generated)
            generated = torch.cat([generated, logits[:, -1].argmax(-1, keepdim=True).full_tensor()], dim=1)
            expected = torch.cat([expected, reference(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, expected)


class _TiedLlama(Llama):
    def __init__(self):
        super().__init__()
        self.output.weight = self.tok_embeddings.weight


@spmd(meshes=[(2,)])
def test_tied_embedding_and_output_with_fully_shard_train_like_one_device(mesh):
    rank = mesh.get_rank()
    reference = _llama(_TiedLlama)
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.output.weight is model.tok_embeddings.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for tokens in _token_batches(2):
        _train_step(model, optimizer, tokens.chunk(2)[rank], foreach=False, parallel=False)
        _train_step(reference, reference_optimizer, tokens, foreach=False, parallel=False)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


def _bfloat16_step_by_hand(model, optimizer, tokens, ranks: int):
    """What fully_shard's bf16 parameters with fp32 reduction compute: each data-parallel slice in bf16
    (parameters cast, buffers not), the bf16 gradients summed in fp32 and divided by the ranks."""
    gradients = [torch.zeros_like(parameter) for parameter in model.parameters()]
    for rank in range(ranks):
        low = copy.deepcopy(model)
        for parameter in low.parameters():
            parameter.data = parameter.data.to(torch.bfloat16)
        local_tokens = tokens.chunk(ranks)[rank]
        _next_token_loss(low(local_tokens[:, :-1]), local_tokens).backward()
        for total, parameter in zip(gradients, low.parameters(), strict=True):
            total += parameter.grad.float()
    for parameter, total in zip(model.parameters(), gradients, strict=True):
        parameter.grad = total / ranks
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()


@spmd(meshes=[(2,)])
def test_llama_in_bfloat16_with_float32_reduction_equals_the_same_by_hand(mesh):
    from shardtensor.fsdp import MixedPrecisionPolicy

    rank = mesh.get_rank()
    reference = _llama(dtype=torch.float32)
    model = copy.deepcopy(reference)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for tokens in _token_batches(2):
        loss, _ = _train_step(model, optimizer, tokens.chunk(2)[rank], foreach=True, parallel=False)
        assert loss.dtype == torch.bfloat16
        _bfloat16_step_by_hand(reference, reference_optimizer, tokens, 2)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert parameter.dtype == torch.float32
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(2,)])
def test_llama_with_dtensor_activations_through_attention(mesh):
    """Tensor parallel keeping DTensors inside attention (`use_local_output=False`): the model's views
    with -1 count global heads, the rotary frequencies are a plain buffer next to DTensors."""
    from shardtensor.experimental import implicit_replication

    reference = _llama()
    model = copy.deepcopy(reference)
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(use_local_output=False),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(use_local_output=False),
        })
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for tokens in _token_batches(2):
        with implicit_replication():  # the plain frequencies meet DTensor queries and keys
            loss, _ = _train_step(model, optimizer, tokens, foreach=True, parallel=False)
        expected, _ = _train_step(reference, reference_optimizer, tokens, foreach=True, parallel=False)
        assert_close(loss, expected)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(_full(parameter), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(2,), (3,)])
def test_writes_into_columns_of_class_sharded_logits_reach_them(mesh):
    """Decoding code bans a token with `logits[:, token] = -inf` on logits sharded along the vocabulary:
    the column is a view of a moved copy, and the write (also through a view of that view, several
    times, or through two columns taken before either is written) is stored back into the logits, also
    after a write into the logits themselves."""
    from shardtensor import distribute_tensor

    full = torch.randn(4, VOCAB, dtype=torch.float64)
    logits = distribute_tensor(full, mesh, [Shard(1)])
    expected = full.clone()
    for tensor in (logits, expected):
        tensor[:, 3] = float("-inf")
        column = tensor[:, 7]
        column[1:3].fill_(-1.0)
        column.mul_(2.0)
        tensor.t()[11].add_(5.0)
        first, second = tensor[:, 12], tensor[:, 13]
        first.fill_(2.0)
        second.copy_(first * 3.0)
    assert torch.equal(logits.full_tensor(), expected)
    assert torch.equal(logits.argmax(-1).full_tensor(), expected.argmax(-1))

    for tensor in (logits, expected):  # a column taken before a write into the logits sees it
        column = tensor[:, 0]
        tensor.add_(1.0)
        column[2:].fill_(0.0)
    assert torch.equal(logits.full_tensor(), expected)
