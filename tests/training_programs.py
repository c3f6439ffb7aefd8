"""Canonical training programs written with plain torch ops, for shardtensor, PyTorch's DTensor and
one device alike (tests/test_training_steps.py counts their collectives; bench/bench_training.py times them).

A `Program` holds full-size parameters and inputs (the same on every rank: drawn from a seeded
generator), the placements of each on one mesh dim for tensor parallelism ("tp") and for data
parallelism ("dp"), and a forward function of (parameters, inputs) -> loss. `distribute` lays
them out on a mesh whose mesh dim `tp_mesh_dim` is the tensor-parallel one and every other mesh
dim data-parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

TP_SHARDED = "tp"  # placement names resolved per library: ("shard", dim) or "replicate"


@dataclasses.dataclass(frozen=True)
class Program:
    """Full tensors by name, their placement on a tensor-parallel and a data-parallel mesh dim
    (("shard", dim) or "replicate"), and the forward function."""

    name: str
    parameters: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    tp_placements: dict[str, object]
    dp_placements: dict[str, object]
    forward: Callable
    gathers_parameters: bool = False  # FSDP style: parameters are redistributed to Replicate before use


def _placement(library, spec):
    return library.Replicate() if spec == "replicate" else library.Shard(spec[1])


def distribute(program: Program, library, mesh, tp_mesh_dim: int, dtype=torch.float64):
    """(leaf parameters, inputs) as `library` DTensors on `mesh`."""

    def placements(name):
        specs = [program.tp_placements[name] if mesh_dim == tp_mesh_dim else program.dp_placements[name]
                 for mesh_dim in range(mesh.ndim)]
        return [_placement(library, spec) for spec in specs]

    parameters = {
        name: library.distribute_tensor(full.to(dtype), mesh, placements(name)).requires_grad_()
        for name, full in program.parameters.items()
    }
    inputs = {name: library.distribute_tensor(full.to(dtype), mesh, placements(name)) for name, full in program.inputs.items()}
    return parameters, inputs


def single_device(program: Program, dtype=torch.float64):
    """(leaf parameters, inputs) as plain tensors: the reference."""
    parameters = {name: full.to(dtype).clone().requires_grad_() for name, full in program.parameters.items()}
    inputs = {name: full.to(dtype) for name, full in program.inputs.items()}
    return parameters, inputs


def loss_of(program: Program, parameters: dict, inputs: dict, library=None):
    """The program's loss; FSDP-style programs gather each parameter first (DTensors only)."""
    if program.gathers_parameters and library is not None:
        parameters = {
            name: value.redistribute(value.device_mesh, [library.Replicate()] * value.device_mesh.ndim)
            for name, value in parameters.items()
        }
    return program.forward(parameters, **inputs)


# ---- forward functions -----------------------------------------------------------------------------


def mlp_block(p: dict, x, target):
    """LayerNorm, W1 (column-parallel), gelu, W2 (row-parallel), residual, mean squared error."""
    h = F.layer_norm(x, (x.shape[-1],), p["ln_weight"], p["ln_bias"])
    h = F.gelu(F.linear(h, p["w1"], p["b1"]))
    y = x + F.linear(h, p["w2"], p["b2"])
    return ((y - target) ** 2).mean()


