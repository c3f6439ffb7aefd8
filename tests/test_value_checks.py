"""A value that one rank's kernel would refuse (binary_cross_entropy's probabilities, bernoulli's p, a
margin loss's target class) raises on every rank (ops/value_checks.py), and random parameters that
torch refuses raise on every rank, even on a rank whose shard is empty."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import documented_random, value_agreement
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor

ROWS = 8  # divisible by 4: the last row lies in the last rank's shard


def _probabilities(bad=None) -> torch.Tensor:
    """Values in (0.05, 0.95); with `bad`, the last element (last rank's shard) is `bad`."""
    values = torch.rand(ROWS, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.9 + 0.05
    if bad is not None:
        values[-1, -1] = bad
    return values


# Each case distributes its inputs with `make(full)` and returns the op call to run on them.


def _bce_input(make, bad):
    x, target = make(_probabilities(bad)), make(_probabilities())
    return lambda: F.binary_cross_entropy(x, target)


def _bce_target(make, bad):
    x, target = make(_probabilities()), make(_probabilities(bad))
    return lambda: F.binary_cross_entropy(x, target, reduction="sum")


def _bernoulli(make, bad):
    probabilities = make(_probabilities(bad))
    return lambda: torch.bernoulli(probabilities)


def _bernoulli_in_place(make, bad):
    target, probabilities = make(torch.zeros(ROWS, 3, dtype=torch.float64)), make(_probabilities(bad))
    return lambda: target.bernoulli_(probabilities)


def _scores() -> torch.Tensor:
    return torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(4))


def _classes(bad) -> torch.Tensor:
    target = torch.arange(ROWS) % 4
    if bad is not None:
        target[-1] = 4  # one class past the last
    return target


def _class_lists(bad) -> torch.Tensor:
    target = torch.tensor([[0, 2, -1, 1]]).repeat(ROWS, 1)  # classes 0 and 2, then the end marker
    if bad is not None:
        target[-1, 0] = -2
    return target


def _multi_margin(make, bad):
    scores, target = make(_scores()), make(_classes(bad))
    return lambda: F.multi_margin_loss(scores, target)


def _multilabel_margin(make, bad):
    scores, target = make(_scores()), make(_class_lists(bad))
    return lambda: F.multilabel_margin_loss(scores, target)


# name -> (case, what the message names, the number of checked tensors)
CASES = {
    "bce input": (_bce_input, "all elements of input", 2),
    "bce target": (_bce_target, "all elements of target", 2),
    "bernoulli": (_bernoulli, "all elements of p", 1),
    "bernoulli_": (_bernoulli_in_place, "all elements of p", 1),
    "multi_margin_loss": (_multi_margin, "all elements of target", 1),
    "multilabel_margin_loss": (_multilabel_margin, "all elements of target", 1),
}


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_a_bad_value_in_one_shard_raises_on_every_rank(mesh):
    """Every case in turn on the same ranks: a rank left behind by one case would hang the next."""
    bad_values = (1.5, -0.25, math.nan)
    for placements in ([Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim):
        for number, (name, (case, named, _)) in enumerate(CASES.items()):
            bad = bad_values[number % len(bad_values)]
            run = case(lambda full: distribute_tensor(full, mesh, placements), bad)
            with pytest.raises(RuntimeError) as raised:
                run()
            assert named in str(raised.value) and "Every rank raises this" in str(raised.value), (name, bad)
    assert torch.equal(distribute_tensor(torch.ones(4), mesh, [Shard(0)] * mesh.ndim).full_tensor(), torch.ones(4))


@spmd(meshes=[(1,), (2,), (2, 2)])
def test_good_values_agree_in_one_small_all_reduce_and_match_one_device(mesh):
    sharded, replicated = [Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim
    shardtensor.manual_seed(5)  # else the first random call agrees on a seed (two all_gathers)
    for name, (case, _, flags) in CASES.items():
        run = case(lambda full: distribute_tensor(full, mesh, sharded), None)
        with comm.observe() as records:
            result = run()
        assert list(records) == value_agreement(mesh, checked=flags), name
        if mesh.size() > 1:  # the losses are 0-d partial sums; the draws keep their shards
            expected = (Partial(),) * mesh.ndim if result.ndim == 0 else tuple(sharded)
            assert result.placements == expected, (name, result.placements)
        run = case(lambda full: distribute_tensor(full, mesh, replicated), None)
        with comm.observe() as records:
            run()
        assert list(records) == [], name  # replicated values: every rank checks the same ones, no collective
    on_one_device = {
        "bce input": F.binary_cross_entropy(_probabilities(), _probabilities()),
        "bce target": F.binary_cross_entropy(_probabilities(), _probabilities(), reduction="sum"),
        "multi_margin_loss": F.multi_margin_loss(_scores(), _classes(None)),
        "multilabel_margin_loss": F.multilabel_margin_loss(_scores(), _class_lists(None)),
    }
    for name, expected in on_one_device.items():
        result = CASES[name][0](lambda full: distribute_tensor(full, mesh, sharded), None)()
        assert_close(result.full_tensor(), expected, msg=lambda text: f"{name}: {text}")
    shardtensor.manual_seed(5)  # random call 0: `uniform < p` of the documented draw
    draws = _bernoulli(lambda full: distribute_tensor(full, mesh, sharded), None)().full_tensor()
    expected = (documented_random("rand", (ROWS, 3), seed=5, counter=0) < _probabilities()).double()
    assert torch.equal(draws, expected) and set(draws.unique().tolist()) == {0.0, 1.0}


@spmd(meshes=[(2,), (4,)])
def test_random_parameters_torch_refuses_raise_on_every_rank_even_with_an_empty_shard(mesh):
    """One row over the mesh: every rank but the first holds an empty shard and draws nothing."""
    cases = [
        (lambda x: x.uniform_(2.0, 1.0), "uniform_ expects"),
        (lambda x: x.exponential_(-1.0), "exponential_ expects"),
        (lambda x: x.normal_(0.0, -1.0), "normal expects"),
        (lambda x: x.bernoulli_(1.5), "bernoulli_ expects"),
        (lambda x: torch.normal(x, -1.0), "normal expects"),
    ]
    for function, message in cases:
        x = distribute_tensor(torch.zeros(1, 3), mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match=message):
            function(x)
    assert torch.equal(distribute_tensor(torch.ones(1, 3), mesh, [Shard(0)]).full_tensor(), torch.ones(1, 3))
