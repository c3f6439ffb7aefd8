"""`out=` and in-place variants on DTensors: the single-device values, by sharding rules, written exactly.

Every case runs under `strict_mode()` (the replicate fallback would raise) with inputs and out
tensors of random layouts (uneven shards included: dims of 5 on 4 ranks), the out tensors
pre-filled with garbage, and checks the written values, that the op returns its out tensors
themselves, and that their layouts did not change.
"""

import random

import torch
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard, distribute_tensor

GARBAGE = 1234.5
LAYOUTS_PER_CASE = 3

# name: (input shapes, call(inputs, out)); `out` is a tensor or a tuple of tensors like the result.
OUT_CASES = {
    "mm": ([(5, 3), (3, 6)], lambda x, out: torch.mm(*x, out=out)),
    "addmm": ([(6,), (5, 3), (3, 6)], lambda x, out: torch.addmm(*x, beta=0.5, out=out)),
    "bmm": ([(2, 5, 3), (2, 3, 4)], lambda x, out: torch.bmm(*x, out=out)),
    "baddbmm": ([(2, 5, 4), (2, 5, 3), (2, 3, 4)], lambda x, out: torch.baddbmm(*x, out=out)),
    "addbmm": ([(5, 4), (2, 5, 3), (2, 3, 4)], lambda x, out: torch.addbmm(*x, out=out)),
    "matmul": ([(5, 3), (3, 6)], lambda x, out: torch.matmul(*x, out=out)),
    "matmul_matrix_vector": ([(5, 3), (3,)], lambda x, out: torch.matmul(*x, out=out)),
    # torch writes through out.unsqueeze_(0), then mm.out resizes it, then squeeze_(0)
    "matmul_vector_matrix": ([(3,), (3, 5)], lambda x, out: torch.matmul(*x, out=out)),
    "mv": ([(5, 3), (3,)], lambda x, out: torch.mv(*x, out=out)),
    "sum": ([(5, 6)], lambda x, out: torch.sum(x[0], 1, out=out)),
    "mean": ([(5, 6)], lambda x, out: torch.mean(x[0], 0, keepdim=True, out=out)),
    "amax": ([(5, 6)], lambda x, out: torch.amax(x[0], 1, out=out)),
    "cumsum": ([(5, 6)], lambda x, out: torch.cumsum(x[0], 1, out=out)),
    "add": ([(5, 6), (6,)], lambda x, out: torch.add(*x, alpha=2, out=out)),
    "sort": ([(5, 6)], lambda x, out: torch.sort(x[0], 1, out=out)),
    "topk": ([(5, 6)], lambda x, out: torch.topk(x[0], 2, 1, out=out)),
    "max_dim": ([(5, 6)], lambda x, out: torch.max(x[0], 1, out=out)),
    "min_dim": ([(5, 6)], lambda x, out: torch.min(x[0], 0, out=out)),
    "median_dim": ([(5, 6)], lambda x, out: torch.median(x[0], 1, out=out)),
    "mode": ([(5, 6)], lambda x, out: torch.mode(x[0].round(), 1, out=out)),
    "kthvalue": ([(5, 6)], lambda x, out: torch.kthvalue(x[0], 2, 1, out=out)),
    "frexp": ([(5, 6)], lambda x, out: torch.frexp(x[0], out=out)),
    "aminmax": ([(5, 6)], lambda x, out: torch.aminmax(x[0], dim=1, out=out)),
}

# name: (input shapes, in-place call on inputs[0] with the others).
INPLACE_CASES = {
    "add_": ([(5, 6), (6,)], lambda x: x[0].add_(x[1], alpha=2)),
    "addmm_": ([(5, 6), (5, 3), (3, 6)], lambda x: x[0].addmm_(x[1], x[2])),
    "baddbmm_": ([(2, 5, 4), (2, 5, 3), (2, 3, 4)], lambda x: x[0].baddbmm_(x[1], x[2], alpha=2)),
    "addbmm_": ([(5, 4), (2, 5, 3), (2, 3, 4)], lambda x: x[0].addbmm_(x[1], x[2])),
    "addr_": ([(5, 6), (5,), (6,)], lambda x: x[0].addr_(x[1], x[2], beta=0.5)),
    "cumsum_": ([(5, 6)], lambda x: x[0].cumsum_(1)),
    "clamp_": ([(5, 6)], lambda x: x[0].clamp_(-0.5, 0.5)),
    "tril_": ([(5, 6)], lambda x: x[0].tril_(-1)),
}


