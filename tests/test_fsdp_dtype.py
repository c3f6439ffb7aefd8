"""`model.to(dtype)` / `.double()` / `.to(device)` after fully_shard: the units follow the new dtype, and
training equals the single-device model converted the same way. Also the dtype `reduce_dtype=None` reduces in,
against the installed torch's fully_shard (torch 2.15 changed it).
"""

import pytest
import torch
from helpers import TORCH_VERSION
from spmd import spmd
from test_fsdp import (
    _batches,
    _data_parallel_rank,
    _local_batch,
    _loss,
    _mixed_precision_model,
    _model,
    _shard,
    _train_reference,
    _train_sharded,
)
from test_fsdp_2d import _named_mesh
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Shard, comm
from shardtensor.fsdp import MixedPrecisionPolicy, fully_shard

# Tighter than assert_close's float64 default (rtol 1e-7), which float32 rounding somewhere would still meet.
FLOAT64 = {"rtol": 1e-12, "atol": 1e-14}
CONVERSIONS = {"double": nn.Module.double, "to": lambda module: module.to(torch.float64)}


def _assert_float64_shards(sharded, reference, rank, ranks):
    """Each parameter: a float64 DTensor with Shard(0), whose local tensor is this rank's exact chunk."""
    for (name, parameter), (_, expected) in zip(sharded.named_parameters(), reference.named_parameters(), strict=True):
        assert isinstance(parameter, DTensor) and parameter.dtype == parameter.to_local().dtype == torch.float64, name
        assert parameter.placements == (Shard(0),) and parameter.shape == expected.shape, (name, parameter.placements)
        assert parameter.to_local().shape == expected.chunk(ranks)[rank].shape, (name, parameter.to_local().shape)


def _train_and_compare(sharded, reference, batches, data_parallel_rank, ranks):
    """AdamW on both, step by step: this rank's loss, every gradient and every parameter equal to float64 tolerance."""
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for inputs, target in batches:
        local_inputs, local_target = (_local_batch(tensor, data_parallel_rank, ranks) for tensor in (inputs, target))
        loss = _loss(sharded(local_inputs), local_target)
        with torch.no_grad():
            assert_close(loss, _loss(reference(local_inputs), local_target), **FLOAT64)
        loss.backward()
        _loss(reference(inputs), target).backward()
        for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert parameter.grad.dtype == torch.float64 and parameter.grad.sharding == parameter.sharding, name
            assert_close(parameter.grad.full_tensor(), expected.grad, **FLOAT64, msg=lambda message, name=name: f"{name}: {message}")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach(), **FLOAT64, msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
@spmd(meshes=[(2,), (4,)])
def test_double_after_fully_shard_trains_like_the_single_device_model_doubled(mesh, conversion):
    rank, ranks = _data_parallel_rank(mesh)
    reference = _model(torch.float32).double()
    sharded = _shard(_model(torch.float32), mesh)
    with torch.no_grad():
        sharded(torch.ones(2, 5))  # the root stays gathered after forward, in float32
    sharded = CONVERSIONS[conversion](sharded)
    _assert_float64_shards(sharded, reference, rank, ranks)
    _train_and_compare(sharded, reference, _batches(2), rank, ranks)
    # the unit's pieces were homed again in one float64 buffer (what its all-gather sends)
    pieces = [parameter.to_local() for parameter in sharded.blocks[0].parameters()]
    assert {piece.untyped_storage().data_ptr() for piece in pieces} == {pieces[0].untyped_storage().data_ptr()}
    assert pieces[0].untyped_storage().nbytes() == sum(piece.numel() for piece in pieces) * 8


