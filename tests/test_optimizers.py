"""torch.optim and clip_grad_norm_ on DTensor parameters against single-device training.

Parameters mix Shard(0), Shard(1) and Replicate, some with sizes the mesh does not divide; every
optimizer runs with foreach=False, foreach=True and fused=True (where torch has a fused CPU kernel).
"""

import math

import torch
from helpers import partial_of, torch_collectives, torch_mesh
from spmd import spmd
from torch.testing import assert_close

from shardtensor import Replicate, Shard, comm, distribute_tensor
from shardtensor.debug import CommDebugMode

R = Replicate()
STEPS = 3

# name -> (optimizer class, keyword arguments, whether torch has a fused CPU kernel)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, True),
    "sgd_nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, True),
    "adam": (torch.optim.Adam, {"lr": 0.01}, True),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}, True),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}, True),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}, True),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}, False),
}


def _placements(mesh) -> list[list]:
    """Four parameters' placements: sharded on dim 0, on dim 1, replicated, and mixed on a 2-D mesh."""
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [R], [Shard(0)]]
    return [[Shard(0), Shard(1)], [Shard(1), R], [R, R], [R, Shard(0)]]


SHAPES = [(7, 5), (6, 9), (5, 3), (4, 3)]  # 7, 9 and 5 split unevenly over 2 or 4 ranks


def _full_values():
    """(full parameters, every step's full gradients)."""
    generator = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES] for _ in range(STEPS)]
    return fulls, grads


def _parameters(mesh):
    """(full parameters, their DTensors, every step's full gradients)."""
    fulls, grads = _full_values()
    dtensors = [distribute_tensor(full.clone(), mesh, placements).requires_grad_()
                for full, placements in zip(fulls, _placements(mesh))]
    return fulls, dtensors, grads


def _modes(fused_on_cpu: bool) -> list[dict]:
    return [{"foreach": False}, {"foreach": True}] + ([{"fused": True}] if fused_on_cpu else [])


def _train(optimizer_class, options, parameters, grads, to_grad):
    optimizer = optimizer_class(parameters, **options)
    for step_grads in grads:
        for parameter, grad in zip(parameters, step_grads):
            parameter.grad = to_grad(grad, parameter)
        optimizer.step()
    return optimizer


def _check_optimizer(mesh, name):
    optimizer_class, options, fused_on_cpu = OPTIMIZERS[name]
    for mode in _modes(fused_on_cpu):
        fulls, dtensors, grads = _parameters(mesh)
        references = [full.clone().requires_grad_() for full in fulls]
        _train(optimizer_class, {**options, **mode}, references, grads, lambda grad, parameter: grad.clone())
        _train(optimizer_class, {**options, **mode}, dtensors, grads,
               lambda grad, parameter: distribute_tensor(grad, mesh, parameter.placements))
        for dtensor, reference, placements in zip(dtensors, references, _placements(mesh)):
            assert list(dtensor.placements) == placements, (name, mode)
            assert_close(dtensor.full_tensor(), reference.detach(), msg=lambda text: f"{name} {mode}: {text}")


@spmd()
def test_sgd_with_momentum_matches_one_device(mesh):
    _check_optimizer(mesh, "sgd")
    _check_optimizer(mesh, "sgd_nesterov")


@spmd()
def test_adam_and_adamw_match_one_device(mesh):
    _check_optimizer(mesh, "adam")
    _check_optimizer(mesh, "adam_amsgrad")
    _check_optimizer(mesh, "adamw")


@spmd()
def test_adagrad_and_rmsprop_match_one_device(mesh):
    _check_optimizer(mesh, "adagrad")
    _check_optimizer(mesh, "rmsprop")


@spmd(meshes=[(2,), (2, 2)])
def test_a_step_issues_no_collective_when_grads_have_their_parameters_layouts(mesh):
    for name in ("sgd", "adam", "adamw"):
        optimizer_class, options, _ = OPTIMIZERS[name]
        for mode in _modes(True):
            _, dtensors, grads = _parameters(mesh)
            optimizer = _train(optimizer_class, {**options, **mode}, dtensors, grads[:1],
                               lambda grad, parameter: distribute_tensor(grad, mesh, parameter.placements))
            with comm.observe() as records:
                optimizer.step()
                optimizer.step()
            assert list(records) == [], (name, mode, records)


def _clip_inputs(mesh):
    fulls, dtensors, grads = _parameters(mesh)
    for dtensor, grad in zip(dtensors, grads[0]):
        dtensor.grad = distribute_tensor(grad, mesh, dtensor.placements)
    references = [full.clone().requires_grad_() for full in fulls]
    for reference, grad in zip(references, grads[0]):
        reference.grad = grad.clone()
    return dtensors, references


