"""The attention kernels' rules (`ops/attention.py`) decide on meta tensors: no GPU here, so the CUDA
kernels (flash, efficient, cuDNN) and the overrideable fused one cannot run, and these tests check
their decisions through `propagation.decide` against independent expectations: batch or heads
sharding passes through with no move, and every result with batch and heads dims comes out sharded
like the query with the local shapes that torch's own meta kernel gives on the local inputs (uneven
shards too); mixed inputs meet on one dim with the expected moves; dropout takes the replicate fallback.
The CPU kernel runs for real in tests/test_nn.py (`F.scaled_dot_product_attention` on DTensors);
the last tests run the efficient kernel's rules on real shards through a CPU stand-in for its CUDA
kernel (registered for the test only), values and gradients against the stand-in on one device.
"""

from __future__ import annotations

import collections
import contextlib
import itertools

import pytest
import torch
from helpers import local_piece, seeded_randn, with_fallback_draws
from spmd import spmd
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten, tree_unflatten

import shardtensor
from shardtensor import DeviceMesh, comm, distribute_tensor, propagation
from shardtensor.layout import Layout
from shardtensor.ops.attention import KERNELS
from shardtensor.dispatch import fallback_counts
from shardtensor.ops.registry import RULES
from shardtensor.placement import Replicate, Shard
from shardtensor.rules import OpCall, ReplicateFallback, TensorMeta

aten = torch.ops.aten
R = Replicate()

BATCH, HEADS, QUERIES, KEYS, FEATURES = 5, 3, 4, 6, 8  # 5 and 3 split unevenly over 2 ranks


# ---- the kernels' calls, as autograd makes them ----------------------------------------------------


def _flash(q, k, v, mask, dropout_p):
    return aten._scaled_dot_product_flash_attention.default, (q, k, v, dropout_p, False, False), {}


def _flash_backward(grad, q, k, v, mask, results, dropout_p):
    out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, _ = results
    return aten._scaled_dot_product_flash_attention_backward.default, (
        grad, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, False, rng_state, unused), {}


def _efficient(q, k, v, mask, dropout_p):
    return aten._scaled_dot_product_efficient_attention.default, (q, k, v, mask, True, dropout_p, False), {}


def _efficient_backward(grad, q, k, v, mask, results, dropout_p):
    out, logsumexp, seed, offset = results
    wanted = (True, True, True, mask is not None)
    return aten._scaled_dot_product_efficient_attention_backward.default, (
        grad, q, k, v, mask, out, logsumexp, seed, offset, dropout_p, wanted, False), {}


def _cudnn(q, k, v, mask, dropout_p):
    return aten._scaled_dot_product_cudnn_attention.default, (q, k, v, mask, True, dropout_p, False, False), {}


def _cudnn_backward(grad, q, k, v, mask, results, dropout_p):
    out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, _ = results
    return aten._scaled_dot_product_cudnn_attention_backward.default, (
        grad, q, k, v, out, logsumexp, seed, offset, mask, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, False), {}


def _fused(q, k, v, mask, dropout_p):
    return aten._scaled_dot_product_fused_attention_overrideable.default, (q, k, v, mask, dropout_p, False, False), {}


def _fused_backward(grad, q, k, v, mask, results, dropout_p):
    out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, _ = results
    wanted = (True, True, True, mask is not None)
    return aten._scaled_dot_product_fused_attention_overrideable_backward.default, (
        grad, q, k, v, mask, wanted, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, False, seed,
        offset), {}


def _cpu(q, k, v, mask, dropout_p):
    return aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, dropout_p, False), {"attn_mask": mask}


def _cpu_backward(grad, q, k, v, mask, results, dropout_p):
    out, logsumexp = results
    return aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (
        grad, q, k, v, out, logsumexp, dropout_p, False), {"attn_mask": mask}


# name -> (forward, backward, takes a mask)
KERNEL_CALLS = {
    "flash": (_flash, _flash_backward, False),
    "efficient": (_efficient, _efficient_backward, True),
    "cudnn": (_cudnn, _cudnn_backward, True),
    "fused_overrideable": (_fused, _fused_backward, True),
    "cpu_flash": (_cpu, _cpu_backward, True),
}
CASES = [(name, backward) for name in KERNEL_CALLS for backward in (False, True)]
CASE_IDS = [f"{name}{'_backward' if backward else ''}" for name, backward in CASES]


