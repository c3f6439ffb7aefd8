"""User journeys, fourth set: programs a demanding PyTorch user writes with features merged on 2026-11-26
(replayed random draws under torch's composable checkpoint with fully_shard and tensor parallelism,
pipeline stages on slices of an 8-rank world, HSDP gathers, CommDebugMode over direct collectives,
0-d tensor operands in a training loop, to_local(grad_placements=...) weights under an optimizer).
Each compares with the single-device program, and where useful with torch's own DTensor/FSDP2 names
on the same ranks."""

import functools
import itertools

import torch
import torch.distributed as dist
from helpers import documented_random
from spmd import spmd
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint

import shardtensor
from shardtensor import DTensor, Replicate
from shardtensor.fsdp import fully_shard
from shardtensor.mesh import DeviceMesh
from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardtensor.random import checkpoint_contexts

SEED, STEPS, LEARNING_RATE = 7, 2, 0.1
WIDTH, HIDDEN, BATCH = 6, 8, 8


def _assert_close(ours, expected, what):
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=lambda message: f"{what}: {message}")


def _full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# --- 1. activation checkpointing of blocks with dropout, with fully_shard and tensor parallelism ---------------

class _Block(nn.Module):
    """A transformer-MLP stand-in: up, relu, dropout on the hidden activations, down, dropout, residual."""

    def __init__(self, dropout=nn.functional.dropout):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, dtype=torch.float64)
        self.down = nn.Linear(HIDDEN, WIDTH, dtype=torch.float64)
        self.dropout = dropout

    def forward(self, x):
        return x + self.dropout(self.down(self.dropout(self.up(x).relu(), 0.5)), 0.25)


def _blocks(dropout=nn.functional.dropout) -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(*(_Block(dropout) for _ in range(2)))


def _documented_dropout(counters):
    """Dropout on one device whose masks are those of shardtensor's random calls `next(counters)`."""
    def dropout(h, p):
        mask = documented_random("rand", h.shape, seed=SEED, counter=next(counters)) < 1 - p
        return h * mask / (1 - p)
    return dropout


def _reference_tp_steps(batch, halves):
    """One device: every step, each of the `halves` data-parallel slices of `batch` runs the model with the
    same dropout masks (each dp rank's tp DTensors take the same random calls), the loss the mean over
    slices of each slice's sum of squares (fully_shard averages the gradients); (losses per slice, params)."""
    draws_per_step = 4
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for piece in batch.chunk(halves):
            counters = itertools.count(step * draws_per_step)
            for block in model:
                block.dropout = _documented_dropout(counters)
            output = model(piece)
            step_losses.append((output * output).sum())
        (sum(step_losses) / halves).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach() for loss in step_losses]))
    return losses, [parameter.detach() for parameter in model.parameters()]


def _checkpoint_then_shard(model, tp_mesh, dp_mesh, order):
    plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(use_local_output=False)}
    for block in model:
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, plan)
        if order == "checkpoint first":
            composable_checkpoint(block, context_fn=checkpoint_contexts)
            fully_shard(block, mesh=dp_mesh)
        else:
            fully_shard(block, mesh=dp_mesh)
            composable_checkpoint(block, context_fn=checkpoint_contexts)
    fully_shard(model, mesh=dp_mesh)


def _named(mesh, names):
    return DeviceMesh("cpu", mesh.mesh, mesh_dim_names=names)


@spmd(meshes=[(2, 2), (1, 2), (2, 1)], timeout=180.0)
def test_checkpointed_dropout_blocks_with_fully_shard_and_tensor_parallel_train_as_one_device(mesh):
    """fully_shard over "dp" of blocks parallelized over "tp" (Colwise up, Rowwise down, DTensor activations),
    each block under torch's composable checkpoint with checkpoint_contexts (applied before or after
    fully_shard): two SGD steps give each dp slice's loss and the parameters of one device."""
    mesh = _named(mesh, ("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    dp_size, dp_rank = mesh.size(0), mesh.get_local_rank("dp")
    torch.manual_seed(12)
    batch = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    expected_losses, expected_parameters = _reference_tp_steps(batch, dp_size)
    for order in ("checkpoint first", "fully_shard first"):
        model = _blocks()
        _checkpoint_then_shard(model, tp_mesh, dp_mesh, order)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        shardtensor.manual_seed(SEED)
        x = DTensor.from_local(batch.chunk(dp_size)[dp_rank], tp_mesh, [Replicate()])
        for step in range(STEPS):
            output = model(x)
            loss = (output * output).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            _assert_close(loss.full_tensor(), expected_losses[step][dp_rank], f"{order}, loss of step {step}")
        for (name, parameter), expected in zip(model.named_parameters(), expected_parameters):
            _assert_close(parameter.full_tensor(), expected, f"{order}, {name}")


def _reference_plain_dropout_steps(batch, ranks):
    """One device, fully_shard over `ranks` with plain-tensor dropout: slice r's masks come from torch's
    generator as rank r holds it (seeded SEED + r, advanced by its own draws only)."""
    model = _blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    states = []
    for rank in range(ranks):
        torch.manual_seed(SEED + rank)
        states.append(torch.get_rng_state())
    losses = []
    for _ in range(STEPS):
        step_losses = []
        for rank, piece in enumerate(batch.chunk(ranks)):
            torch.set_rng_state(states[rank])
            output = model(piece)
            states[rank] = torch.get_rng_state()
            step_losses.append((output * output).sum())
        (sum(step_losses) / ranks).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack([loss.detach() for loss in step_losses]))
    return losses, [parameter.detach() for parameter in model.parameters()]


@spmd(meshes=[(2,), (4,)], timeout=180.0)
def test_checkpointed_plain_dropout_blocks_with_fully_shard_train_as_one_device(mesh):
    """fully_shard alone (plain activations, dropout from torch's generator, preserved by torch's
    checkpoint), each block under the composable checkpoint with checkpoint_contexts."""
    torch.manual_seed(12)
    batch = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    expected_losses, expected_parameters = _reference_plain_dropout_steps(batch, mesh.size(0))
    rank = mesh.get_local_rank(0)
    for order in ("checkpoint first", "fully_shard first"):
        model = _blocks()
        _checkpoint_then_shard(model, None, mesh, order)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        torch.manual_seed(SEED + rank)
        for step in range(STEPS):
            output = model(batch.chunk(mesh.size(0))[rank])
            loss = (output * output).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            _assert_close(loss, expected_losses[step][rank], f"{order}, loss of step {step}")
        for (name, parameter), expected in zip(model.named_parameters(), expected_parameters):
            _assert_close(parameter.full_tensor(), expected, f"{order}, {name}")
