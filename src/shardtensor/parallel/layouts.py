"""Crossing a style's boundary: plain local tensors to DTensors and back, with exact global shapes.

A style turns a module's plain inputs into DTensors with `DTensor.from_local(..., shape=...)`, which
costs no collective only when the global shape is known. It is known for a Replicate input (the
local shape), for a dim the module defines (a Linear's input features), and for a local tensor that
came straight out of another style (`use_local_output=True`): such a tensor carries its DTensor's
layout (`_LAYOUT_ATTRIBUTE`), so uneven shards (a sequence of 7 over 4 ranks) stay exact, and so does
a view of it that splits the sharded dim into whole rows (heads of q_proj's output). For
anything else (the sum of a residual connection made of local tensors, as in PyTorch's tensor
parallel tutorial) the size along a sharded dim is learnt from every rank's local shape, as
`from_local` infers it: a small collective per call (one all_gather), logged once per style with
how to avoid it (keep the activations DTensors: `use_local_output=False`); under
`explicit_communication()` the style raises instead. PyTorch assumes equal shards there, which is
wrong for uneven ones. Under torch.compile the tag travels through the graph as well; an untagged
tensor is read as equal shards, and the graph checks every rank's shape (docs/compile.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import torch

from ..dtensor import DTensor
from ..layout import Layout
from ..mesh import DeviceMesh
from ..modes import is_explicit
from ..placement import Partial, Placement, Shard, normalize_placements

__all__ = ["check_tp_mesh", "redistribute_to", "to_dtensor", "to_output"]

# Set on the plain tensor a style returns: what it knows of the DTensor it was the local shard of (`_tag`).
_LAYOUT_ATTRIBUTE = "_shardtensor_layout"
# Set on that tensor's base, for views of it (read only by `_layout_of_view`, which checks it fits the view).
_BASE_LAYOUT_ATTRIBUTE = "_shardtensor_base_layout"

logger = logging.getLogger(__name__)
_inferring: set[str] = set()  # the styles (`where`) that have logged that they learn sizes with a collective


def check_tp_mesh(mesh: DeviceMesh, where: str) -> None:
    """Parallel styles lay out tensors along one mesh dim: the mesh must be 1-D."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where} needs a shardtensor DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        hint = f"mesh[{names[-1]!r}]" if names else "a 1-D mesh (init_device_mesh(..., mesh_dim_names=(...)) and mesh['tp'])"
        raise ValueError(
            f"{where} takes a 1-D device mesh (the tensor-parallel mesh dim), got the {mesh.ndim}-D {mesh!r}; "
            f"pass the sub-mesh of the tensor-parallel dim, e.g. {hint}"
        )


def _unknown_size(where: str, local: torch.Tensor, placement: Shard, mesh: DeviceMesh) -> str:
    return (
        f"{where} got a plain torch.Tensor of local shape {tuple(local.shape)} to read as {placement!r} over "
        f"{mesh!r} whose global size along dim {placement.dim} is unknown: it did not come straight out of a "
        f"parallel style (for example it is the sum of a residual connection), so learning the size takes a "
        f"collective. To avoid it, keep the activations DTensors between styles: give the style that produced "
        f"it use_local_output=False (e.g. RowwiseParallel(output_layouts=Shard(1), use_local_output=False)), "
        f"or pass a DTensor"
    )


def _tag_mismatch_error(where: str, given: Sequence[Placement], tag_placements, tag_mesh) -> ValueError:
    return ValueError(
        f"{where} was told its input is laid out as {tuple(given)!r}, but the tensor is the local shard "
        f"of a DTensor laid out as {tuple(tag_placements)!r} on {tag_mesh!r} (the output of another "
        f"style); make the plan's input_layouts agree with the producing style's output_layouts"
    )


def _tag(value: DTensor) -> tuple:
    """What a style's local output remembers of its DTensor. Eagerly (mesh, layout): the reader checks the
    local shape against the layout's remembered one and builds nothing. While torch.compile traces, (mesh,
    placements, global shape, explicit pieces: per tensor dim its pieces, or None where the size alone gives
    them): the tag a graph sets on its output then holds each call's sizes (the graph returns them as values),
    where a layout with symbolic sizes would be a constant of the graph naming symbols its code does not bind
    (torch 2.15: NameError; 2.13 and 2.14 kept a stale SymInt)."""
    if not torch.compiler.is_compiling():
        return value.device_mesh, value.sharding
    layout = value.sharding
    return value.device_mesh, layout.placements, tuple(value.shape), layout.explicit_pieces()


def _tagged_layout(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], where: str):
    """The global shape and explicit shard sizes a style stored on `local`, if they still describe it (this
    mesh; eagerly, also its local shape), else None."""
    tag = getattr(local, _LAYOUT_ATTRIBUTE, None)  # an attribute, not `__dict__`: torch.compile traces attributes
    if tag is None:
        return None
    coordinate = mesh.get_coordinate()
    if tag[0] != mesh or coordinate is None:
        return None
    if len(tag) == 2:  # written eagerly: the DTensor's layout
        layout = tag[1]
        tag_placements, shape, explicit = layout.placements, layout.shape, layout.explicit_pieces()
    else:  # written by a compiled graph: its sizes, as values
        _, tag_placements, shape, explicit = tag
        layout = None
    sizes = {mesh_dim: explicit[p.dim] for mesh_dim, p in enumerate(tag_placements)
             if isinstance(p, Shard) and explicit[p.dim] is not None}
    if not torch.compiler.is_compiling():  # compiled, from_local checks the local shape while tracing
        if layout is None:
            layout = Layout.create(mesh.shape, tag_placements, shape, shard_sizes=sizes or None)
        if layout.local_shape(coordinate) != tuple(local.shape):
            return None
    if tag_placements != placements:
        raise _tag_mismatch_error(where, placements, tag_placements, tag[0])
    return shape, sizes


