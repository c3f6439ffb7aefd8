"""What each rank holds and what any plan must move: per-rank geometry of a layout (the (offset,
shape) box of every coordinate's shard, the elements of a wanted shard a rank lacks) and from it
`lower_bound_bytes`, the bytes the busiest rank must receive in any plan between two layouts. The
planner prices its steps and its search heuristic with these, and prints each plan against the bound.
"""

from __future__ import annotations

import functools
import itertools
import math

from ..layout import Layout
from ..placement import Partial

__all__ = ["boxes", "overlap", "most_missing", "missing_at", "missing_between", "busiest_rank", "coordinate_of", "shard_shapes", "lower_bound_bytes"]


@functools.lru_cache(maxsize=4096)
def _piece_indices(mesh_shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Index of the piece held at every coordinate, in `itertools.product` order, for a tensor dim split
    by the mesh dims `order` (outermost first). It does not depend on sizes: every shape shares it."""
    strides = [0] * len(mesh_shape)
    step = 1
    for mesh_dim in reversed(order):
        strides[mesh_dim] = step
        step *= mesh_shape[mesh_dim]
    indices = [0]
    for size, stride in zip(mesh_shape, strides):  # row-major: the last mesh dim varies fastest
        indices = [index + stride * value for index in indices for value in range(size)]
    return tuple(indices)


@functools.lru_cache(maxsize=65536)
def _intervals(mesh_shape: tuple[int, ...], order: tuple[int, ...], pieces: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, length) on one tensor dim of the shard at every coordinate, in `itertools.product` order.

    Keyed by that tensor dim's cut alone, so the many layouts a search visits that differ only on
    other tensor dims share it.
    """
    if not order:
        return ((0, pieces[0]),) * math.prod(mesh_shape)
    start = 0
    spans = []
    for length in pieces:
        spans.append((start, length))
        start += length
    return tuple([spans[index] for index in _piece_indices(mesh_shape, order)])


def _dim_intervals(layout: Layout, dim: int) -> tuple[tuple[int, int], ...]:
    return _intervals(layout.mesh_shape, layout.shard_order[dim], layout.pieces[dim])


@functools.lru_cache(maxsize=65536)
def boxes(layout: Layout) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """(offset, shape) of the local shard at every coordinate, in `itertools.product` order."""
    if not layout.ndim:
        return (((), ()),) * math.prod(layout.mesh_shape)
    columns = zip(*(_dim_intervals(layout, dim) for dim in range(layout.ndim)))
    return tuple((tuple(start for start, _ in column), tuple(length for _, length in column)) for column in columns)


def overlap(first, second) -> int:
    """Number of elements in the intersection of two (offset, shape) boxes."""
    count = 1
    for start_a, size_a, start_b, size_b in zip(first[0], first[1], second[0], second[1]):
        count *= max(0, min(start_a + size_a, start_b + size_b) - max(start_a, start_b))
    return count


@functools.lru_cache(maxsize=65536)
def _kept_lengths(held: tuple[tuple[int, int], ...], wanted: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """Per coordinate, on one tensor dim: (length of held ∩ wanted, wanted length). Keyed by the two
    cuts alone, so layout pairs that differ only on other tensor dims share it (large meshes)."""
    kept_lengths = []
    for (held_start, held_length), (start, length) in zip(held, wanted):
        held_end, end = held_start + held_length, start + length
        kept = (held_end if held_end < end else end) - (held_start if held_start > start else start)
        kept_lengths.append((kept if kept > 0 else 0, length))
    return tuple(kept_lengths)


def most_missing(held: Layout, wanted: Layout) -> int:
    """Max over ranks of the elements of its `wanted` shard that its `held` shard lacks."""
    return _most_missing(held, wanted)[0]


def busiest_rank(held: Layout, wanted: Layout) -> int:
    """A coordinate (its index in `itertools.product` order) that lacks `most_missing` elements."""
    return _most_missing(held, wanted)[1]


# Up to this many ranks, `_most_missing` visits every coordinate: cheaper than building interval tables.
_PER_COORDINATE_RANKS = 4


@functools.lru_cache(maxsize=65536)
def _most_missing(held: Layout, wanted: Layout) -> tuple[int, int]:
    """`most_missing` and `busiest_rank`.

    A box is a product of per-dim intervals: missing = (product of unchanged lengths) *
    (product of wanted lengths - product of kept lengths) over the changed dims. A dim unsharded
    on both sides has one length everywhere, a factor taken out of the max.
    """
    mesh_shape = wanted.mesh_shape
    if math.prod(mesh_shape) <= _PER_COORDINATE_RANKS:
        most = busiest = 0
        held_order, held_cut, wanted_order, wanted_cut = held.shard_order, held.pieces, wanted.shard_order, wanted.pieces
        for index, coordinate in enumerate(itertools.product(*map(range, mesh_shape))):
            missing = missing_between(mesh_shape, held_order, held_cut, wanted_order, wanted_cut, coordinate)
            if missing > most:
                most, busiest = missing, index
        return most, busiest
    changed, unchanged = [], []
    factor = 1
    for dim in range(wanted.ndim):
        wanted_order, wanted_pieces = wanted.shard_order[dim], wanted.pieces[dim]
        if held.pieces[dim] != wanted_pieces or held.shard_order[dim] != wanted_order:
            changed.append(_kept_lengths(_dim_intervals(held, dim), _dim_intervals(wanted, dim)))
        elif wanted_order:
            unchanged.append(_dim_intervals(wanted, dim))
        else:
            factor *= wanted_pieces[0]
    if not changed or not factor:
        return 0, 0
    most = busiest = 0
    if len(changed) == 1 and not unchanged:  # the common step: one tensor dim is cut anew
        for index, (kept, length) in enumerate(changed[0]):
            if length - kept > most:
                most, busiest = length - kept, index
        return most * factor, busiest
    for index, parts in enumerate(zip(*changed)):
        wanted_numel = kept = 1
        for kept_length, length in parts:
            wanted_numel *= length
            kept *= kept_length
        if wanted_numel == kept:
            continue
        for column in unchanged:
            wanted_numel *= column[index][1]
            kept *= column[index][1]
        if wanted_numel - kept > most:
            most, busiest = wanted_numel - kept, index
    return most * factor, busiest


def missing_at(held: Layout, wanted: Layout, coordinate: tuple[int, ...]) -> int:
    """Elements of the `wanted` shard at one mesh coordinate that the `held` shard there lacks: one
    rank's term of `most_missing`, so never above it (and cheaper: no per-coordinate tables)."""
    return missing_between(wanted.mesh_shape, held.shard_order, held.pieces, wanted.shard_order, wanted.pieces, coordinate)


def missing_between(mesh_shape: tuple[int, ...], held_order, held_cut, wanted_order, wanted_cut,
                    coordinate: tuple[int, ...]) -> int:
    """`missing_at` from the two layouts' shard orders and pieces alone: the planner prices a move out
    with it before building the layout the move leads to. The piece indices are `Layout.piece_index`
    written inline: a call per tensor dim cost 2.4% of a first plan's instructions on 2x2."""
    wanted_numel = kept = 1
    for wanted_dims, wanted_pieces, held_dims, held_pieces in zip(wanted_order, wanted_cut, held_order, held_cut):
        index = 0
        for mesh_dim in wanted_dims:
            index = index * mesh_shape[mesh_dim] + coordinate[mesh_dim]
        length = wanted_pieces[index]
        wanted_numel *= length
        if not held_dims or (held_dims == wanted_dims and held_pieces == wanted_pieces):
            kept *= length  # the held piece is the whole dim, or the wanted piece itself
            continue
        held_index = 0
        for mesh_dim in held_dims:
            held_index = held_index * mesh_shape[mesh_dim] + coordinate[mesh_dim]
        if not wanted_dims:  # the wanted piece is the whole dim
            kept *= held_pieces[held_index]
            continue
        start = sum(wanted_pieces[:index]) if index else 0
        held_start = sum(held_pieces[:held_index]) if held_index else 0
        end, held_end = start + length, held_start + held_pieces[held_index]
        common = (end if end < held_end else held_end) - (start if start > held_start else held_start)
        kept *= common if common > 0 else 0
    return wanted_numel - kept


def coordinate_of(mesh_shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The mesh coordinate at index `rank` of `itertools.product` order (row-major)."""
    coordinate = []
    for size in reversed(mesh_shape):
        rank, position = divmod(rank, size)
        coordinate.append(position)
    return tuple(reversed(coordinate))


@functools.lru_cache(maxsize=65536)
def shard_shapes(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """The local shard shape at every coordinate, in `itertools.product` order."""
    return tuple(shape for _, shape in boxes(layout))


@functools.lru_cache(maxsize=65536)
def lower_bound_bytes(source: Layout, target: Layout, itemsize: int) -> int:
    """Bytes that the busiest rank must receive in any plan from `source` to `target`.

    Without a reduction (no Partial mesh dim of the source changes): the most target elements a
    rank does not hold yet. With one, let G be the number of operands each element combines (the
    product of the sizes of the source's Partial mesh dims that change) and K the number of
    separate reductions (the product of the sizes of the source's Partial mesh dims that the target
    keeps; a Partial the target adds is made from a reduced value, which every rank holds). Per
    element and kept coordinate, any plan receives at least `G - 1` values to combine the operands
    (each lies on a different rank) plus `N - 1` copies of the result, N being the ranks whose
    target shard holds the element: the first rank to hold the result needs one message from each
    other operand, every other holder one message after that. Summed: `K * numel * (G - 2) +
    sum over ranks of |target shard|`; the busiest rank receives at least the average over all
    ranks, and at least one value per element of its own target shard. A plan's `total_bytes`
    sums the busiest rank of each step, so it is never below this bound; an all_reduce
    (`2(G-1)/G` of the tensor per rank) and a reduce_scatter (`G - 1` pieces) are exactly at it.
    """
    reduced = _reduced_mesh_dims(source, target)
    group = math.prod(source.mesh_shape[mesh_dim] for mesh_dim in reduced)
    if group == 1:
        return most_missing(source, target) * itemsize
    kept = math.prod(
        size for size, before, after in zip(source.mesh_shape, source.placements, target.placements)
        if isinstance(before, Partial) and before == after
    )
    return _reduction_bound(target, group, kept) * itemsize // math.prod(target.mesh_shape)


def _reduced_mesh_dims(source: Layout, target: Layout) -> tuple[int, ...]:
    """The source's Partial mesh dims that the target does not keep (their operands are combined)."""
    return tuple(
        mesh_dim
        for mesh_dim, placement in enumerate(source.placements)
        if isinstance(placement, Partial) and target.placements[mesh_dim] != placement
    )


@functools.lru_cache(maxsize=65536)
def _reduction_bound(target: Layout, group: int, kept: int) -> int:
    """`lower_bound_bytes` in elements times the number of ranks, for `kept` separate reductions
    of `group` operands per element: it depends on the target alone, so a search prices it once."""
    ranks = math.prod(target.mesh_shape)
    if any(target.shard_order):
        numels = [math.prod(shape) for shape in shard_shapes(target)]
        total, largest = sum(numels), max(numels)
    else:  # every rank holds the whole tensor
        total, largest = ranks * target.numel, target.numel
    combine_and_copy = kept * target.numel * (group - 2) + total
    return max(combine_and_copy, ranks * largest)
