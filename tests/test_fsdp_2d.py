"""fully_shard on mesh["dp"] over tensor-parallel parameters on mesh["tp"]: training equals one device."""

import torch
from spmd import spmd
from test_fsdp import _assert_same_parameters, _batches, _kinds, _local_batch, _loss, _model, _train_reference
from torch import nn

from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.fsdp import fully_shard
from shardtensor.mesh import DeviceMesh


class TensorParallelBlock(nn.Module):
    """Megatron MLP by hand: `up` column-wise (Shard(0) weight and bias), `down` row-wise (Shard(1) weight,
    replicated bias); the Partial output is all-reduced explicitly."""

    def __init__(self, block, tp_mesh):
        super().__init__()
        self.tp_mesh = tp_mesh
        self.up, self.down = block.up, block.down
        for linear, weight_placement, bias_placement in ((self.up, Shard(0), Shard(0)), (self.down, Shard(1), Replicate())):
            for name, placement in (("weight", weight_placement), ("bias", bias_placement)):
                full = getattr(linear, name).detach()
                setattr(linear, name, nn.Parameter(distribute_tensor(full, tp_mesh, [placement], src_data_rank=None)))

    def forward(self, x):
        replicated = DTensor.from_local(x, self.tp_mesh, [Replicate()])
        partial = self.down(torch.tanh(self.up(replicated)))
        return x + partial.redistribute(placements=[Replicate()]).to_local()


def _step_kinds(model, batch, dp):
    """Collective counts of one forward and backward on data-parallel rank `dp`'s half of the batch."""
    inputs, target = batch
    with comm.observe() as records:
        _loss(model(_local_batch(inputs, dp, 2)), _local_batch(target, dp, 2)).backward()
    return _kinds(records)


def _named_mesh(mesh):
    return DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp", "tp"))


def _tensor_parallel_model(tp_mesh):
    model = _model()
    model.blocks = nn.ModuleList([TensorParallelBlock(block, tp_mesh) for block in model.blocks])
    return model


@spmd(meshes=[(2, 2)])
def test_fsdp_over_hand_written_tensor_parallel_trains_like_one_device(mesh):
    mesh = _named_mesh(mesh)
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    batches = _batches(3)
    reference = _train_reference(_model(), batches)
    model = _tensor_parallel_model(tp_mesh)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    up = model.blocks[0].up.weight
    assert up.placements == (Shard(0), Shard(0)) and up.device_mesh == mesh, (up.placements, up.sharding)
    assert up.sharding.shard_order[0] == (1, 0)  # the tensor-parallel split first, FSDP's within it
    dp, tp = mesh.get_coordinate()
    # 30 rows: 15 per tp rank, then 8 / 7 per dp rank within them
    assert up.to_local().shape == ([8, 7][dp], 12)
    assert model.blocks[0].down.weight.placements == (Shard(0), Shard(1))
    assert model.head.weight.placements == (Shard(0),)
    tensor_parallel_only = _step_kinds(_tensor_parallel_model(tp_mesh), batches[0], dp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step, (inputs, target) in enumerate(batches):
        if step == 0:  # FSDP adds one all-gather per unit (two more for the resharded blocks' backward) and one reduce-scatter
            expected = dict(tensor_parallel_only)
            expected["all_gather"] = expected.get("all_gather", 0) + 3 + 2
            expected["reduce_scatter"] = expected.get("reduce_scatter", 0) + 3
            assert _step_kinds(model, (inputs, target), dp) == expected, (tensor_parallel_only, expected)
        else:
            _loss(model(_local_batch(inputs, dp, 2)), _local_batch(target, dp, 2)).backward()
        assert up.grad.sharding == up.sharding  # the nested order (tp outer, dp inner) survives autograd
        with comm.observe() as records:
            optimizer.step()
        assert records == [] and up.sharding.shard_order[0] == (1, 0)
        optimizer.zero_grad()
    _assert_same_parameters(model, reference)


@spmd(meshes=[(2, 2)])
def test_fsdp_over_parallelize_module_trains_like_one_device(mesh):
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _named_mesh(mesh)
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    batches = _batches(3)
    reference = _train_reference(_model(), batches)
    model = _model()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    assert model.blocks[1].up.weight.placements == (Shard(0), Shard(0))
    assert model.blocks[1].down.weight.placements == (Shard(0), Shard(1))
    assert model.blocks[1].down.bias.placements == (Shard(0), Replicate())
    dp = mesh.get_coordinate()[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        with comm.observe() as records:
            _loss(model(_local_batch(inputs, dp, 2)), _local_batch(target, dp, 2)).backward()
        kinds = _kinds(records)
        # FSDP: 3 + 2 all-gathers, 3 reduce-scatters on dp; TP: one all-reduce per block forward and backward
        assert kinds == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 4}, kinds
        optimizer.step()
        optimizer.zero_grad()
    _assert_same_parameters(model, reference)