def _layout_of_view(view: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]):
    """The layout of `view`, a reshape of a style's local output (Qwen3's per-head norm reads
    `q_proj(x).view(batch, sequence, -1, head_dim)`), when the view splits the sharded dim into whole
    rows of itself on every rank; else None (the size is then learnt with a collective).

    The output's shard along dim d is a run [a, b) of its rows; viewed with the dims before d kept, the
    same run is rows [a / u, b / u) of the view, u = view rows per output row, when every piece divides.
    The view's trailing dims are its local ones, the same on every rank in SPMD code."""
    base = view._base
    tag = getattr(base, _BASE_LAYOUT_ATTRIBUTE, None)
    if tag is None or tag[0] != mesh or mesh.get_coordinate() is None or len(placements) != 1:
        return None
    layout = tag[1]
    shard, wanted = layout.placements[0], placements[0]
    if not (isinstance(shard, Shard) and isinstance(wanted, Shard) and shard.dim == wanted.dim):
        return None
    dim, local_shape = shard.dim, layout.local_shape(mesh.get_coordinate())
    if (tuple(base.shape) != local_shape or not (base.is_contiguous() and view.is_contiguous())
            or view.data_ptr() != base.data_ptr() or view.numel() != base.numel() or view.ndim <= dim
            or tuple(view.shape[:dim]) != local_shape[:dim]):
        return None
    base_row, view_row = math.prod(local_shape[dim + 1:]), math.prod(view.shape[dim + 1:])
    if base_row == 0 or view_row % base_row:
        return None
    rows = view_row // base_row
    pieces = layout.pieces[dim]
    if any(piece % rows for piece in pieces):
        return None
    shape = (*layout.shape[:dim], layout.shape[dim] // rows, *view.shape[dim + 1:])
    return Layout.create(mesh.shape, placements, shape, shard_sizes={0: [piece // rows for piece in pieces]})


def to_dtensor(
    value,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    where: str,
    *,
    known_sizes: Mapping[int, int] | None = None,
):
    """`value` as a DTensor on `mesh` with `placements` (a plain local tensor) or as it is (a DTensor).

    `known_sizes` maps a tensor dim (negative allowed) to its global size where the module defines
    it. Anything that is not a tensor passes through unchanged.
    """
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(
                f"{where} got a DTensor on {value.device_mesh!r}, but the style lays out tensors on "
                f"{mesh!r}; redistribute it to that mesh first, or pass its local tensor"
            )
        return value
    if not isinstance(value, torch.Tensor):
        return value
    placements = normalize_placements(placements, value.ndim, mesh.ndim)
    tagged = _tagged_layout(value, mesh, placements, where)
    if tagged is None and value._base is not None:
        layout = _layout_of_view(value, mesh, placements)
        if layout is not None:
            tagged = layout.shape, {mesh_dim: layout.pieces[p.dim] for mesh_dim, p in enumerate(placements) if isinstance(p, Shard)}
    if tagged is not None:
        shape, sizes = tagged
        return DTensor.from_local(value, mesh, placements, shape=shape, shard_sizes=sizes or None)
    shape = list(value.shape)
    known = {dim % max(value.ndim, 1): size for dim, size in (known_sizes or {}).items()}
    for placement in placements:
        if isinstance(placement, Shard):
            if placement.dim not in known:
                return _inferred(value, mesh, placements, where, placement)
            shape[placement.dim] = known[placement.dim]
    return DTensor.from_local(value, mesh, placements, shape=tuple(shape))


def _inferred(value: torch.Tensor, mesh: DeviceMesh, placements, where: str, placement: Shard) -> DTensor:
    """`from_local` learning the exact global shape from every rank's local shape (a collective)."""
    if is_explicit():
        raise ValueError(f"{_unknown_size(where, value, placement, mesh)}; explicit_communication() refuses that collective")
    if not torch.compiler.is_compiling() and where not in _inferring:  # compiled, from_local checks in the graph
        _inferring.add(where)
        logger.info("%s", _unknown_size(where, value, placement, mesh))
    return DTensor.from_local(value, mesh, placements)


def redistribute_to(value, placements: Sequence[Placement]):
    """A DTensor moved to `placements` (a Partial target keeps the value's Partial); other values as they are."""
    if not isinstance(value, DTensor):
        return value
    if placements == value.placements:  # the common case, checked before normalizing
        return value
    target = tuple(
        old if isinstance(new, Partial) and old == new else new
        for old, new in zip(value.placements, normalize_placements(placements, value.ndim, value.device_mesh.ndim))
    )
    if target == value.placements:
        return value
    return value.redistribute(value.device_mesh, target)


def to_output(value, placements: Sequence[Placement] | None, use_local_output: bool):
    """A module's output moved to `placements` (None: as it is), then its local tensor if asked.

    The local tensor remembers its DTensor's layout, so the next style reads it exactly.
    """
    if not isinstance(value, DTensor):
        return value
    if placements is not None:
        value = redistribute_to(value, placements)
    if not use_local_output:
        return value
    local = value.to_local()
    setattr(local, _LAYOUT_ATTRIBUTE, _tag(value))
    base = local._base  # what a view of `local` (q_proj(x).view(..., heads, head_dim)) has as its base
    if base is not None and base.numel() == local.numel() and not torch.compiler.is_compiling():
        setattr(base, _BASE_LAYOUT_ATTRIBUTE, (value.device_mesh, value.sharding))
    return local