@spmd()
def test_clip_grad_norm_gives_the_one_device_norm_and_grads(mesh):
    for foreach in (True, False):
        for norm_type in (2.0, math.inf, 1.0):
            dtensors, references = _clip_inputs(mesh)
            with comm.observe() as records:
                total = torch.nn.utils.clip_grad_norm_(dtensors, max_norm=1.0, norm_type=norm_type, foreach=foreach)
            expected = torch.nn.utils.clip_grad_norm_(references, max_norm=1.0, norm_type=norm_type, foreach=foreach)
            assert_close(total.full_tensor(), expected)
            for dtensor, reference in zip(dtensors, references):
                assert list(dtensor.grad.placements) == list(dtensor.placements)
                assert_close(dtensor.grad.full_tensor(), reference.grad)
            if foreach:  # one collective for the whole list: the parameters' partial norms reduced together
                assert [record.kind for record in records] == ([] if mesh.size() == 1 else ["all_reduce"]), norm_type


@spmd(meshes=[(2,), (2, 2)])
def test_clip_grad_norm_without_foreach_issues_one_collective(mesh):
    """foreach=False (and foreach=None, which takes that path for tensor subclasses) norms each
    gradient separately: a sharded gradient's norm stays a NormPartial, the stacked norms and their
    norm too, and the one reduction happens where the clip coefficient reads the total (one
    all_reduce over every mesh dim at once). torch's DTensor does the same with its _NormPartial."""
    for foreach in (False, None):
        for norm_type in (2.0, math.inf, 1.0, 3.0):
            dtensors, references = _clip_inputs(mesh)
            with comm.observe() as records:
                total = torch.nn.utils.clip_grad_norm_(dtensors, max_norm=1.0, norm_type=norm_type, foreach=foreach)
            assert [record.kind for record in records] == ["all_reduce"], (foreach, norm_type, records)
            expected = torch.nn.utils.clip_grad_norm_(references, max_norm=1.0, norm_type=norm_type, foreach=False)
            assert_close(total.full_tensor(), expected)
            for dtensor, reference in zip(dtensors, references):
                assert list(dtensor.grad.placements) == list(dtensor.placements)
                assert_close(dtensor.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_clip_grad_norm_of_partial_gradients_gives_the_one_device_norm_and_grads(mesh):
    """PEER_BUGS #183363: Replicate parameters whose gradients are Partial(sum) (a different operand on
    every rank, as data parallel leaves them): the total norm and the clipped gradients equal one
    device's for every norm type, foreach or not, with the collectives counted."""
    for foreach in (True, False):
        for norm_type in (2.0, math.inf, 1.0):
            fulls, _, grads = _parameters(mesh)
            dtensors = [distribute_tensor(full.clone(), mesh, [R] * mesh.ndim).requires_grad_() for full in fulls]
            references = [full.clone().requires_grad_() for full in fulls]
            for index, (dtensor, reference, grad) in enumerate(zip(dtensors, references, grads[0])):
                dtensor.grad, reference.grad = partial_of(grad, mesh, seed=10 * index), grad.clone()
            with comm.observe() as records:
                total = torch.nn.utils.clip_grad_norm_(dtensors, max_norm=1.0, norm_type=norm_type, foreach=foreach)
            # foreach: the gradients reduced together (one all_reduce); one at a time: each gradient's
            # norm reduce-scatters it (a NormPartial of its shards, half an all_reduce's bytes), then
            # the total's one all_reduce
            kinds = ["all_reduce"] if foreach else ["reduce_scatter"] * len(dtensors) + ["all_reduce"]
            assert [record.kind for record in records] == kinds, (foreach, norm_type, records)
            expected = torch.nn.utils.clip_grad_norm_(references, max_norm=1.0, norm_type=norm_type, foreach=False)
            assert_close(total.full_tensor(), expected)
            for dtensor, reference in zip(dtensors, references):
                assert_close(dtensor.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2, 2), (2, 2, 2)])
def test_mixed_sum_and_avg_gradients_are_reduced_in_one_all_reduce(mesh):
    """Gradients Partial(sum) on the first mesh dim and Partial(avg) on the others (tensor-parallel
    sums, data-parallel averages): a multi-tensor step reduces them all in one all_reduce over the
    whole mesh (a sum divided by the averaged ranks), the per-tensor path one per gradient, and the
    parameters match one device."""
    from shardtensor import DTensor, Partial

    placements = [Partial("sum")] + [Partial("avg")] * (mesh.ndim - 1)
    optimizer_class, options, _ = OPTIMIZERS["adamw"]
    for mode in _modes(True):
        fulls, grads = _full_values()
        dtensors = [distribute_tensor(full.clone(), mesh, [R] * mesh.ndim).requires_grad_() for full in fulls]
        references = [full.clone().requires_grad_() for full in fulls]
        _train(optimizer_class, {**options, **mode}, references, grads, lambda grad, parameter: grad.clone())

        def mixed_grad(grad, parameter):
            share = grad / mesh.size(0)  # summed over mesh dim 0, averaged over the others: the gradient
            return DTensor.from_local(share, mesh, placements)

        with CommDebugMode() as step:
            _train(optimizer_class, {**options, **mode}, dtensors, grads, mixed_grad)
        per_step = len(SHAPES) if mode == {"foreach": False} else 1
        assert step.get_comm_counts() == {"all_reduce": per_step * STEPS}, (mode, step.get_comm_counts())
        for dtensor, reference in zip(dtensors, references):
            assert_close(dtensor.full_tensor(), reference.detach(), msg=lambda text: f"{mode}: {text}")


