"""loss_parallel: F.cross_entropy on class-sharded logits against the single-device loss, forward and
backward, with every option; the logits are never gathered (collectives counted)."""

import functools
import itertools

import pytest

import torch
import torch.nn.functional as F
from spmd import spmd
from torch import nn
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.parallel import loss_parallel

MESHES = [(1,), (2,), (4,), (2, 2)]
ROWS, CLASSES = 6, 11  # 11 classes over 4 ranks: 3, 3, 3, 2


def _logits_placements(mesh):
    """Classes over the last mesh dim; on a 2x2 mesh the rows over the first (data parallel)."""
    return [Shard(1)] if mesh.ndim == 1 else [Shard(0), Shard(1)]


def _local_rows(mesh, full):
    """This rank's rows of a per-row tensor (the batch part a data-parallel rank holds)."""
    if mesh.ndim == 1:
        return full
    return full.tensor_split(mesh.size(0))[mesh.get_coordinate()[0]]


def _check_collectives(records, mesh) -> None:
    """Only all_reduces of per-row values (never the (rows, classes) logits) over the class mesh dim."""
    row_bytes = ROWS * 8
    for record in records:
        assert record.kind == "all_reduce", record
        assert record.bytes_sent <= 2 * row_bytes, record


@spmd(meshes=MESHES)
def test_cross_entropy_on_class_sharded_logits_matches_one_device(mesh):
    torch.manual_seed(3)
    logits_full = torch.randn(ROWS, CLASSES, dtype=torch.float64)
    weight_full = torch.rand(CLASSES, dtype=torch.float64)
    options = itertools.product(["mean", "sum", "none"], [-100, 3], [0.0, 0.2], [None, weight_full])
    for reduction, ignore_index, smoothing, weight in options:
        target_full = torch.tensor([0, 10, 5, ignore_index, 7, 3])
        logits = distribute_tensor(logits_full, mesh, _logits_placements(mesh)).requires_grad_()
        reference = logits_full.clone().requires_grad_()
        kwargs = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=smoothing, weight=weight)
        with loss_parallel(), comm.observe() as forward:
            loss = F.cross_entropy(logits, _local_rows(mesh, target_full), **kwargs)
        expected = F.cross_entropy(reference, target_full, **kwargs)
        assert isinstance(loss, DTensor) and not any(p.is_partial() for p in loss.placements)
        assert_close(loss.full_tensor(), expected, msg=lambda m: f"{kwargs}: {m}")
        gradient = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).reshape(expected.shape)
        gradient_dtensor = distribute_tensor(gradient, mesh, loss.placements)
        with comm.observe() as backward:
            loss.backward(gradient_dtensor)  # outside the context
        expected.backward(gradient)
        assert_close(logits.grad.full_tensor(), reference.grad, msg=lambda m: f"{kwargs} grad: {m}")
        assert logits.grad.placements == logits.placements
        _check_collectives([*forward, *backward], mesh)


@spmd(meshes=MESHES)
def test_a_sequence_of_classes_is_never_gathered(mesh):
    """Logits (batch, classes, sequence), as F.cross_entropy takes per-position classes, with targets
    (batch, sequence), and nll_loss of their log_softmax: one device's loss and gradient, with all_reduces only (aten's nll_loss2d, which
    has no class-sharded rule, is not reached)."""
    torch.manual_seed(5)
    logits_full = torch.randn(4, CLASSES, 3, dtype=torch.float64)
    target_full = torch.randint(0, CLASSES, (4, 3))
    target_full[1, 2] = 3
    for reduction, ignore_index in (("mean", -100), ("sum", 3), ("none", 3)):
        logits = distribute_tensor(logits_full, mesh, _logits_placements(mesh)).requires_grad_()
        reference = logits_full.clone().requires_grad_()
        with loss_parallel(), comm.observe() as records:
            loss = F.cross_entropy(logits, _local_rows(mesh, target_full), reduction=reduction, ignore_index=ignore_index)
            nll = F.nll_loss(F.log_softmax(logits, 1), _local_rows(mesh, target_full), reduction=reduction,
                             ignore_index=ignore_index)
            (loss.sum() + nll.sum()).backward()
        expected = F.cross_entropy(reference, target_full, reduction=reduction, ignore_index=ignore_index)
        (2 * expected.sum()).backward()
        assert_close(nll.full_tensor(), expected, msg=lambda m: f"{reduction} nll_loss: {m}")
        assert_close(loss.full_tensor(), expected, msg=lambda m: f"{reduction}: {m}")
        assert_close(logits.grad.full_tensor(), reference.grad, msg=lambda m: f"{reduction} grad: {m}")
        assert {record.kind for record in records} <= {"all_reduce"}, [record.kind for record in records]


