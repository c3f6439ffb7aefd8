"""Hugging Face transformers' tensor-parallel plans, read as shardtensor plans.

A transformers model names how each of its submodules is split for tensor parallelism in its own
`tp_plan`: a dict from module names (`"model.layers.*.self_attn.q_proj"`, `*` for the layer number)
to strings (`"colwise"`, `"rowwise"`, `"embedding_rowwise"`, ...). `hf_tp_plan` turns that dict into
one of styles with the same meaning, for `parallelize_module`. transformers is not imported here: the
plan is read from the model's attributes.

    >>> model = LlamaForCausalLM(LlamaConfig(...))  # doctest: +SKIP
    >>> parallelize_module(model, mesh["tp"], hf_tp_plan(model, mesh["tp"]))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase

from torch import nn

from ..mesh import DeviceMesh
from ..placement import Replicate
from .style import ParallelStyle
from .styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["hf_tp_plan", "HF_TP_STYLES"]

# Each string a transformers plan uses, and the style with its meaning. transformers' styles take
# and return local tensors (use_local_output), as ours do by default; None: nothing to lay out.
HF_TP_STYLES: dict[str, Callable[[], ParallelStyle] | None] = {
    # Linear split by output features; the output stays split (local heads, local MLP features).
    "colwise": ColwiseParallel,
    "local_colwise": ColwiseParallel,  # transformers 4.x: the same split, held as local tensors
    # Linear split by input features; its partial sums are all-reduced.
    "rowwise": RowwiseParallel,
    "local_rowwise": RowwiseParallel,
    # ... with the output gathered (an output head, or a fused projection sliced afterwards).
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    # ... taking a replicated input, each rank using its slice of the features.
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # Embedding split by vocabulary rows (a masked local lookup, all-reduced) or by embedding columns (gathered).
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # A position-wise module on activations split along the sequence.
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    # A per-head norm (Qwen3's q_norm/k_norm) between a colwise and a rowwise layer: it sees this
    # rank's heads (dim -2 of (batch, sequence, heads, head_dim)); its replicated weight's gradient
    # is summed over the ranks.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
    # Every rank keeps the whole parameter (a quantization scale): what a module without a style gets.
    "replicate": None,
}

# Strings transformers defines that have no style here (mixture-of-experts and packed layouts).
_UNSUPPORTED = (
    "packed_colwise", "packed_rowwise", "local_packed_rowwise", "moe_tp_experts", "moe_identity_expert",
    "grouped_gemm", "ep_dispatch_experts", "ep_router", "megamoe_router", "megamoe_experts", "mla_kv_a_proj",
    "all_reduce", "gather", "local", "local_params", "isolate",
)


def _style_error(key: str, value) -> ValueError:
    known = ", ".join(repr(name) for name in HF_TP_STYLES)
    if value in _UNSUPPORTED:
        what = "has no shardtensor style yet"
    else:
        what = "is not a tensor-parallel style string known here"
    return ValueError(
        f"hf_tp_plan: tp_plan[{key!r}] = {value!r} {what}; the known strings are {known}. Lay out that "
        f"module with a style of your own (add it to the returned dict), or leave it out of the plan"
    )


def _with_input_embedding(model: nn.Module, plan: Mapping[str, str]) -> Mapping[str, str]:
    """The plan with the input embedding split by vocabulary unless it names the embedding.

    transformers >= 5.21 adds this entry itself; earlier 5.x plans leave the embedding whole, and a
    head tied to it (split by "colwise_gather_output") could then not stay tied. Every 5.x plan is
    read as 5.21's.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Embedding):
        return plan
    name = next(name for name, module in model.named_modules() if module is embedding)
    if any(fnmatchcase(name, key) for key in plan):
        return plan
    return {name: "embedding_rowwise", **plan}


def _model_plan(model: nn.Module) -> Mapping[str, str]:
    """The model's whole plan, its base model's entries under their prefix (`model.layers.*...`)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not plan:
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__} has no tensor-parallel plan (neither model.tp_plan nor "
            f"model._tp_plan; the model's config.base_model_tp_plan is empty): pass the plan dict itself, "
            f"hf_tp_plan({{'layers.*.mlp.up_proj': 'colwise', ...}})"
        )
    return _with_input_embedding(model, plan)


def _heads_error(config, tp_size: int) -> ValueError:
    return ValueError(
        f"hf_tp_plan: colwise q/k/v projections split attention by heads, so each rank must get whole heads: "
        f"num_attention_heads={config.num_attention_heads} and num_key_value_heads="
        f"{getattr(config, 'num_key_value_heads', None)} must both divide over the {tp_size} tensor-parallel "
        f"ranks; choose a tp mesh dim that divides them"
    )


def _check_heads(model: nn.Module, tp_size: int) -> None:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text_config, "num_attention_heads", None)
    if heads is None:
        return
    key_value_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % tp_size or key_value_heads % tp_size:
        raise _heads_error(text_config, tp_size)


def hf_tp_plan(model: nn.Module | Mapping[str, str], device_mesh: DeviceMesh | None = None) -> dict[str, ParallelStyle]:
    """The styles of a transformers model's own tensor-parallel plan (`model.tp_plan`), for `parallelize_module`.

    `model` is a transformers `PreTrainedModel` or a plan dict of its kind. With the tensor-parallel
    `device_mesh`, the attention heads are checked to divide over it. Strings that need no layout
    ("replicate") are left out; one without a style here raises, naming it and the known strings.

    >>> hf_tp_plan({"layers.*.mlp.down_proj": "rowwise"})["layers.*.mlp.down_proj"] == RowwiseParallel()
    True
    """
    plan = model if isinstance(model, Mapping) else _model_plan(model)
    if device_mesh is not None and isinstance(model, nn.Module):
        _check_heads(model, device_mesh.size())
    styles = {}
    for key, value in plan.items():
        if not isinstance(value, str) or value not in HF_TP_STYLES:
            raise _style_error(key, value)
        make = HF_TP_STYLES[value]
        if make is not None:
            styles[key] = make()
    return styles