def _meta(*shape, dtype=torch.float16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _kernel_call(name: str, backward: bool, *, mask_shape=None, dropout_p: float = 0.0, key_heads: int = HEADS):
    """(op, args, kwargs, the tensors with batch and heads dims) of one kernel's call on meta tensors;
    a backward gets the forward's results on meta as autograd passes them."""
    forward, backward_call, takes_mask = KERNEL_CALLS[name]
    q = _meta(BATCH, HEADS, QUERIES, FEATURES)
    k, v = _meta(BATCH, key_heads, KEYS, FEATURES), _meta(BATCH, key_heads, KEYS, FEATURES)
    mask = _meta(*mask_shape) if takes_mask and mask_shape is not None else None
    op, args, kwargs = forward(q, k, v, mask, dropout_p)
    if not backward:
        return op, args, kwargs, [q, k, v]
    results = op(*args, **kwargs)
    grad = torch.empty_like(results[0])
    op, args, kwargs = backward_call(grad, q, k, v, mask, results, dropout_p)
    return op, args, kwargs, [grad, q, k, v, results[0], results[1]]


def _decide(op, args, kwargs, placements: dict, mesh_shape, coordinate, shard_sizes=None):
    """`propagation.decide` for the call as dispatch builds it: every tensor argument a `TensorMeta`,
    laid out by `placements[id(tensor)]` (Replicate when absent; `shard_sizes` for those)."""
    flat, tree = tree_flatten((args, kwargs))
    tensors = [value for value in flat if isinstance(value, torch.Tensor)]
    metas = tuple(TensorMeta(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype) for tensor in tensors)
    stand_ins = iter(metas)
    call_args, call_kwargs = tree_unflatten(
        [next(stand_ins) if isinstance(value, torch.Tensor) else value for value in flat], tree)
    call = OpCall(op, metas, call_args, tuple(call_kwargs.items()))
    layouts = [
        Layout.create(mesh_shape, placements[id(tensor)], tensor.shape, shard_sizes=shard_sizes)
        if id(tensor) in placements else Layout.create(mesh_shape, [R] * len(mesh_shape), tensor.shape)
        for tensor in tensors
    ]
    return tensors, layouts, propagation.decide(call, layouts, RULES[op], coordinate, None)


def _coordinates(mesh_shape):
    return itertools.product(*(range(size) for size in mesh_shape))


def _has_batch_and_heads(result) -> bool:
    return isinstance(result, torch.Tensor) and result.ndim >= 3 and tuple(result.shape[:2]) == (BATCH, HEADS)


def test_every_kernel_in_aten_has_a_rule_and_its_table_names_its_schema():
    ops = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::_scaled_dot_product")
           and "attention" in name and "math" not in name and not name.endswith(".quantized")}
    assert ops == {op._schema.name for op in KERNELS} and all(op in RULES for op in KERNELS)
    for op, kernel in KERNELS.items():
        arguments = {argument.name for argument in op._schema.arguments}
        assert set(kernel.like_query) <= arguments and kernel.mask in arguments | {None}
        assert len(kernel.results) == len(op._schema.returns)


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("mesh_shape, placements", [
    ((2,), [Shard(0)]), ((2,), [Shard(1)]), ((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Shard(1), Shard(1)]),
    ((4,), [Shard(1)]),  # 3 heads on 4 ranks: one rank holds none
])
def test_batch_or_heads_sharding_passes_through_to_every_result(name, backward, mesh_shape, placements):
    op, args, kwargs, laid_out = _kernel_call(name, backward, mask_shape=(BATCH, HEADS, QUERIES, KEYS))
    mask = next((value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)
                 and value.shape == (BATCH, HEADS, QUERIES, KEYS)), None)
    sharded = {id(tensor): placements for tensor in laid_out + ([mask] if mask is not None else [])}
    tensors, layouts, decision = _decide(op, args, kwargs, sharded, mesh_shape, (0,) * len(mesh_shape))
    assert decision.input_layouts == tuple(layouts)  # nothing moves
    global_results = [result for result in tree_flatten(op(*args, **kwargs))[0]]
    assert len(global_results) == len(decision.output_layouts)
    for coordinate in _coordinates(mesh_shape):
        local_inputs = {id(tensor): local_piece(tensor, mesh_shape, layout.placements, coordinate)
                        for tensor, layout in zip(tensors, layouts)}
        local_args, local_kwargs = tree_unflatten(
            [local_inputs.get(id(value), value) for value in tree_flatten((args, kwargs))[0]],
            tree_flatten((args, kwargs))[1])
        local_results = tree_flatten(op(*local_args, **local_kwargs))[0]
        batch_and_heads = local_inputs[id(laid_out[0])].shape[:2]
        for result, local, layout in zip(global_results, local_results, decision.output_layouts):
            if not isinstance(result, torch.Tensor):
                assert layout is None
            elif _has_batch_and_heads(result):
                expected = (*batch_and_heads, *result.shape[2:])
                assert layout.placements == tuple(placements)
                assert tuple(local.shape) == expected and layout.local_shape(coordinate) == expected
            else:  # random state, an empty debug mask
                assert layout.placements == (R,) * len(mesh_shape)


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
def test_explicit_uneven_shard_sizes_are_kept_by_every_result(name, backward):
    op, args, kwargs, laid_out = _kernel_call(name, backward)
    sharded = {id(tensor): [Shard(0)] for tensor in laid_out}
    _, layouts, decision = _decide(op, args, kwargs, sharded, (2,), (0,), shard_sizes={0: [4, 1]})
    assert decision.input_layouts == tuple(layouts)
    for layout in decision.output_layouts:
        if layout is not None and layout.placements == (Shard(0),):
            assert [layout.local_shape((rank,))[0] for rank in range(2)] == [4, 1]


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
def test_mixed_inputs_meet_on_the_dim_most_of_them_are_sharded_on(name, backward):
    """The value alone is sharded on heads: it moves to the batch sharding of the others, and a
    Replicate mask is cut to its batch shard (no communication)."""
    op, args, kwargs, laid_out = _kernel_call(name, backward, mask_shape=(BATCH, HEADS, QUERIES, KEYS))
    value = laid_out[3] if backward else laid_out[2]
    sharded = {id(tensor): [Shard(1) if tensor is value else Shard(0)] for tensor in laid_out}
    tensors, layouts, decision = _decide(op, args, kwargs, sharded, (2,), (0,))
    for tensor, layout, target in zip(tensors, layouts, decision.input_layouts):
        if id(tensor) in sharded or tensor.ndim == 4:  # the laid-out tensors and the mask
            assert target.placements == (Shard(0),), tensor.shape
        else:
            assert target == layout
    for layout in decision.output_layouts:
        assert layout is None or layout.placements in ((Shard(0),), (R,))


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
def test_grouped_query_attention_shards_batch_only(name, backward):
    op, args, kwargs, laid_out = _kernel_call(name, backward, key_heads=1)
    sharded = {id(tensor): [Shard(1)] for tensor in laid_out}
    _, _, decision = _decide(op, args, kwargs, sharded, (2,), (0,))
    assert {row.inputs[0] for row in decision.rows} <= {Shard(0), R}


