"""Index checks that every rank agrees on: a bad index raises on every rank, or on none.

A kernel that checks index values (gather, scatter, `x[index]`, embedding, nll_loss targets) sees
only this rank's shard of the index. When the index is sharded, the rank holding a bad value would
raise alone and leave the others waiting in their next collective. So a rule declares which
arguments hold indices (`IndexArgument`), and its local op checks them first: one fused min/max per
index tensor, then, when some index is not Replicate on a mesh dim, ONE small all_reduce(max) over
exactly those mesh dims (`agreement.py`). Every rank then sees the same worst values and raises the same error, or
runs the kernel on indices that are known to be in range. Ranges come from global sizes, so they
are the same on every rank.

`modes.trusted_indices()` / `SHARDTENSOR_TRUST_INDICES=1` turns the checks off where the program knows
its indices are in range and cannot afford one collective per indexing op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..layout import Layout
from ..modes import indices_trusted
from ..rules import OpCall, TensorMeta
from .agreement import start_agreement, varying_mesh_dims

__all__ = ["IndexArgument", "with_index_checks"]


@dataclass(frozen=True, slots=True)
class IndexArgument:
    """The schema argument `name` holds indices into a dim of the argument `indexes`.

    `dim`: a schema argument naming the dim ("dim"), a fixed dim, "position" (item i of a tensor
    list indexes dim i, as in `x[i, j]`), or None (the flattened tensor: `take`). `negative`: values
    from -size count from the end. `ignore`: a schema argument whose value is skipped
    (nll_loss's ignore_index). `error`: what the op raises on one device (IndexError/RuntimeError).
    """

    name: str
    indexes: str = "self"
    dim: str | int | None = "dim"
    negative: bool = False
    ignore: str | None = None
    error: type = IndexError


@dataclass(frozen=True, slots=True)
class _Check:
    """One index tensor of one call: where it sits in the local arguments and its allowed range."""

    argument: IndexArgument
    position: int | str  # index into args, or a keyword name
    item: int | None  # its item in a tensor list argument
    low: int
    high: int  # the indexed size: values lie in [low, high)
    dim: int | None
    ignore: int | None

    def fetch(self, args: tuple, kwargs: dict) -> torch.Tensor:
        value = kwargs[self.position] if isinstance(self.position, str) else args[self.position]
        return value if self.item is None else value[self.item]

    def describe(self, op, value: int) -> str:
        where = f"the flattened {self.argument.indexes}" if self.dim is None else f"dim {self.dim} of {self.argument.indexes}"
        allowed = f"{self.low} <= index < {self.high}"
        if self.ignore is not None:
            allowed += f" (or the ignore_index {self.ignore})"
        return (
            f"{op}: index {value} in `{self.argument.name}` is out of range for {where} (size {self.high}); "
            f"allowed: {allowed}. Every rank raises this, whichever rank's shard holds the value: fix the "
            f"index values (e.g. check or clamp them before the op)"
        )


def _schema_position(op, name: str, call: OpCall) -> int | str:
    for position, schema_argument in enumerate(op._schema.arguments):
        if schema_argument.name == name:
            return position if position < len(call.args) and not schema_argument.kwarg_only else name
    raise ValueError(f"{op} has no argument {name!r}")


def _checks(call: OpCall, arguments: Sequence[IndexArgument]) -> list[tuple[_Check, int]]:
    """Each index tensor's check and its position among the call's tensor inputs."""
    flat_positions = {}  # id of a TensorMeta in the call's arguments -> its position in call.inputs
    for schema_argument in call.op._schema.arguments:
        value = call.argument(schema_argument.name)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, TensorMeta):
                flat_positions[id(item)] = len(flat_positions)
    result = []
    for index_argument in arguments:
        value = call.argument(index_argument.name)
        indexed = call.argument(index_argument.indexes)
        if not isinstance(indexed, TensorMeta):
            continue
        position = _schema_position(call.op, index_argument.name, call)
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for item, meta in items:
            if not isinstance(meta, TensorMeta) or meta.dtype in (torch.bool, torch.uint8):
                continue  # None (a dim not indexed) or a boolean mask: no value range
            dim = item if index_argument.dim == "position" else index_argument.dim
            if isinstance(dim, str):
                dim = call.argument(dim)
            if dim is None:
                size = 1
                for length in indexed.shape:
                    size *= length
            else:
                dim = dim % max(indexed.ndim, 1)
                size = indexed.shape[dim] if indexed.ndim else 1
            ignore = call.argument(index_argument.ignore) if index_argument.ignore else None
            low = -size if index_argument.negative else 0
            check = _Check(index_argument, position, item, low, size, dim, ignore)
            result.append((check, flat_positions[id(meta)]))
    return result


def _excess(check: _Check, index: torch.Tensor) -> tuple[int, int]:
    """(how far the largest value lies above the allowed range, how far the smallest lies below it):
    one fused min/max kernel; both are <= 0 when every value is in range (or there are none)."""
    if check.ignore is not None:
        index = index.masked_fill(index == check.ignore, check.low)
    if index.numel() == 0:
        return -1, -1
    smallest, largest = torch.aminmax(index)
    return int(largest) - (check.high - 1), check.low - int(smallest)


def _raise_for(op, check: _Check, above: int, below: int) -> None:
    if above > 0:
        raise check.argument.error(check.describe(op, check.high - 1 + above))
    if below > 0:
        raise check.argument.error(check.describe(op, check.low - below))


def _check_locally(op, checks: list[_Check], args: tuple, kwargs: dict) -> None:
    """Every index is Replicate: every rank sees the same values and raises alike, no collective."""
    for check in checks:
        _raise_for(op, check, *_excess(check, check.fetch(args, kwargs)))


def _start_agreement(checks: list[_Check], mesh, mesh_dims: tuple[int, ...], args: tuple, kwargs: dict):
    """(whether this rank's indices are in range, a handle to every peer's worst excesses).

    The excesses of every check, reduced with max over `mesh_dims` asynchronously, so that the
    collective can overlap the local kernel.
    """
    excesses = [value for check in checks for value in _excess(check, check.fetch(args, kwargs))]
    return max(excesses) <= 0, start_agreement(excesses, mesh, mesh_dims, mesh.device_type)


def _finish_agreement(op, checks: list[_Check], handle) -> None:
    """Raise the same error on every rank when some rank's indices are out of range."""
    agreed = handle.wait().tolist()
    for number, check in enumerate(checks):
        _raise_for(op, check, agreed[2 * number], agreed[2 * number + 1])


def with_index_checks(
    local_op: Callable | None, call: OpCall, input_layouts: Sequence[Layout], arguments: Sequence[IndexArgument]
) -> Callable | None:
    """`local_op` (None: the op itself) preceded by the checks of `arguments` on real shards.

    The agreement collective runs over the mesh dims on which some index tensor is not Replicate
    (its values differ between ranks there); with every index Replicate the check is local only.
    """
    found = _checks(call, arguments)
    if not found:
        return local_op
    checks = [check for check, _ in found]
    mesh_dims = varying_mesh_dims([input_layouts[input_position] for _, input_position in found])
    op = call.op
    run = op._op if local_op is None else None

    def checked(mesh, *args, **kwargs):
        if mesh is None or indices_trusted():  # meta tensors (no data), or trusted
            return compute(mesh, *args, **kwargs)
        if not mesh_dims:
            _check_locally(op, checks, args, kwargs)
            return compute(mesh, *args, **kwargs)
        in_range, agreement = _start_agreement(checks, mesh, mesh_dims, args, kwargs)
        if in_range and run is not None:  # the op's own kernel issues no collective: it overlaps the agreement
            result = run(*args, **kwargs)
            _finish_agreement(op, checks, agreement)
            return result
        # A rule's local op may communicate, which a rank with a bad shard would never join: agree first.
        _finish_agreement(op, checks, agreement)
        return compute(mesh, *args, **kwargs)

    def compute(mesh, *args, **kwargs):
        return run(*args, **kwargs) if run is not None else local_op(mesh, *args, **kwargs)

    return checked