@spmd(meshes=MESHES)
def test_the_vocab_parallel_loss_costs_three_small_all_reduces(mesh):
    """max and sum of exponentials for the log-softmax, the picked values' sum; backward none on
    a 1-D mesh (one, the log-softmax gradient's row sums, when the batch is sharded too): all over
    the class mesh dim, none gathers logits."""
    logits = distribute_tensor(torch.randn(ROWS, CLASSES), mesh, _logits_placements(mesh)).requires_grad_()
    target = torch.randint(0, CLASSES, (ROWS,))
    with loss_parallel(), comm.observe() as forward:
        loss = F.cross_entropy(logits, _local_rows(mesh, target))
    with comm.observe() as backward:
        loss.backward()
    class_mesh_dim = mesh.ndim - 1
    sharded = mesh.size(class_mesh_dim) > 1
    _check_collectives([*forward, *backward], mesh)
    if mesh.ndim == 1:
        assert [record.kind for record in forward] == ["all_reduce"] * 3 * sharded
    else:  # the batch's share of the mean is reduced over the data-parallel mesh dim too
        assert [record.mesh_dim for record in forward][:2] == [class_mesh_dim] * 2
    assert [(record.kind, record.mesh_dim) for record in backward] == [("all_reduce", class_mesh_dim)] * sharded * (mesh.ndim == 2)


@spmd(meshes=[(1,), (2,), (4,)])
def test_probability_targets_and_the_module_form(mesh):
    torch.manual_seed(4)
    logits_full = torch.randn(ROWS, CLASSES, dtype=torch.float64)
    probabilities = torch.softmax(torch.randn(ROWS, CLASSES, dtype=torch.float64), dim=1)
    local_probabilities = distribute_tensor(probabilities, mesh, [Shard(1)]).to_local()
    logits = distribute_tensor(logits_full, mesh, [Shard(1)]).requires_grad_()
    reference = logits_full.clone().requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(logits, local_probabilities, label_smoothing=0.1)
        whole_loss = F.cross_entropy(logits, probabilities, label_smoothing=0.1)  # every class: read as replicated
        module_loss = nn.CrossEntropyLoss(reduction="sum")(logits, torch.arange(ROWS) % CLASSES)
    expected = F.cross_entropy(reference, probabilities, label_smoothing=0.1)
    assert_close(loss.full_tensor(), expected)
    assert_close(whole_loss.full_tensor(), expected)
    assert_close(module_loss.full_tensor(), F.cross_entropy(logits_full, torch.arange(ROWS) % CLASSES, reduction="sum"))
    loss.backward()
    expected.backward()
    assert_close(logits.grad.full_tensor(), reference.grad)


@spmd(meshes=[(2,)])
def test_plain_tensors_and_other_functions_pass_through(mesh):
    logits = torch.randn(4, 5)
    target = torch.tensor([1, 0, 4, 2])
    with loss_parallel():
        plain = F.cross_entropy(logits, target)
        replicated = F.cross_entropy(distribute_tensor(logits, mesh, [Replicate()]), target)
        softmax = torch.softmax(logits, dim=1)
    assert not isinstance(plain, DTensor) and not isinstance(softmax, DTensor)
    assert_close(plain, F.cross_entropy(logits, target))
    assert_close(replicated.full_tensor(), plain)


@spmd(meshes=[(2,)])
def test_a_target_out_of_range_raises_on_every_rank(mesh):
    logits = distribute_tensor(torch.randn(3, 5), mesh, [Shard(1)])
    for bad in (torch.tensor([0, 5, 1]), torch.tensor([0, -2, 1])):
        with loss_parallel(), pytest.raises(IndexError, match="out of range for 5 classes"):
            F.cross_entropy(logits, bad)


@spmd(meshes=MESHES)
def test_nll_loss_of_log_softmax_with_a_plain_target_matches_one_device(mesh):
    """The pair users write for cross_entropy, `F.nll_loss(F.log_softmax(x, -1), target)` (and
    `nn.NLLLoss`), with a plain target and weight read as cross_entropy reads them: the single-device
    loss and gradient, replicated, the logits never gathered."""
    torch.manual_seed(5)
    logits_full = torch.randn(ROWS, CLASSES, dtype=torch.float64)
    weight_full = torch.rand(CLASSES, dtype=torch.float64)
    target_full = torch.tensor([0, 10, 5, -100, 7, 3])
    for reduction, weight, module in itertools.product(["mean", "sum", "none"], [None, weight_full], [False, True]):
        logits = distribute_tensor(logits_full, mesh, _logits_placements(mesh)).requires_grad_()
        reference = logits_full.clone().requires_grad_()
        loss_function = nn.NLLLoss(weight, reduction=reduction) if module else functools.partial(
            F.nll_loss, weight=weight, reduction=reduction)
        with loss_parallel(), comm.observe() as forward:
            loss = loss_function(F.log_softmax(logits, -1), _local_rows(mesh, target_full))
        expected = loss_function(F.log_softmax(reference, -1), target_full)
        case = dict(reduction=reduction, weight=weight is not None, module=module)
        assert isinstance(loss, DTensor) and not any(p.is_partial() for p in loss.placements), case
        assert_close(loss.full_tensor(), expected, msg=lambda m: f"{case}: {m}")
        gradient = torch.linspace(0.5, 1.5, expected.numel(), dtype=torch.float64).reshape(expected.shape)
        gradient_dtensor = distribute_tensor(gradient, mesh, loss.placements)
        with comm.observe() as backward:
            loss.backward(gradient_dtensor)
        expected.backward(gradient)
        assert_close(logits.grad.full_tensor(), reference.grad, msg=lambda m: f"{case} grad: {m}")
        _check_collectives([*forward, *backward], mesh)
