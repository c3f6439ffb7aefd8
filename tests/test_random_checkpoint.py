"""Activation checkpointing with random DTensors: `shardtensor.random.checkpoint`'s recomputation, and that
of torch's checkpoints (composable `checkpoint(module)`, `torch.utils.checkpoint.checkpoint`,
`checkpoint_wrapper`) given `context_fn=shardtensor.random.checkpoint_contexts`, draws what the forward
drew (the gradients of the program without checkpointing, and of one device); a plain torch checkpoint
whose recomputation would draw other numbers raises, naming what to use instead."""

import functools
import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import documented_random
from spmd import spmd
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import shardtensor
from shardtensor import DeviceMesh, Replicate, Shard, distribute_tensor
from shardtensor.random import checkpoint, checkpoint_contexts

SHAPE = (8, 6)
SEED = 5


def _no_checkpoint(function, *args, use_reentrant):
    return function(*args)


class _Function(torch.nn.Module):
    """`function` as a module, for the checkpoints that wrap modules."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *args):
        return self.function(*args)


def _composable(function, *args, use_reentrant, **kwargs):
    """torch's composable `checkpoint(module)` around `function` (it has no reentrant mode)."""
    assert not use_reentrant
    return composable_checkpoint(_Function(function), **kwargs)(*args)


# Checkpoints whose recomputation replays our draws, and the use_reentrant modes each takes.
REPLAYING_CHECKPOINTS = {
    "shardtensor.random.checkpoint": (checkpoint, (False, True)),
    "composable checkpoint(module, context_fn=checkpoint_contexts)": (
        functools.partial(_composable, context_fn=checkpoint_contexts), (False,)),
    "torch checkpoint(context_fn=checkpoint_contexts)": (
        functools.partial(torch_checkpoint, context_fn=checkpoint_contexts), (False,)),
}


def _block(x, w):
    """Three random calls: dropout, rand_like, dropout."""
    h = F.dropout(x * w, 0.5)
    h = h.tanh() * torch.rand_like(h)
    return F.dropout(h, 0.25)


def _program(checkpoint_function, nested: bool, use_reentrant: bool):
    """`_block`, checkpointed; `nested`: inside a checkpointed region with a dropout before and after it."""
    if not nested:
        return lambda x, w: checkpoint_function(_block, x, w, use_reentrant=use_reentrant)

    def outer(x, w):
        h = F.dropout(x, 0.5)
        h = checkpoint_function(_block, h, w, use_reentrant=use_reentrant)
        return F.dropout(h, 0.5) + x

    return lambda x, w: checkpoint_function(outer, x, w, use_reentrant=use_reentrant)


def _reference(x, w, nested: bool):
    """The program on one device, with the masks and values random calls 0, 1, ... after manual_seed(SEED) draw."""
    draws = iter(documented_random("rand", SHAPE, seed=SEED, counter=counter) for counter in range(5))
    if nested:
        h = x * (next(draws) < 0.5) * 2.0
    else:
        h = x
    h = h * w * (next(draws) < 0.5) * 2.0
    h = h.tanh() * next(draws)
    h = h * (next(draws) < 0.75) * (1 / 0.75)
    return h * (next(draws) < 0.5) * 2.0 + x if nested else h


def _run(mesh, placements, program, backwards=1):
    """(output, x.grad, w.grad) as full tensors after `backwards` backwards through the graph, and the
    values of the random call after the step."""
    shardtensor.manual_seed(SEED)
    torch.manual_seed(0)
    x_full, w_full = torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64)
    x = distribute_tensor(x_full, mesh, placements).requires_grad_()
    w = distribute_tensor(w_full, mesh, placements).requires_grad_()
    output = program(x, w)
    loss = (output * output).sum()
    for _ in range(backwards):
        loss.backward(retain_graph=True)
    after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
    return [output.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()], after, (x_full, w_full)


def _placement_lists(mesh):
    return [[Shard(0)] + [Shard(1)] * (mesh.ndim - 1), [Replicate()] * mesh.ndim]


