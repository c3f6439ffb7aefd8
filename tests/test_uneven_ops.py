"""Ops on inputs co-sharded with explicit uneven shard sizes: a moved input adopts the kept one's pieces.

`a` is sharded with explicit sizes (not `torch.chunk`'s); the other inputs are Replicate (moved to
Shard by a local slice, no communication) or chunk-sharded (re-split to `a`'s pieces). Values and
gradients are compared with the single-device computation.
"""

import pytest
import torch
from helpers import layout_box
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor
from shardtensor.layout import Layout

R = Replicate()

# Explicit uneven sizes per mesh shape: {mesh_dim: sizes} for a tensor sharded on dim 0 (and dim 1 on 2x2).
UNEVEN = {
    (4,): ([Shard(0)], {0: [3, 1, 0, 2]}),
    (2, 2): ([Shard(0), Shard(1)], {0: [5, 1], 1: [3, 0]}),
}
SHAPE = (6, 3)


def _integers(shape, seed):
    """Small integers in float64, so every sum and product is exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, shape, generator=generator).to(torch.float64)


def _uneven(full, mesh, placements, shard_sizes, *, requires_grad=False):
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    local = layout_box(full, layout, mesh.get_coordinate())
    dtensor = DTensor.from_local(local.clone().requires_grad_(requires_grad), mesh, placements, shape=full.shape,
                                 shard_sizes=shard_sizes)
    if requires_grad:
        dtensor.retain_grad()
    return dtensor


def _add(a, b):
    return a + b


def _where(a, b):
    return torch.where(b > 0, a, b * 2)


def _cat_along_columns(a, b):
    return torch.cat([a, b], dim=1)


def _broadcast_row(a, b):
    return a * b[:1]


OPS = {"add": _add, "where": _where, "cat_dim1": _cat_along_columns, "broadcast_row": _broadcast_row}


@pytest.mark.parametrize("op", sorted(OPS))
@spmd(meshes=[(4,), (2, 2)])
def test_replicate_input_adopts_uneven_pieces_locally(mesh, op):
    placements, shard_sizes = UNEVEN[tuple(mesh.shape)]
    full_a, full_b = _integers(SHAPE, 1), _integers(SHAPE, 2)
    a = _uneven(full_a, mesh, placements, shard_sizes, requires_grad=True)
    b = distribute_tensor(full_b, mesh, [R] * mesh.ndim).requires_grad_()
    with shardtensor.strict_mode(), comm.observe() as records:
        result = OPS[op](a, b)
    # Replicate -> Shard with a's pieces is a local slice; cat along dim 1 on 2x2 must move a's dim-1
    # shard: one all_gather on that mesh dim (re-sharding dim 0 over both mesh dims instead would
    # take an all_to_all per mesh dim and leave a dim-0 sharding on mesh dim 1 that no input had).
    expected_kinds = ["all_gather"] if op == "cat_dim1" and mesh.ndim == 2 else []
    assert [record.kind for record in records] == expected_kinds, records
    reference_a, reference_b = full_a.clone().requires_grad_(), full_b.clone().requires_grad_()
    expected = OPS[op](reference_a, reference_b)
    assert torch.equal(result.full_tensor(), expected)
    if not expected_kinds:  # the output keeps a's uneven pieces on dim 0
        assert result.sharding.pieces[0] == a.sharding.pieces[0]
    result.full_tensor().sum().backward()
    expected.sum().backward()
    assert torch.equal(a.grad.full_tensor(), reference_a.grad)
    assert torch.equal(b.grad.full_tensor(), reference_b.grad)


@spmd(meshes=[(4,), (2, 2)])
def test_chunk_sharded_input_is_resplit_to_uneven_pieces(mesh):
    placements, shard_sizes = UNEVEN[tuple(mesh.shape)]
    full_a, full_b = _integers(SHAPE, 3), _integers(SHAPE, 4)
    a = _uneven(full_a, mesh, placements, shard_sizes)
    b = distribute_tensor(full_b, mesh, placements)  # torch.chunk pieces: same placements, other sizes
    with shardtensor.strict_mode():
        result = a * b + a
    assert result.sharding.pieces == a.sharding.pieces
    assert torch.equal(result.full_tensor(), full_a * full_b + full_a)


@spmd(meshes=[(4,), (2, 2)])
def test_matmul_contracting_an_uneven_dim(mesh):
    """mm(a, b) with `a` unevenly sharded on the contracted dim: `b` (Replicate) is sliced to a's pieces
    of that dim and the product is Partial(sum), with no communication."""
    sizes = [3, 1, 0, 2] if mesh.ndim == 1 else [5, 1]
    placements = [Shard(1)] + [R] * (mesh.ndim - 1)
    full_a, full_b = _integers((4, 6), 5), _integers((6, 3), 6)
    a = _uneven(full_a, mesh, placements, {0: sizes}, requires_grad=True)
    b = distribute_tensor(full_b, mesh, [R] * mesh.ndim).requires_grad_()
    with shardtensor.strict_mode(), comm.observe() as records:
        product = torch.mm(a, b)
    assert records == [] and product.placements[0].is_partial("sum")
    assert torch.equal(product.full_tensor(), full_a @ full_b)
    reference_a, reference_b = full_a.clone().requires_grad_(), full_b.clone().requires_grad_()
    product.full_tensor().sum().backward()
    (reference_a @ reference_b).sum().backward()
    assert torch.equal(a.grad.full_tensor(), reference_a.grad)
    assert torch.equal(b.grad.full_tensor(), reference_b.grad)


# Reductions whose CPU kernel rejects an empty reduced dim (their meta kernels accept it): a size-3
# dim over 4 ranks leaves one shard empty.
EMPTY_SHARD_OPS = {
    "max.dim": lambda x: torch.max(x, 0).values,
    "argmax": lambda x: torch.argmax(x, 0),
    "amax": lambda x: torch.amax(x, 0),
    "max": lambda x: x.max(),
    "min.dim": lambda x: torch.min(x, 0).values,
    "argmin": lambda x: torch.argmin(x, 0),
    "amin": lambda x: torch.amin(x, 0),
    "min": lambda x: x.min(),
    "aminmax": lambda x: torch.stack(torch.aminmax(x, dim=0)),
    "median.dim": lambda x: torch.median(x, 0).values,
    "mode": lambda x: torch.mode(x, 0).values,
    "kthvalue": lambda x: torch.kthvalue(x, 1, 0).values,
    "logsumexp": lambda x: torch.logsumexp(x, 0),
}


@pytest.mark.parametrize("op", sorted(EMPTY_SHARD_OPS))
@spmd(meshes=[(4,), (2, 2)])
def test_a_kernel_rejecting_an_empty_shard_does_not_diverge(mesh, op):
    """Every rank returns the single-device value (or every rank raises): none waits for the others."""
    full = torch.randn(3, 2)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    result = EMPTY_SHARD_OPS[op](x)
    assert torch.equal(result.full_tensor(), EMPTY_SHARD_OPS[op](full))


# Reductions of a dim that is empty on one device too: each raises there, so each must raise on every rank
# (an empty shard reads as the identity only when another shard holds elements). The message of the
# local kernel where it runs (None: the meta kernel raises first, with its own words).
GLOBALLY_EMPTY_OPS = {
    "max": (lambda x: x.max(), r"max\(\): Expected reduction dim"),
    "min": (lambda x: x.min(), r"min\(\): Expected reduction dim"),
    "amax": (lambda x: torch.amax(x, 0), None),
    "aminmax": (lambda x: torch.aminmax(x), None),
    "vector_norm inf": (lambda x: torch.linalg.vector_norm(x, float("inf")), "inf norm"),
}


@spmd(meshes=[(2,), (4,), (2, 2)], timeout=30)
def test_a_reduction_of_a_globally_empty_dim_raises_on_every_rank(mesh):
    """max() of a (0, 3) tensor sharded on dim 0 returned -inf (every shard read as the identity)."""
    for placements in ([Shard(0)] * mesh.ndim, [Shard(1)] * mesh.ndim):
        x = distribute_tensor(torch.empty(0, 3), mesh, placements)
        for name, (op, message) in GLOBALLY_EMPTY_OPS.items():
            with pytest.raises((RuntimeError, IndexError)):
                op(torch.empty(0, 3))
            with pytest.raises((RuntimeError, IndexError), match=message):
                op(x).full_tensor()
