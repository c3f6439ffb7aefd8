"""Shared by the model-layer tests: the tensor-parallel mesh of a test mesh, and a training run of a
parallelized module compared step by step with the same module on one device."""

from __future__ import annotations

import copy

import torch
from torch.testing import assert_close

from shardtensor import DTensor, init_device_mesh
from shardtensor.parallel import parallelize_module

_named_meshes: dict = {}


def tp_mesh(mesh):
    """The 1-D mesh styles run on: the mesh itself, or the "tp" dim of a 2-D mesh (named dp x tp)."""
    if mesh.ndim == 1:
        return mesh
    if mesh not in _named_meshes:  # by mesh, not shape: each simulated rank (launch.simulate) has its own world
        _named_meshes[mesh] = init_device_mesh("cpu", mesh.shape, mesh_dim_names=("dp", "tp"))
    return _named_meshes[mesh]["tp"]


def data_seed(mesh) -> int:
    """Different data on each data-parallel row of a 2-D mesh, the same within a tp group."""
    return 1000 + (mesh.get_coordinate()[0] if mesh.ndim == 2 else 0)


def full(value, like: torch.Tensor, mesh, placements=None) -> torch.Tensor:
    """The global value of a module output: a DTensor's full tensor, or a tagged/plain local tensor
    read with `placements` (chunk sizes, as the styles' shards follow)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if placements is None:
        return value
    return DTensor.from_local(value, mesh, placements, shape=like.shape).full_tensor()


def _value(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_and_compare(mesh, build, plan, make_inputs, *, output_placements=None, steps=3, tolerance=None):
    """Train `build()` parallelized with `plan` on `tp_mesh(mesh)` and a single-device copy with
    AdamW on the same data; compare outputs, input and parameter gradients, and parameters.
    `plan` is a parallelize_module plan, or a function `(module, mesh)` that distributes the module."""
    tolerance = tolerance or {}
    tp = tp_mesh(mesh)
    torch.manual_seed(0)
    module = build()
    reference = copy.deepcopy(module)
    if callable(plan):
        plan(module, tp)
    else:
        parallelize_module(module, tp, plan)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(data_seed(mesh))
    for step in range(steps):
        inputs = make_inputs(generator)
        reference_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        output = module(*inputs)
        expected = reference(*reference_inputs)
        output_full = full(output, expected, tp, output_placements)
        assert_close(output_full, expected, **tolerance)
        weights = torch.randn(expected.shape, generator=generator, dtype=expected.dtype)
        (output_full * weights).sum().backward()
        (expected * weights).sum().backward()
        for given, wanted in zip(inputs, reference_inputs):
            if wanted.requires_grad:
                assert_close(given.grad, wanted.grad, **tolerance)
        for (name, parameter), wanted in zip(module.named_parameters(), reference.parameters()):
            assert isinstance(parameter, torch.nn.Parameter), name
            if wanted.grad is None:
                assert parameter.grad is None, name
                continue
            assert_close(_value(parameter.grad), wanted.grad, **tolerance, msg=lambda m: f"{name} grad, step {step}: {m}")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    for (name, parameter), wanted in zip(module.named_parameters(), reference.parameters()):
        assert_close(_value(parameter), wanted, **tolerance, msg=lambda m: f"{name} after {steps} steps: {m}")
    return module
