"""Programs written as PyTorch's tutorials and torchtitan write them, with shardtensor's imports, that
the unit tests of each piece missed: each trains like one device with exactly the collectives it needs.

Activation checkpointing with fully_shard: torchtitan wraps each block in `checkpoint_wrapper` before
`fully_shard`; others call `torch.utils.checkpoint.checkpoint` on a sharded module, or on a region
holding several units. The recomputation runs a forward inside backward: the gathered parameters must
be the ones it sees, and it must neither reshard them before backward reads them nor gather again.

A penalty on sharded parameters added to a data-parallel loss: the loss is this rank's plain scalar,
the penalty a DTensor, so the sum is a DTensor and its gradient must reach the plain graph that made
the loss as this rank's plain tensor (ops there save rank-local tensors, such as token ids); a plain
0-d parameter (a learnable temperature) mixed with DTensors gets a plain gradient.
"""

import copy

import pytest
import torch
from spmd import spmd
from test_fsdp import Model, _assert_same_parameters, _batches, _kinds, _local_batch, _loss, _model, _train_reference
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from shardtensor import comm
from shardtensor.fsdp import fully_shard
from shardtensor.parallel import ColwiseParallel, parallelize_module


class _CheckpointedBlocks(Model):
    """test_fsdp's Model with each block's forward recomputed in backward."""

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _checkpointed_and_sharded(where: str, mesh, reshard_after_forward: bool):
    """The single-device model's values, checkpointed and sharded `where` says; its gathers per step."""
    if where == "checkpoint_wrapper":  # torchtitan: wrapper inside the unit, recomputing without FSDP hooks
        model = _model()
        model.blocks = torch.nn.ModuleList(
            checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for block in model.blocks
        )
        units = list(model.blocks)
    else:
        model = _CheckpointedBlocks().to(torch.float64)
        model.load_state_dict(_model().state_dict())
        if where == "around_a_unit":  # the unit's own hooks run again in the recomputation
            units = list(model.blocks)
        else:  # "around_two_units": their forwards recomputed before their backward starts
            units = [linear for block in model.blocks for linear in (block.up, block.down)]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    # Forward gathers every unit and the root once; backward gathers again the units resharded after forward.
    gathers = (len(units) + 1, len(units) if reshard_after_forward else 0)
    return model, gathers


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("where", ["checkpoint_wrapper", "around_a_unit", "around_two_units"])
@spmd(meshes=[(2,)])
def test_activation_checkpointing_with_fully_shard_trains_like_one_device(mesh, where, reshard_after_forward):
    rank, ranks = mesh.get_rank(), mesh.size()
    model, (forward_gathers, backward_gathers) = _checkpointed_and_sharded(where, mesh, reshard_after_forward)
    reference = _train_reference(_model(), _batches(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reduce_scatters = forward_gathers  # one per unit, the root included
    for inputs, target in _batches(2):
        with comm.observe() as forward:
            loss = _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks))
        with comm.observe() as backward:
            loss.backward()
        assert _kinds(forward) == {"all_gather": forward_gathers}, _kinds(forward)
        expected = {"all_gather": backward_gathers, "reduce_scatter": reduce_scatters}
        if not backward_gathers:
            del expected["all_gather"]
        assert _kinds(backward) == expected, _kinds(backward)
        optimizer.step()
        optimizer.zero_grad()
    _assert_same_parameters(model, reference)


class _Tagger(nn.Module):
    """Token embedding (11 rows: 6 and 5 over 2 ranks) and a linear head."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 6, dtype=torch.float64)
        self.head = nn.Linear(6, 5, dtype=torch.float64)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def _penalized_loss(model, tokens, targets):
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    return loss + 0.01 * sum(parameter.pow(2).sum() for parameter in model.parameters())


@spmd(meshes=[(2,)])
def test_a_penalty_on_sharded_parameters_added_to_the_loss_trains_like_one_device(mesh):
    rank, ranks = mesh.get_rank(), mesh.size()
    torch.manual_seed(0)
    reference = _Tagger()
    model = fully_shard(copy.deepcopy(reference), mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens, targets = torch.randint(0, 11, (4, 3), generator=generator), torch.randint(0, 5, (4, 3), generator=generator)
        _penalized_loss(model, tokens.chunk(ranks)[rank], targets.chunk(ranks)[rank]).backward()
        _penalized_loss(reference, tokens, targets).backward()
        for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert_close(parameter.grad.full_tensor(), expected.grad, msg=lambda message, name=name: f"{name}: {message}")
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    _assert_same_parameters(model, reference)


class _TemperatureHead(nn.Module):
    """A tensor-parallel head divided by a learnable 0-d temperature that stays a plain parameter."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 6, dtype=torch.float64)
        self.temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        return (self.head(x) / self.temperature).pow(2).sum()


@spmd(meshes=[(2,)])
def test_a_plain_scalar_parameter_mixed_with_dtensors_gets_its_plain_gradient(mesh):
    torch.manual_seed(0)
    reference = _TemperatureHead()
    model = parallelize_module(copy.deepcopy(reference), mesh, {"head": ColwiseParallel(use_local_output=False)})
    inputs = torch.randn(3, 4, dtype=torch.float64)
    model(inputs).backward()
    reference(inputs).backward()
    assert type(model.temperature.grad) is torch.Tensor  # not a DTensor in a plain parameter's .grad
    assert_close(model.temperature.grad, reference.temperature.grad)
    assert_close(model.head.weight.grad.full_tensor(), reference.head.weight.grad)


@spmd(meshes=[(2,)])
def test_a_plain_scalar_next_to_dtensors_nested_in_a_tuple_runs_as_before(mesh):
    """Only DTensors nested in an argument (`index_put(s, (index,), values)`): the plain one-element
    tensor is read as Replicate by the dispatcher (it raised a bare StopIteration)."""
    from shardtensor import Replicate, distribute_tensor

    plain = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)[:1]
    index = distribute_tensor(torch.tensor([0]), mesh, [Replicate()])
    values = torch.tensor([5.0], dtype=torch.float64)
    output = torch.index_put(plain, (index,), values)
    assert output.placements == (Replicate(),)
    assert_close(output.full_tensor(), torch.index_put(plain.detach(), (torch.tensor([0]),), values))
