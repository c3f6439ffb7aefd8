"""Whole training steps: canonical programs written with plain torch ops issue exactly the collectives
their hand-written versions need, forward and backward counted separately; gradients come out in
their parameters' layouts; values and gradients equal the single-device step.

Meshes: 1-D (the mesh is the tensor-parallel dim) and 2x2 (mesh dim 1 tensor-parallel, mesh dim 0
data-parallel: batch-sharded inputs, Replicate parameters there). PyTorch's DTensor counts below
were measured with `torch.distributed.tensor.debug.CommDebugMode` on the same programs (torch
2.13, gloo; the transformer with attention written as softmax(q k^T) v, since torch has no CPU
rule for sdpa); a Partial gradient there is reduced later, one collective per parameter, by the
optimizer.
"""

import pytest
import torch
import training_programs as programs
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Replicate, Shard, distribute_tensor
from shardtensor.debug import CommDebugMode
from shardtensor.redistribute.executor import observe_plans

MESHES = [(1,), (2,), (2, 2)]

# program -> mesh shape -> (forward counts, backward counts) for ours (a 1-rank mesh issues none).
EXPECTED = {
    # Megatron MLP. 1-D: one all_reduce after W2 (at the loss's pow, which needs the reduced value)
    # and in backward one all_reduce of the two LayerNorm gradients together at the end. torch: 1 + 2
    # (pow's backward reduces its saved Partial input again). 2x2: the data-parallel gradients add one
    # all_reduce over mesh dim 0 (all of them in one buffer); torch reduce-scatters the loss over the
    # batch instead, then needs 2 reduce_scatters and 2 all_gathers in backward (1 + 4) and leaves
    # every gradient Partial on mesh dim 0 (6 more all_reduces in the optimizer).
    "megatron_mlp": {(2,): ({"all_reduce": 1}, {"all_reduce": 1}), (2, 2): ({"all_reduce": 1}, {"all_reduce": 2})},
    # Transformer block: one all_reduce after each row-parallel linear in forward, in backward one
    # before LayerNorm 2's backward and one at the end for LayerNorm 1's gradients (Megatron: 2 + 2).
    # torch: 2 + 4. 2x2 adds the data-parallel gradient reduction (ours 2 + 3, torch 3 + 9 with every
    # gradient Partial on mesh dim 0).
    "megatron_transformer": {(2,): ({"all_reduce": 2}, {"all_reduce": 2}), (2, 2): ({"all_reduce": 2}, {"all_reduce": 3})},
    # Data parallel: no forward communication, one all_reduce for all gradients (DDP's bucket).
    # torch: 0 + 0 with every gradient Partial: the optimizer then reduces each (6 all_reduces).
    "data_parallel_mlp": {(2,): ({}, {"all_reduce": 1}), (2, 2): ({}, {"all_reduce": 1})},
    # FSDP style: one all_gather per parameter, one reduce_scatter per parameter, both over the two
    # mesh dims at once on 2x2 (a [Shard(0), Shard(0)] parameter gathers in one collective over the
    # 4 ranks), where torch issues 12 all_gathers and 12 reduce_scatters, one per mesh dim.
    "fsdp_mlp": {(2,): ({"all_gather": 6}, {"reduce_scatter": 6}), (2, 2): ({"all_gather": 6}, {"reduce_scatter": 6})},
    # Sequence parallel: all_gather of the sequence before W1, reduce_scatter after W2; backward the
    # mirror pair and one all_reduce of the LayerNorm and b2 gradients (Partial over the sequence).
    # torch: 2 + 4 (three all_gathers) with those three gradients Partial (3 more all_reduces later).
    "sequence_parallel_mlp": {
        (2,): ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}),
        (2, 2): ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}),
    },
}


def _step(program, mesh):
    """Forward and backward of `program` on `mesh`, counted; returns (parameters, loss, counts)."""
    parameters, inputs = programs.distribute(program, shardtensor, mesh, tp_mesh_dim=mesh.ndim - 1)
    with shardtensor.strict_mode(), CommDebugMode() as forward:
        loss = programs.loss_of(program, parameters, inputs, shardtensor)
    with shardtensor.strict_mode(), CommDebugMode() as backward:
        loss.backward()
    return parameters, loss, (forward.get_comm_counts(), backward.get_comm_counts())


