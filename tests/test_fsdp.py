"""fully_shard: training equals single-device training; one all-gather / reduce-scatter per unit, counted."""

import copy

import torch
from spmd import spmd
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm
from shardtensor.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from shardtensor.mesh import DeviceMesh

BATCH = 8


class Block(nn.Module):
    """30 hidden rows: uneven over 4 ranks (8, 8, 8, 6)."""

    def __init__(self, width: int = 12, hidden: int = 30):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Model(nn.Module):
    """Input projection, two blocks, a 7-row head (uneven over 4 ranks: 2, 2, 2, 1)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 7)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(dtype=torch.float64) -> Model:
    torch.manual_seed(0)
    return Model().to(dtype)


def _batches(steps: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, generator=generator, dtype=dtype), torch.randn(BATCH, 7, generator=generator, dtype=dtype))
            for _ in range(steps)]


def _local_batch(tensor: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    return tensor.chunk(ranks)[rank]


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _shard(model: Model, mesh, nested: bool = True, **options) -> Model:
    if nested:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def _data_parallel_rank(mesh) -> tuple[int, int]:
    return mesh.get_rank(), mesh.size()


def _train_reference(model, batches):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        _loss(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _train_sharded(model, batches, rank, ranks):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for inputs, target in batches:
        _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _assert_same_parameters(sharded, reference):
    for (name, parameter), (_, expected) in zip(sharded.named_parameters(), reference.named_parameters(), strict=True):
        assert isinstance(parameter, DTensor), name
        assert_close(parameter.full_tensor(), expected.detach(), msg=name)


@spmd(meshes=[(1,), (2,), (4,)])
def test_training_equals_single_device_with_uneven_rows(mesh):
    batches = _batches(3)
    reference = _train_reference(_model(), batches)
    sharded = _shard(_model(), mesh)
    rank, ranks = _data_parallel_rank(mesh)
    _train_sharded(sharded, batches, rank, ranks)
    _assert_same_parameters(sharded, reference)


@spmd(meshes=[(4,)])
def test_parameters_are_exact_uneven_shards_without_padding(mesh):
    model = _shard(_model(), mesh)
    rank = mesh.get_rank()
    head = model.head.weight
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    assert type(model).__mro__[1] is FSDPModule and isinstance(head, nn.Parameter)
    assert head.placements == (Shard(0),) and head.shape == (7, 12)
    assert head.to_local().shape == ([2, 2, 2, 1][rank], 12)
    up = model.blocks[0].up.weight
    assert up.to_local().shape == ([8, 8, 8, 6][rank], 12)
    assert up.to_local().untyped_storage().nbytes() == up.to_local().numel() * 8  # no padding bytes held
    assert_close(up.full_tensor(), _model().blocks[0].up.weight.detach())


def _kinds(records):
    counts = {}
    for record in records:
        counts[record.kind] = counts.get(record.kind, 0) + 1
    return counts


def _step_records(model, inputs, target):
    """The collectives of forward, backward and optimizer step, each observed on its own."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with comm.observe() as forward:
        loss = _loss(model(inputs), target)
    with comm.observe() as backward:
        loss.backward()
    with comm.observe() as step:
        optimizer.step()
        optimizer.zero_grad()
    return _kinds(forward), _kinds(backward), _kinds(step)


@spmd(meshes=[(2,), (4,)])
def test_one_all_gather_per_unit_forward_and_one_reduce_scatter_per_unit_backward(mesh):
    rank, ranks = _data_parallel_rank(mesh)
    inputs, target = (_local_batch(tensor, rank, ranks) for tensor in _batches(1)[0])
    for reshard_after_forward, backward_gathers in ((None, 2), (True, 3), (False, 0)):
        model = _shard(_model(), mesh, reshard_after_forward=reshard_after_forward)
        for _ in range(2):  # the second step runs with prefetching from the recorded order
            forward, backward, step = _step_records(model, inputs, target)
            assert forward == {"all_gather": 3}, forward
            assert backward == ({"all_gather": backward_gathers, "reduce_scatter": 3} if backward_gathers
                                else {"reduce_scatter": 3}), backward
            assert step == {}, step
