"""`TraceableMixin` (a base of `DTensor`): torch's protocol for tracing a wrapper tensor subclass.

`torch.compile` sees a DTensor as its local tensor plus metadata: `__tensor_flatten__` names the one
inner tensor (`_local_tensor`) and returns a `TracedMetadata` value (mesh, exact layout with every
rank's shard sizes, dtype, requires_grad) that compares and hashes by value, so a compiled graph is
guarded on it (`__metadata_guard__`: all but the sizes dynamo's own size guards check) and reused for
every DTensor with the same metadata. `__tensor_unflatten__` rebuilds a
DTensor around a traced (fake or functional) local tensor, its layout taking the traced global size (SymInts
under dynamic shapes, `Layout.with_shape`); the dispatch layer then runs on it as in eager mode, with `comm`
issuing functional collectives (docs/compile.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout
from .mesh import DeviceMesh
from .spec import DTensorSpec

__all__ = ["TraceableMixin", "TracedMetadata"]


@dataclass(frozen=True, slots=True)
class TracedMetadata:
    """Everything about a DTensor a compiled graph depends on except its local tensor and global
    stride (which torch passes to `__tensor_unflatten__` itself)."""

    mesh: DeviceMesh
    layout: Layout
    dtype: torch.dtype
    requires_grad: bool


class TraceableMixin:
    """`__tensor_flatten__` / `__tensor_unflatten__` and the tangent coercions of a class holding one
    shard per rank (`_local_tensor`, `_spec`) and built as `cls(local_tensor, spec, requires_grad=...)`."""

    __slots__ = ()

    def __tensor_flatten__(self):
        spec = self._spec
        layout = spec.layout
        if layout.is_symbolic:  # traced with dynamic shapes: the sizes come back through `__tensor_unflatten__`'s
            layout = layout.with_example_sizes()  # outer_size (symbolic while tracing, concrete when a graph runs)
        return ["_local_tensor"], TracedMetadata(spec.mesh, layout, spec.dtype, self.requires_grad)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, metadata: TracedMetadata, outer_size, outer_stride):
        # Dynamic shapes: `outer_size` and `outer_stride` may hold SymInts; the layout takes them (`with_shape`).
        spec = DTensorSpec(metadata.mesh, metadata.layout.with_shape(outer_size), tuple(outer_stride), metadata.dtype)
        return cls(inner_tensors["_local_tensor"], spec, requires_grad=metadata.requires_grad)

    @classmethod
    def __metadata_guard__(cls, traced: TracedMetadata, given: TracedMetadata) -> bool:
        """Dynamo's guard on a DTensor input's metadata: equal, except for the sizes that dynamo's guards on
        the tensor's own sizes check (a dim's size, and its pieces where the size alone gives them), so a
        graph traced with a dynamic size serves every size. Explicit uneven pieces must be equal."""
        if traced == given:
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
        """This gradient in the layout the compiled backward was traced with (None: not possible)."""
        if expected_type is not None:
            return None
        if metadata.mesh != self._spec.mesh:
            return None
        return self.redistribute(metadata.mesh, metadata.layout.placements)