def _checkpoints_and_modes():
    return [(item, mode) for item in REPLAYING_CHECKPOINTS.items() for mode in item[1][1]]


@spmd()
def test_checkpoint_recomputes_the_forward_draws(mesh):
    for placements in _placement_lists(mesh):
        for nested in (False, True):
            for (name, (checkpoint_function, _)), use_reentrant in _checkpoints_and_modes():
                note = (placements, nested, name, use_reentrant)
                without = _program(_no_checkpoint, nested, use_reentrant)
                plain, plain_after, (x_full, w_full) = _run(mesh, placements, without)
                checkpointed, after, _ = _run(mesh, placements, _program(checkpoint_function, nested, use_reentrant))
                assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain)), note
                # the recomputation leaves the counter where the forward left it
                calls = 5 if nested else 3
                assert torch.equal(after, plain_after), note
                assert torch.equal(after, documented_random("rand", SHAPE, seed=SEED, counter=calls)), note
                x, w = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
                expected = _reference(x, w, nested)
                (expected * expected).sum().backward()
                for ours, reference in zip(checkpointed, [expected, x.grad, w.grad]):
                    torch.testing.assert_close(ours, reference.detach(), rtol=1e-12, atol=1e-12, msg=str(note))


# torch's checkpoints without our context_fn: their recomputation would draw other numbers.
PLAIN_CHECKPOINTS = {
    "torch checkpoint, use_reentrant=False": functools.partial(torch_checkpoint, use_reentrant=False),
    "torch checkpoint, use_reentrant=True": functools.partial(torch_checkpoint, use_reentrant=True),
    "composable checkpoint(module)": functools.partial(_composable, use_reentrant=False),
}
WHAT_TO_USE = ("ran during backward(.|\n)*" + re.escape(
    "Pass context_fn=shardtensor.random.checkpoint_contexts to checkpoint(module, ...), to "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or to checkpoint_wrapper") + "(.|\n)*" + re.escape(
    "shardtensor.random.checkpoint(function, *args, use_reentrant=..., ...)"))


@spmd()
def test_plain_torch_checkpoint_raises_instead_of_drawing_another_mask(mesh):
    """On every rank, the message names what to use instead, for each of torch's checkpoints."""
    placements = _placement_lists(mesh)[0]
    for name, plain_checkpoint in PLAIN_CHECKPOINTS.items():
        shardtensor.manual_seed(SEED)
        x = distribute_tensor(torch.randn(SHAPE), mesh, placements).requires_grad_()
        output = plain_checkpoint(lambda x: F.dropout(x, 0.5), x)
        with pytest.raises(RuntimeError, match=WHAT_TO_USE):
            output.sum().backward()
        # the failed recomputation took no number: the next call is call 1
        after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
        assert torch.equal(after, documented_random("rand", SHAPE, seed=SEED, counter=1)), name
        # a plain checkpoint without random ops, between random ops, is fine
        x.grad = None
        output = F.dropout(plain_checkpoint(torch.tanh, F.dropout(x, 0.5)), 0.5)
        output.sum().backward()
        assert torch.equal(x.grad.full_tensor() != 0, output.full_tensor() != 0), name


@spmd(meshes=[(2,), (2, 2)])
def test_recomputation_uses_the_forward_s_seed(mesh):
    """Without manual_seed, the seed drawn by the forward's first random call; after a manual_seed between
    forward and backward, still the forward's, and the new seed's counter is left as it was."""
    for use_reentrant in (False, True):
        shardtensor.random._seed = None
        torch.manual_seed(torch.distributed.get_rank())  # the seed comes from rank 0, whatever the others hold
        x = distribute_tensor(torch.ones(SHAPE), mesh, [Shard(0)] * mesh.ndim).requires_grad_()
        output = checkpoint(lambda x: F.dropout(x, 0.5), x, use_reentrant=use_reentrant)
        shardtensor.manual_seed(SEED + 1)
        output.sum().backward()
        assert torch.equal(x.grad.full_tensor(), output.full_tensor()), use_reentrant
        after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
        assert torch.equal(after, documented_random("rand", SHAPE, seed=SEED + 1, counter=0)), use_reentrant


