"""distribute_module as PyTorch documents it: partition_fn, input_fn and output_fn, parameters that
stay nn.Parameters holding DTensors, buffers distributed, training equal to one device."""

import pytest
import torch
from parallel_helpers import tp_mesh, train_and_compare
from spmd import spmd
from torch import nn

from shardtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

MESHES = [(1,), (2,), (4,), (2, 2)]


class MyModule(nn.Module):
    """The module of PyTorch's distribute_module example (fc1 and fc2 sharded by output features)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 10)  # 10 output features: uneven over 4 ranks
        self.fc2 = nn.Linear(8, 10)
        self.relu = nn.ReLU()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 10))

    def forward(self, input):
        return self.relu(self.fc1(input) + self.fc2(input)) * self.scale


def shard_params(mod_name, mod, mesh):
    col_linear_placement = [Shard(0)]
    if isinstance(mod, nn.Linear):
        for name, param in mod.named_parameters():
            dist_param = nn.Parameter(distribute_tensor(param, mesh, col_linear_placement))
            mod.register_parameter(name, dist_param)


def input_fn(module, inputs, device_mesh):
    return tuple(DTensor.from_local(x, device_mesh, [Replicate()], shape=x.shape) for x in inputs)


def output_fn(module, outputs, device_mesh):
    return outputs.full_tensor()


def _distribute(module, mesh):
    distribute_module(module, mesh, partition_fn=shard_params, input_fn=input_fn, output_fn=output_fn)


@spmd(meshes=MESHES)
def test_the_documented_example_trains_like_one_device(mesh):
    inputs = lambda generator: [torch.randn(3, 8, generator=generator, requires_grad=True)]  # noqa: E731
    module = train_and_compare(mesh, MyModule, _distribute, inputs)
    for name, parameter in module.named_parameters():
        assert isinstance(parameter, nn.Parameter) and isinstance(parameter, DTensor), name
        assert parameter.placements == (Shard(0),) and parameter.requires_grad
    assert isinstance(module.scale, DTensor) and module.scale.placements == (Replicate(),)
    assert set(dict(module.named_parameters())) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


@spmd(meshes=[(2,)])
def test_without_partition_fn_everything_is_replicated_and_two_argument_hooks_work(mesh):
    module = MyModule()
    distribute_module(module, mesh, input_fn=lambda inputs, device_mesh: input_fn(None, inputs, device_mesh))
    assert all(p.placements == (Replicate(),) for p in module.parameters())
    output = module(torch.ones(2, 8))
    assert isinstance(output, DTensor) and output.placements == (Replicate(),)
    with pytest.raises(RuntimeError, match="once"):
        distribute_module(module, tp_mesh(mesh))