@pytest.mark.parametrize("name, backward", [case for case in CASES if KERNEL_CALLS[case[0]][2]],
                         ids=[case_id for case, case_id in zip(CASES, CASE_IDS) if KERNEL_CALLS[case[0]][2]])
def test_a_mask_broadcast_over_batch_stays_replicate(name, backward):
    """A (1, heads, queries, keys) mask is Replicate next to batch shards. A backward that returns its
    gradient (efficient, overrideable) has no batch row, since each shard's gradient would be a partial
    sum: the inputs move (to heads, which the mask spans, or to Replicate, as the step costs say)."""
    op, args, kwargs, laid_out = _kernel_call(name, backward, mask_shape=(1, HEADS, QUERIES, KEYS))
    sharded = {id(tensor): [Shard(0)] for tensor in laid_out}
    tensors, _, decision = _decide(op, args, kwargs, sharded, (2,), (0,))
    if backward and name in ("efficient", "fused_overrideable"):
        assert decision.rows[0].inputs[0] != Shard(0)
        return
    for tensor, target in zip(tensors, decision.input_layouts):
        assert target.placements == ((Shard(0),) if id(tensor) in sharded else (R,))


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
def test_dropout_takes_the_replicate_fallback(name, backward):
    """A kernel draws its dropout mask for the shapes it gets, so no row shards it: the rule hands the
    call to the counted replicate fallback, which seeds a forward's draws (a backward replays the mask)."""
    op, args, kwargs, laid_out = _kernel_call(name, backward, dropout_p=0.25)
    sharded = {id(tensor): [Shard(0)] for tensor in laid_out}
    with pytest.raises(ReplicateFallback) as verdict:
        _decide(op, args, kwargs, sharded, (2,), (0,))
    assert verdict.value.draws == (not backward)


