"""Sharding rules: every scaled-dot-product-attention kernel aten has, forward and backward.

`F.scaled_dot_product_attention` picks a kernel by device and inputs: the CPU flash kernel, CUDA's
flash, memory-efficient and cuDNN kernels, or the overrideable fused kernel of out-of-tree backends
(the math path decomposes into ops that have rules of their own). Every kernel treats batch (dim 0)
and heads (dim 1) independently, so one rule serves them all, reading a table (`KERNELS`): which
tensor arguments have batch and heads as dims 0 and 1 like the query, which one is the additive mask
or bias (it follows by broadcasting), and what each result is. Random state (philox seed and offset,
`rng_state`) is Replicate: with dropout_p = 0 no kernel reads it, and with dropout_p > 0 nothing is
sharded.

Dropout is not sharded because a kernel draws its mask for the shapes it is given, so a shard's mask
would not be its piece of the whole op's mask. With dropout_p > 0 the rule has no sharded way and says
so (`ReplicateFallback`): the replicate fallback gathers every input and computes the whole op on every
rank, a forward with torch's generator seeded alike on every rank (`random.same_draws_on_every_rank`),
so every rank draws the same mask, the one any mesh (one rank included) draws for that random call.
The backward, which replays that mask from the forward's seed and offset, draws nothing. Being the
fallback, it is logged, counted in `fallback_counts` (`CommDebugMode.get_fallback_counts`) and refused
in strict mode, like every computation that runs whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..placement import Replicate, Shard
from ..rules import OpCall, ReplicateFallback, Row, ShardingRule, TensorMeta
from .common import empty_shard_results, on_shards
from .registry import aten, register_rule

__all__ = ["Kernel", "KERNELS", "Attention"]


R = Replicate()

# What a kernel's result is, one per schema return (`Kernel.results`).
LIKE_QUERY = "like query"  # batch and heads as dims 0 and 1: output, logsumexp, gradients of q, k, v
LIKE_MASK = "like mask"  # the gradient of the mask/bias argument: its shape and layout
DEBUG_MASK = "debug mask"  # the attention weights when asked for (4-D, like the query), else an empty placeholder
REPLICATE = "replicate"  # random state, or a size (an int: no placement)


@dataclass(frozen=True, slots=True)
class Kernel:
    """How one attention kernel's arguments and results lie. `like_query` names the tensor arguments
    whose dims 0 and 1 are batch and heads (query, key, value; in a backward also grad_out, out and
    logsumexp); `mask` the additive mask or bias argument, if the kernel takes one; `results` says
    what each schema return is; `draws` whether its dropout draws from torch's generator (a forward;
    a backward replays the forward's mask)."""

    like_query: tuple[str, ...]
    mask: str | None
    results: tuple[str, ...]
    draws: bool


_QKV = ("query", "key", "value")
_BACKWARD_INPUTS = ("grad_out", *_QKV, "out", "logsumexp")
# flash, cuDNN and the overrideable kernel return (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
# philox seed or rng_state, philox offset or unused, debug_attn_mask); cum_seq_* are None for dense inputs.
_FLASH_LIKE_RESULTS = (LIKE_QUERY, LIKE_QUERY, REPLICATE, REPLICATE, REPLICATE, REPLICATE, REPLICATE, REPLICATE,
                       DEBUG_MASK)
_GRADIENTS = (LIKE_QUERY,) * 3

KERNELS: dict = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: Kernel(_QKV, "attn_mask", (LIKE_QUERY, LIKE_QUERY), True),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: Kernel(_BACKWARD_INPUTS, "attn_mask", _GRADIENTS,
                                                                              False),
    aten._scaled_dot_product_flash_attention.default: Kernel(_QKV, None, _FLASH_LIKE_RESULTS, True),
    aten._scaled_dot_product_flash_attention_backward.default: Kernel(_BACKWARD_INPUTS, None, _GRADIENTS, False),
    # (output, log_sumexp, philox_seed, philox_offset); log_sumexp's last dim is the query length rounded up to 32.
    aten._scaled_dot_product_efficient_attention.default: Kernel(_QKV, "attn_bias",
                                                                 (LIKE_QUERY, LIKE_QUERY, REPLICATE, REPLICATE), True),
    aten._scaled_dot_product_efficient_attention_backward.default: Kernel(
        ("grad_out_", *_BACKWARD_INPUTS[1:]), "attn_bias", _GRADIENTS + (LIKE_MASK,), False),
    # logsumexp is (batch, heads, query length, 1).
    aten._scaled_dot_product_cudnn_attention.default: Kernel(_QKV, "attn_bias", _FLASH_LIKE_RESULTS, True),
    aten._scaled_dot_product_cudnn_attention_backward.default: Kernel(_BACKWARD_INPUTS, "attn_bias", _GRADIENTS, False),
    aten._scaled_dot_product_fused_attention_overrideable.default: Kernel(_QKV, "attn_bias", _FLASH_LIKE_RESULTS, True),
    aten._scaled_dot_product_fused_attention_overrideable_backward.default: Kernel(
        _BACKWARD_INPUTS, "attn_bias", _GRADIENTS + (LIKE_MASK,), False),
}


