"""context_parallel / ring attention against F.scaled_dot_product_attention on the full sequence.

Every rank builds the same full q/k/v, computes the single-device reference (outside the context),
then runs SDPA inside `context_parallel` on its sequence piece; outputs and gradients gathered with
`context_parallel_unshard` must equal the reference. Collectives are counted with comm.observe.
"""

import pytest
import torch
import torch.nn.functional as F
from spmd import spmd
from torch.testing import assert_close

from shardtensor import comm
from shardtensor.experimental import context_parallel, context_parallel_unshard, set_rotate_method
from shardtensor.experimental.ring_attention import SequenceLayout

MESHES = [(1,), (2,), (4,)]


def _inputs(query_heads=4, key_value_heads=4, sequence=16, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    shape = (2, query_heads, sequence, 8)
    query = torch.randn(shape, generator=generator, dtype=dtype)
    key = torch.randn((2, key_value_heads, sequence, 8), generator=generator, dtype=dtype)
    value = torch.randn((2, key_value_heads, sequence, 8), generator=generator, dtype=dtype)
    grad_output = torch.randn(shape, generator=generator, dtype=dtype)
    return query, key, value, grad_output


def _reference(query, key, value, grad_output, **options):
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    output = F.scaled_dot_product_attention(*leaves, **options)
    output.backward(grad_output)
    return [output.detach()] + [leaf.grad for leaf in leaves]


def _ring(mesh, query, key, value, grad_output, load_balance=True, **options):
    """Output and q/k/v gradients of SDPA inside the context, gathered to the full sequence."""
    buffers = [query, key, value, grad_output]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], load_balance=load_balance):
        leaves = [tensor.detach().clone().requires_grad_() for tensor in (query, key, value)]
        output = F.scaled_dot_product_attention(*leaves, **options)
        output.backward(grad_output)
        local = [output.detach()] + [leaf.grad for leaf in leaves]
        return context_parallel_unshard(mesh, local, [2, 2, 2, 2], load_balance=load_balance)


