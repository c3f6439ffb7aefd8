"""fully_shard around the training loop: explicit unshard() registers the unsharded parameters until
reshard(); a model built on the meta device, sharded, then `to_empty` and initialized holds the values
of the same initialization of the whole model and trains like one device; HSDP x TP on 2x2x2."""

import torch
from spmd import spmd
from test_fsdp import (
    Model,
    _assert_same_parameters,
    _batches,
    _kinds,
    _local_batch,
    _loss,
    _model,
    _shard,
    _train_reference,
    _train_sharded,
)
from torch import nn

import shardtensor
from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.mesh import DeviceMesh


@spmd(meshes=[(2,)])
def test_explicit_unshard_registers_the_unsharded_parameters_until_reshard(mesh):
    reference = _model()
    model = _shard(_model(), mesh)
    block = model.blocks[0]
    sharded = block.up.weight
    with comm.observe() as records:
        block.unshard()
    assert _kinds(records) == {"all_gather": 1}
    unsharded = block.up.weight
    assert type(unsharded) is nn.Parameter and unsharded.requires_grad
    assert torch.equal(unsharded, reference.blocks[0].up.weight) and torch.equal(block.down.bias, reference.blocks[0].down.bias)
    assert model.blocks[1].up.weight is not unsharded and isinstance(model.blocks[1].up.weight, DTensor)
    rank = mesh.get_rank()
    inputs, target = (_local_batch(tensor, rank, 2) for tensor in _batches(1)[0])
    with comm.observe() as records:
        output = model(inputs)
    assert _kinds(records) == {"all_gather": 2}  # the root and the second block; the first was gathered
    assert block.up.weight is sharded  # blocks reshard after forward, and show their sharded parameters again
    _loss(output, target).backward()
    handle = model.blocks[1].unshard(async_op=True)
    assert isinstance(model.blocks[1].up.weight, DTensor)  # registered once the gather is waited for
    handle.wait()
    assert torch.equal(model.blocks[1].up.weight, reference.blocks[1].up.weight)
    model.blocks[1].reshard()
    assert model.blocks[1].up.weight is model.blocks[1]._fsdp_unit.sharded_parameters[0]
    model.unshard()  # the root keeps its parameters after forward: they stay registered unsharded
    model(inputs)
    assert torch.equal(model.head.weight, reference.head.weight) and not isinstance(model.head.weight, DTensor)
    model.reshard()
    assert isinstance(model.head.weight, DTensor) and model.head.weight.placements == (Shard(0),)


def _initialize(model: nn.Module, seed: int) -> None:
    shardtensor.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()


@spmd(meshes=[(4,)])
def test_meta_device_init_equals_initializing_the_whole_model_and_trains_like_one_device(mesh):
    """Built under torch.device("meta"), sharded (nothing allocated), `to_empty`, `reset_parameters`:
    shardtensor's random values depend on seed and global shape only, so each parameter equals the
    same initialization of a replicated (whole) copy of it; training from there equals one device."""
    with torch.device("meta"):
        model = Model().to(torch.float64)
    _shard(model, mesh)
    assert {parameter.device.type for parameter in model.parameters()} == {"meta"}
    model.to_empty(device="cpu")
    _initialize(model, seed=7)
    whole = _model()
    for module in whole.modules():
        for name, parameter in list(module._parameters.items()):
            setattr(module, name, nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Replicate()], src_data_rank=None)))
    _initialize(whole, seed=7)
    reference = _model()
    with torch.no_grad():
        for parameter, initialized, target in zip(model.parameters(), whole.parameters(), reference.parameters(), strict=True):
            assert parameter.device.type == "cpu" and parameter.placements == (Shard(0),)
            assert torch.equal(parameter.full_tensor(), initialized.to_local())
            target.copy_(initialized.to_local())
    batches = _batches(2)
    rank = mesh.get_rank()
    inputs, target = (_local_batch(tensor, rank, 4) for tensor in batches[0])
    with comm.observe() as records:
        model(inputs)
    assert _kinds(records) == {"all_gather": 3}
    _train_sharded(model, batches, rank, 4)
    _assert_same_parameters(model, _train_reference(reference, batches))


class _TensorParallelBlock(nn.Module):
    """The Megatron MLP on a plain tensor stream: `up` column-wise, `down` row-wise, the Partial sum
    all-reduced over tp."""

    def __init__(self, block, tp_mesh):
        super().__init__()
        from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.block = parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, x):
        return self.block(x)


@spmd(meshes=[(2, 2, 2)], timeout=180)
def test_hsdp_over_tensor_parallel_on_a_3d_mesh_trains_like_one_device(mesh):
    """mesh (replicate, shard, tp): blocks tensor-parallel on tp, every unit HSDP on (replicate, shard);
    the batch is split over the 4 data-parallel ranks. Per step: 3 all-gathers forward and 2 re-gathers
    backward on shard, 3 reduce-scatters on shard then 3 all-reduces on replicate, and the blocks' one
    all-reduce each way on tp."""
    mesh = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("replicate", "shard", "tp"))
    batches = _batches(2)
    reference = _train_reference(_model(), batches)
    model = _model()
    model.blocks = nn.ModuleList([_TensorParallelBlock(block, mesh["tp"]) for block in model.blocks])
    data_parallel = mesh["replicate", "shard"]
    _shard(model, data_parallel)
    up = model.blocks[0].block.up.weight
    assert up.placements == (Replicate(), Shard(0), Shard(0)) and up.device_mesh == mesh
    replica, shard, _ = mesh.get_coordinate()
    assert up.to_local().shape == ([8, 7][shard], 12)  # 30 rows: 15 per tp rank, 8 / 7 per shard rank
    rank = 2 * replica + shard
    inputs, target = (_local_batch(tensor, rank, 4) for tensor in batches[0])
    with comm.observe() as records:
        _loss(model(inputs), target).backward()
    counts = {}
    for record in records:
        counts[record.kind, record.group_size] = counts.get((record.kind, record.group_size), 0) + 1
    assert counts == {("all_gather", 2): 5, ("reduce_scatter", 2): 3, ("all_reduce", 2): 3 + 4}, counts
    model.zero_grad()
    _train_sharded(model, batches, rank, 4)
    _assert_same_parameters(model, reference)


@spmd(meshes=[(2,)])
def test_a_parameter_replaced_out_of_layout_and_a_0d_parameter_raise_clear_errors(mesh):
    import pytest

    from shardtensor.fsdp import fully_shard

    model = _shard(_model(), mesh)
    model.head.weight = nn.Parameter(torch.zeros(7, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="parameter 'weight' was replaced by Parameter .* keep its sharded layout"):
        model(torch.zeros(2, 5, dtype=torch.float64))
    scaled = nn.Linear(2, 2)
    scaled.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="0-d parameters cannot be sharded"):
        fully_shard(scaled, mesh=mesh)
