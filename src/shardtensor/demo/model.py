"""The demo's model: a small GPT (token + position embedding, causal self-attention and MLP blocks
with LayerNorm, untied head), written for one device, and the plan that lays it out for tensor
parallelism with sequence parallelism (torchtitan's layout for Llama, on a GPT).

The model is plain PyTorch; only `tensor_parallel_plan` and `parallelize` know about meshes, so
other parallelisms (FSDP over the data-parallel mesh dim) compose on top of `parallelize`'s result.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import DeviceMesh
from ..placement import Replicate, Shard
from ..parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["GPTConfig", "GPT", "tensor_parallel_plan", "parallelize"]


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig:
    """Sizes of the model: `width` features per token, split over `heads` attention heads."""

    vocab_size: int
    block_size: int = 64
    layers: int = 2
    heads: int = 4
    width: int = 64


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Head counts come from the projections' outputs (`-1`), so
    the same code runs on the local heads of a column-sharded projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.width // config.heads
        self.query = nn.Linear(config.width, config.width)
        self.key = nn.Linear(config.width, config.width)
        self.value = nn.Linear(config.width, config.width)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[0], x.shape[1]
        q, k, v = (
            projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for projection in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Character-level GPT: `forward(tokens)` gives logits of shape (batch, length, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.block_size, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        for name, parameter in self.named_parameters():
            if name.endswith("weight") and parameter.ndim == 2:
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tensor_parallel_plan() -> dict:
    """Megatron tensor parallelism with sequence parallelism, as a plan a reader takes in at a glance.

    Between blocks the residual stream is sharded along the sequence (dim 1) and stays a DTensor;
    each attention/MLP gathers it once (PrepareModuleInput), splits its first projections by output
    features (local heads) and its last by input features, reduce-scattering back to the sequence.
    The head's logits stay sharded by vocabulary for `loss_parallel`.
    """
    sequence, replicated = Shard(1), Replicate()
    gather_sequence = PrepareModuleInput(input_layouts=sequence, desired_input_layouts=replicated)
    back_to_sequence = RowwiseParallel(output_layouts=sequence, use_local_output=False)
    return {
        "token_embedding": RowwiseParallel(input_layouts=replicated, output_layouts=sequence, use_local_output=False),
        "position_embedding": RowwiseParallel(input_layouts=replicated, output_layouts=sequence, use_local_output=False),
        "blocks.*.attention_norm": SequenceParallel(),
        "blocks.*.attention": gather_sequence,
        "blocks.*.attention.query": ColwiseParallel(),
        "blocks.*.attention.key": ColwiseParallel(),
        "blocks.*.attention.value": ColwiseParallel(),
        "blocks.*.attention.out": back_to_sequence,
        "blocks.*.mlp_norm": SequenceParallel(),
        "blocks.*.mlp": gather_sequence,
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": back_to_sequence,
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False),
    }


def _heads_error(config: GPTConfig, tp_size: int) -> ValueError:
    return ValueError(
        f"tensor parallelism splits attention by heads: {config.heads} heads do not divide over {tp_size} "
        f"tensor-parallel ranks; choose --heads as a multiple of the tp mesh dim (or a smaller tp)"
    )


def parallelize(model: GPT, tp_mesh: DeviceMesh) -> GPT:
    """Lay `model` out over the 1-D tensor-parallel mesh (every rank built the same weights, so
    each slices its own shard: no communication)."""
    if model.config.heads % tp_mesh.size() != 0:
        raise _heads_error(model.config, tp_mesh.size())
    return parallelize_module(model, tp_mesh, tensor_parallel_plan(), src_data_rank=None)
