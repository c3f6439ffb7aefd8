"""The planner's moves: every step a search may take from a layout, each given as the placements, shard
order and pieces it leads to, so that the search can price a move out (`bounds.missing_between`) before
it builds the `Layout`; and the steps that can land on a given layout (the shortcuts' candidates).

One mesh dim moves at a time (`Layout.transition`'s rules: only the innermost mesh dim of a shard order
leaves it; a new split goes innermost and takes the target's pieces when its shard order becomes a
prefix of the target's); a flattened reduction moves several Partial mesh dims, a flattened gather the
mesh dims that shard one tensor dim innermost.
"""

from __future__ import annotations

import functools
import itertools
import math

from ..layout import Layout
from ..placement import Partial, Placement, Replicate, Shard, chunk_sizes

__all__ = ["flattened_gathers", "flattened_reductions", "gathered_is", "group_to_depth", "moved", "moves", "neighbors"]

_REPLICATE = Replicate()


@functools.lru_cache(maxsize=64)
def _shard(dim: int) -> Shard:
    """One `Shard(dim)` per dim: a planner step builds many and compares them."""
    return Shard(dim)


def target_pieces(state: Layout, target: Layout, mesh_dim: int, dim: int) -> tuple[int, ...] | None:
    """The pieces of `dim` after `mesh_dim` newly splits it, when that split is one the target has.

    When the resulting shard order of `dim` is a prefix of the target's, the new pieces are the
    target's pieces grouped to that depth, provided they refine the current (outer) pieces.
    """
    order = state.shard_order[dim]
    order = (order if mesh_dim not in order else tuple(other for other in order if other != mesh_dim)) + (mesh_dim,)
    target_order = target.shard_order[dim]
    if target_order[: len(order)] != order:
        return None
    inner = math.prod(target.mesh_shape[m] for m in target_order[len(order):])
    final = target.pieces[dim]
    grouped = final if inner == 1 else tuple(sum(final[i : i + inner]) for i in range(0, len(final), inner))
    parts = state.mesh_shape[mesh_dim]
    outer = group_to_depth(state, dim, order[:-1])
    if tuple(sum(grouped[i : i + parts]) for i in range(0, len(grouped), parts)) != outer:
        return None
    return grouped


def group_to_depth(state: Layout, dim: int, order: tuple[int, ...]) -> tuple[int, ...]:
    """Pieces of `dim` when only the mesh dims `order` (a prefix of its shard order) split it."""
    current = state.shard_order[dim]
    pieces = state.pieces[dim]
    if len(order) == len(current):
        return pieces
    if not order:
        return (sum(pieces),)
    inner = math.prod(state.mesh_shape[m] for m in current[len(order):])
    return tuple(sum(pieces[i : i + inner]) for i in range(0, len(pieces), inner))


def moves(state: Layout, target: Layout, mesh_dim: int, only: Placement | None = None):
    """Candidate (placement, pieces) moves for one mesh dim of `state`; with `only`, just those to it."""
    current = state.placements[mesh_dim]
    wanted = target.placements[mesh_dim]
    is_shard = isinstance(current, Shard)
    if is_shard and state.shard_order[current.dim][-1] != mesh_dim:
        return
    if not isinstance(current, Replicate) and (only is None or isinstance(only, Replicate)):
        yield _REPLICATE, None
    current_dim = current.dim if current.__class__ is Shard else None  # what `Shard(dim) == current` tests
    dims = range(state.ndim) if only is None else (only.dim,) if only.__class__ is Shard else ()
    for dim in dims:
        pieces = target_pieces(state, target, mesh_dim, dim)
        if dim != current_dim:
            yield _shard(dim), pieces
        elif pieces is not None and pieces != state.pieces[dim]:
            yield _shard(dim), pieces
    if not is_shard and isinstance(current, Replicate) and isinstance(wanted, Partial):
        yield wanted, None


def moved(state: Layout, mesh_dim: int, placement: Placement, pieces: tuple[int, ...] | None):
    """(placements, shard order, pieces) of `state.transition(mesh_dim, placement, pieces=pieces)` for a
    move `moves` gives (valid by construction, so unchecked), without building the layout."""
    old = state.placements[mesh_dim]
    order = list(state.shard_order)
    cut = list(state.pieces)
    parts = state.mesh_shape[mesh_dim]
    if isinstance(old, Shard):
        order[old.dim] = order[old.dim][:-1]
        merged = cut[old.dim]
        if len(merged) == parts:  # the dim's only split: one piece again
            cut[old.dim] = (sum(merged),)
        elif parts != 1:
            cut[old.dim] = tuple(sum(merged[i : i + parts]) for i in range(0, len(merged), parts))
    if isinstance(placement, Shard):
        dim = placement.dim
        order[dim] = order[dim] + (mesh_dim,)
        outer = cut[dim]
        if pieces is not None:
            cut[dim] = pieces
        elif len(outer) == 1:
            cut[dim] = chunk_sizes(outer[0], parts)
        else:
            cut[dim] = tuple(sub for piece in outer for sub in chunk_sizes(piece, parts))
    placements = state.placements[:mesh_dim] + (placement,) + state.placements[mesh_dim + 1:]
    return placements, tuple(order), tuple(cut)