@spmd(meshes=[(2, 2)])
def test_double_after_fsdp_over_tensor_parallel_trains_like_the_single_device_model_doubled(mesh):
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _named_mesh(mesh)
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    reference = _model(torch.float32).double()
    sharded = _model(torch.float32)
    for block in sharded.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(sharded, mesh=dp_mesh).double()
    dp, tp = mesh.get_coordinate()
    up, down = sharded.blocks[0].up.weight, sharded.blocks[0].down.weight
    assert up.placements == (Shard(0), Shard(0)) and up.dtype == torch.float64
    assert up.to_local().shape == ([8, 7][dp], 12)  # 30 rows: 15 per tp rank, then 8 / 7 per dp rank
    assert down.placements == (Shard(0), Shard(1)) and down.to_local().shape == ([6, 6][dp], 15)
    assert sharded.head.weight.placements == (Shard(0),) and sharded.head.weight.to_local().shape == ([4, 3][dp], 12)
    assert all(parameter.dtype == parameter.to_local().dtype == torch.float64 for parameter in sharded.parameters())
    _train_and_compare(sharded, reference, _batches(2), dp, 2)


@spmd(meshes=[(2,), (4,)])
def test_double_after_fully_shard_with_mixed_precision_equals_sharding_the_float64_model(mesh):
    """bf16 compute and fp32 reduction stay; the parameters and the optimizer become float64, bit for bit as
    when the float64 model is sharded with the same policies."""
    batches = _batches(2)
    rank, ranks = _data_parallel_rank(mesh)
    converted = _mixed_precision_model(mesh).double()
    model = _model(torch.float64)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    built = fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in batches[0])
    with comm.observe() as records:
        output = converted(inputs)
    assert output.dtype == torch.float32
    expected_sent = sum(parameter.to_local().numel() * 2 * (ranks - 1) for parameter in converted.parameters())
    assert sum(record.bytes_sent for record in records) == expected_sent  # still bf16 on the wire
    _loss(output, target).backward()
    assert all(parameter.grad.dtype == torch.float64 for parameter in converted.parameters())
    converted.zero_grad()
    _train_sharded(converted, batches, rank, ranks)
    _train_sharded(built, batches, rank, ranks)
    for parameter, expected in zip(converted.parameters(), built.parameters(), strict=True):
        assert parameter.dtype == torch.float64 and torch.equal(parameter.full_tensor(), expected.full_tensor())


@spmd(meshes=[(2,)])
def test_to_cpu_and_a_round_trip_through_float64_keep_training_like_one_device(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    batches = _batches(2, torch.float32)
    reference = _train_reference(_model(torch.float32), batches)
    sharded = _shard(_model(torch.float32), mesh).to("cpu").double().to("cpu").float()
    assert all(parameter.dtype == torch.float32 for parameter in sharded.parameters())
    _train_sharded(sharded, batches, rank, ranks)
    for parameter, expected in zip(sharded.parameters(), reference.parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach())


@spmd(meshes=[(2,)])
def test_converting_one_module_of_a_unit_raises_a_clear_error(mesh):
    model = _model(torch.float32)
    fully_shard([model.blocks[0], model.blocks[1]], mesh=mesh)
    model.blocks[0].double()
    with pytest.raises(ValueError, match="different dtypes .* after a conversion"):
        model.blocks[0](torch.ones(2, 12))


@spmd(meshes=[(2,)])
def test_double_between_micro_batches_keeps_the_gradients_accumulated_without_sync(mesh):
    """A float32 micro-batch without sync, `.double()`, a float64 one with sync: the accumulated gradients
    became float64 (the first micro-batch's gradient is exactly zero, so float32 rounding of the second
    would show beyond float64 tolerance)."""
    rank, ranks = _data_parallel_rank(mesh)
    (inputs, target), (inputs_64, target_64) = _batches(1, torch.float32)[0], _batches(2)[1]
    reference = _model(torch.float32).double()
    _loss(reference(inputs_64), target_64).backward()
    sharded = _shard(_model(torch.float32), mesh)
    sharded.set_requires_gradient_sync(False)
    (_loss(sharded(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks)) * 0).backward()
    sharded.double().set_requires_gradient_sync(True)
    _loss(sharded(_local_batch(inputs_64, rank, ranks)), _local_batch(target_64, rank, ranks)).backward()
    for (name, parameter), expected in zip(sharded.named_parameters(), reference.parameters(), strict=True):
        assert parameter.grad.dtype == torch.float64, name
        assert_close(parameter.grad.full_tensor(), expected.grad, **FLOAT64, msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(2,), (4,)])