@spmd(meshes=[(2,), (4,), (2, 2), (2, 2, 2)])
def test_clip_grad_norm_of_partial_gradients_against_torch(mesh):
    """foreach=False with Partial(sum) gradients, torch DTensor as the oracle (same operands): each
    gradient's norm reduce-scatters it over the whole mesh (half the bytes of an all_reduce), the
    norms stay a NormPartial and the total is one all_reduce of a scalar: n + 1 collectives. torch
    all_reduces every gradient on every mesh dim: n per mesh dim. Ours is lower on 2x2 (5 vs 8) and
    2x2x2 (5 vs 12), one more on a 1-D mesh (5 vs 4, at half the gradient bytes; one collective for
    all would need the norms deferred across separate op calls: bench/README.md, clip_grad_norm_ of
    Partial gradients). Norm and clipped gradients equal one device's and torch's."""
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate

    fulls, grads = _full_values()
    dtensors = [distribute_tensor(full.clone(), mesh, [R] * mesh.ndim).requires_grad_() for full in fulls]
    oracles = [TorchDTensor.from_local(full.clone(), torch_mesh(mesh), [TorchReplicate()] * mesh.ndim).requires_grad_()
               for full in fulls]
    references = [full.clone().requires_grad_() for full in fulls]
    for index, (dtensor, oracle, reference, grad) in enumerate(zip(dtensors, oracles, references, grads[0])):
        dtensor.grad, reference.grad = partial_of(grad, mesh, seed=10 * index), grad.clone()
        oracle.grad = TorchDTensor.from_local(dtensor.grad.to_local().clone(), torch_mesh(mesh), [TorchPartial()] * mesh.ndim)
    with CommDebugMode() as mode:
        total = torch.nn.utils.clip_grad_norm_(dtensors, max_norm=1.0, foreach=False)
    assert mode.get_comm_counts() == {"reduce_scatter": len(dtensors), "all_reduce": 1}
    oracle_total, torch_count = torch_collectives(lambda: torch.nn.utils.clip_grad_norm_(oracles, max_norm=1.0, foreach=False))
    assert torch_count == len(dtensors) * mesh.ndim
    expected = torch.nn.utils.clip_grad_norm_(references, max_norm=1.0, foreach=False)
    assert_close(total.full_tensor(), expected)
    assert_close(oracle_total.full_tensor(), expected)
    for dtensor, oracle, reference in zip(dtensors, oracles, references):
        assert_close(dtensor.grad.full_tensor(), reference.grad)
        assert_close(oracle.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,), (2, 2)])
def test_partial_gradients_are_reduced_before_the_step(mesh):
    """Replicate parameters whose gradients are Partial(sum) (each rank's share, as data parallel
    gives them): every mode reduces each gradient where the step reads it and matches one device.
    A multi-tensor step (foreach, fused) reduces all of them in one all_reduce per step (over both
    mesh dims at once on 2x2), and reads a reduced gradient again without a collective; the
    per-tensor path (foreach=False) reduces each gradient where it first reads it."""
    from shardtensor import DTensor, Partial

    for name in ("sgd", "adamw"):
        optimizer_class, options, _ = OPTIMIZERS[name]
        for mode in _modes(True):
            fulls, _, grads = _parameters(mesh)
            dtensors = [distribute_tensor(full.clone(), mesh, [R] * mesh.ndim).requires_grad_() for full in fulls]
            references = [full.clone().requires_grad_() for full in fulls]
            _train(optimizer_class, {**options, **mode}, references, grads, lambda grad, parameter: grad.clone())

            def partial_grad(grad, parameter):
                share = grad / mesh.size()  # every rank holds an equal share; their sum is the gradient
                return DTensor.from_local(share, mesh, [Partial()] * mesh.ndim)

            with comm.observe() as records:
                _train(optimizer_class, {**options, **mode}, dtensors, grads, partial_grad)
            per_step = len(SHAPES) if mode == {"foreach": False} else 1
            assert [record.kind for record in records] == ["all_reduce"] * (per_step * STEPS), (name, mode, records)
            for dtensor, reference in zip(dtensors, references):
                assert list(dtensor.placements) == [R] * mesh.ndim
                assert_close(dtensor.full_tensor(), reference.detach(), msg=lambda text: f"{name} {mode}: {text}")
