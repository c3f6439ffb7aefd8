"""A bad index in one rank's shard raises on every rank (no rank is left waiting); good indices give
the single-device values, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from spmd import spmd
from torch.testing import assert_close

import shardtensor
from shardtensor import DeviceMesh, Replicate, Shard, distribute_tensor

R = Replicate()
ROWS = 8  # index rows: divisible by 4, so the last one lies in the last rank's shard


def _indices(shape, size: int, bad: bool) -> torch.Tensor:
    """Random indices in [0, size); with `bad`, the last one (last rank's shard) is size + 3."""
    index = torch.randint(0, size, shape)
    if bad:
        index.view(-1)[-1] = size + 3
    return index


# Each case builds its tensors with `make(full, sharded)` (a DTensor, or the single-device tensor)
# and returns the op's output and the float inputs whose gradients are compared.


def _gather(make, bad):
    x = make(torch.randn(ROWS, 6), False)
    return torch.gather(x, 1, make(_indices((ROWS, 3), 6, bad), True)), [x]


def _gather_along_the_sharded_dim(make, bad):
    x = make(torch.randn(6, 3), False)
    return torch.gather(x, 0, make(_indices((ROWS, 3), 6, bad), True)), [x]


def _scatter_family(method):
    def case(make, bad):
        x, src = make(torch.randn(ROWS, 6), True), make(torch.randn(ROWS, 3), True)
        full_index = torch.stack([torch.randperm(6)[:3] for _ in range(ROWS)])  # unique per row: no write order
        if bad:
            full_index[-1, -1] = 9
        index = make(full_index, True)
        if method == "scatter_reduce":
            return x.scatter_reduce(1, index, src, "sum"), [x, src]
        return getattr(x, method)(1, index, src), [x, src]

    return case


def _index(make, bad):
    x = make(torch.randn(6, 4), False)
    return x[make(_indices((ROWS,), 6, bad), True)], [x]


def _index_put(make, bad):
    x, values = make(torch.randn(6, 4), False), make(torch.randn(ROWS, 4), True)
    return x.index_put((make(_indices((ROWS,), 6, bad), True),), values, accumulate=True), [x, values]


def _index_select(make, bad):
    x = make(torch.randn(6, 4), False)
    return x.index_select(0, make(_indices((ROWS,), 6, bad), True)), [x]


def _take(make, bad):
    x = make(torch.randn(6, 4), False)
    return x.take(make(_indices((ROWS,), 24, bad), True)), [x]


def _put(make, bad):
    x, source = make(torch.randn(6, 4), False), make(torch.randn(ROWS), True)
    return x.put(make(_indices((ROWS,), 24, bad), True), source, accumulate=True), [x, source]


def _embedding(make, bad):
    weight = make(torch.randn(6, 4), False)
    return F.embedding(make(_indices((ROWS,), 6, bad), True), weight), [weight]


def _loss(function):
    def case(make, bad):
        logits = make(torch.randn(ROWS, 5), True)
        return function(logits, make(_indices((ROWS,), 5, bad), True)), [logits]

    return case


# name -> (case, the error one device raises, what the message names, the bad value)
CASES = {
    "gather": (_gather, RuntimeError, "gather", 9),
    "gather_along_the_sharded_dim": (_gather_along_the_sharded_dim, RuntimeError, "gather", 9),
    "scatter": (_scatter_family("scatter"), RuntimeError, "scatter", 9),
    "scatter_add": (_scatter_family("scatter_add"), RuntimeError, "scatter_add", 9),
    "scatter_reduce": (_scatter_family("scatter_reduce"), RuntimeError, "scatter_reduce", 9),
    "index": (_index, IndexError, "aten.index.Tensor", 9),
    "index_put": (_index_put, IndexError, "index_put", 9),
    "index_select": (_index_select, IndexError, "index_select", 9),
    "take": (_take, IndexError, "take", 27),
    "put": (_put, IndexError, "put", 27),
    "embedding": (_embedding, IndexError, "embedding", 9),
    "nll_loss": (_loss(lambda x, t: F.nll_loss(F.log_softmax(x, 1), t)), IndexError, "nll_loss", 8),
    "cross_entropy": (_loss(F.cross_entropy), IndexError, "nll_loss", 8),
}


def _distributed(mesh):
    def make(full, sharded):
        placements = [Shard(0)] * mesh.ndim if sharded else [R] * mesh.ndim
        dtensor = distribute_tensor(full, mesh, placements)
        return dtensor.requires_grad_() if full.is_floating_point() else dtensor

    return make


def _single_device(full, sharded):
    return full.clone().requires_grad_() if full.is_floating_point() else full


@spmd(meshes=[(2,), (4,), (2, 2)], timeout=30)
def test_a_bad_index_in_one_shard_raises_on_every_rank(mesh):
    """Every case in turn on the same ranks: one left behind by a case would hang the next."""
    for name, (case, error, op_name, value) in CASES.items():
        with shardtensor.strict_mode():
            case(_distributed(mesh), bad=False)  # the same call with a bad index then runs a cached plan
            with pytest.raises(error) as raised:
                case(_distributed(mesh), bad=True)
        message = str(raised.value)
        assert op_name in message and f"index {value} " in message, (name, message)


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_good_indices_give_single_device_values_and_gradients(mesh):
    for name, (case, *_) in CASES.items():
        torch.manual_seed(1)
        output, leaves = case(_distributed(mesh), bad=False)
        torch.manual_seed(1)
        expected, references = case(_single_device, bad=False)
        assert_close(output.full_tensor(), expected, msg=lambda text: f"{name}: {text}")
        grad = torch.randn(expected.shape)
        placements = [R if placement.is_partial() else placement for placement in output.placements]
        with shardtensor.strict_mode():
            output.backward(distribute_tensor(grad, mesh, placements))
        expected.backward(grad)
        for leaf, reference in zip(leaves, references):
            assert_close(leaf.grad.full_tensor(), reference.grad, msg=lambda text: f"{name} gradient: {text}")


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_a_bad_sorter_index_of_a_batched_searchsorted_raises_on_every_rank(mesh):
    """The sorter shards with its batched sequence: the last rank's rows hold the bad value alone."""
    sequences = torch.randn(ROWS, 5, generator=torch.Generator().manual_seed(2))
    values = torch.randn(ROWS, 3, generator=torch.Generator().manual_seed(3))
    sorter = sequences.argsort(1)
    batch = [Shard(0)] * mesh.ndim
    sharded = [distribute_tensor(tensor, mesh, batch) for tensor in (sequences, values, sorter)]
    assert torch.equal(torch.searchsorted(*sharded[:2], sorter=sharded[2]).full_tensor(),
                       torch.searchsorted(sequences, values, sorter=sorter))
    sorter[-1, -1] = 9
    with pytest.raises(RuntimeError, match="index 9 in `sorter` is out of range"):
        torch.searchsorted(*sharded[:2], sorter=distribute_tensor(sorter, mesh, batch))


@spmd(meshes=[(2,), (4,)])
def test_trusted_indices_skip_the_agreement_collective(mesh):
    x, index = torch.randn(ROWS, 6), _indices((ROWS, 3), 6, bad=False)
    sharded_x, sharded_index = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(index, mesh, [Shard(0)])
    with shardtensor.comm.observe() as checked:
        torch.gather(sharded_x, 1, sharded_index)
    with shardtensor.trusted_indices(), shardtensor.comm.observe() as trusted:
        result = torch.gather(sharded_x, 1, sharded_index)
    assert [record.kind for record in checked] == ["all_reduce"] and trusted == []
    assert_close(result.full_tensor(), torch.gather(x, 1, index))


@spmd(meshes=[(2,), (4,), (2, 2)], timeout=30)
def test_a_bad_index_into_a_vocabulary_sharded_table_raises_on_every_rank(mesh):
    """A table sharded by rows (RowwiseParallel's embedding) looks up only the indices a rank owns: an
    index past the vocabulary (or negative) is owned by none and must raise on every rank, not read as
    zeros; good indices give the single-device rows."""
    from torch import nn

    from shardtensor.parallel import RowwiseParallel, parallelize_module

    table = torch.randn(11, 4)
    weight = distribute_tensor(table, mesh, [Shard(0)] * mesh.ndim)
    good = torch.tensor([1, 2, 10, 4, 3, 0, 7, 5])
    for index_placements in ([R] * mesh.ndim, [Shard(0)] * mesh.ndim):
        indices = distribute_tensor(good, mesh, index_placements)
        assert torch.equal(F.embedding(indices, weight).full_tensor(), F.embedding(good, table))
        for value in (13, -1):
            bad = good.clone()
            bad[-1] = value
            with pytest.raises(IndexError, match=f"embedding.*index {value} "):
                F.embedding(distribute_tensor(bad, mesh, index_placements), weight)
    tp = mesh if mesh.ndim == 1 else DeviceMesh("cpu", mesh.mesh.flatten().tolist())
    embedding = parallelize_module(nn.Embedding(11, 4), tp, RowwiseParallel(input_layouts=Replicate()))
    with pytest.raises(IndexError, match="index 13 "):
        embedding(torch.tensor([[1, 2], [3, 13]]))