@spmd(meshes=[(4,)])
def test_ranks_outside_a_sub_mesh_and_the_replicate_fallback_replay_too(mesh):
    """A dropout on a sub-mesh (ranks 0 and 2 take its number without drawing) and poisson (computed whole
    on every rank, torch's generator seeded from the counter) inside the region: the recomputation
    draws what the forward drew on every rank, and the world stays in step."""
    sub_mesh = DeviceMesh("cpu", [1, 3])
    sub = distribute_tensor(torch.ones(SHAPE, dtype=torch.float64), sub_mesh, [Shard(0)])

    def region(x, w):
        F.dropout(sub, 0.5)
        return F.dropout(x * w, 0.5) * torch.poisson(torch.full_like(x, 2.0))

    for use_reentrant in (False, True):
        def checkpointed_region(x, w):
            return checkpoint(region, x, w, use_reentrant=use_reentrant)

        plain, plain_after, _ = _run(mesh, [Shard(0)], region)
        checkpointed, after, _ = _run(mesh, [Shard(0)], checkpointed_region)
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain)), use_reentrant
        assert torch.equal(after, plain_after)
        assert torch.equal(after, documented_random("rand", SHAPE, seed=SEED, counter=3)), use_reentrant


class _Block(torch.nn.Module):
    def forward(self, x, w):
        return _block(x, w)


@spmd(meshes=[(2,)])
def test_torch_checkpoint_wrapper_with_our_checkpoint_function_or_context_fn(mesh):
    plain, _, _ = _run(mesh, [Shard(0)], _Block())
    for use_reentrant in (False, True):
        wrapped = checkpoint_wrapper(_Block(), checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint,
                                     use_reentrant=use_reentrant)
        checkpointed, _, _ = _run(mesh, [Shard(0)], wrapped)
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain)), use_reentrant
    wrapped = checkpoint_wrapper(_Block(), checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=checkpoint_contexts)
    checkpointed, _, _ = _run(mesh, [Shard(0)], wrapped)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain))


@spmd(meshes=[(2,), (2, 2)])
def test_a_draw_that_belongs_in_backward_runs_inside_draws_in_backward(mesh):
    """Noise added to a gradient in a hook is drawn in backward on purpose: refused as a likely
    checkpoint recomputation, allowed inside `draws_in_backward`, where it takes the next counter value."""
    placements = _placement_lists(mesh)[0]
    shardtensor.manual_seed(SEED)
    x = distribute_tensor(torch.randn(SHAPE, dtype=torch.float64), mesh, placements).requires_grad_()
    x.register_hook(lambda grad: grad + torch.rand_like(grad))
    with pytest.raises(RuntimeError, match="draws_in_backward"):
        (x * 2).sum().backward()
    x.grad = None
    with shardtensor.random.draws_in_backward():
        (x * 2).sum().backward()
    noise = documented_random("rand", SHAPE, seed=SEED, counter=0)
    assert torch.equal(x.grad.full_tensor(), 2 + noise)


