"""torchtitan's Llama 3 recipe on shardtensor: tensor + sequence parallelism, fully_shard, DCP resharding.

The model is written for one device in torchtitan's shape (RMSNorm, rotary embeddings, SwiGLU feed
forward, grouped-query attention), with one fused q/k/v projection `wqkv`. Its rows are grouped by
key/value head (Megatron's layout): for each key/value head, the rows of the query heads that share
it, then its key rows, then its value rows. A plain column-wise split of `wqkv` then gives every
tensor-parallel rank whole groups, i.e. its query heads together with the key and value heads they
attend with. (Rows ordered [all q; all k; all v] cannot be split so: rank 0 would get query rows only.)

The plan is torchtitan's: the residual stream sharded along the sequence (`SequenceParallel` norms),
gathered once before attention and the feed forward (`PrepareModuleInput`), projections split
column-wise then row-wise back onto the sequence (one reduce-scatter each), and the output head's
logits left sharded by vocabulary for `loss_parallel`. Every block, then the rest, is `fully_shard`ed
over "dp". Training runs two steps on a 2x2 mesh (dp x tp), saves a DCP checkpoint, loads it into the
model laid out on 1x4 (tensor parallel over 4 ranks) and trains one more step; every rank checks the
losses and the weights against the same training on one device.

Run: python examples/llama3_tp_sp.py   (four ranks are spawned locally)
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.testing import assert_close

from shardtensor import DeviceMesh, Replicate, Shard, comm, init_device_mesh
from shardtensor.fsdp import fully_shard
from shardtensor.launch import spawn
from shardtensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

BATCH, LENGTH, STEPS, SAVED_STEPS = 4, 10, 3, 2  # a sequence of 10 over 4 ranks: 3, 3, 3, 1


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4  # grouped-query attention: 2 query heads per key/value head
    vocab_size: int = 98
    ffn_hidden: int = 96
    max_seq_len: int = LENGTH
    rope_theta: float = 10000.0


def precompute_freqs_cis(head_dim: int, length: int, theta: float) -> torch.Tensor:
    """The rotary embedding's rotations, one complex number per position and pair of features, stored
    as (real, imaginary) pairs: `Module.to(torch.float64)` would drop the imaginary part of a complex buffer."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, sequence, heads, head_dim) queries or keys by their positions."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    rotated = pairs * torch.view_as_complex(freqs_cis).view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3)


class Attention(nn.Module):
    """Causal grouped-query attention with one fused projection, its rows grouped per key/value head.

    Head counts come from the projection's output (`-1`), so the same code runs on a rank's groups.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.queries_per_group = args.n_heads // args.n_kv_heads
        group_rows = (self.queries_per_group + 2) * self.head_dim  # the group's q heads, then its k, then its v
        self.wqkv = nn.Linear(args.dim, args.n_kv_heads * group_rows, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        groups = self.wqkv(x).view(batch, length, -1, self.queries_per_group + 2, self.head_dim)
        q = groups[:, :, :, : self.queries_per_group].flatten(2, 3)  # query head g * per_group + j uses group g
        k, v = groups[:, :, :, -2], groups[:, :, :, -1]
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        k, v = (t.repeat_interleave(self.queries_per_group, dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(index): TransformerBlock(args) for index in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        freqs_cis = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def tensor_parallel_plan() -> dict:
    """torchtitan's TP + SP plan for Llama 3. The residual stream stays a DTensor sharded along the
    sequence between styles (use_local_output=False), so uneven sequence shards are read exactly."""
    sequence, replicated = Shard(1), Replicate()
    back_to_sequence = RowwiseParallel(output_layouts=sequence, use_local_output=False)
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=replicated, output_layouts=sequence, use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(sequence, None),
                                                 desired_input_layouts=(replicated, None)),
        "layers.*.attention.wqkv": ColwiseParallel(),
        "layers.*.attention.wo": back_to_sequence,
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(replicated,)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": back_to_sequence,
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def parallelize(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """TP + SP over mesh["tp"], then fully_shard per block and for the rest over mesh["dp"]."""
    tp_size = mesh["tp"].size()
    if model.args.n_kv_heads % tp_size:
        raise ValueError(
            f"wqkv splits into whole key/value groups: n_kv_heads={model.args.n_kv_heads} must divide over "
            f"{tp_size} tensor-parallel ranks"
        )
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(), src_data_rank=None)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs()).to(torch.float64)  # float64: equal to one device up to rounding, AdamW included


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, ModelArgs.vocab_size, (BATCH, LENGTH + 1), generator=generator) for _ in range(STEPS)]
    return [(sequence[:, :-1], sequence[:, 1:]) for sequence in tokens]


def train_step(model, optimizer, batch, mesh: DeviceMesh | None = None) -> float:
    """One AdamW step on this dp rank's share of the batch; returns the whole batch's mean loss."""
    tokens, targets = batch
    if mesh is not None:
        dp_rank, dp_size = mesh.get_coordinate()[0], mesh.size(0)
        tokens, targets = tokens.tensor_split(dp_size)[dp_rank], targets.tensor_split(dp_size)[dp_rank]
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    local = loss.to_local() if hasattr(loss, "to_local") else loss
    if mesh is not None:
        local = comm.all_reduce(local.detach().reshape(1), mesh, 0, reduce_op="avg")[0]
    return local.item()


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)


def main() -> str:
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    one_by_four = DeviceMesh("cpu", world.mesh.reshape(1, 4), mesh_dim_names=("dp", "tp"))
    batches = make_batches()
    reference = make_model()
    reference_optimizer = _optimizer(reference)
    reference_losses = [train_step(reference, reference_optimizer, batch) for batch in batches]

    rank = world.get_rank()
    directory = comm.all_gather_object(tempfile.mkdtemp(prefix="llama3_dcp_") if rank == 0 else None, one_by_four, 1)[0]
    try:
        model = parallelize(make_model(), world)
        optimizer = _optimizer(model)
        losses = [train_step(model, optimizer, batch, world) for batch in batches[:SAVED_STEPS]]
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)

        resumed = parallelize(make_model(), one_by_four)  # a fresh model, laid out over 4 tp ranks
        resumed_optimizer = _optimizer(resumed)
        model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses += [train_step(resumed, resumed_optimizer, batch, one_by_four) for batch in batches[SAVED_STEPS:]]
    finally:
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)

    assert_close(torch.tensor(losses), torch.tensor(reference_losses))
    for name, parameter in resumed.named_parameters():
        assert_close(parameter.full_tensor(), reference.get_parameter(name).detach(), msg=name)
    wqkv = resumed.layers["0"].attention.wqkv.weight
    return (f"rank {rank}: losses {[round(loss, 4) for loss in losses]} (steps 1-{SAVED_STEPS} on 2x2, then 1x4); "
            f"wqkv {tuple(wqkv.shape)} {wqkv.placements}, local {tuple(wqkv.to_local().shape)}")


if __name__ == "__main__":
    for line in spawn(main, 4):
        print(line)
    print("ok: Llama 3 with TP + SP and fully_shard, saved on 2x2 and resumed on 1x4, trains like one device")