def neighbors(state: Layout, target: Layout, flattened_groups: bool, exchange: bool):
    """(mesh dim, placements, shard order, pieces) for every step from `state`: one mesh dim's move, the
    flattened collectives (`flattened_groups`), and with `exchange` the exchange (mesh dim None)."""
    for mesh_dim in range(state.mesh_ndim):
        for placement, pieces in moves(state, target, mesh_dim):
            yield (mesh_dim, *moved(state, mesh_dim, placement, pieces))
    if flattened_groups:
        for mesh_dims, after in flattened_reductions(state, target):
            yield mesh_dims, after.placements, after.shard_order, after.pieces
        for dim, start, mesh_dims in _gather_groups(state):
            placements = tuple(_REPLICATE if mesh_dim in mesh_dims else placement
                               for mesh_dim, placement in enumerate(state.placements))
            order = state.shard_order[:dim] + (state.shard_order[dim][:start],) + state.shard_order[dim + 1:]
            pieces = state.pieces[:dim] + (group_to_depth(state, dim, order[dim]),) + state.pieces[dim + 1:]
            yield mesh_dims, placements, order, pieces
    if exchange:
        yield None, target.placements, target.shard_order, target.pieces


def flattened_reductions(state: Layout, target: Layout, landing: frozenset[int] | None = None):
    """(mesh dims, layout after) for one reduction over two or more Partial mesh dims at once (their
    Partials commute, or the planner has refused the plan; a mix reduces as `flattened_partial` says).

    The new shards are appended in ascending mesh-dim order, which is the row-major order of the
    flattened sub-mesh that `comm` uses, so peer i of the reduce_scatter receives piece i. With
    `landing` (the mesh dims where `state` and `target` differ), only the moves that can be the target.
    """
    moving = [
        mesh_dim for mesh_dim, placement in enumerate(state.placements)
        if isinstance(placement, Partial) and state.mesh_shape[mesh_dim] > 1 and target.placements[mesh_dim] != placement
    ]
    for count in range(2, len(moving) + 1):
        for mesh_dims in itertools.combinations(moving, count):
            wanted = {target.placements[mesh_dim] for mesh_dim in mesh_dims}
            if landing is not None and (set(mesh_dims) != landing or len(wanted) > 1):
                continue
            if landing is not None and wanted == {Replicate()} and state.shard_order == target.shard_order and (
                    state.pieces == target.pieces):  # the layout after is the target: yield it as is
                yield mesh_dims, target
            elif landing is None or wanted == {Replicate()}:
                yield mesh_dims, functools.reduce(lambda layout, m: layout.transition(m, Replicate()), mesh_dims, state)
            for dim in range(state.ndim):
                if landing is not None and wanted != {Shard(dim)}:
                    continue
                after = state
                for mesh_dim in mesh_dims:
                    after = after.transition(mesh_dim, Shard(dim), pieces=target_pieces(after, target, mesh_dim, dim))
                yield mesh_dims, after


def _gather_groups(state: Layout):
    """(dim, start, mesh dims) for every suffix `shard_order[dim][start:]` of two or more mesh dims of
    size > 1: the mesh dims one all_gather may make Replicate at once (`flattened_gathers`)."""
    for dim, order in enumerate(state.shard_order):
        for start in range(len(order) - 1):
            mesh_dims = order[start:]
            if len([mesh_dim for mesh_dim in mesh_dims if state.mesh_shape[mesh_dim] > 1]) >= 2:
                yield dim, start, mesh_dims


def flattened_gathers(state: Layout, target: Layout, landing: frozenset[int]):
    """(mesh dims, layout after) for the one all_gather over exactly the mesh dims `landing` that shard
    one tensor dim innermost (a suffix of its shard order, two or more of size > 1), where `target`
    replicates them.

    The mesh dims are given in shard order (outermost first): row-major over them, peer i holds
    piece i of the pieces being merged, consecutive on the tensor dim, so the collective's
    concatenation in peer order is the merged piece (exact sizes, uneven ones included).
    """
    for dim, start, mesh_dims in _gather_groups(state):
        if set(mesh_dims) != landing or any(not isinstance(target.placements[mesh_dim], Replicate) for mesh_dim in mesh_dims):
            continue
        if gathered_is(state, dim, start, target):  # the layout after is the target: yield it as is
            yield mesh_dims, target
            continue
        after = state
        for mesh_dim in reversed(mesh_dims):  # innermost first: only it may leave the shard order
            after = after.transition(mesh_dim, Replicate())
        yield mesh_dims, after


def gathered_is(state: Layout, dim: int, start: int, target: Layout) -> bool:
    """Whether gathering the mesh dims `state.shard_order[dim][start:]` (made Replicate) gives `target`,
    where the target replicates them and every other mesh dim's placement is already the target's."""
    orders, pieces = state.shard_order, state.pieces
    if target.shard_order[:dim] != orders[:dim] or target.shard_order[dim + 1:] != orders[dim + 1:]:
        return False
    if target.pieces[:dim] != pieces[:dim] or target.pieces[dim + 1:] != pieces[dim + 1:]:
        return False
    if target.shard_order[dim] != orders[dim][:start]:
        return False
    return target.pieces[dim] == group_to_depth(state, dim, orders[dim][:start])