@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
@pytest.mark.parametrize("is_causal", [False, True])
@spmd(meshes=MESHES)
def test_ring_attention_matches_full_sdpa_forward_and_backward(mesh, is_causal, rotate_method):
    set_rotate_method(rotate_method)
    try:
        inputs = _inputs()
        expected = _reference(*inputs, is_causal=is_causal)
        actual = _ring(mesh, *inputs, is_causal=is_causal)
    finally:
        set_rotate_method("allgather")
    for name, got, want in zip(["output", "dq", "dk", "dv"], actual, expected):
        assert_close(got, want, msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
@spmd(meshes=[(2,), (4,)])
def test_gqa_causal_and_scale(mesh, rotate_method):
    set_rotate_method(rotate_method)
    try:
        inputs = _inputs(query_heads=4, key_value_heads=2)
        options = {"is_causal": True, "enable_gqa": True, "scale": 0.3}
        expected = _reference(*inputs, **options)
        actual = _ring(mesh, *inputs, **options)
    finally:
        set_rotate_method("allgather")
    for got, want in zip(actual, expected):
        assert_close(got, want)


@spmd(meshes=[(2,), (4,)])
def test_without_load_balance_and_in_float32(mesh):
    inputs = _inputs(dtype=torch.float32, sequence=12 if mesh.size(0) == 2 else 8)
    expected = _reference(*inputs, is_causal=True)
    actual = _ring(mesh, *inputs, load_balance=False, is_causal=True)
    for got, want in zip(actual, expected):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
@spmd(meshes=[(2,), (4,)])
def test_communication_per_call(mesh, rotate_method):
    """allgather: one all_gather forward; all_gather + reduce_scatter backward. alltoall: world-1
    k/v exchanges forward; backward world-1 k/v exchanges and world gradient exchanges."""
    world = mesh.size(0)
    query, key, value, grad_output = _inputs()
    set_rotate_method(rotate_method)
    try:
        with context_parallel(mesh, buffers=[query, key, value, grad_output], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [tensor.detach().clone().requires_grad_() for tensor in (query, key, value)]
            with comm.observe() as forward_records:
                output = F.scaled_dot_product_attention(*leaves, is_causal=True)
            with comm.observe() as backward_records:
                output.backward(grad_output)
    finally:
        set_rotate_method("allgather")
    forward_kinds = [record.kind for record in forward_records]
    backward_kinds = sorted(record.kind for record in backward_records)
    block_bytes = 2 * key.numel() // world * key.element_size()  # k and v of one rank
    if rotate_method == "allgather":
        assert forward_kinds == ["all_gather"]
        assert forward_records[0].bytes_received == block_bytes * (world - 1)
        assert backward_kinds == ["all_gather", "reduce_scatter"]
    else:
        assert forward_kinds == ["batch_p2p"] * (world - 1)
        assert all(record.bytes_sent == block_bytes for record in forward_records)
        assert backward_kinds == ["batch_p2p"] * (2 * world - 1)


@spmd(meshes=[(1,), (2,), (4,)])
def test_buffers_sharded_in_place_and_restored(mesh):
    world, coordinate = mesh.size(0), mesh.get_local_rank(0)
    sequence = torch.arange(16.0).reshape(1, 16)  # seq dim 1
    positions = torch.arange(16.0)
    kept_sharded = torch.arange(16.0) * 10
    original_attention = F.scaled_dot_product_attention
    with context_parallel(mesh, buffers=[sequence, positions, kept_sharded], buffer_seq_dims=[1, 0, 0],
                          no_restore_buffers={kept_sharded}):
        chunk = 16 // (2 * world)
        head, tail = coordinate, 2 * world - 1 - coordinate
        expected = torch.cat([torch.arange(head * chunk, (head + 1) * chunk),
                              torch.arange(tail * chunk, (tail + 1) * chunk)]).double()
        assert F.scaled_dot_product_attention is not original_attention
        assert_close(positions.double(), expected)
        assert_close(sequence[0].double(), expected)
        (gathered,) = context_parallel_unshard(mesh, [positions], [0])
        assert_close(gathered, torch.arange(16.0))
    assert F.scaled_dot_product_attention is original_attention
    assert_close(sequence, torch.arange(16.0).reshape(1, 16))
    assert_close(positions, torch.arange(16.0))
    assert_close(kept_sharded.double(), expected * 10)


@spmd(meshes=[(2,)])
def test_parameter_buffer_sharded_and_restored(mesh):
    parameter = torch.nn.Parameter(torch.arange(8.0))
    with context_parallel(mesh, buffers=[parameter], buffer_seq_dims=[0], load_balance=False):
        assert_close(parameter.detach(), torch.arange(8.0)[4 * mesh.get_local_rank(0):][:4])
    assert_close(parameter.detach(), torch.arange(8.0))
    assert parameter.requires_grad


@spmd(meshes=[(2,)])
def test_sdpa_restored_after_an_error_inside(mesh):
    original_attention = F.scaled_dot_product_attention
    buffer = torch.arange(8.0)
    with pytest.raises(RuntimeError, match="boom"):
        with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[0]):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original_attention
    assert_close(buffer, torch.arange(8.0))


@spmd(meshes=[(2,), (4,)])
def test_clear_errors(mesh):
    world = mesh.size(0)
    with pytest.raises(ValueError, match=f"not divisible by {2 * world}"):
        with context_parallel(mesh, buffers=[torch.zeros(1, 2, 2 * world + 2, 4)], buffer_seq_dims=[2]):
            pass
    with pytest.raises(ValueError, match="1 buffers but 2 buffer_seq_dims"):
        with context_parallel(mesh, buffers=[torch.zeros(8)], buffer_seq_dims=[0, 0]):
            pass
    query, key, value, _ = _inputs(query_heads=4, key_value_heads=2)
    with context_parallel(mesh, buffers=[query, key, value], buffer_seq_dims=[2, 2, 2]):
        with pytest.raises(ValueError, match="enable_gqa=True"):
            F.scaled_dot_product_attention(query, key, value)
        with pytest.raises(NotImplementedError, match="attn_mask"):
            F.scaled_dot_product_attention(query, key, value, attn_mask=torch.ones(1, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(NotImplementedError, match="allgather"):
        set_rotate_method("ring")


def test_head_tail_order_balances_causal_work():
    for world in (2, 4, 8):
        balanced = SequenceLayout(world, load_balance=True)
        contiguous = SequenceLayout(world, load_balance=False)
        assert {balanced.causal_work(rank) for rank in range(world)} == {2 * world + 1}
        assert [contiguous.causal_work(rank) for rank in range(world)] == [rank + 1 for rank in range(world)]