@pytest.mark.parametrize("name, backward", CASES, ids=CASE_IDS)
def test_a_rank_without_heads_makes_empty_results_without_the_kernel(name, backward):
    """3 heads on 4 ranks: rank 3 holds none and must not launch the kernel (the CUDA ones have no CPU
    kernel, so calling one here would raise); its results have the shapes of the meta kernel's."""
    op, args, kwargs, laid_out = _kernel_call(name, backward)
    sharded = {id(tensor): [Shard(1)] for tensor in laid_out}
    tensors, layouts, decision = _decide(op, args, kwargs, sharded, (4,), (3,))
    assert decision.local_op is not None
    flat, tree = tree_flatten((args, kwargs))
    local = {id(tensor): torch.zeros(layout.local_shape((3,)), dtype=tensor.dtype)
             for tensor, layout in zip(tensors, layouts)}
    local_args, local_kwargs = tree_unflatten([local.get(id(value), value) for value in flat], tree)
    results = tree_flatten(decision.local_op(object(), *local_args, **local_kwargs))[0]
    for result, layout in zip(results, decision.output_layouts):
        if layout is not None:
            assert result.device.type == "cpu" and tuple(result.shape) == layout.local_shape((3,))
    assert _decide(op, args, kwargs, sharded, (4,), (0,))[2].local_op is None


# ---- the efficient kernel on real shards, through a CPU stand-in ------------------------------------


def _probabilities(query, key, attn_bias, scale, dropout_p, seed):
    """Softmax of the scores and the dropout factor (0 or 1 / (1 - p)) of the mask drawn from `seed`."""
    scale = query.size(-1) ** -0.5 if scale is None else scale
    probabilities = (query @ key.transpose(-2, -1) * scale + attn_bias).softmax(-1)
    generator = torch.Generator().manual_seed(int(seed))
    kept = torch.rand(probabilities.shape, generator=generator, dtype=probabilities.dtype) >= dropout_p
    return probabilities, kept / (1 - dropout_p), scale