class _Scale(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return (x * self.weight).tanh()


def _sequential(mesh, placements):
    """Scale, dropout, scale, dropout, rand_like noise: five functions, three random calls."""
    torch.manual_seed(1)
    weights = [distribute_tensor(torch.randn(SHAPE, dtype=torch.float64), mesh, placements) for _ in range(2)]
    return torch.nn.Sequential(_Scale(weights[0]), torch.nn.Dropout(0.5), _Scale(weights[1]), torch.nn.Dropout(0.25),
                               _Noise())


class _Noise(torch.nn.Module):
    def forward(self, x):
        return x * torch.rand_like(x)


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_checkpoint_sequential_replays_each_segment_s_draws(mesh):
    """`shardtensor.random.checkpoint_sequential` cuts the model as torch does and checkpoints every
    segment but the last with `checkpoint`: output, input and weight gradients equal the program
    without checkpointing, for 1 to 5 segments and both modes; torch's own raises in backward."""
    from shardtensor.random import checkpoint_sequential

    placements = _placement_lists(mesh)[0]

    def run(forward):
        shardtensor.manual_seed(SEED)
        model = _sequential(mesh, placements)
        torch.manual_seed(2)
        x = distribute_tensor(torch.randn(SHAPE, dtype=torch.float64), mesh, placements).requires_grad_()
        output = forward(model, x)
        (output * output).sum().backward()
        after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
        return [output.full_tensor(), x.grad.full_tensor(), *(p.grad.full_tensor() for p in model.parameters())], after

    plain, plain_after = run(lambda model, x: model(x))
    assert torch.equal(plain_after, documented_random("rand", SHAPE, seed=SEED, counter=3))
    for segments in range(1, 6):
        for use_reentrant in (False, True):
            checkpointed, after = run(lambda model, x: checkpoint_sequential(model, segments, x, use_reentrant=use_reentrant))
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain)), (segments, use_reentrant)
            assert torch.equal(after, plain_after), (segments, use_reentrant)
    with pytest.raises(ValueError, match="segments must be between 1 and the number of functions \\(5\\), got 6"):
        checkpoint_sequential(_sequential(mesh, placements), 6, distribute_tensor(torch.ones(SHAPE), mesh, placements))
    with pytest.raises(RuntimeError, match="shardtensor.random.checkpoint_sequential"):
        run(lambda model, x: torch.utils.checkpoint.checkpoint_sequential(model, 2, x, use_reentrant=False))


LAYERS, STEPS, LEARNING_RATE = 3, 2, 0.1


def _train_steps(model, x):
    """The losses of `STEPS` SGD steps of `model` on `x`, the loss the sum of squares of its output."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for _ in range(STEPS):
        output = model(x)
        loss = (output * output).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


class _Layer(torch.nn.Module):
    """A transformer-block stand-in with three random calls: dropout, randn_like, normal_."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.dropout = torch.nn.Dropout(0.25)

    def forward(self, x):
        h = self.dropout((x * self.weight).tanh())
        h = h + 0.1 * torch.randn_like(h)
        return h * torch.empty_like(h).normal_(1.0, 0.5)


class _ReferenceLayer(_Layer):
    """`_Layer` on one device, its random calls' values those documented (`_documented_draws`)."""

    def __init__(self, weight, draw):
        super().__init__(weight)
        self.draw = draw

    def forward(self, x):
        h = (x * self.weight).tanh() * (self.draw("rand") < 0.75) * (1 / 0.75)
        h = h + 0.1 * self.draw("randn")
        return h * self.draw("normal_", parameters=(1.0, 0.5))


