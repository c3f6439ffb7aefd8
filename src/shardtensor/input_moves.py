"""An op's input moved to the layout its rule needs, a Partial input reduced only once.

Autograd saves the inputs of an op for its backward, so a Partial input that the forward had to
reduce (`(y - target) ** 2` with `y` Partial, a LayerNorm after a row-parallel linear) would be
reduced again when the backward formula reads it: one more collective per step than the
hand-written program. A DTensor holding Partial values therefore keeps the result of its last
implicit move (`moved_local`: one entry, with the shard it was computed from and the version
counters of the DTensor, its shard and the result, so an in-place write invalidates it; inputs an
op writes to are never kept). While it is valid, an op sees that DTensor in the moved layout
(`with_kept_moves`): the same global value, already where the first op needed it, so the rule
chooses knowing the move is free. Moves from layouts without a Partial are not kept: recomputing
them (an all_gather of a saved shard) is the memory saving the program chose by sharding.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import torch

from .layout import Layout
from .redistribute import redistribute_local_tensor
from .redistribute.buckets import reduce_in_buckets
from .spec import DTensorSpec, interned_spec

__all__ = ["KeptMoves", "moved_local", "moved_locals", "with_kept_moves"]


@dataclasses.dataclass(slots=True)
class _Kept:
    target: Layout
    source: torch.Tensor
    versions: tuple[int, int, int]
    result: torch.Tensor
    moved: torch.Tensor | None = None  # the DTensor standing for it, made on first reuse

    def valid_for(self, dtensor, local: torch.Tensor) -> bool:
        return self.source is local and self.versions == _versions(dtensor, local, self.result)


def _versions(dtensor, local: torch.Tensor, result: torch.Tensor) -> tuple[int, int, int]:
    """Version counters that an in-place write bumps: the DTensor's own (an in-place op on it; its
    shard is written below autograd, which does not count), its shard's (a write through
    `to_local()`) and the kept result's."""
    return dtensor._version, local._version, result._version


class KeptMoves:
    """How many DTensors hold a kept move now: while none does, dispatch skips `with_kept_moves`."""

    count = 0


def _forget() -> None:
    KeptMoves.count -= 1


def moved_local(dtensor, target: Layout, mesh) -> torch.Tensor:
    """`dtensor`'s shard redistributed to `target` (which differs from its layout); not for an input
    the op writes to."""
    source = dtensor._spec.layout
    local = dtensor._local_tensor
    if not source.partial_mesh_dims():
        return redistribute_local_tensor(local, source, target, mesh)
    kept = _kept_result(dtensor, target)
    if kept is not None:
        return kept
    return _keep(dtensor, target, redistribute_local_tensor(local, source, target, mesh))


def moved_locals(dtensors: Sequence, targets: Sequence[Layout], written: Sequence[bool], mesh) -> list[torch.Tensor]:
    """Each DTensor's shard moved to its target, the Partial ones that need only an all_reduce
    reduced together (`reduce_in_buckets`): an op reading or updating many Partial gradients (a
    multi-tensor optimizer step) issues one collective per bucket, not one per tensor. Inputs the
    op reads move as with `moved_local` (kept for later readers); `written` ones get a moved copy."""
    results = [None if writes else _kept_result(dtensor, target) for dtensor, target, writes in zip(dtensors, targets, written)]
    waiting = [index for index, result in enumerate(results) if result is None and dtensors[index]._spec.layout.partial_mesh_dims()]
    reduced = reduce_in_buckets([dtensors[index]._local_tensor for index in waiting],
                                [dtensors[index]._spec.layout for index in waiting], [targets[index] for index in waiting], mesh)
    for index, result in zip(waiting, reduced):
        if result is not None:
            results[index] = result if written[index] else _keep(dtensors[index], targets[index], result)
    for index, (dtensor, target, writes) in enumerate(zip(dtensors, targets, written)):
        if results[index] is None:
            results[index] = (redistribute_local_tensor(dtensor._local_tensor, dtensor._spec.layout, target, mesh)
                              if writes else moved_local(dtensor, target, mesh))
    return results


def _kept_result(dtensor, target: Layout) -> torch.Tensor | None:
    kept = dtensor.__dict__.get("_moved")
    if kept is not None and kept.target == target and kept.valid_for(dtensor, dtensor._local_tensor):
        return kept.result
    return None


def _keep(dtensor, target: Layout, result: torch.Tensor) -> torch.Tensor:
    """Remember `result` as `dtensor`'s shard moved to `target` (see the module's docstring)."""
    if "_moved" not in dtensor.__dict__:
        KeptMoves.count += 1
        weakref.finalize(dtensor, _forget)
    local = dtensor._local_tensor
    dtensor._moved = _Kept(target, local, _versions(dtensor, local, result), result)
    return result


_mutable_ops: dict = {}


def with_kept_moves(dtensor_class: type, op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with each DTensor that holds a valid kept move replaced by a DTensor in
    the moved layout (not for ops that write to an argument)."""
    mutable = _mutable_ops.get(op)
    if mutable is None:
        mutable = _mutable_ops[op] = op._schema.is_mutable
    if mutable:
        return args, kwargs
    if any(type(value) is dtensor_class and "_moved" in value.__dict__ for value in args):
        args = tuple(_kept_or_self(dtensor_class, value) for value in args)
    if any(type(value) is dtensor_class and "_moved" in value.__dict__ for value in kwargs.values()):
        kwargs = {name: _kept_or_self(dtensor_class, value) for name, value in kwargs.items()}
    return args, kwargs


def _kept_or_self(dtensor_class: type, value):
    if type(value) is not dtensor_class:
        return value
    kept = value.__dict__.get("_moved")
    if kept is None or not kept.valid_for(value, value._local_tensor):
        return value
    if kept.moved is None:
        spec = value._spec
        moved_spec = interned_spec(DTensorSpec(spec.mesh, kept.target, spec.stride, spec.dtype))
        kept.moved = dtensor_class._wrap(kept.result, moved_spec)
    return kept.moved