def _efficient_on_cpu(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """The CUDA kernel's results from math, without `is_causal`: it takes its philox seed from torch's
    generator and draws its dropout mask from it, as the kernel does; logsumexp padded to 32 rows."""
    seed = torch.randint(2**62, (), dtype=torch.int64)
    probabilities, factor, scale = _probabilities(query, key, attn_bias, scale, dropout_p, seed)
    output = (probabilities * factor) @ value
    logsumexp = (query @ key.transpose(-2, -1) * scale + attn_bias).logsumexp(-1).float()
    rows = -(-query.size(2) // 32) * 32 if compute_log_sumexp else 0
    padded = torch.nn.functional.pad(logsumexp, (0, rows - query.size(2)))[..., :rows]
    return output.transpose(1, 2).contiguous().transpose(1, 2), padded, seed, torch.zeros((), dtype=torch.int64)


def _efficient_backward_on_cpu(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                               dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    """Gradients of the stand-in's output, replaying its dropout mask from `philox_seed`."""
    probabilities, factor, scale = _probabilities(query, key, attn_bias, scale, dropout_p, philox_seed)
    grad_value = (probabilities * factor).transpose(-2, -1) @ grad_out_
    grad_probabilities = (grad_out_ @ value.transpose(-2, -1)) * factor
    grad_scores = probabilities * (grad_probabilities - (grad_probabilities * probabilities).sum(-1, keepdim=True))
    return grad_scores @ key * scale, grad_scores.transpose(-2, -1) @ query * scale, grad_value, grad_scores


@contextlib.contextmanager
def _efficient_kernel_on_cpu():
    with torch.library._scoped_library("aten", "IMPL") as library:
        library.impl("_scaled_dot_product_efficient_attention", _efficient_on_cpu, "CPU")
        library.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward_on_cpu, "CPU")
        yield


def _efficient_attention_and_grads(tensors, dropout_p, grad):
    """Output, logsumexp and the gradients of q, k, v, bias of the efficient kernel (`grad` flowing
    back), and the collectives issued meanwhile."""
    with comm.observe() as records:
        output, logsumexp, _, _ = aten._scaled_dot_product_efficient_attention(*tensors, True, dropout_p, False)
        output.backward(grad)
    return [output, logsumexp] + [tensor.grad for tensor in tensors], list(records)


@spmd(meshes=[(2,), (2, 2)])
def test_efficient_kernel_on_shards_equals_one_device(mesh):
    """Batch or heads shards (5 and 3: uneven, none on one of 4 ranks) compute with no communication;
    with dropout the replicate fallback computes the whole op on every rank, drawing the mask its seed
    gives (the one device's), and the backward replays it: one counted fallback each, refused in
    strict mode."""
    shapes = [(BATCH, HEADS, QUERIES, FEATURES), (BATCH, HEADS, KEYS, FEATURES), (BATCH, HEADS, KEYS, FEATURES),
              (BATCH, HEADS, QUERIES, KEYS)]
    fulls = [seeded_randn(shape, seed) for seed, shape in enumerate(shapes)]
    grad_full = seeded_randn(shapes[0], 9)
    with _efficient_kernel_on_cpu():
        for dropout_p, placement in [(0.0, Shard(0)), (0.0, Shard(1)), (0.4, Shard(1))]:
            placements = (placement,) * mesh.ndim
            expected, _ = with_fallback_draws(lambda: _efficient_attention_and_grads(
                [full.clone().requires_grad_() for full in fulls], dropout_p, grad_full), seed=3, counter=0)
            leaves = [distribute_tensor(full, mesh, placements).requires_grad_() for full in fulls]
            grad = distribute_tensor(grad_full, mesh, placements if dropout_p == 0 else (R,) * mesh.ndim)
            shardtensor.random.manual_seed(3)
            fallbacks_before = collections.Counter(fallback_counts)
            results, records = _efficient_attention_and_grads(leaves, dropout_p, grad)
            fallbacks = collections.Counter(fallback_counts) - fallbacks_before
            if dropout_p == 0:
                assert records == [] and results[0].placements == placements == results[2].placements
                assert not fallbacks
            else:
                forward = aten._scaled_dot_product_efficient_attention.default
                assert fallbacks == {str(forward): 1, str(aten._scaled_dot_product_efficient_attention_backward.default): 1}
                assert results[0].placements == placements  # the fallback lays an output out like its first input
                with shardtensor.strict_mode(), pytest.raises(NotImplementedError, match="no sharded way .*dropout_p > 0"):
                    aten._scaled_dot_product_efficient_attention(*leaves, True, dropout_p, False)
            for result, single_device in zip(results, expected):
                assert_close(result.full_tensor(), single_device)


@spmd(meshes=[(4,)])
def test_dropout_on_a_sub_mesh_gives_ranks_outside_it_the_metadata(mesh):
    """Ranks outside the mesh reach the rule's fallback verdict too (without data): members compute the
    whole op with the fallback's draws, the others get the outputs' global shapes and layouts."""
    sub_mesh = DeviceMesh("cpu", [1, 3])
    shapes = [(BATCH, HEADS, QUERIES, FEATURES), (BATCH, HEADS, KEYS, FEATURES), (BATCH, HEADS, KEYS, FEATURES),
              (BATCH, HEADS, QUERIES, KEYS)]
    fulls = [seeded_randn(shape, seed) for seed, shape in enumerate(shapes)]
    attention = aten._scaled_dot_product_efficient_attention.default
    with _efficient_kernel_on_cpu():
        expected = with_fallback_draws(lambda: attention(*fulls, True, 0.4, False)[0], seed=3, counter=0)
        shardtensor.random.manual_seed(3)
        output = attention(*[distribute_tensor(full, sub_mesh, [Shard(1)]) for full in fulls], True, 0.4, False)[0]
    assert output.shape == expected.shape and output.placements == (Shard(1),)
    if sub_mesh.get_coordinate() is None:
        assert output.to_local().numel() == 0
    else:
        assert_close(output.full_tensor(), expected)
