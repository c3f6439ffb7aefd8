"""The planner's moves (`redistribute/moves.py`) land where `Layout.transition` lands: `moved` repeats its
piece arithmetic without building a layout (the search prices a move before paying for one), so every
move `moves` offers from every layout of small meshes, uneven and empty dims, nested shards in both
orders, is checked against the layout `transition` builds."""

import itertools

import pytest

from shardtensor.layout import Layout
from shardtensor.placement import Partial, Replicate, Shard
from shardtensor.redistribute.moves import moved, moves

PLACEMENTS = (Replicate(), Partial("sum"), Shard(0), Shard(1))
CASES = [((2, 2), (5, 7)), ((2, 3), (6, 1)), ((2, 1, 2), (3, 0)), ((4,), (9, 4))]


def _layouts(mesh_shape, shape):
    """Every layout of these placements on the mesh, with both shard orders where two mesh dims split a
    dim, and explicit uneven sizes (all of the dim on the last rank) where mesh dim 0 alone splits one."""
    for placements in itertools.product(PLACEMENTS, repeat=len(mesh_shape)):
        orders = {None}
        for dim in range(len(shape)):
            splitting = [mesh_dim for mesh_dim, p in enumerate(placements) if p == Shard(dim)]
            if len(splitting) == 2:
                orders.add(tuple(tuple(splitting[::-1]) if d == dim else
                                 tuple(m for m, p in enumerate(placements) if p == Shard(d)) for d in range(len(shape))))
        for order in orders:
            yield Layout.create(mesh_shape, placements, shape, shard_order=order)
        first = placements[0]
        if isinstance(first, Shard) and sum(p == first for p in placements) == 1:
            sizes = [0] * (mesh_shape[0] - 1) + [shape[first.dim]]
            yield Layout.create(mesh_shape, placements, shape, shard_sizes={0: sizes})


@pytest.mark.parametrize("mesh_shape, shape", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_every_move_lands_where_transition_does(mesh_shape, shape):
    layouts = list(_layouts(mesh_shape, shape))
    checked = 0
    for state, target in itertools.product(layouts, layouts):
        for mesh_dim in range(len(mesh_shape)):
            for placement, pieces in moves(state, target, mesh_dim):
                after = state.transition(mesh_dim, placement, pieces=pieces)
                assert moved(state, mesh_dim, placement, pieces) == (after.placements, after.shard_order, after.pieces), (
                    state, target, mesh_dim, placement, pieces)
                checked += 1
    assert checked > len(layouts) ** 2  # every pair offers moves
