"""View and shape ops on DTensors: single-device results forward and backward, rules not fallback.

Each case runs under `strict_mode()` (so the replicate fallback would raise) on even and uneven
shards, including explicit `shard_sizes`, and compares values and gradients with plain torch.
"""

import torch
from helpers import layout_box
from spmd import spmd

import shardtensor
from shardtensor import DTensor, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.layout import Layout
from shardtensor.ops.views import KeptDim, view_dim_map


def make(full, mesh, placements, shard_sizes=None):
    """A DTensor of `full` (a non-leaf, so that torch.autograd.grad can differentiate w.r.t. it)."""
    layout = Layout.create(tuple(mesh.shape), placements, full.shape, shard_sizes=shard_sizes)
    local = layout_box(full, layout, mesh.get_coordinate()).clone().requires_grad_()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, shard_sizes=shard_sizes)


def check(mesh, full, placements, function, shard_sizes=None):
    """`function` on a DTensor equals `function` on `full`, forward and backward, with rules only."""
    full = full.to(torch.float64)
    dtensor = make(full, mesh, placements, shard_sizes)
    with shardtensor.strict_mode():
        result = function(dtensor)
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        reference_input = full.clone().requires_grad_()
        reference = function(reference_input)
        references = list(reference) if isinstance(reference, (list, tuple)) else [reference]
        gradients_full = [torch.linspace(-1, 1, r.numel(), dtype=torch.float64).reshape(r.shape) for r in references]
        gradients = [
            distribute_tensor(g, mesh, [Replicate()] * mesh.ndim).redistribute(placements=r.placements)
            for g, r in zip(gradients_full, results)
        ]
        for r, expected in zip(results, references):
            assert torch.equal(r.full_tensor(), expected), f"{function.__code__.co_firstlineno=} {placements}"
        (gradient,) = torch.autograd.grad(results, dtensor, gradients)
    (expected_gradient,) = torch.autograd.grad(references, reference_input, gradients_full)
    torch.testing.assert_close(gradient.full_tensor(), expected_gradient, rtol=0, atol=1e-12)
    return results


def check_both_shardings(mesh, full, function):
    """`check` with tensor dims (0, 1) sharded along mesh dims (0, 1), then with (1, 0)."""
    check(mesh, full, placements_for(mesh, 0, 1), function)
    check(mesh, full, placements_for(mesh, 1, 0), function)


def placements_for(mesh, *dims):
    """Shard(dims[m]) on mesh dim m (None: Replicate); extra mesh dims replicate."""
    chosen = list(dims[: mesh.ndim]) + [None] * (mesh.ndim - len(dims))
    return [Replicate() if dim is None else Shard(dim) for dim in chosen]


def test_view_dim_map_groups_merged_and_split_dims():
    assert view_dim_map((2, 3, 4), (6, 4)) == (KeptDim(0, 0, 3, 1), KeptDim(2, 1))
    assert view_dim_map((6, 4), (2, 3, 4)) == (KeptDim(0, 0, 1, 3), KeptDim(1, 2))
    assert view_dim_map((4, 1, 6), (4, 6, 1)) == (KeptDim(0, 0), KeptDim(2, 1))
    assert view_dim_map((6, 4), (4, 6)) == (KeptDim(0, 0, 4, 6),)
    assert view_dim_map((0, 3), (3, 0)) == ()


RESHAPES = [
    ((4, 3, 2), lambda x: x.view(12, 2), (0, 2)),
    ((4, 3, 2), lambda x: x.flatten(), (0, 0)),
    ((8, 3), lambda x: x.view(2, 4, 3), (0, 1)),
    ((8, 3), lambda x: x.unflatten(0, (4, 2)), (0, 0)),
    ((6, 5), lambda x: x.view(2, 3, 5), (0, 1)),  # 6 rows on 4 ranks: pieces 2,2,2,0 do not split by 3
    ((5, 6), lambda x: x.reshape(5, 2, 3), (1, 0)),
    ((5, 6), lambda x: x.t().reshape(-1), (0, 1)),  # non-contiguous: clone + _unsafe_view
    ((5, 1, 6), lambda x: x.squeeze(1), (2, 0)),
    ((5, 1, 6), lambda x: x.squeeze(), (0, 2)),
    ((5, 1, 6), lambda x: x.squeeze((1,)), (2, 0)),
    ((5, 6), lambda x: x.unsqueeze(1)[..., None], (0, 1)),
    ((5, 6), lambda x: x[None], (1, 0)),
    # dim 1 sharded (PEER_BUGS #179502): the inner dim of a merge must move first; the outer dim of one not
    ((4, 6), lambda x: x.view(24), (1, 0)),
    ((3, 4, 2), lambda x: x.view(12, 2), (1, 2)),
    ((3, 4, 2), lambda x: x.view(3, 8), (1, 0)),
    ((3, 8), lambda x: x.view(3, 2, 4), (1, 0)),
    ((3, 6, 2), lambda x: x.flatten(1), (1, 0)),
]


