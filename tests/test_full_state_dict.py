"""Full state dicts (`StateDictOptions(full_state_dict=True)`, `cpu_offload`) of fully_shard and tensor parallel
models through `shardtensor.checkpoint`'s get/set_state_dict: equal to the single-device model's, exactly."""

import copy

import pytest
import torch
from spmd import spmd
from test_checkpoint import OPTIMIZER_STATE, _build, _train_step
from test_fsdp import _batches, _model, _shard
from test_fsdp_checkpoint import LR, _steps
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.testing import assert_close

from shardtensor import DTensor
from shardtensor.checkpoint import get_state_dict, set_state_dict

FULL = StateDictOptions(full_state_dict=True)


def _single_device_state(steps: int):
    """The plain model's and AdamW's state after `steps` steps, as torch's get_state_dict gives it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _steps(model, optimizer, _batches(steps), 0, 1)
    return (model, optimizer), torch_get_state_dict(model, optimizer)


def _assert_plain_and_equal(actual, expected, exact: bool, where: str = "") -> None:
    """The same nested structure; tensors plain (not DTensor) and equal (exactly, or to float64 rounding)."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            _assert_plain_and_equal(actual[key], expected[key], exact, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (item, other) in enumerate(zip(actual, expected)):
            _assert_plain_and_equal(item, other, exact, f"{where}.{index}")
    elif isinstance(expected, torch.Tensor):
        assert type(actual) is torch.Tensor, f"{where}: {type(actual).__name__}"
        tolerance = {"rtol": 0, "atol": 0} if exact else {}
        assert_close(actual, expected, msg=lambda message: f"{where}: {message}", **tolerance)
    else:
        assert actual == expected, where


@spmd(meshes=[(4,), (2, 2)])
def test_full_state_dict_of_fully_shard_equals_single_device_training(mesh):
    _, expected = _single_device_state(2)
    model = _shard(_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _steps(model, optimizer, _batches(2), mesh.get_rank(), mesh.size())

    _assert_plain_and_equal(get_state_dict(model, optimizer, options=FULL), expected, exact=False)
    offloaded = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if mesh.get_rank() == 0:  # as torch: with cpu_offload only global rank 0 keeps the full state dicts
        _assert_plain_and_equal(offloaded, expected, exact=False)
    else:
        assert offloaded == ({}, {})
    sharded_state, _ = get_state_dict(model, optimizer)  # without options: still this rank's shards
    offloaded_shards, _ = get_state_dict(model, optimizer, options=StateDictOptions(cpu_offload=True))
    for name, value in sharded_state.items():
        assert isinstance(value, DTensor) and isinstance(offloaded_shards[name], DTensor), name
        assert offloaded_shards[name].placements == value.placements and offloaded_shards[name].device.type == "cpu"
        assert torch.equal(offloaded_shards[name].to_local(), value.to_local()), name


@spmd(meshes=[(4,), (2, 2)])
def test_set_full_state_dict_loads_single_device_state_exactly_and_training_continues(mesh):
    (reference, reference_optimizer), (model_state, optimizer_state) = _single_device_state(2)
    model = _shard(_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    # a copy: AdamW's load_state_dict keeps the given `step` tensors, which the reference's steps would advance
    model_state, optimizer_state = copy.deepcopy((model_state, optimizer_state))
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=FULL)

    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor) and parameter.placements[-1].is_shard(0), name
        state = optimizer.state[parameter]
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == parameter.placements, name
    _assert_plain_and_equal(get_state_dict(model, optimizer, options=FULL), (model_state, optimizer_state), exact=True)

    batches = _batches(3)
    _steps(model, optimizer, batches[2:], mesh.get_rank(), mesh.size())
    _steps(reference, reference_optimizer, batches[2:], 0, 1)
    for (name, parameter), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(parameter.full_tensor(), expected.detach(), msg=lambda message, name=name: f"{name}: {message}")


@spmd(meshes=[(2, 2)])
def test_tensor_parallel_and_nested_uneven_shards_round_trip_a_single_device_full_state_dict(mesh):
    plain, plain_optimizer = _build(mesh, "plain", seed=1)
    for step in range(2):
        _train_step(plain, plain_optimizer, step)
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    expected = torch_get_state_dict(plain, plain_optimizer)

    model, optimizer = _build(mesh, "tp2", seed=2)  # embed.weight nested over both mesh dims, up.* uneven
    loaded = copy.deepcopy(expected)  # AdamW keeps the given `step` tensors, which the plain model's steps advance
    set_state_dict(model, optimizer, model_state_dict=loaded[0], optim_state_dict=loaded[1], options=FULL)
    for name, parameter in model.named_parameters():
        assert_close(parameter.full_tensor(), plain.get_parameter(name).detach(), rtol=0, atol=0)
        for key in OPTIMIZER_STATE:
            value = optimizer.state[parameter][key]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            assert_close(full, plain_optimizer.state[plain.get_parameter(name)][key], rtol=0, atol=0)
    _assert_plain_and_equal(get_state_dict(model, optimizer, options=FULL), expected, exact=True)

    _train_step(model, optimizer, 2)
    _train_step(plain, plain_optimizer, 2)
    _assert_plain_and_equal(get_state_dict(model, optimizer, options=FULL), torch_get_state_dict(plain, plain_optimizer),
                            exact=False)


@spmd(meshes=[(2,)])
def test_a_full_tensor_of_another_shape_and_broadcast_from_rank0_are_refused_on_every_rank(mesh):
    model = _shard(_model(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FULL)
    model_state["head.weight"] = torch.zeros(8, 12, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'head.weight' has shape \[8, 12\], but the model's DTensor there has the global shape \[7, 12\]"):
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=FULL)
    with pytest.raises(ValueError, match=r"broadcast_from_rank0=True\) is not supported"):
        get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
