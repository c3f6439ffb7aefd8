"""Saving and loading DTensors: the `torch.distributed.checkpoint` protocol, pickling and deepcopy.

`torch.distributed.checkpoint` (DCP) asks a tensor class it does not know three questions, by duck
typing: which chunks do you write (`__create_write_items__`), which boxes of the global tensor do you
hold to load into (`__create_chunk_list__`), and which local tensor backs a chunk
(`__get_tensor_shard__`). A DTensor answers from its `Layout`: a rank's shard is one box (offsets and
sizes per tensor dim; nested sharding too, since pieces are contiguous), so every rank writes only its
own shard, a replica is written once (DCP's planner keeps one copy of each box), and loading reads
into each shard its overlap with every saved box, whatever mesh, layout or plain tensor saved it.
Nothing here communicates, except gathering full state dicts. `pickle`, `torch.save` and `copy.deepcopy`
keep this rank's shard and the spec; the mesh pickles without its process groups (see `mesh.py`).

`get_state_dict` / `set_state_dict` (and the model / optimizer variants) take the arguments of
`torch.distributed.checkpoint.state_dict`'s functions, which they call: torch's gathers only its own
DTensor class for `StateDictOptions(full_state_dict=True)`, so these gather (and, to load, shard) ours.
See docs/checkpoint.md.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import torch

from .layout import Layout
from .placement import Partial, Replicate, Shard
from .spec import DTensorSpec

__all__ = [
    "CheckpointableMixin",
    "local_box",
    "offers_shard",
    "get_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]


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
    # A view of a moved copy (`_view_of_copy`) pickles and copies as an independent tensor of its values.
    _data_attributes: tuple[str, ...] = ("_local_value", "_pending", "_spec", "_view_of_copy")

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


# ---- full state dicts: torch.distributed.checkpoint.state_dict's functions, gathering our DTensors ----------


def _state_dict_functions():
    """torch's state-dict module, imported on first use (it imports torch's own DTensor)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _sharded_options(options):
    """The options torch's functions run with: ours do the gathering, offloading and sharding."""
    functions = _state_dict_functions()
    options = options or functions.StateDictOptions()
    if options.broadcast_from_rank0:
        raise ValueError(
            "StateDictOptions(broadcast_from_rank0=True) is not supported for shardtensor DTensors; give every "
            "rank the full state dict and pass StateDictOptions(full_state_dict=True) instead"
        )
    return options, dataclasses.replace(options, full_state_dict=False, cpu_offload=False)


def _converted(value, gather: bool, cpu_offload: bool):
    """`value` (a state dict or a part of it) with every DTensor made a full plain tensor (`gather`), and
    every tensor moved to CPU (`cpu_offload`). Every rank walks the same structure in the same order,
    so the gathers of the ranks match up."""
    if isinstance(value, dict):
        return {key: _converted(item, gather, cpu_offload) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_converted(item, gather, cpu_offload) for item in value)
    if gather and isinstance(value, CheckpointableMixin):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if cpu_offload else value.detach()
    return value


def _finish(state: dict, options) -> dict:
    """torch's semantics of `full_state_dict` and `cpu_offload` on a state dict holding our DTensors:
    gathered on every rank; with both options, only global rank 0 keeps it (the others get {})."""
    if not (options.full_state_dict or options.cpu_offload):
        return state
    state = _converted(state, options.full_state_dict, options.cpu_offload)
    if options.full_state_dict and options.cpu_offload and torch.distributed.is_initialized() \
            and torch.distributed.get_rank() != 0:
        return {}
    return state


def _shape_error(path: str, given: torch.Tensor, template) -> ValueError:
    return ValueError(
        f"the full state dict's {path!r} has shape {list(given.shape)}, but the model's DTensor there has the "
        f"global shape {list(template.shape)} (placements {list(template.placements)}); a full state dict holds "
        f"global tensors of the same shapes as the single-device model's"
    )


def _shard_like(given: torch.Tensor, template, path: str):
    """This rank's shard of the full tensor `given` in the layout (mesh, placements, shard sizes) of `template`.

    Every rank holds the whole of `given`, so each slices its own box: nothing is sent.
    """
    if tuple(given.shape) != tuple(template.shape):
        raise _shape_error(path, given, template)
    spec = template._spec
    coordinate = spec.mesh.get_coordinate()
    local = given.detach().to(device=template._local_tensor.device, dtype=template.dtype)
    if coordinate is None:  # outside the mesh: no elements, as the template
        return type(template)(local.new_empty(template._local_tensor.shape), spec)
    offsets, sizes = local_box(spec.layout, coordinate)
    for dim, (start, length) in enumerate(zip(offsets, sizes)):
        local = local.narrow(dim, start, length)
    local = spec.layout.operand_of(local.clone(memory_format=torch.contiguous_format), coordinate)
    return type(template)(local, spec)