def _explicit_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v without a mask: PyTorch's DTensor has no CPU rule for sdpa."""
    return F.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def transformer_block(p: dict, x, target, heads: int = 4, attend: Callable = _sdpa):
    """Pre-norm attention (q/k/v column-parallel, sdpa over the heads, o row-parallel) and MLP."""
    batch, sequence, hidden = x.shape

    def split_heads(t):
        return t.view(batch, sequence, heads, hidden // heads).transpose(1, 2)

    h = F.layer_norm(x, (hidden,), p["ln1_weight"], p["ln1_bias"])
    q, k, v = (split_heads(F.linear(h, p[name])) for name in ("wq", "wk", "wv"))
    attention = attend(q, k, v)
    x = x + F.linear(attention.transpose(1, 2).reshape(batch, sequence, hidden), p["wo"])
    h = F.layer_norm(x, (hidden,), p["ln2_weight"], p["ln2_bias"])
    y = x + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
    return ((y - target) ** 2).mean()


# ---- programs ------------------------------------------------------------------------------------

R = "replicate"


def _mlp_parameters(generator, hidden: int) -> dict[str, torch.Tensor]:
    return {
        "ln_weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "ln_bias": 0.1 * torch.randn(hidden, generator=generator),
        "w1": torch.randn(4 * hidden, hidden, generator=generator) / hidden**0.5,
        "b1": 0.1 * torch.randn(4 * hidden, generator=generator),
        "w2": torch.randn(hidden, 4 * hidden, generator=generator) / (4 * hidden) ** 0.5,
        "b2": 0.1 * torch.randn(hidden, generator=generator),
    }


_MEGATRON_MLP = {"ln_weight": R, "ln_bias": R, "w1": ("shard", 0), "b1": ("shard", 0), "w2": ("shard", 1), "b2": R}
_ALL_REPLICATE = {name: R for name in _MEGATRON_MLP}


def megatron_mlp(hidden: int = 16, batch: int = 8, seed: int = 0) -> Program:
    """Tensor-parallel MLP on the tp mesh dim; batch-sharded (data parallel) on any other."""
    generator = torch.Generator().manual_seed(seed)
    parameters = _mlp_parameters(generator, hidden)
    inputs = {"x": torch.randn(batch, hidden, generator=generator), "target": torch.randn(batch, hidden, generator=generator)}
    batch_sharded = {"x": ("shard", 0), "target": ("shard", 0)}
    return Program("megatron_mlp", parameters, inputs, {**_MEGATRON_MLP, "x": R, "target": R},
                   {**_ALL_REPLICATE, **batch_sharded}, mlp_block)


def data_parallel_mlp(hidden: int = 16, batch: int = 8, seed: int = 0) -> Program:
    """Replicate parameters, batch-sharded inputs on every mesh dim."""
    program = megatron_mlp(hidden, batch, seed)
    placements = {**_ALL_REPLICATE, "x": ("shard", 0), "target": ("shard", 0)}
    return dataclasses.replace(program, name="data_parallel_mlp", tp_placements=placements, dp_placements=placements)


def fsdp_mlp(hidden: int = 16, batch: int = 8, seed: int = 0) -> Program:
    """Parameters stored Shard(0), gathered to Replicate before use; batch-sharded inputs."""
    program = megatron_mlp(hidden, batch, seed)
    placements = {**{name: ("shard", 0) for name in _MEGATRON_MLP}, "x": ("shard", 0), "target": ("shard", 0)}
    return dataclasses.replace(program, name="fsdp_mlp", tp_placements=placements, dp_placements=placements,
                               gathers_parameters=True)


def sequence_parallel_mlp(hidden: int = 16, batch: int = 2, sequence: int = 8, seed: int = 0) -> Program:
    """Megatron sequence parallelism: LayerNorm and the residual on sequence-sharded (Shard(1))
    activations, the column- and row-parallel linears between them."""
    generator = torch.Generator().manual_seed(seed)
    parameters = _mlp_parameters(generator, hidden)
    inputs = {
        "x": torch.randn(batch, sequence, hidden, generator=generator),
        "target": torch.randn(batch, sequence, hidden, generator=generator),
    }
    sequence_sharded = {"x": ("shard", 1), "target": ("shard", 1)}
    return Program("sequence_parallel_mlp", parameters, inputs, {**_MEGATRON_MLP, **sequence_sharded},
                   {**_ALL_REPLICATE, "x": ("shard", 0), "target": ("shard", 0)}, mlp_block)


def megatron_transformer(
    hidden: int = 16, batch: int = 2, sequence: int = 8, heads: int = 4, seed: int = 0, sdpa: bool = True
) -> Program:
    """Tensor-parallel transformer block on the tp mesh dim (q/k/v/w1 Shard(0), o/w2 Shard(1),
    heads sharded in attention); batch-sharded on any other mesh dim. `sdpa=False` writes the
    attention as softmax(q k^T) v (for PyTorch's DTensor, which has no CPU sdpa rule)."""
    generator = torch.Generator().manual_seed(seed)
    mlp = _mlp_parameters(generator, hidden)
    parameters = {
        "ln1_weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "ln1_bias": 0.1 * torch.randn(hidden, generator=generator),
        **{name: torch.randn(hidden, hidden, generator=generator) / hidden**0.5 for name in ("wq", "wk", "wv", "wo")},
        "ln2_weight": mlp["ln_weight"], "ln2_bias": mlp["ln_bias"],
        **{name: mlp[name] for name in ("w1", "b1", "w2", "b2")},
    }
    inputs = {
        "x": torch.randn(batch, sequence, hidden, generator=generator),
        "target": torch.randn(batch, sequence, hidden, generator=generator),
    }
    tp = {"ln1_weight": R, "ln1_bias": R, "wq": ("shard", 0), "wk": ("shard", 0), "wv": ("shard", 0),
          "wo": ("shard", 1), "ln2_weight": R, "ln2_bias": R, "w1": ("shard", 0), "b1": ("shard", 0),
          "w2": ("shard", 1), "b2": R, "x": R, "target": R}
    dp = {**{name: R for name in parameters}, "x": ("shard", 0), "target": ("shard", 0)}

    def forward(p, x, target):
        return transformer_block(p, x, target, heads, _sdpa if sdpa else _explicit_attention)

    return Program("megatron_transformer" if sdpa else "megatron_transformer_explicit_attention",
                   parameters, inputs, tp, dp, forward)