def _check_against_single_device(program, parameters, loss):
    reference_parameters, reference_inputs = programs.single_device(program)
    reference_loss = programs.loss_of(program, reference_parameters, reference_inputs)
    reference_loss.backward()
    assert_close(loss.full_tensor(), reference_loss.detach())
    for name, parameter in parameters.items():
        grad = parameter.grad
        assert grad.placements == parameter.placements, (name, grad.placements, parameter.placements)
        assert grad.sharding == parameter.sharding, name  # the leaf's shard sizes too
        assert grad.to_local().shape == parameter.to_local().shape, name
        assert_close(grad.full_tensor(), reference_parameters[name].grad, msg=name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@spmd(meshes=MESHES)
def test_canonical_program_issues_the_hand_written_collectives(mesh, name):
    program = getattr(programs, name)()
    for step in range(2):  # the second step runs from cached decisions and plans: the same counts
        parameters, loss, counts = _step(program, mesh)
        expected = ({}, {}) if mesh.size() == 1 else EXPECTED[name][tuple(mesh.shape)]
        assert counts == expected, (step, counts)
    _check_against_single_device(program, parameters, loss)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@spmd(meshes=[(1,), (2, 1)])
def test_moves_on_mesh_dims_of_size_one_run_no_plan(mesh, name):
    """On a mesh dim of size 1 every placement holds the whole value, so a move that changes only
    such mesh dims is a relabel: two steps accumulating gradients execute no redistribute plan that
    only relabels (none at all on one rank), and the gradients still lie like their parameters."""
    program = getattr(programs, name)()
    parameters, inputs = programs.distribute(program, shardtensor, mesh, tp_mesh_dim=mesh.ndim - 1)
    reference_parameters, reference_inputs = programs.single_device(program)
    with observe_plans() as executed:
        for _ in range(2):
            loss = programs.loss_of(program, parameters, inputs, shardtensor)
            loss.backward()
    reference_loss = None
    for _ in range(2):
        reference_loss = programs.loss_of(program, reference_parameters, reference_inputs)
        reference_loss.backward()
    assert [str(plan) for plan in executed if plan.relabels_only] == [], [str(plan) for plan in executed if plan.relabels_only]
    assert mesh.size() > 1 or executed == []
    assert_close(loss.full_tensor(), reference_loss.detach())
    for name, parameter in parameters.items():
        assert parameter.grad.sharding == parameter.sharding, name
        assert_close(parameter.grad.full_tensor(), reference_parameters[name].grad, msg=name)


@spmd(meshes=[(2,), (2, 2)])
def test_optimizer_step_after_backward_is_local_and_matches_single_device(mesh):
    """Gradients already lie like their parameters, so SGD issues no collective at all."""
    program = programs.megatron_mlp()
    parameters, _, _ = _step(program, mesh)
    reference_parameters, reference_inputs = programs.single_device(program)
    programs.loss_of(program, reference_parameters, reference_inputs).backward()
    for values, foreach in ((parameters, False), (reference_parameters, False)):
        optimizer = torch.optim.SGD(list(values.values()), lr=0.1, momentum=0.9, foreach=foreach)
        with CommDebugMode() as step:
            optimizer.step()
        assert step.get_total_counts() == 0
    for name, parameter in parameters.items():
        assert parameter.placements == parameter.grad.placements
        assert_close(parameter.full_tensor(), reference_parameters[name].detach(), msg=name)


@spmd(meshes=[(2,), (2, 2)])
def test_a_second_backward_accumulates_and_reduces_all_gradients_together(mesh):
    """Gradient accumulation without zeroing, data parallel: the second backward's Partial gradients
    are added to the reduced ones without a collective (`.grad` made a Partial operand again, on one
    rank) and reduced together at the end: one all_reduce per backward, like the first."""
    program = programs.data_parallel_mlp()
    parameters, inputs = programs.distribute(program, shardtensor, mesh, tp_mesh_dim=mesh.ndim - 1)
    reference_parameters, reference_inputs = programs.single_device(program)
    for _ in range(3):
        with CommDebugMode() as backward:
            programs.loss_of(program, parameters, inputs, shardtensor).backward()
        assert backward.get_comm_counts() == {"all_reduce": 1}
        programs.loss_of(program, reference_parameters, reference_inputs).backward()
    for name, parameter in parameters.items():
        assert parameter.grad.sharding == parameter.sharding, name
        assert_close(parameter.grad.full_tensor(), reference_parameters[name].grad, msg=name)


@spmd(meshes=[(2,), (2, 2)])
def test_partial_gradient_of_a_sharded_leaf_is_reduce_scattered_to_its_shard(mesh):
    """`x @ w` with the batch and `w` both sharded on dim 0: the rule gathers `w`, so `w`'s gradient
    is a full-size Partial on every rank; after backward it is `w`'s own shard."""
    x_full, w_full = torch.randn(8, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    placements = [Shard(0)] * mesh.ndim
    x = distribute_tensor(x_full, mesh, placements)
    w = distribute_tensor(w_full, mesh, placements).requires_grad_()
    reference = w_full.clone().requires_grad_()
    (x @ w).sum().backward()
    (x_full @ reference).sum().backward()
    assert w.grad.placements == w.placements and w.grad.sharding == w.sharding
    assert w.grad.to_local().shape == w.to_local().shape
    assert_close(w.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_a_reduced_partial_is_reused_until_it_is_written(mesh):
    """A Partial input reduced for one op is not reduced again for the next, unless written in between."""
    partial = shardtensor.DTensor.from_local(torch.arange(4.0), mesh, [shardtensor.Partial()])
    with CommDebugMode() as first:
        squared = partial**2
        cubed = partial**3
    assert first.get_comm_counts() == {"all_reduce": 1}
    partial.mul_(2)  # in place: the kept reduction is stale
    with CommDebugMode() as after_write:
        squared_again = partial**2
    assert after_write.get_comm_counts() == {"all_reduce": 1}
    total = torch.arange(4.0) * 2
    assert_close(squared.full_tensor(), total**2)
    assert_close(cubed.full_tensor(), total**3)
    assert_close(squared_again.full_tensor(), (2 * total) ** 2)
    assert partial.placements == (shardtensor.Partial(),)  # the Partial itself is unchanged


@spmd(meshes=[(2,), (2, 2)])
def test_collectives_inside_a_local_op_are_declared_priced_and_refused_in_explicit_mode(mesh):
    """softmax over a sharded dim issues the collectives its row declares; explicit mode refuses them."""
    full = torch.randn(4, 64, dtype=torch.float64)
    x = distribute_tensor(full, mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(1)])
    with CommDebugMode() as mode:
        y = torch.softmax(x, dim=1)
    assert y.placements == x.placements  # reducing the row statistics is cheaper than gathering x
    assert mode.get_comm_counts() == {"all_reduce": 2}
    assert_close(y.full_tensor(), torch.softmax(full, dim=1))
    for attempt in range(2):  # the second call takes the cached plan: it must raise as well
        with shardtensor.explicit_communication(), pytest.raises(RuntimeError) as raised:
            torch.softmax(x, dim=1)
        assert "all_reduce" in str(raised.value) and "inside the op" in str(raised.value)
    with shardtensor.explicit_communication(), pytest.raises(RuntimeError, match="inside the op"):
        torch.equal(x, x)
    small = distribute_tensor(full[:, :4], mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(1)])
    with CommDebugMode() as mode:
        z = torch.softmax(small, dim=1)  # 4 rows of 2 columns a rank: one gather is cheaper than 2 all_reduces
    assert mode.get_comm_counts() == {"all_gather": 1}
    assert_close(z.full_tensor(), torch.softmax(full[:, :4], dim=1))