@spmd()
def test_reshapes(mesh):
    for shape, function, dims in RESHAPES:
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        check(mesh, full, placements_for(mesh, *dims), function)


@spmd(meshes=[(2,), (4,)])
def test_views_of_explicitly_uneven_shards(mesh):
    full = torch.arange(48.0).reshape(12, 4)
    sizes = {0: [1, 5]} if mesh.size() == 2 else {0: [2, 0, 3, 1]}
    merged = check(mesh, full.view(6, 2, 4), [Shard(0)], lambda x: x.flatten(0, 1), shard_sizes=sizes)[0]
    assert merged.placements == (Shard(0),)  # a merge keeps the outermost shard, pieces doubled
    assert merged.sharding.pieces[0] == tuple(2 * size for size in sizes[0])
    split = check(mesh, full, [Shard(0)], lambda x: x.view(6, 2, 4), shard_sizes={0: [2 * s for s in sizes[0]]})[0]
    assert split.placements == (Shard(0),) and split.sharding.pieces[0] == tuple(sizes[0])
    odd = {0: [3, 9]} if mesh.size() == 2 else {0: [3, 1, 6, 2]}
    odd_split = check(mesh, full, [Shard(0)], lambda x: x.view(6, 2, 4), shard_sizes=odd)[0]  # PEER_BUGS #179502
    assert odd_split.placements != (Shard(0),)  # redistributed first (to the cheapest dim it can keep)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_merging_a_sharded_outer_dim_issues_no_collective(mesh):
    full = torch.arange(96.0).reshape(8, 3, 4)
    x = distribute_tensor(full, mesh, placements_for(mesh, 0, 2))
    with comm.observe() as records:
        merged = x.view(24, 4)
        split = merged.view(8, 3, 4)
        moved = split.transpose(0, 1).permute(2, 0, 1)[:, 0].t()
    assert list(records) == []
    assert merged.placements == tuple(placements_for(mesh, 0, 1))
    assert torch.equal(moved.full_tensor(), full.transpose(0, 1).permute(2, 0, 1)[:, 0].t())


PERMUTES = [
    lambda x: x.transpose(0, 2),
    lambda x: x.transpose(-1, 1),
    lambda x: x.permute(2, 0, 1),
    lambda x: x.movedim(0, -1),
    lambda x: x[:, 0].t(),
    lambda x: x.expand(2, 5, 3, 4),
    lambda x: x[:, :1].expand(5, 3, 4),
    lambda x: x.expand_as(torch.empty(5, 3, 4)) * 1,
    lambda x: x.repeat(1, 2, 1),
    lambda x: x.repeat(2, 1, 1, 2),
]


@spmd()
def test_permutes_expands_repeats(mesh):
    full = torch.arange(60.0).reshape(5, 3, 4)
    for function in PERMUTES:
        check(mesh, full, placements_for(mesh, 0, 2), function)
        check(mesh, full, placements_for(mesh, 2, 1), function)


SPLITS = [
    lambda x: x.split(2, dim=1),
    lambda x: x.split([1, 3], dim=-1),
    lambda x: x.chunk(3, dim=0),
    lambda x: x.unbind(1),
    lambda x: torch.cat([x, x * 2], dim=1),
    lambda x: torch.cat([x, x[:2]], dim=0),
    lambda x: torch.stack([x, x + 1], dim=1),
    lambda x: torch.stack([x, x + 1], dim=-1),
]


@spmd()
def test_splits_and_joins(mesh):
    full = torch.arange(20.0).reshape(5, 4)
    for function in SPLITS:
        check_both_shardings(mesh, full, function)


