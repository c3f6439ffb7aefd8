"""Placements: how a tensor lies along one mesh dim.

`Shard(dim)` splits tensor dim `dim` across the mesh dim, `Replicate()` keeps a full copy on every
rank, and `Partial(reduce_op)` holds a summand (or max/min/... operand) whose reduction over the
mesh dim is the value. Placements are small immutable values, so layouts built from them can be
hashed and cached.

`Partial` also carries the algebra of its reduce op, in one place for the executor, the rules and
the tensor class: its identity value (what an empty shard contributes), and the operand a rank
holds when a value every rank has becomes a Partial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .graph_constants import register_graph_constant

__all__ = [
    "Placement", "Shard", "Replicate", "Partial", "NormPartial", "REDUCE_OPS", "normalize_placements", "chunk_sizes",
    "flattened_partial", "check_partial_dtype",
]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


def chunk_sizes(size: int, parts: int) -> tuple[int, ...]:
    """Sizes of `torch.chunk(size, parts)`, padded with empty chunks to exactly `parts` entries (SymInt
    expressions for a symbolic `size`: torch.compile's dynamic shapes, with no guard on the size)."""
    if isinstance(size, torch.SymInt):
        return _symbolic_chunk_sizes(size, parts)
    if not size:
        return (0,) * parts
    step = -(-size // parts)
    full = size // step  # pieces of `step`, then the rest, then empty pieces
    if full >= parts:
        return (step,) * parts
    return (step,) * full + (size - full * step,) + (0,) * (parts - full - 1)


def _symbolic_chunk_sizes(size: torch.SymInt, parts: int) -> tuple[torch.SymInt, ...]:
    """`chunk_sizes` of a symbolic size, written so that the pieces add up to `size` as an expression (the
    last piece is what the others leave), so comparing their sum with `size` needs no guard."""
    if parts == 1:
        return (size,)
    step = -(-size // parts)  # 0 for an empty dim too
    sizes = [step]
    for index in range(1, parts - 1):
        sizes.append(torch.sym_max(0, torch.sym_min(step, size - index * step)))
    sizes.append(size - sum(sizes))
    return tuple(sizes)


class Placement:
    """A placement along one mesh dim. Subclasses answer the three `is_*` questions."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """True for `Shard`, and, when `dim` is given, only if it shards that tensor dim."""
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        """True for `Partial`, and, when `reduce_op` is given, only for that reduce op."""
        return False

    def __fx_repr__(self) -> tuple[str, dict]:
        """How a compiled graph's code writes this placement (a constant of the graph): its repr, which
        reads like the constructor."""
        return repr(self), {type(self).__name__: type(self), "inf": math.inf}


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Shard(Placement):
    """Tensor dim `dim` is split across the mesh dim; sizes follow `torch.chunk` unless given."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) takes an int tensor dim, got {self.dim!r} ({type(self.dim).__name__})")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    @staticmethod
    def local_shard_size_and_offset(curr_local_size: int, num_chunks: int, rank: int) -> tuple[int, int]:
        """Size and offset of piece `rank` when `curr_local_size` elements are split in `num_chunks`
        `torch.chunk` pieces (an empty piece past the end has offset `curr_local_size`).

        >>> Shard.local_shard_size_and_offset(5, 4, 3)
        (0, 5)
        """
        sizes = chunk_sizes(curr_local_size, num_chunks)
        return sizes[rank], sum(sizes[:rank])

    def __str__(self) -> str:
        return f"S({self.dim})"

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Replicate(Placement):
    """Every rank along the mesh dim holds the whole tensor dim."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Partial(Placement):
    """Each rank holds an operand; the value is their reduction (`reduce_op`) over the mesh dim.

    `Partial("avg")` (the mean of the operands) needs a floating or complex dtype: integer and bool
    layouts with it are refused where they are made (`check_partial_dtype`; PyTorch fails later).
    """

    reduce_op: str = "sum"
    ALL_REDUCE_OPS: ClassVar[tuple[str, ...]] = REDUCE_OPS
    LINEAR_REDUCE_OPS: ClassVar[tuple[str, ...]] = ("sum", "avg")  # reduce(a + b) = reduce(a) + reduce(b)

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; "
                f"allowed reduce ops are {', '.join(REDUCE_OPS)}"
            )

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def identity(self, dtype: torch.dtype) -> bool | int | float:
        """The value that leaves any operand unchanged under the reduce op, in `dtype`: 0 for sum,
        1 for product, the lowest value of the dtype for max and the highest for min. What an
        empty shard contributes to a reduction; `avg` has none (it counts its operands)."""
        if self.reduce_op in ("sum", "product"):
            return int(self.reduce_op == "product")
        if self.reduce_op == "avg":
            raise ValueError("Partial(avg) has no identity value: an average counts its operands")
        highest = self.reduce_op == "min"
        if dtype == torch.bool:
            return highest
        if dtype.is_floating_point:
            return math.inf if highest else -math.inf
        info = torch.iinfo(dtype)
        return info.max if highest else info.min

    def operand_of(self, value: torch.Tensor, first: bool) -> torch.Tensor:
        """This rank's operand when every rank along the mesh dim holds the whole `value` and it
        becomes this Partial (`first`: the rank at coordinate 0 of the mesh dim). Reducing the
        operands gives `value` back exactly: the first rank keeps it, the others hold the identity
        for sum and product; avg, max and min of identical copies are the value itself."""
        if first or self.reduce_op in ("avg", "max", "min"):
            return value
        return torch.full_like(value, self.identity(value.dtype))

    def commutes_with(self, other: Partial) -> bool:
        """Whether reducing this Partial over one mesh dim and `other` over another gives one value
        in either order, so a layout may hold both: the same placement, or sum with avg (an average
        of sums is the sum of averages, both being linear). max over sums, say, is not."""
        both_linear = {self.reduce_op, other.reduce_op} <= set(self.LINEAR_REDUCE_OPS)
        return self == other or (type(self) is type(other) is Partial and both_linear)

    @property
    def collective_op(self) -> str:
        """The reduce op of the collective (all_reduce, reduce_scatter) that combines the operands."""
        return self.reduce_op

    def to_collective(self, operand: torch.Tensor) -> torch.Tensor:
        """What a rank sends into that collective for its `operand`: the operand itself."""
        return operand

    def from_collective(self, reduced: torch.Tensor) -> torch.Tensor:
        """The value from the collective's result: the result itself."""
        return reduced

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def __repr__(self) -> str:
        return f"Partial(reduce_op={self.reduce_op!r})"


@dataclass(frozen=True, slots=True)
class NormPartial(Partial):
    """Each rank holds the p-norm (`order` > 0, or inf) of its part of the data; the value is the
    p-norm of those norms: (sum of operand ** p) ** (1 / p), or their max for inf.

    This is what a vector norm over a sharded dim gives, and the norm of a vector of such norms
    with the same order is again one (the p-th powers of all shards of all entries add up), so
    `clip_grad_norm_` reduces once for all its gradients. Operands are norms (>= 0), or one rank's
    copy of a replicated value (any sign: the powers keep the sign, so it comes back exactly).
    """

    reduce_op: str = field(default="norm", init=False, repr=False)
    order: float = 2.0

    def __post_init__(self) -> None:
        if not (isinstance(self.order, (int, float)) and not isinstance(self.order, bool) and self.order > 0):
            raise ValueError(
                f"NormPartial(order={self.order!r}) is not supported; the order must be a number > 0 or "
                f"math.inf (norms of order 0 add up as Partial('sum'), of order -inf as Partial('min'))"
            )
        object.__setattr__(self, "order", float(self.order))

    def identity(self, dtype: torch.dtype) -> float:
        """0: a norm of nothing, and no contribution to a sum of powers or a max of norms."""
        return 0.0

    def operand_of(self, value: torch.Tensor, first: bool) -> torch.Tensor:
        """The first rank keeps `value`, the others 0 (for inf: every rank keeps it; max of copies)."""
        if first or self.order == math.inf:
            return value
        return torch.zeros_like(value)

    @property
    def collective_op(self) -> str:
        return "max" if self.order == math.inf else "sum"

    def to_collective(self, operand: torch.Tensor) -> torch.Tensor:
        """operand ** p with its sign kept (a replicated value's one copy may be negative)."""
        if self.order in (1.0, math.inf):
            return operand
        return operand.abs().pow(self.order).copysign(operand)

    def from_collective(self, reduced: torch.Tensor) -> torch.Tensor:
        """The p-th root of the summed powers, sign kept."""
        if self.order in (1.0, math.inf):
            return reduced
        return reduced.abs().pow(1.0 / self.order).copysign(reduced)

    def __str__(self) -> str:
        return f"P({self.order:g}-norm)"

    def __repr__(self) -> str:
        return f"NormPartial(order={self.order!r})"


def flattened_partial(placements: Sequence[Partial], sizes: Sequence[int]) -> tuple[Partial, int]:
    """How one collective over several Partial mesh dims flattened (of `sizes` ranks) reduces them all:
    (the Partial it reduces as, the count to divide its result by). Equal placements reduce as
    themselves (divide by 1); a mix of sum and avg (they commute) sums over every mesh dim and divides
    by the ranks along the avg ones: an average over some mesh dims of sums over the others.

    >>> flattened_partial([Partial("sum"), Partial("avg")], [2, 4])
    (Partial(reduce_op='sum'), 4)
    """
    if len(set(placements)) == 1:
        return placements[0], 1
    if not all(first.commutes_with(second) for first in placements for second in placements):
        raise ValueError(f"Partials {[str(p) for p in placements]} do not commute: no one collective reduces them")
    return Partial("sum"), math.prod(size for placement, size in zip(placements, sizes) if placement.reduce_op == "avg")


def check_partial_dtype(placements: Sequence[Placement], dtype: torch.dtype, function: str) -> None:
    """Refuse `Partial("avg")` on a dtype that is neither floating nor complex, before any collective.

    The value of a P(avg) is the mean of the ranks' operands, which integers (and bools) cannot hold in
    general, so no integer result is right; we raise where the layout is made (the same error on every
    rank, as the check reads only local metadata). PyTorch's DTensor accepts such a layout and fails at
    its first reduction inside the all_reduce ("result type Float can't be cast to ... Long").
    """
    if dtype.is_floating_point or dtype.is_complex:
        return
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and placement.reduce_op == "avg":
            raise ValueError(
                f"{function}: placements[{mesh_dim}] = Partial('avg') needs a floating or complex dtype, got "
                f"{dtype} (placements {tuple(placements)!r}): the mean of integer operands is not an integer "
                f"in general. Use Partial('sum') for {dtype} and divide after reducing, or convert the tensor "
                f"to a floating dtype first (tensor.float())"
            )


def _placements_error(placements: object, ndim: int, mesh_ndim: int, problem: str) -> ValueError:
    return ValueError(
        f"{problem}. Given placements {placements!r} for a tensor of {ndim} dims on a mesh of "
        f"{mesh_ndim} dims; give one Shard(dim) (-{ndim} <= dim < {ndim}), Replicate() or Partial() "
        f"per mesh dim."
    )


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Check placements against a tensor of `ndim` dims on a mesh of `mesh_ndim` dims.

    Returns them as a tuple with negative shard dims made non-negative; raises a ValueError or
    TypeError that names what was wrong otherwise.
    """
    if type(placements) is tuple and len(placements) == mesh_ndim:  # already normal: returned as it is, no loop
        for placement in placements:  # over enumerate and a new tuple (torch.compile traces every style hook's call)
            kind = type(placement)
            if not (kind is Replicate or kind is Partial or (kind is Shard and 0 <= placement.dim < ndim)):
                break
        else:
            return placements
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise _placements_error(placements, ndim, mesh_ndim, "placements must be a sequence of Placement")
    if len(placements) != mesh_ndim:
        raise _placements_error(
            placements, ndim, mesh_ndim, f"got {len(placements)} placements for {mesh_ndim} mesh dims"
        )
    normalized = []
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Placement):
            raise TypeError(
                f"placements[{mesh_dim}] is {placement!r} ({type(placement).__name__}), not a Placement; "
                f"use Shard(dim), Replicate() or Partial(reduce_op)"
            )
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                raise _placements_error(
                    placements, ndim, mesh_ndim, f"placements[{mesh_dim}] = {placement!r} is out of range"
                )
            if placement.dim < 0:
                placement = Shard(placement.dim + ndim)
        normalized.append(placement)
    return tuple(normalized)


# torch.compile holds placements in a graph as opaque values: compared with `==` (guards), hashed, kept in a
# weak dictionary by torch 2.15's tracer (hence the weakref slots; a graph may return them), and
# written into the graph's code by `__fx_repr__`.
for _placement_class in (Shard, Replicate, Partial, NormPartial):
    register_graph_constant(_placement_class)
