"""Saving and loading DTensors: the `torch.distributed.checkpoint` protocol, pickling and deepcopy.

`torch.distributed.checkpoint` (DCP) asks a tensor class it does not know three questions, by duck
typing: which chunks do you write (`__create_write_items__`), which boxes of the global tensor do you
hold to load into (`__create_chunk_list__`), and which local tensor backs a chunk
(`__get_tensor_shard__`). A DTensor answers from its `Layout`: a rank's shard is one box (offsets and
sizes per tensor dim; nested sharding too, since pieces are contiguous), so every rank writes only its
own shard, a replica is written once (DCP's planner keeps one copy of each box), and loading reads
into each shard its overlap with every saved box, whatever mesh, layout or plain tensor saved it.
Nothing here communicates. `pickle`, `torch.save` and `copy.deepcopy` keep this rank's shard and the
spec; the mesh pickles without its process groups (see `mesh.py`). See docs/checkpoint.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch

from .layout import Layout
from .placement import Partial, Replicate, Shard
from .spec import DTensorSpec

__all__ = ["CheckpointableMixin", "local_box", "offers_shard"]


def local_box(layout: Layout, coordinate: Sequence[int]) -> tuple[torch.Size, torch.Size]:
    """(offsets, sizes) of the shard held at a mesh coordinate, as a box of the global tensor."""
    return torch.Size(layout.local_offset(coordinate)), torch.Size(layout.local_shape(coordinate))


def offers_shard(layout: Layout, coordinate: Sequence[int]) -> bool:
    """Whether the shard at `coordinate` is offered to DCP for writing.

    Every replica offers its box; DCP's save planner keeps one copy of each box (a chunk is named by
    its fqn and offset), on the rank with the least to write so far, so the replicas of a tensor
    share the writing instead of one coordinate writing them all. An empty shard offers nothing (its
    offset may be a neighbour's non-empty box), except coordinate 0 of an empty tensor, so that the
    checkpoint still lists the tensor.
    """
    if math.prod(layout.local_shape(coordinate)) == 0:
        return layout.numel == 0 and not any(coordinate)
    return True


def _partial_error(what: str, layout: Layout, fqn: str | None) -> RuntimeError:
    name = f" {fqn!r}" if fqn else ""
    mesh_dims = layout.partial_mesh_dims()
    reduced = [Replicate() if mesh_dim in mesh_dims else p for mesh_dim, p in enumerate(layout.placements)]
    return RuntimeError(
        f"cannot {what} the DTensor{name} of shape {list(layout.shape)} with placements "
        f"{list(layout.placements)}: it is Partial on mesh dims {list(mesh_dims)}, so its local tensors "
        f"are operands of a pending reduction, not pieces of the value. Reduce it first on every rank of "
        f"its mesh, e.g. x = x.redistribute(placements={reduced!r}), and {what} that"
    )


def _wrong_shard_error(index, offsets: torch.Size | None) -> ValueError:
    held = "this rank is outside its mesh and holds none"
    if offsets is not None:
        held = f"this rank's starts at {list(offsets)}"
    return ValueError(
        f"checkpoint asked the DTensor {index.fqn!r} for the chunk at offsets {index.offset}, but {held}; "
        f"a DTensor holds one chunk per rank of its mesh"
    )


def _other_shard_error(layout: Layout, saved_coordinate, coordinate) -> RuntimeError:
    return RuntimeError(
        f"cannot unpickle a DTensor of shape {list(layout.shape)} with placements "
        f"{list(layout.placements)}: its local tensor is the shard of mesh coordinate {saved_coordinate}, "
        f"but this rank is at mesh coordinate {coordinate}, which holds another shard. Load each rank's "
        f"pickle on the rank that saved it, or save with torch.distributed.checkpoint, which reshards "
        f"on load (docs/checkpoint.md)"
    )


def _same_shard(layout: Layout, saved_coordinate, coordinate) -> bool:
    """Whether a shard saved at one mesh coordinate is also the right shard at another."""
    if saved_coordinate is None or coordinate is None:
        return saved_coordinate is None and coordinate is None
    if list(saved_coordinate) == list(coordinate):
        return True
    return not layout.partial_mesh_dims() and local_box(layout, saved_coordinate) == local_box(layout, coordinate)


def _rebuild_dtensor(cls, local_tensor, spec, requires_grad: bool, saved_coordinate, attributes: dict):
    """Unpickle a DTensor: this rank's shard, the spec (its mesh re-attached) and extra attributes."""
    coordinate = spec.mesh.get_coordinate()
    if not _same_shard(spec.layout, saved_coordinate, coordinate):
        raise _other_shard_error(spec.layout, saved_coordinate, coordinate)
    dtensor = cls(local_tensor, spec, requires_grad=requires_grad)
    dtensor.__dict__.update(attributes)
    return dtensor


# `torch.load` defaults to weights_only=True, which unpickles only allowed globals: a DTensor's.
torch.serialization.add_safe_globals([_rebuild_dtensor, DTensorSpec, Layout, Shard, Replicate, Partial])


class CheckpointableMixin:
    """DCP's checkpoint protocol, pickling and deepcopy for a class holding one shard per rank.

    A subclass provides `_spec` (with `.mesh`, a `DeviceMesh`, and `.layout`, a `Layout`),
    `_local_tensor` (this rank's shard), and a constructor `cls(local_tensor, spec,
    requires_grad=...)`; `_data_attributes` names the instance attributes that hold its shard and
    spec (rebuilt by the constructor, so not copied with the other attributes, such as a
    parameter's flag).
    """

    __slots__ = ()
    _data_attributes: tuple[str, ...] = ("_local_value", "_pending", "_spec")

    def __init_subclass__(cls, **options):
        """A subclass may be rebuilt by `torch.load(weights_only=True)` like the values it holds."""
        super().__init_subclass__(**options)
        torch.serialization.add_safe_globals([cls])

    # ---- torch.distributed.checkpoint -----------------------------------------------------------

    def _checkpoint_coordinate(self, what: str, fqn: str | None) -> list[int] | None:
        """This rank's mesh coordinate (None outside the mesh) after refusing a Partial layout."""
        layout = self._spec.layout
        if layout.partial_mesh_dims():
            raise _partial_error(what, layout, fqn)
        return self._spec.mesh.get_coordinate()

    def __create_write_items__(self, fqn: str, value) -> list:
        """DCP save plan: this rank's shard as one chunk (DCP keeps one replica), none outside the mesh."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        coordinate = self._checkpoint_coordinate("save", fqn)
        layout = self._spec.layout
        if coordinate is None or not offers_shard(layout, coordinate):
            return []
        offsets, sizes = local_box(layout, coordinate)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=torch.Size(layout.shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list:
        """DCP load plan: the box this rank's shard holds (replicas each load theirs), none outside."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        coordinate = self._checkpoint_coordinate("load into", None)
        if coordinate is None:
            return []
        offsets, sizes = local_box(self._spec.layout, coordinate)
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        """The local tensor behind this rank's chunk: DCP writes it, or narrows and copies into it."""
        coordinate = self._checkpoint_coordinate("save or load", index.fqn)
        offsets = None if coordinate is None else local_box(self._spec.layout, coordinate)[0]
        if offsets is None or (index.offset is not None and torch.Size(index.offset) != offsets):
            raise _wrong_shard_error(index, offsets)
        return self._local_tensor

    # ---- pickle, torch.save, copy ---------------------------------------------------------------

    def _extra_attributes(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in self._data_attributes}

    def __reduce_ex__(self, protocol):
        """Pickle this rank's shard, the spec and the attributes; unpickling checks it lands on a
        rank that holds the same shard."""
        arguments = (
            type(self),
            self._local_tensor.detach(),
            self._spec,
            self.requires_grad,
            self._spec.mesh.get_coordinate(),
            self._extra_attributes(),
        )
        return (_rebuild_dtensor, arguments)

    def __deepcopy__(self, memo: dict):
        """A DTensor with the same layout and its own copy of the shard (and gradient), as torch.Tensor."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "copy.deepcopy of a DTensor needs a graph leaf (a parameter, or a tensor made without "
                f"autograd history), as for torch.Tensor; this one was computed by {type(self.grad_fn).__name__}; "
                "deepcopy x.detach() instead"
            )
        local = copy.deepcopy(self._local_tensor.detach(), memo)
        copied = type(self)(local, self._spec, requires_grad=self.requires_grad)
        memo[id(self)] = copied
        for key, value in self._extra_attributes().items():
            setattr(copied, key, copy.deepcopy(value, memo))
        if self.grad is not None:
            copied.grad = copy.deepcopy(self.grad, memo)
        return copied