def test_bfloat16_after_fully_shard_computes_like_the_single_device_model_in_bfloat16(mesh):
    """The forward equals the single-device bf16 model bit for bit; the gradients are bf16 with the parameters'
    layout (their values are a bf16 sum over ranks, not one device's, so they are not compared)."""
    rank, ranks = _data_parallel_rank(mesh)
    inputs, target = (_local_batch(tensor, rank, ranks).bfloat16() for tensor in _batches(1, torch.float32)[0])
    reference = _model(torch.float32).bfloat16()
    sharded = _shard(_model(torch.float32), mesh).bfloat16()
    output = sharded(inputs)
    assert output.dtype == torch.bfloat16 and torch.equal(output, reference(inputs))
    _loss(output, target).backward()
    for name, parameter in sharded.named_parameters():
        assert parameter.grad.dtype == torch.bfloat16 and parameter.grad.sharding == parameter.sharding, name


@spmd(meshes=[(2,)])
def test_reduce_dtype_none_reduces_in_the_dtype_the_installed_torchs_fully_shard_does(mesh):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=None) on float32 parameters: torch >= 2.15 reduces
    the bf16 gradients in float32 (the parameters' dtype), torch 2.13 and 2.14 in bf16 (param_dtype). Ours
    sends that dtype, and its float32 gradients equal torch's fully_shard's and, exactly, the ranks' bf16
    gradients (a bf16 copy of the model on each rank's batch) summed in that dtype over 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, ranks = _data_parallel_rank(mesh)
    reduce_dtype = torch.float32 if TORCH_VERSION >= (2, 15) else torch.bfloat16
    inputs, target = _batches(1, torch.float32)[0]
    ours, theirs = _model(torch.float32), _model(torch.float32)
    torch_mesh = torch_init_device_mesh("cpu", (ranks,))
    for module in (*ours.blocks, ours):
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    for module in (*theirs.blocks, theirs):
        torch_fully_shard(module, mesh=torch_mesh, mp_policy=TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16))
    local_inputs, local_target = (_local_batch(tensor, rank, ranks) for tensor in (inputs, target))
    with comm.observe() as records:
        _loss(ours(local_inputs).float(), local_target).backward()
    _loss(theirs(local_inputs).float(), local_target).backward()
    received = sum(record.bytes_received for record in records if record.kind == "reduce_scatter")
    assert received == sum(parameter.to_local().numel() for parameter in ours.parameters()) * (ranks - 1) * reduce_dtype.itemsize
    rank_grads = []
    for other in range(ranks):
        low = _model(torch.float32).to(torch.bfloat16)
        _loss(low(_local_batch(inputs, other, ranks).bfloat16()).float(), _local_batch(target, other, ranks)).backward()
        rank_grads.append([parameter.grad for parameter in low.parameters()])
    differs = False
    for (name, parameter), theirs_parameter, grads in zip(ours.named_parameters(), theirs.parameters(), zip(*rank_grads), strict=True):
        summed = {dtype: (sum(grad.to(dtype) for grad in grads) / ranks).float() for dtype in (torch.bfloat16, torch.float32)}
        differs |= not torch.equal(summed[torch.bfloat16], summed[torch.float32])
        assert parameter.grad.dtype == theirs_parameter.grad.dtype == torch.float32, name
        ours_grad, theirs_grad = parameter.grad.full_tensor(), theirs_parameter.grad.full_tensor()
        assert_close(ours_grad, summed[reduce_dtype], rtol=0, atol=0, msg=lambda message, name=name: f"{name}: {message}")
        assert_close(ours_grad, theirs_grad, rtol=0, atol=0, msg=lambda message, name=name: f"{name} vs torch: {message}")
    assert differs  # the two dtypes give different gradients here, so the comparisons above tell them apart
