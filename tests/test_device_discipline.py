"""Device discipline (issue 12 item 3): the library creates every tensor on the device of the data it
belongs to, and its collectives refuse tensors on a device the mesh's backend cannot use.

There is no GPU here, so the first tests run ops on CPU DTensors with PyTorch's default device set to
`meta`: a tensor the library creates without `device=` lands on meta and fails (or gives a meta
result) instead of silently working as it would on a CPU-only machine. `torch.set_default_device` is
a torch-function mode, which torch pops before a tensor subclass's `__torch_function__` runs, so the
library's `__torch_dispatch__` is also run inside it (patched here for the block). Values are compared with the
single-device results computed before the default device changes.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard, comm, distribute_tensor

MESHES = [(1,), (2,)]


_library_dispatch = shardtensor.DTensor.__dict__["__torch_dispatch__"]


@classmethod
def _dispatch_on_meta_default(cls, *args, **kwargs):
    with torch.device("meta"):
        return _library_dispatch.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def _default_device_meta():
    torch.set_default_device("meta")
    shardtensor.DTensor.__torch_dispatch__ = _dispatch_on_meta_default
    try:
        yield
    finally:
        shardtensor.DTensor.__torch_dispatch__ = _library_dispatch
        torch.set_default_device(None)


def _full(dtensor) -> torch.Tensor:
    full = dtensor.full_tensor()
    assert full.device.type == "cpu", f"a result on {full.device}: the library created a tensor without device="
    return full


@spmd(meshes=MESHES)
def test_equal_and_allclose_of_shards_make_their_flags_on_the_data_device(mesh):
    full = torch.arange(12.0).reshape(6, 2)
    other = full.clone()
    other[5, 1] = -1.0
    x, same, different = (distribute_tensor(value, mesh, [Shard(0)]) for value in (full, full.clone(), other))
    with _default_device_meta():
        answers = [torch.equal(x, same), torch.equal(x, different), torch.allclose(x, same), torch.allclose(x, different)]
    assert answers == [True, False, True, False]


@spmd(meshes=MESHES)
def test_nll_loss_of_class_sharded_logits_on_the_data_device(mesh):
    for reduction in ("none", "sum", "mean"):
        _check_nll_loss(mesh, reduction)


def _check_nll_loss(mesh, reduction):
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0)).log_softmax(1)
    target = torch.tensor([0, 5, 2, -100, 3])
    weight = torch.arange(1.0, 7.0)
    expected = F.nll_loss(logits, target, weight, reduction=reduction)
    sharded = distribute_tensor(logits, mesh, [Shard(1)])
    targets = distribute_tensor(target, mesh, [Replicate()])
    weights = distribute_tensor(weight, mesh, [Replicate()])
    with _default_device_meta():
        loss = F.nll_loss(sharded, targets, weights, reduction=reduction)
        unweighted = F.nll_loss(sharded, targets, reduction=reduction)
    torch.testing.assert_close(_full(loss), expected)
    torch.testing.assert_close(_full(unweighted), F.nll_loss(logits, target, reduction=reduction))


@spmd(meshes=MESHES)
def test_embedding_with_a_vocabulary_sharded_weight_checks_indices_on_the_data_device(mesh):
    weight = torch.arange(24.0).reshape(8, 3)
    ids = torch.tensor([[0, 7, 3], [5, 5, 1]])
    x = distribute_tensor(weight, mesh, [Shard(0)])
    indices = distribute_tensor(ids, mesh, [Replicate()])
    out_of_range = distribute_tensor(torch.tensor([8]), mesh, [Replicate()])
    with _default_device_meta():
        out = F.embedding(indices, x)
        with pytest.raises(IndexError):
            F.embedding(out_of_range, x)
    assert torch.equal(_full(out), F.embedding(ids, weight))


@spmd(meshes=MESHES)
def test_random_ops_draw_on_the_data_device_and_do_not_depend_on_the_layout(mesh):
    """Each random op twice from the same seed, sharded and replicated: the same global numbers."""
    full = torch.arange(1.0, 13.0).reshape(6, 2)
    results = {}
    for name, placements in (("sharded", [Shard(0)]), ("replicated", [Replicate()])):
        x = distribute_tensor(full, mesh, placements)
        shardtensor.manual_seed(7)
        with _default_device_meta():
            dropped = F.dropout(x, p=0.5, training=True)
            coins = torch.bernoulli(x / 13.0)
            normal = torch.normal(x, 1.0)
            x_copy = x.clone()
            x_copy.uniform_(-1.0, 1.0)
        results[name] = [_full(value) for value in (dropped, coins, normal, x_copy)]
    for sharded, replicated in zip(results["sharded"], results["replicated"]):
        assert torch.equal(sharded, replicated)
    dropped = results["sharded"][0]
    assert torch.equal(dropped[dropped != 0], 2 * full[dropped != 0])  # kept values scaled by 1 / (1 - p)


@spmd(meshes=MESHES)
def test_attention_on_a_rank_without_heads_makes_its_results_on_the_data_device(mesh):
    """One head on 2 ranks: the rank without it builds empty results (`ops/attention.py`) instead of
    calling the kernel, forward and backward."""
    fulls = [torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    leaves = [distribute_tensor(full, mesh, [Shard(1)]).requires_grad_() for full in fulls]
    references = [full.clone().requires_grad_() for full in fulls]
    grad_full = torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(3))
    grad = distribute_tensor(grad_full, mesh, [Shard(1)])
    with _default_device_meta():
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(grad)
    expected = F.scaled_dot_product_attention(*references, is_causal=True)
    expected.backward(grad_full)
    torch.testing.assert_close(_full(out), expected)
    for leaf, reference in zip(leaves, references):
        torch.testing.assert_close(_full(leaf.grad), reference.grad)


@spmd(meshes=MESHES)
def test_meshes_and_redistribute_under_a_meta_default_device(mesh):
    full = torch.arange(10.0).reshape(5, 2)
    with _default_device_meta():
        again = shardtensor.init_device_mesh("cpu", mesh.shape)
        x = distribute_tensor(full, again, [Shard(0)])
        y = x.redistribute(again, [Replicate()])
    assert x.to_local().device.type == "cpu" and torch.equal(_full(y), full)


@spmd(meshes=MESHES)
def test_a_collective_refuses_a_tensor_on_another_device_naming_both(mesh):
    for collective in (
        lambda tensor: comm.all_reduce(tensor, mesh, 0, reduce_op="sum"),
        lambda tensor: comm.all_gather(tensor, mesh, 0, dim=0, sizes=[2] * mesh.size()),
        lambda tensor: comm.broadcast(tensor, mesh, 0),
    ):
        with pytest.raises(ValueError, match=r"on device meta .*device type 'cpu'"):
            collective(torch.ones(2, device="meta"))
    assert torch.equal(comm.all_reduce(torch.ones(2), mesh, 0, reduce_op="sum"), torch.full((2,), float(mesh.size())))


@spmd(meshes=[(1,)])
def test_distribute_tensor_keeps_a_meta_tensor_on_meta(mesh):
    x = distribute_tensor(torch.empty(4, 2, device="meta"), mesh, [Shard(0)])
    assert x.to_local().device.type == "meta" and x.shape == (4, 2)