def _sharded_like(given, template, path: str = ""):
    """`given` (a full state dict or a part of it) with each plain tensor that stands where `template` holds
    a DTensor made that DTensor's shard; everything else as given."""
    if isinstance(given, dict):
        template = template if isinstance(template, dict) else {}
        return {key: _sharded_like(item, template.get(key), f"{path}.{key}".lstrip(".")) for key, item in given.items()}
    if isinstance(given, (list, tuple)) and isinstance(template, (list, tuple)) and len(given) == len(template):
        return type(given)(_sharded_like(item, other, f"{path}.{index}") for index, (item, other) in enumerate(zip(given, template)))
    if isinstance(template, CheckpointableMixin) and isinstance(given, torch.Tensor) and not isinstance(given, CheckpointableMixin):
        return _shard_like(given, template, path)
    return given


def get_model_state_dict(model, *, submodules=None, options=None) -> dict:
    """`torch.distributed.checkpoint.state_dict.get_model_state_dict`, whose `full_state_dict` and
    `cpu_offload` options also gather and offload shardtensor DTensors (every rank calls).

    >>> state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # doctest: +SKIP
    """
    options, sharded = _sharded_options(options)
    state = _state_dict_functions().get_model_state_dict(model, submodules=submodules, options=sharded)
    return _finish(state, options)


def get_optimizer_state_dict(model, optimizers, *, submodules=None, options=None) -> dict:
    """`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`, gathering shardtensor DTensors
    for `full_state_dict` (every rank calls)."""
    options, sharded = _sharded_options(options)
    state = _state_dict_functions().get_optimizer_state_dict(model, optimizers, submodules=submodules, options=sharded)
    return _finish(state, options)


def get_state_dict(model, optimizers, *, submodules=None, options=None) -> tuple[dict, dict]:
    """`torch.distributed.checkpoint.state_dict.get_state_dict`, gathering shardtensor DTensors for
    `full_state_dict` (every rank calls): with it, the model's and optimizer's state dicts equal the
    single-device model's (same keys, full plain tensors).

    >>> from torch.distributed.checkpoint.state_dict import StateDictOptions  # doctest: +SKIP
    >>> model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    """
    options, sharded = _sharded_options(options)
    model_state, optimizer_state = _state_dict_functions().get_state_dict(
        model, optimizers, submodules=submodules, options=sharded
    )
    return _finish(model_state, options), _finish(optimizer_state, options)


def set_model_state_dict(model, model_state_dict: dict, *, options=None):
    """`torch.distributed.checkpoint.state_dict.set_model_state_dict`; with `full_state_dict`, every rank
    gives the full state dict and keeps its shard of each tensor in the layout of the model's DTensor."""
    options, sharded = _sharded_options(options)
    functions = _state_dict_functions()
    if options.full_state_dict:
        model_state_dict = _sharded_like(model_state_dict, functions.get_model_state_dict(model, options=sharded))
    return functions.set_model_state_dict(model, model_state_dict, options=sharded)


def set_optimizer_state_dict(model, optimizers, optim_state_dict: dict, *, options=None) -> None:
    """`torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`; with `full_state_dict`, each
    state tensor is sharded like the optimizer's own (which is created first if there is none yet)."""
    options, sharded = _sharded_options(options)
    functions = _state_dict_functions()
    if options.full_state_dict:
        template = functions.get_optimizer_state_dict(model, optimizers, options=sharded)
        optim_state_dict = _sharded_like(optim_state_dict, template)
    functions.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=sharded)


def set_state_dict(model, optimizers, *, model_state_dict: dict, optim_state_dict: dict, options=None):
    """`torch.distributed.checkpoint.state_dict.set_state_dict`; with `full_state_dict`, every rank gives
    the full state dicts (e.g. a single-device model's) and keeps its shards in the model's layouts.

    >>> set_state_dict(model, optimizer, model_state_dict=full_model, optim_state_dict=full_optimizer,  # doctest: +SKIP
    ...                options=StateDictOptions(full_state_dict=True))
    """
    options, sharded = _sharded_options(options)
    functions = _state_dict_functions()
    if options.full_state_dict:
        model_template, optimizer_template = functions.get_state_dict(model, optimizers, options=sharded)
        model_state_dict = _sharded_like(model_state_dict, model_template)
        optim_state_dict = _sharded_like(optim_state_dict, optimizer_template)
    return functions.set_state_dict(
        model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=sharded
    )
