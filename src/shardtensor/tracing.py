"""`TraceableMixin` (a base of `DTensor`): torch's protocol for tracing a wrapper tensor subclass.

`torch.compile` sees a DTensor as its local tensor plus metadata: `__tensor_flatten__` names the one
inner tensor (`_local_tensor`) and returns a `TracedMetadata` value (mesh, exact layout with every
rank's shard sizes, dtype, requires_grad) that compares and hashes by value, so a compiled graph is
guarded on it (`__metadata_guard__`: all but the sizes dynamo's own size guards check) and reused for
every DTensor with the same metadata. `__tensor_unflatten__` rebuilds a
DTensor around a traced (fake or functional) local tensor, its layout taking the traced global size (SymInts
under dynamic shapes, `Layout.with_shape`); the dispatch layer then runs on it as in eager mode, with `comm`
issuing functional collectives (docs/compile.md). Flattening a real leaf that requires grad hooks
its gradient as eager mode's first use would (`gradients.watch_graph_input`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .autograd import Redistribute
from .gradients import watch_graph_input
from .layout import Layout
from .mesh import DeviceMesh
from .process_groups import on_new_world
from .spec import DTensorSpec

__all__ = ["TraceableMixin", "TracedMetadata"]


@dataclass(frozen=True, slots=True)
class TracedMetadata:
    """Everything about a DTensor a compiled graph depends on except its local tensor and global
    stride (which torch passes to `__tensor_unflatten__` itself).

    Immutable, so a deep copy is the value itself: a guard keeps the deep copy of the metadata it
    was compiled for, and with `__tensor_flatten__` returning one object per spec, a guard check
    on an unchanged DTensor is one identity test (`TraceableMixin.__metadata_guard__`)."""

    mesh: DeviceMesh
    layout: Layout
    dtype: torch.dtype
    requires_grad: bool

    def __deepcopy__(self, memo) -> TracedMetadata:
        return self


# (interned spec, requires_grad) -> its metadata. Bounded like the interned specs: emptied when full,
# which costs a new object (and a guard check by value), never a wrong comparison.
_metadata_by_spec: dict[tuple[DTensorSpec, bool], TracedMetadata] = {}
_MAX_METADATA = 4096
on_new_world(_metadata_by_spec.clear)  # specs hold meshes, which hold the groups of their world


class TraceableMixin:
    """`__tensor_flatten__` / `__tensor_unflatten__` and the tangent coercions of a class holding one
    shard per rank (`_local_tensor`, `_spec`) and built as `cls(local_tensor, spec, requires_grad=...)`."""

    __slots__ = ()

    def __tensor_flatten__(self):
        spec = self._spec
        if spec.layout.is_symbolic:  # traced with dynamic shapes: the sizes come back through `__tensor_unflatten__`'s
            layout = spec.layout.with_example_sizes()  # outer_size (symbolic while tracing, concrete when a graph runs)
            return ["_local_tensor"], TracedMetadata(spec.mesh, layout, spec.dtype, self.requires_grad)
        # Called on every DTensor input of every compiled call (by its guards and its runtime wrapper): a
        # dict lookup on the interned spec's identity instead of a new object.
        requires_grad = self.requires_grad
        if requires_grad:  # a parameter used only inside compiled code gets its gradient hooks here
            watch_graph_input(self)
        key = (spec, requires_grad)
        metadata = _metadata_by_spec.get(key)
        if metadata is None:
            if len(_metadata_by_spec) >= _MAX_METADATA:
                _metadata_by_spec.clear()
            metadata = _metadata_by_spec[key] = TracedMetadata(spec.mesh, spec.layout, spec.dtype, requires_grad)
        return ["_local_tensor"], metadata

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, metadata: TracedMetadata, outer_size, outer_stride):
        # Dynamic shapes: `outer_size` and `outer_stride` may hold SymInts; the layout takes them (`with_shape`).
        spec = DTensorSpec(metadata.mesh, metadata.layout.with_shape(outer_size), tuple(outer_stride), metadata.dtype)
        return cls(inner_tensors["_local_tensor"], spec, requires_grad=metadata.requires_grad)

    @classmethod
    def __metadata_guard__(cls, traced: TracedMetadata, given: TracedMetadata) -> bool:
        """Dynamo's guard on a DTensor input's metadata: equal, except for the sizes that dynamo's guards on
        the tensor's own sizes check (a dim's size, and its pieces where the size alone gives them), so a
        graph traced with a dynamic size serves every size. Explicit uneven pieces must be equal. The common
        case is one identity test (`__tensor_flatten__` returns one metadata object per spec)."""
        if given is traced or traced == given:
            return True
        layout, other = traced.layout, given.layout
        return (
            traced.mesh == given.mesh and traced.dtype == given.dtype and traced.requires_grad == given.requires_grad
            and layout.mesh_shape == other.mesh_shape and layout.placements == other.placements
            and layout.shard_order == other.shard_order and layout.explicit_pieces() == other.explicit_pieces()
        )

    def __coerce_tangent_metadata__(self):
        """A Partial gradient flowing into a compiled backward is reduced first (Partial read as Replicate)."""
        layout = self._spec.layout
        if not layout.partial_mesh_dims():
            return self
        return self.redistribute(self._spec.mesh, layout.without_partial().placements)

    def __coerce_same_metadata_as_tangent__(self, metadata: TracedMetadata, expected_type=None):
        """This gradient in the layout the compiled backward was traced with (None: not possible): its exact
        pieces too, as eager `FromLocal.backward` gives them (a gradient of shards 5 and 5 reaching a graph
        traced for 8 and 2). A traced layout of another global shape (a dynamic size) gives its placements."""
        if expected_type is not None:
            return None
        spec = self._spec
        if metadata.mesh != spec.mesh:
            return None
        target = metadata.layout
        if target.shape != spec.layout.shape:
            target = spec.layout.with_placements(target.placements)
        if target == spec.layout:
            return self
        return Redistribute.apply(self, spec.mesh, target, False)