SLICES = [
    lambda x: x[1:4],
    lambda x: x[1:6:2],
    lambda x: x[-3:],
    lambda x: x[:, 1:-1],
    lambda x: x.narrow(0, 2, 3),
    lambda x: x.narrow(1, 1, 2)[::3],
    lambda x: x[2],
    lambda x: x[:, -1],
    lambda x: x.select(0, -2),
    lambda x: x[4:2],
    lambda x: x.as_strided((2, 2), (4, 1), 1),
]


@spmd()
def test_slices_and_selects(mesh):
    full = torch.arange(28.0).reshape(7, 4)
    for function in SLICES:
        check_both_shardings(mesh, full, function)


@spmd(meshes=[(2,), (4,)])
def test_slicing_a_sharded_dim_is_local_and_uneven(mesh):
    full = torch.arange(40.0).reshape(10, 4)
    x = distribute_tensor(full, mesh, [Shard(0)])
    with comm.observe() as records:
        sliced = x[1:9:3]
    assert list(records) == []
    assert sliced.placements == (Shard(0),) and sum(sliced.sharding.pieces[0]) == 3
    assert torch.equal(sliced.full_tensor(), full[1:9:3])


@spmd(meshes=[(2,), (2, 2)])
def test_partial_passes_through_views(mesh):
    local = torch.arange(12.0).reshape(3, 4)
    partial = DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)
    with shardtensor.strict_mode(), comm.observe() as records:
        moved = partial.t().reshape(2, 6)[1]
    assert list(records) == [] and moved.placements == (Partial(),) * mesh.ndim
    assert torch.equal(moved.full_tensor(), (local * mesh.size()).t().reshape(2, 6)[1])


COPIES = [
    torch.alias_copy,
    lambda x: torch.transpose_copy(x, 0, 2),
    lambda x: torch.permute_copy(x, (2, 0, 1)),
    lambda x: torch.t_copy(x[:, 0]),
    lambda x: torch.view_copy(x, (5, 12)),
    lambda x: torch.squeeze_copy(x[:, :1]),
    lambda x: torch.squeeze_copy(x[:, :1], 1),
    lambda x: torch.squeeze_copy(x[:, :1], (1, 2)),
    lambda x: torch.unsqueeze_copy(x, 1),
    lambda x: torch.expand_copy(x, (2, 5, 3, 4)),
    lambda x: torch.split_copy(x, 2, 1),
    lambda x: torch.split_with_sizes_copy(x, [1, 3], -1),
    lambda x: torch.unsafe_split(x, 2, 0),
    lambda x: torch.unsafe_chunk(x, 2, 2),
    lambda x: torch.unsafe_split_with_sizes(x, [2, 1], 1),
    lambda x: torch.unbind_copy(x, 1),
    lambda x: torch.select_copy(x, 2, -1),
    lambda x: torch.slice_copy(x, 0, 1, 5, 2),
    lambda x: torch.narrow_copy(x, 0, 1, 3),
    lambda x: torch.narrow_copy(x, 2, -3, 2),
    lambda x: torch.diagonal_copy(x, 1, 0, 2),
    lambda x: x.unfold(1, 2, 1),
    lambda x: x.unfold(0, 2, 2),
    lambda x: torch.unfold_copy(x, 2, 3, 1),
    lambda x: torch.as_strided_copy(x, (2, 3), (4, 1), 2),
]


@spmd()
def test_copy_variants_reuse_their_views_rule(mesh):
    full = torch.arange(60.0).reshape(5, 3, 4)
    for function in COPIES:
        for placements in (placements_for(mesh, 0, 2), placements_for(mesh, 2, 1)):
            check(mesh, full, placements, function)
    x = distribute_tensor(full, mesh, placements_for(mesh, 0, 2))
    with shardtensor.strict_mode(), comm.observe() as records:
        copies = [torch.transpose_copy(x, 1, 2), torch.view_copy(x, (5, 3, 2, 2)), torch.narrow_copy(x, 0, 1, 3),
                  torch.unfold_copy(x, 1, 2, 1), torch.detach_copy(x)]
    assert list(records) == []  # kept shards: no collective
    assert copies[0].placements == tuple(placements_for(mesh, 0, 1))
    for copy in copies:  # a copy, not a view: writing into it leaves the input alone
        copy.zero_()
    assert torch.equal(x.full_tensor(), full)