def _placements(chooser: random.Random, ndim: int, mesh_ndim: int) -> list:
    options = [Replicate()] + [Shard(dim) for dim in range(ndim)]
    return [chooser.choice(options) for _ in range(mesh_ndim)]


def _distribute(mesh, full: torch.Tensor, chooser: random.Random):
    return distribute_tensor(full, mesh, _placements(chooser, full.ndim, mesh.ndim))


def _garbage_like(mesh, result: torch.Tensor, chooser: random.Random):
    return _distribute(mesh, torch.full_like(result, GARBAGE), chooser)


@spmd()
def test_out_variants_write_single_device_values(mesh):
    chooser = random.Random(0)
    for name, (shapes, call) in OUT_CASES.items():
        fulls = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
        with torch.no_grad():
            expected = call(fulls, None)
        expected_list = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        for _ in range(LAYOUTS_PER_CASE):
            inputs = [_distribute(mesh, full, chooser) for full in fulls]
            outs = [_garbage_like(mesh, value, chooser) for value in expected_list]
            layouts = [out.sharding for out in outs]
            out = outs[0] if isinstance(expected, torch.Tensor) else tuple(outs)
            where = f"{name}: inputs {[x.placements for x in inputs]}, out {[o.placements for o in outs]}"
            with shardtensor.strict_mode():
                returned = call(inputs, out)
            returned_list = [returned] if isinstance(returned, torch.Tensor) else list(returned)
            assert all(r is o for r, o in zip(returned_list, outs)), where
            for written, value, layout in zip(outs, expected_list, layouts):
                assert written.sharding == layout, f"{where}: {written.sharding!r}, was {layout!r}"
                torch.testing.assert_close(written.full_tensor(), value, rtol=1e-12, atol=1e-12, msg=where)


@spmd()
def test_inplace_variants_write_single_device_values(mesh):
    chooser = random.Random(1)
    for name, (shapes, call) in INPLACE_CASES.items():
        fulls = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
        expected = call([full.clone() for full in fulls])
        for _ in range(LAYOUTS_PER_CASE):
            inputs = [_distribute(mesh, full, chooser) for full in fulls]
            layout = inputs[0].sharding
            where = f"{name}: inputs {[x.placements for x in inputs]}"
            with shardtensor.strict_mode():
                returned = call(inputs)
            assert returned is inputs[0], where
            assert inputs[0].sharding == layout, where
            torch.testing.assert_close(inputs[0].full_tensor(), expected, rtol=1e-12, atol=1e-12, msg=where)


@spmd(meshes=[(4,), (2, 2)])
def test_written_tensors_of_another_shape_are_resized_like_torch(mesh):
    """An empty out= (torch resizes it) and a broadcast self of `addbmm_` (resized too) get the values."""
    a, b = torch.randn(5, 3), torch.randn(3, 4)
    batch1, batch2, addend = torch.randn(2, 5, 3), torch.randn(2, 3, 4), torch.randn(4)
    placements = [Shard(0)] * mesh.ndim
    out = distribute_tensor(torch.empty(0), mesh, [Replicate()] * mesh.ndim)
    self = distribute_tensor(addend, mesh, placements)
    with shardtensor.strict_mode():
        returned = torch.mm(distribute_tensor(a, mesh, placements), distribute_tensor(b, mesh, placements), out=out)
        resized = self.addbmm_(distribute_tensor(batch1, mesh, placements), distribute_tensor(batch2, mesh, placements))
    assert returned is out and resized is self
    torch.testing.assert_close(out.full_tensor(), a @ b)
    torch.testing.assert_close(self.full_tensor(), addend.clone().addbmm_(batch1, batch2))