def _save_tanh(context, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_every_layer(model, **kwargs):
    for layer in model:
        composable_checkpoint(layer, **kwargs)


# How a model of `_Layer`s is checkpointed, torchtitan style: every block, or the model too (nested).
MODEL_CHECKPOINTS = {
    "none": lambda model: None,
    "composable, every layer": lambda model: _checkpoint_every_layer(model, context_fn=checkpoint_contexts),
    "composable, every layer and the model": lambda model: (
        _checkpoint_every_layer(model, context_fn=checkpoint_contexts),
        composable_checkpoint(model, context_fn=checkpoint_contexts)),
    "composable, selective (tanh saved)": lambda model: _checkpoint_every_layer(model, context_fn=functools.partial(
        checkpoint_contexts, functools.partial(create_selective_checkpoint_contexts, _save_tanh))),
}
def _documented_draws():
    """`draw(kind, shape, parameters)`: the values of random call 0, 1, ... after `manual_seed(SEED)`."""
    counters = itertools.count()

    def draw(kind, shape=SHAPE, parameters=()):
        return documented_random(kind, shape, seed=SEED, counter=next(counters), parameters=parameters)

    return draw


@spmd()
def test_composable_checkpoint_with_our_context_fn_trains_as_one_device(mesh):
    """torch's composable `checkpoint(module, context_fn=shardtensor.random.checkpoint_contexts)` on every
    block (nested in a checkpointed model, or combined with selective checkpointing): the losses and
    parameters of two SGD steps equal the run without checkpointing exactly and the single-device run."""
    placements = _placement_lists(mesh)[0]
    torch.manual_seed(3)
    x_full = torch.randn(SHAPE, dtype=torch.float64)
    weights_full = [torch.randn(SHAPE, dtype=torch.float64) for _ in range(LAYERS)]
    draw = _documented_draws()
    reference_model = torch.nn.Sequential(*(_ReferenceLayer(weight.clone(), draw) for weight in weights_full))
    reference = _train_steps(reference_model, x_full)
    reference += [parameter.detach() for parameter in reference_model.parameters()]
    x = distribute_tensor(x_full, mesh, placements)
    runs = {}
    for name, apply_checkpoint in MODEL_CHECKPOINTS.items():
        shardtensor.manual_seed(SEED)
        model = torch.nn.Sequential(*(_Layer(distribute_tensor(weight, mesh, placements)) for weight in weights_full))
        apply_checkpoint(model)
        losses = _train_steps(model, x)
        runs[name] = [tensor.full_tensor() for tensor in [*losses, *model.parameters()]]
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(runs[name], runs["none"])), name
        for ours, expected in zip(runs[name], reference):
            torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12, msg=name)


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_every_backward_through_a_region_recomputes_the_forward_draws(mesh):
    """A second backward through a retained graph recomputes each region again, from the same counter:
    the gradients are those of the program without checkpointing (torch's composable checkpoint cannot backward twice
    itself: its recomputation context `_no_hook` is entered once only, so torch's function checkpoint)."""
    placements = _placement_lists(mesh)[0]
    torch_with_our_contexts = REPLAYING_CHECKPOINTS["torch checkpoint(context_fn=checkpoint_contexts)"][0]
    for nested in (False, True):
        plain, plain_after, _ = _run(mesh, placements, _program(_no_checkpoint, nested, False), backwards=2)
        twice, after, _ = _run(mesh, placements, _program(torch_with_our_contexts, nested, False), backwards=2)
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(twice, plain)), nested
        assert torch.equal(after, plain_after), nested


class _MLPBlock(torch.nn.Module):
    """A tensor-parallel MLP block with dropout on its sharded hidden activations and on its output."""

    def __init__(self, dropout=torch.nn.functional.dropout):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 8, dtype=torch.float64), torch.nn.Linear(8, 6, dtype=torch.float64)
        self.dropout = dropout

    def forward(self, x):
        return x + self.dropout(self.down(self.dropout(self.up(x).relu(), 0.5)), 0.25)


@spmd(meshes=[(1,), (2,), (4,)])
def test_tensor_parallel_blocks_under_composable_checkpoint_train_as_one_device(mesh):
    """torchtitan's layout: ColwiseParallel/RowwiseParallel blocks keeping DTensor activations, each block
    under torch's composable `checkpoint(block, context_fn=checkpoint_contexts)`: two SGD steps give the
    single-device model's losses and parameters, its dropout masks those of the documented random calls."""
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    draw = _documented_draws()

    def documented_dropout(h, p):
        return h * (draw("rand", h.shape) < 1 - p) / (1 - p)

    torch.manual_seed(4)
    reference = torch.nn.Sequential(_MLPBlock(documented_dropout), _MLPBlock(documented_dropout))
    model = torch.nn.Sequential(_MLPBlock(), _MLPBlock())
    model.load_state_dict(reference.state_dict())
    plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel(use_local_output=False)}
    for block in model:
        parallelize_module(block, mesh, plan)
        composable_checkpoint(block, context_fn=checkpoint_contexts)
    x = torch.randn(5, 6, dtype=torch.float64)
    shardtensor.manual_seed(SEED)
    losses = _train_steps(model, distribute_tensor(x, mesh, [Replicate()]))
    for ours, expected in zip(losses, _train_steps(reference, x)):
        torch.testing.assert_close(ours.full_tensor(), expected, rtol=1e-12, atol=1e-12)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.full_tensor(), theirs.detach(), rtol=1e-12, atol=1e-12, msg=name)