def _mask_placement(mask: TensorMeta, query: TensorMeta, dim: int):
    """The mask's placement when the query is sharded on `dim`: it broadcasts against the 4-D
    (batch, heads, query, key) scores, so it is sharded where it spans that dim, else Replicate."""
    mask_dim = dim - (4 - mask.ndim)
    spans = mask_dim >= 0 and mask.shape[mask_dim] == query.shape[dim]
    return Shard(mask_dim) if spans else R


def _result_placement(kind: str, meta: TensorMeta, dim: int, mask_placement):
    if kind == LIKE_QUERY or (kind == DEBUG_MASK and meta.ndim == 4):
        return Shard(dim)
    return mask_placement if kind == LIKE_MASK else R


def _attention_rows(call: OpCall, kernel: Kernel, metas) -> list[Row]:
    """Replicate, and rows sharding batch (dim 0) or heads (dim 1) of every tensor laid out like the
    query, its mask following by broadcast. `metas` are the op's global results (None: not a tensor)."""
    names = call.input_names()
    query = call.inputs[names.index("query")]
    mask = call.argument(kernel.mask) if kernel.mask is not None else None
    results = [kind for kind, meta in zip(kernel.results, metas) if meta is not None]
    result_metas = [meta for meta in metas if meta is not None]
    rows = [Row((R,) * len(results), (R,) * len(names))]
    for dim in (0, 1):
        if dim == 1 and any(meta.shape[1] != query.shape[1] for name, meta in zip(names, call.inputs)
                            if name in kernel.like_query):
            continue  # grouped-query attention: key and value have fewer heads than the query
        mask_placement = _mask_placement(mask, query, dim) if isinstance(mask, TensorMeta) else R
        if mask_placement == R and LIKE_MASK in results:
            continue  # a gradient of a mask broadcast over `dim` would sum over every shard of it
        inputs = tuple(Shard(dim) if name in kernel.like_query else mask_placement if name == kernel.mask else R
                       for name in names)
        outputs = tuple(_result_placement(kind, meta, dim, mask_placement) for kind, meta in zip(results, result_metas))
        rows.append(Row(outputs, inputs))
    return rows


class Attention(ShardingRule):
    """An attention kernel (forward or backward) sharded over batch or heads, as its `Kernel` says.

    With dropout_p > 0 it takes the replicate fallback, its draws seeded alike on every rank. A rank whose
    shard holds no batch or no heads (2 heads on 4 ranks) returns empty results without calling the
    kernel: the CPU kernel dies of a division by zero on zero heads (the other ranks would be left
    waiting), and the CUDA kernels have never been run on empty shards.
    """

    def __init__(self, name: str, kernel: Kernel):
        self.__name__, self.kernel = name, kernel

    def rows(self, call: OpCall) -> list[Row]:
        if call.argument("dropout_p") > 0:
            raise ReplicateFallback(f"{call.op} with dropout_p > 0 draws its mask whole", draws=self.kernel.draws)
        return _attention_rows(call, self.kernel, self.global_outputs(call))

    def random_calls(self, call: OpCall) -> int:
        return 0  # a call that draws (dropout_p > 0) takes the replicate fallback (`rows`), which counts its draw

    def local_op(self, call, input_layouts, coordinate):
        local_shapes = [layout.local_shape(coordinate) for layout in input_layouts if layout.ndim == 4]
        if all(shape[0] and shape[1] for shape in local_shapes):
            return None
        return on_shards(call.op, lambda mesh, *args, **kwargs: empty_shard_results(call.op, args, kwargs))


for _op, _kernel in KERNELS.items():
    register_rule([_op], Attention(_op._schema.name.removeprefix("aten::_").removeprefix("scaled_dot_product_"),
                                   _kernel))
