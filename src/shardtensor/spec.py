"""`DTensorSpec`: everything about a DTensor except its data, interned so plans can key on identity.

Dispatch plans are keyed by the identity of each DTensor argument's spec: equal specs are one
object (`interned_spec`), so one plan serves every DTensor with this metadata, new ones from
`distribute_tensor` included. Also the stride arithmetic of global tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import Layout, contiguous_stride
from .mesh import DeviceMesh
from .process_groups import on_new_world
from .placement import Placement, check_partial_dtype

__all__ = ["DTensorSpec", "interned_spec", "contiguous_stride", "global_stride"]


@dataclass(frozen=True, slots=True, eq=False)
class DTensorSpec:
    """Everything about a DTensor except its data: mesh, exact layout, global stride and dtype.

    Compared and hashed by identity (in C, so a plan key holding the specs of a list of 24
    DTensors hashes fast): `interned_spec` makes equal specs one object.
    """

    mesh: DeviceMesh
    layout: Layout
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.layout.placements


# One object per distinct spec. Bounded: when full it is emptied, which costs plan-cache misses
# (new specs are new ids), never wrong results (a plan keeps its specs alive, so ids are not reused).
_interned_specs: dict[tuple, DTensorSpec] = {}
_MAX_INTERNED_SPECS = 4096
on_new_world(_interned_specs.clear)  # specs hold meshes, which hold the groups of their world


def interned_spec(spec: DTensorSpec) -> DTensorSpec:
    """The one stored spec equal to `spec` (stored now if there is none; a symbolic spec is itself)."""
    fields = (spec.mesh, spec.layout, spec.stride, spec.dtype)
    try:
        found = _interned_specs.get(fields)
    except TypeError:  # symbolic sizes (torch.compile's dynamic shapes): a spec of one trace, never stored
        check_partial_dtype(spec.layout.placements, spec.dtype, "DTensor")
        return spec
    if found is None:
        check_partial_dtype(spec.layout.placements, spec.dtype, "DTensor")  # new specs only: off the hot path
        if len(_interned_specs) >= _MAX_INTERNED_SPECS:
            _interned_specs.clear()
        _interned_specs[fields] = found = spec
    return found


def global_stride(local: torch.Tensor, shape: Sequence[int]) -> tuple[int, ...]:
    """A global stride with the local tensor's dim order (a transposed shard gives a transposed global)."""
    order = sorted(range(local.ndim), key=lambda dim: -local.stride(dim))
    stride, step = [0] * len(shape), 1
    for dim in reversed(order):
        stride[dim] = step
        step *= max(shape[dim], 1)
    return tuple(stride)
