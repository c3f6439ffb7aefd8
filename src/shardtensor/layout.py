"""Layout: which rank holds which slice of a global tensor. Pure arithmetic, no processes.

A tensor dim sharded over mesh dims `(m1, ..., mk)` (its *shard order*, outermost first) is cut into
`n_m1 * ... * n_mk` contiguous *pieces*, numbered lexicographically by the coordinates
`(c_m1, ..., c_mk)`. `Layout.pieces[dim]` stores their lengths, so uneven and ragged sharding is
exact data rather than a special case; the default pieces follow `torch.chunk` applied
recursively (trailing pieces may be empty).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .graph_constants import MemberType, register_graph_constant
from .placement import Partial, Placement, Replicate, Shard, chunk_sizes, normalize_placements

__all__ = ["Layout", "chunk_sizes", "contiguous_stride", "example_size", "ShardSizes"]

# Layouts derived from a layout (`with_placements` targets, `without_partial`: key (layout, placements or
# None)), local shapes (key (layout, coordinate)) and explicit pieces (key: the layout), remembered by value:
# a training step asks for the same ones at every module boundary. Pure functions of hashable values, so
# never stale; emptied when full.
_MAX_REMEMBERED = 4096
_derived: dict[tuple, Layout] = {}
_local_shapes: dict[tuple, tuple[int, ...]] = {}
_explicit_pieces: dict[Layout, tuple[tuple[int, ...] | None, ...]] = {}


def _remember(store: dict, key: tuple, value):
    """Put `value` in `store` under `key` (emptying a full store first) and return it."""
    if len(store) >= _MAX_REMEMBERED:
        store.clear()
    store[key] = value
    return value

# What users may pass to describe shard sizes: "chunk", or {mesh_dim: sizes along that mesh dim}.
ShardSizes = str | Mapping[int, Sequence[int]] | None


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a dim of size 0 counts as 1, as torch does)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _size(value) -> int | torch.SymInt:
    """A size as an int, or as it is when symbolic (a SymInt of torch.compile's dynamic shapes)."""
    return value if isinstance(value, torch.SymInt) else int(value)


def example_size(size: int | torch.SymInt) -> int:
    """A size as an int: a SymInt's value in the example torch.compile traces with, read without a guard
    (for choices that are right for every size, such as which of two correct rows moves fewer bytes)."""
    if not isinstance(size, torch.SymInt):
        return size
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return optimization_hint(size, fallback=8192)


def _default_pieces(size: int, split_counts: Sequence[int]) -> tuple[int, ...]:
    """Recursive chunking: the first count splits the dim, each later count splits every piece."""
    pieces = (size,)
    for parts in split_counts:
        pieces = tuple(sub for piece in pieces for sub in chunk_sizes(piece, parts))
    return pieces


def _default_shard_order(placements: Sequence[Placement], ndim: int) -> tuple[tuple[int, ...], ...]:
    order = [[] for _ in range(ndim)]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            order[placement.dim].append(mesh_dim)
    return tuple(tuple(mesh_dims) for mesh_dims in order)


def _layout_error(layout_text: str, problem: str, allowed: str) -> ValueError:
    return ValueError(f"{problem} (layout: {layout_text}); {allowed}")


class SymbolicLayoutHashError(TypeError):
    """`hash` of a layout with symbolic sizes; its message is formatted only when read, because callers
    catch it while tracing and printing symbolic sizes costs milliseconds of sympy."""

    def __init__(self, layout) -> None:
        super().__init__()
        self.layout = layout

    def __str__(self) -> str:
        return f"a layout with symbolic sizes is not hashable: {self.layout}"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Layout:
    """Global shape, mesh shape, placements, shard order and exact piece sizes of a tensor.

    Build one with `Layout.create`; fields are normalized tuples so that layouts hash and compare
    cheaply. `shard_order[dim]` lists the mesh dims sharding `dim`, outermost first, and
    `pieces[dim]` the lengths of its pieces (`(shape[dim],)` for an unsharded dim).
    """

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    shard_order: tuple[tuple[int, ...], ...]
    pieces: tuple[tuple[int, ...], ...]
    # Computed once: layouts key the decision cache and plans, and hashing five nested tuples costs ~1 us.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            fields_hash = hash((self.mesh_shape, self.placements, self.shape, self.shard_order, self.pieces))
        except TypeError:  # symbolic sizes (a SymInt is unhashable): see `is_symbolic`
            fields_hash = None
        object.__setattr__(self, "_hash", fields_hash)

    def __hash__(self) -> int:
        if self._hash is None:
            raise SymbolicLayoutHashError(self)
        return self._hash

    def __reduce__(self):
        # Rebuilt, not copied: a string's hash differs between processes, so a pickled `_hash` would be stale.
        return (Layout, (self.mesh_shape, self.placements, self.shape, self.shard_order, self.pieces))

    @classmethod
    def create(
        cls,
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        shape: Sequence[int],
        *,
        shard_sizes: ShardSizes = None,
        shard_order: Sequence[Sequence[int]] | None = None,
    ) -> Layout:
        """Validate and build a layout.

        `shard_sizes` is None or "chunk" (the `torch.chunk` default) or `{mesh_dim: sizes}` giving
        the shard sizes along a mesh dim that alone shards its tensor dim (uneven, even empty,
        shards). `shard_order` overrides the default order (ascending mesh dims) per tensor dim.

        >>> Layout.create((2,), [Shard(0)], (5, 3)).local_shape((1,))
        (2, 3)
        """
        mesh_shape = tuple(int(size) for size in mesh_shape)
        shape = tuple(size if type(size) is int else _size(size) for size in shape)
        placements = normalize_placements(placements, len(shape), len(mesh_shape))
        order = _default_shard_order(placements, len(shape))
        if shard_order is not None:
            order = cls._checked_shard_order(shard_order, order, placements)
        pieces = [
            _default_pieces(shape[dim], [mesh_shape[mesh_dim] for mesh_dim in order[dim]])
            for dim in range(len(shape))
        ]
        if shard_sizes not in (None, "chunk"):
            cls._apply_shard_sizes(shard_sizes, mesh_shape, placements, shape, order, pieces)
        return cls(mesh_shape, placements, shape, order, tuple(pieces))

    @staticmethod
    def _checked_shard_order(shard_order, default_order, placements) -> tuple[tuple[int, ...], ...]:
        order = tuple(tuple(int(mesh_dim) for mesh_dim in mesh_dims) for mesh_dims in shard_order)
        if len(order) != len(default_order) or any(
            sorted(given) != list(default) for given, default in zip(order, default_order)
        ):
            raise ValueError(
                f"shard_order {order} does not match placements {list(placements)}: each tensor dim must "
                f"list exactly the mesh dims that shard it (default order: {default_order})"
            )
        return order

    @staticmethod
    def _apply_shard_sizes(shard_sizes, mesh_shape, placements, shape, order, pieces) -> None:
        if isinstance(shard_sizes, str) or not isinstance(shard_sizes, Mapping):
            raise ValueError(
                f"shard_sizes={shard_sizes!r} is not understood; use 'chunk', or a mapping "
                f"{{mesh_dim: sizes}} for mesh dims that shard a tensor dim alone"
            )
        for mesh_dim, sizes in shard_sizes.items():
            if not isinstance(mesh_dim, int) or not 0 <= mesh_dim < len(mesh_shape):
                raise ValueError(f"shard_sizes key {mesh_dim!r} is not a mesh dim of a mesh of shape {mesh_shape}")
            placement = placements[mesh_dim]
            if not isinstance(placement, Shard):
                raise ValueError(
                    f"shard_sizes gives sizes for mesh dim {mesh_dim}, whose placement is {placement!r}; "
                    f"sizes are only meaningful for Shard placements"
                )
            dim = placement.dim
            if len(order[dim]) != 1:
                raise ValueError(
                    f"tensor dim {dim} is sharded over mesh dims {order[dim]}; explicit shard_sizes are "
                    f"supported for a tensor dim sharded by one mesh dim (use shard_sizes='infer' in "
                    f"from_local for nested uneven sharding)"
                )
            sizes = tuple(int(size) for size in sizes)
            if len(sizes) != mesh_shape[mesh_dim] or sum(sizes) != shape[dim] or min(sizes) < 0:
                raise ValueError(
                    f"shard_sizes[{mesh_dim}] = {list(sizes)} must have {mesh_shape[mesh_dim]} non-negative "
                    f"entries (one per coordinate of mesh dim {mesh_dim}) summing to the size {shape[dim]} "
                    f"of tensor dim {dim}"
                )
            pieces[dim] = sizes

    @classmethod
    def from_local_shapes(
        cls,
        mesh_shape: Sequence[int],
        placements: Sequence[Placement],
        local_shapes: Mapping[tuple[int, ...], Sequence[int]],
        *,
        shard_order: Sequence[Sequence[int]] | None = None,
    ) -> Layout:
        """Build the exact layout from every coordinate's local shape (as gathered from all ranks).

        Raises a ValueError naming the coordinates whose shapes disagree, e.g. ranks that differ on a
        dim that is not sharded, or two ranks holding the same piece with different sizes.
        """
        any_shape = next(iter(local_shapes.values()))
        ndim = len(any_shape)
        layout = cls.create(mesh_shape, placements, [0] * ndim, shard_order=shard_order)
        pieces: list[list[int | None]] = [[None] * len(layout.pieces[dim]) for dim in range(ndim)]
        for coordinate, local_shape in local_shapes.items():
            if len(local_shape) != ndim:
                raise ValueError(
                    f"local tensors have different numbers of dims: {any_shape} and {tuple(local_shape)} "
                    f"at mesh coordinate {coordinate}"
                )
            for dim in range(ndim):
                index = layout.piece_index(dim, coordinate)
                known = pieces[dim][index]
                if known is not None and known != local_shape[dim]:
                    raise ValueError(
                        f"local shapes disagree on tensor dim {dim}: mesh coordinate {coordinate} holds "
                        f"{local_shape[dim]} where another rank holding the same "
                        f"{'piece' if layout.shard_order[dim] else 'replicated dim'} holds {known} "
                        f"(placements {list(layout.placements)})"
                    )
                pieces[dim][index] = _size(local_shape[dim])
        exact = tuple(tuple(0 if size is None else size for size in dim_pieces) for dim_pieces in pieces)
        shape = tuple(sum(dim_pieces) for dim_pieces in exact)
        return cls(layout.mesh_shape, layout.placements, shape, layout.shard_order, exact)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_symbolic(self) -> bool:
        """True when a size is a SymInt (traced by torch.compile with dynamic shapes). Such a layout
        belongs to one trace, whose symbols it holds: it is never hashed, so no cache keeps it."""
        return self._hash is None

    @property
    def mesh_ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def piece_index(self, dim: int, coordinate: Sequence[int]) -> int:
        """Index into `pieces[dim]` of the piece held at a mesh coordinate."""
        index = 0
        for mesh_dim in self.shard_order[dim]:
            index = index * self.mesh_shape[mesh_dim] + coordinate[mesh_dim]
        return index

    def local_shape(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        """Shape of the local shard held at a mesh coordinate (remembered by value, as `with_placements`)."""
        key = (self, tuple(coordinate)) if self._hash is not None else None
        known = _local_shapes.get(key) if key is not None else None
        if known is not None:
            return known
        shape = tuple(self.pieces[dim][self.piece_index(dim, coordinate)] for dim in range(self.ndim))
        return shape if key is None else _remember(_local_shapes, key, shape)

    def local_offset(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        """Global index of the first element of the local shard held at a mesh coordinate."""
        return tuple(sum(self.pieces[dim][: self.piece_index(dim, coordinate)]) for dim in range(self.ndim))

    def sizes_along(self, mesh_dim: int, dim: int, coordinate: Sequence[int]) -> list[int]:
        """Sizes on tensor dim `dim` of the shards of the peers along `mesh_dim`, in coordinate order."""
        peer = list(coordinate)
        sizes = []
        for position in range(self.mesh_shape[mesh_dim]):
            peer[mesh_dim] = position
            sizes.append(self.pieces[dim][self.piece_index(dim, peer)])
        return sizes

    def is_chunked(self) -> bool:
        """True when every piece follows the `torch.chunk` default (no explicit uneven sizes)."""
        return all(
            pieces == _default_pieces(sum(pieces), [self.mesh_shape[m] for m in order])
            for pieces, order in zip(self.pieces, self.shard_order)
        )

    def explicit_pieces(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per tensor dim, its pieces when the dim's size alone does not give them (explicit uneven
        sizes), else None (one piece when not sharded, `torch.chunk` pieces when sharded). Remembered by value,
        as `local_shape`: a parallel style's boundary reads them on every call."""
        known = _explicit_pieces.get(self) if self._hash is not None else None
        if known is not None:
            return known
        explicit = tuple(
            None if pieces == _default_pieces(size, [self.mesh_shape[m] for m in order]) else pieces
            for size, pieces, order in zip(self.shape, self.pieces, self.shard_order)
        )
        return explicit if self._hash is None else _remember(_explicit_pieces, self, explicit)

    def has_default_shard_order(self) -> bool:
        return all(list(order) == sorted(order) for order in self.shard_order)

    def partial_mesh_dims(self) -> tuple[int, ...]:
        return tuple(mesh_dim for mesh_dim, p in enumerate(self.placements) if isinstance(p, Partial))

    def with_example_sizes(self) -> Layout:
        """This layout with every symbolic size replaced by its `example_size` (itself when concrete)."""
        if not self.is_symbolic:
            return self
        shape = tuple(example_size(size) for size in self.shape)
        pieces = tuple(tuple(example_size(size) for size in dim_pieces) for dim_pieces in self.pieces)
        return Layout(self.mesh_shape, self.placements, shape, self.shard_order, pieces)

    def with_shape(self, shape: Sequence[int | torch.SymInt]) -> Layout:
        """This layout for a global `shape` that may hold SymInts (torch.compile's dynamic shapes), this
        layout's (concrete) sizes being the traced example's. A dim not sharded, or cut into `torch.chunk` pieces,
        takes its new size (pieces that are SymInt expressions); a dim with other pieces keeps them, and
        its size must be theirs (a symbolic size is then specialized: the graph is guarded on it)."""
        if tuple(shape) is self.shape:
            return self
        pieces = []
        for dim, (size, dim_pieces, order) in enumerate(zip(shape, self.pieces, self.shard_order)):
            if not isinstance(size, torch.SymInt):
                size = int(size)
                if size == self.shape[dim]:
                    pieces.append(dim_pieces)
                    continue
            splits = [self.mesh_shape[mesh_dim] for mesh_dim in order]
            if dim_pieces == _default_pieces(self.shape[dim], splits):
                pieces.append(_default_pieces(size, splits))
            elif size == sum(dim_pieces):
                pieces.append(dim_pieces)
            else:
                raise _layout_error(
                    str(self), f"tensor dim {dim} has explicit pieces {dim_pieces} and the new size {size}",
                    "explicit pieces keep their sizes",
                )
        return Layout(self.mesh_shape, self.placements, tuple(shape), self.shard_order, tuple(pieces))

    # ---- derived layouts -----------------------------------------------------------------------

    def with_placements(
        self, placements: Sequence[Placement], *, shard_order: Sequence[Sequence[int]] | None = None
    ) -> Layout:
        """The same tensor under other placements: a redistribute target.

        Tensor dims whose shard order is unchanged keep their exact pieces; the others get the
        `torch.chunk` default. The same placements (no `shard_order`) give this layout itself, so a
        nested shard order that is not the default one is not "moved" to the default.
        """
        placements = tuple(placements)
        if shard_order is None and placements == self.placements:
            return self
        # Parallel styles and fully_shard ask for the same targets every step: remembered by value.
        key = (self, placements) if shard_order is None and self._hash is not None else None
        known = _derived.get(key) if key is not None else None
        if known is not None:
            return known
        target = Layout.create(self.mesh_shape, placements, self.shape, shard_order=shard_order)
        pieces = tuple(
            old if old_order == new_order else new
            for old, new, old_order, new_order in zip(self.pieces, target.pieces, self.shard_order, target.shard_order)
        )
        result = Layout(self.mesh_shape, target.placements, self.shape, target.shard_order, pieces)
        return result if key is None else _remember(_derived, key, result)

    def without_partial(self) -> Layout:
        """The same layout with every Partial made Replicate: where the reduced value lives, and
        the layout of a Partial tensor's gradient."""
        key = (self, None) if self._hash is not None else None
        known = _derived.get(key) if key is not None else None
        if known is not None:
            return known
        result = self
        if self.partial_mesh_dims():
            placements = tuple(Replicate() if isinstance(p, Partial) else p for p in self.placements)
            result = Layout(self.mesh_shape, placements, self.shape, self.shard_order, self.pieces)
        return result if key is None else _remember(_derived, key, result)

    def operand_of(self, value: torch.Tensor, coordinate: Sequence[int] | None) -> torch.Tensor:
        """The local tensor at `coordinate` of this layout, from `value`, that coordinate's shard of
        `without_partial()`: on each Partial mesh dim see `Partial.operand_of`. A rank outside the
        mesh (`coordinate` None) holds no elements and keeps `value`."""
        if coordinate is None:
            return value
        for mesh_dim in self.partial_mesh_dims():
            value = self.placements[mesh_dim].operand_of(value, first=coordinate[mesh_dim] == 0)
        return value

    def transition(
        self, mesh_dim: int, placement: Placement, *, pieces: Sequence[int] | None = None
    ) -> Layout:
        """The layout after changing only `mesh_dim` to `placement` (one planner step).

        A shard can leave a tensor dim only if `mesh_dim` is the innermost mesh dim splitting it (the
        merged pieces are then contiguous); a new shard becomes the innermost split of its tensor dim,
        each existing piece chunked by `torch.chunk`, or cut into the given `pieces` (the new pieces of
        that tensor dim, `mesh_shape[mesh_dim]` per existing piece). With `pieces`, `placement` may
        equal the current Shard: the innermost split is then redrawn (a re-split).
        """
        old = self.placements[mesh_dim]
        if not isinstance(placement, Placement):
            raise TypeError(f"{placement!r} is not a Placement")
        if pieces is not None and not isinstance(placement, Shard):
            raise _layout_error(str(self), f"pieces={tuple(pieces)} given for {placement!r}", "pieces apply to a Shard")
        changes = old != placement or pieces is not None
        order = list(self.shard_order)
        new_pieces = list(self.pieces)
        parts = self.mesh_shape[mesh_dim]
        if isinstance(old, Shard) and changes:
            if order[old.dim][-1] != mesh_dim:
                raise _layout_error(
                    str(self),
                    f"mesh dim {mesh_dim} is not the innermost mesh dim sharding tensor dim {old.dim} "
                    f"(shard order {order[old.dim]})",
                    "unshard the inner mesh dims first",
                )
            order[old.dim] = order[old.dim][:-1]
            merged = new_pieces[old.dim]
            new_pieces[old.dim] = merged if parts == 1 else tuple(
                sum(merged[i : i + parts]) for i in range(0, len(merged), parts))
        if isinstance(placement, Shard) and changes:
            if not 0 <= placement.dim < self.ndim:
                raise _layout_error(str(self), f"{placement!r} is out of range", f"use 0 <= dim < {self.ndim}")
            order[placement.dim] = order[placement.dim] + (mesh_dim,)
            outer = new_pieces[placement.dim]
            if pieces is None and len(outer) == 1:
                new_pieces[placement.dim] = chunk_sizes(outer[0], parts)
            elif pieces is None:
                new_pieces[placement.dim] = tuple(sub for piece in outer for sub in chunk_sizes(piece, parts))
            else:
                new_pieces[placement.dim] = self._checked_split(outer, tuple(int(size) for size in pieces), parts)
        placements = list(self.placements)
        placements[mesh_dim] = placement
        return Layout(self.mesh_shape, tuple(placements), self.shape, tuple(order), tuple(new_pieces))

    @staticmethod
    def _checked_split(outer: tuple[int, ...], pieces: tuple[int, ...], parts: int) -> tuple[int, ...]:
        grouped = tuple(sum(pieces[i : i + parts]) for i in range(0, len(pieces), parts))
        if len(pieces) != len(outer) * parts or grouped != outer or min(pieces, default=0) < 0:
            raise ValueError(
                f"pieces {pieces} do not split the pieces {outer} into {parts} non-negative parts each; "
                f"give {len(outer) * parts} sizes whose consecutive groups of {parts} sum to {outer}"
            )
        return pieces

    def __fx_repr__(self) -> tuple[str, dict]:
        """How a compiled graph's code writes this layout (a constant of the graph): its repr, which reads
        like the constructor."""
        names = {"Layout": Layout}
        for placement in self.placements:
            names.update(placement.__fx_repr__()[1])
        return repr(self), names

    def __str__(self) -> str:
        text = f"[{', '.join(str(p) for p in self.placements)}] shape={self.shape} mesh={self.mesh_shape}"
        if not self.has_default_shard_order():
            text += f" order={self.shard_order}"
        if not self.is_chunked():
            text += f" pieces={self.pieces}"
        return text


# torch.compile holds a layout as an opaque value (compared with `==`, hashed, written into a graph's code
# by `__fx_repr__`), as it holds placements: a parallel style's Python reads a traced DTensor's layout
# (`parallel.layouts`). Its fields are read directly; its methods run on the real layout while tracing.
register_graph_constant(Layout, members={"local_shape": MemberType.USE_REAL, "explicit_pieces": MemberType.USE_REAL})
