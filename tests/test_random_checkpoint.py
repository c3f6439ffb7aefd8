"""Activation checkpointing with random DTensors: `shardtensor.random.checkpoint`'s recomputation draws
what the forward drew (the gradients of the program without checkpointing, and of one device), and a
plain `torch.utils.checkpoint.checkpoint` whose recomputation would draw other numbers raises."""

import pytest
import torch
import torch.nn.functional as F
from helpers import documented_random
from spmd import spmd
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import shardtensor
from shardtensor import DeviceMesh, Replicate, Shard, distribute_tensor
from shardtensor.random import checkpoint

SHAPE = (8, 6)
SEED = 5


def _no_checkpoint(function, *args, use_reentrant):
    return function(*args)


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


def _run(mesh, placements, program):
    """(output, x.grad, w.grad) as full tensors, and the values of the random call after the step."""
    shardtensor.manual_seed(SEED)
    torch.manual_seed(0)
    x_full, w_full = torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64)
    x = distribute_tensor(x_full, mesh, placements).requires_grad_()
    w = distribute_tensor(w_full, mesh, placements).requires_grad_()
    output = program(x, w)
    (output * output).sum().backward()
    after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
    return [output.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()], after, (x_full, w_full)


def _placement_lists(mesh):
    return [[Shard(0)] + [Shard(1)] * (mesh.ndim - 1), [Replicate()] * mesh.ndim]


@spmd()
def test_checkpoint_recomputes_the_forward_draws(mesh):
    for placements in _placement_lists(mesh):
        for nested in (False, True):
            for use_reentrant in (False, True):
                note = (placements, nested, use_reentrant)
                without = _program(_no_checkpoint, nested, use_reentrant)
                plain, plain_after, (x_full, w_full) = _run(mesh, placements, without)
                checkpointed, after, _ = _run(mesh, placements, _program(checkpoint, nested, use_reentrant))
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


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_plain_torch_checkpoint_raises_instead_of_drawing_another_mask(mesh):
    placements = _placement_lists(mesh)[0]
    for use_reentrant in (False, True):
        shardtensor.manual_seed(SEED)
        x = distribute_tensor(torch.randn(SHAPE), mesh, placements).requires_grad_()
        output = torch_checkpoint(lambda x: F.dropout(x, 0.5), x, use_reentrant=use_reentrant)
        with pytest.raises(RuntimeError, match=r"ran during backward(.|\n)*shardtensor\.random\.checkpoint"):
            output.sum().backward()
        # the failed recomputation took no number: the next call is call 1
        after = shardtensor.rand(*SHAPE, device_mesh=mesh, dtype=torch.float64).full_tensor()
        assert torch.equal(after, documented_random("rand", SHAPE, seed=SEED, counter=1)), use_reentrant
        # a plain checkpoint without random ops, between random ops, is fine
        x.grad = None
        output = F.dropout(torch_checkpoint(torch.tanh, F.dropout(x, 0.5), use_reentrant=use_reentrant), 0.5)
        output.sum().backward()
        assert torch.equal(x.grad.full_tensor() != 0, output.full_tensor() != 0), use_reentrant


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
def test_torch_checkpoint_wrapper_with_our_checkpoint_function(mesh):
    plain, _, _ = _run(mesh, [Shard(0)], _Block())
    for use_reentrant in (False, True):
        wrapped = checkpoint_wrapper(_Block(), checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint,
                                     use_reentrant=use_reentrant)
        checkpointed, _, _ = _run(mesh, [Shard(0)], wrapped)
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(checkpointed, plain)), use_reentrant


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
