"""The `DTensor` class: a global tensor held as one local shard per rank of a mesh.

A DTensor is a `torch.Tensor` wrapper subclass whose metadata (shape, stride, dtype) are those of
the global tensor and whose data is `_local_tensor`, this rank's shard as described by a `Layout`.
The class is complete here: public torch calls on DTensors reach `__torch_function__`
(`torch_function.py`: a fast path for cached local ops), aten ops `__torch_dispatch__`
(`dispatch.py`), and metadata reads, views and common operators come from the inherited
`FastTensorMethods` (`tensor_methods.py`). The conversions `from_local`, `to_local`, `full_tensor`
and `redistribute` are autograd functions (`autograd.py`), so gradients flow through them with the
layouts PyTorch documents (a Partial gradient becomes Replicate).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from . import handlers
from .autograd import FromLocal, Redistribute, ToLocal
from .checkpoint import CheckpointableMixin
from .dispatch import dispatch
from .from_local import from_local_layout, shard_sizes_from_shapes
from .gradients import watch_leaf
from .layout import Layout
from .mesh import DeviceMesh, current_mesh
from .placement import Partial, Placement, Replicate, Shard, check_partial_dtype
from .spec import DTensorSpec, global_stride, interned_spec
from .tensor_methods import FastTensorMethods
from .torch_exchange import from_torch_dtensor, to_torch_dtensor
from .tracing import TraceableMixin

__all__ = ["DTensor"]

_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass

# id -> weak reference of every wrapper whose shard is still on its way (made with `pending`): while
# this is empty, every DTensor's `_local_value` is its shard and hot loops read it directly. (Keyed
# by id: a set of weak references would compare tensors with `==`.)
_waiting: dict[int, weakref.ref] = {}


def _mirror_math_bits(wrapper: torch.Tensor, local_tensor: torch.Tensor) -> None:
    """A DTensor whose shard is a conjugate or negative view (`x.conj()`) reports it as a tensor on
    one device would: `is_conj()` is true and `resolve_conj()` resolves it (before `view_as_real`)."""
    torch._C._set_conj(wrapper, local_tensor.is_conj())
    torch._C._set_neg(wrapper, local_tensor.is_neg())


def _from_local(cls, local_tensor, mesh, placements, run_check, shape, stride, shard_sizes) -> DTensor:
    """`cls.from_local` once its defaults are filled in."""
    layout = from_local_layout(local_tensor, mesh, placements, shape, shard_sizes, run_check)
    global_strides = tuple(stride) if stride is not None else global_stride(local_tensor, layout.shape)
    spec = DTensorSpec(mesh, layout, global_strides, local_tensor.dtype)
    return FromLocal.apply(local_tensor, spec, run_check, cls)


class DTensor(FastTensorMethods, CheckpointableMixin, TraceableMixin, torch.Tensor):
    """A distributed tensor: global metadata on the wrapper, this rank's shard in `_local_tensor`.

    Build one with `distribute_tensor`, `DTensor.from_local` or a factory (`shardtensor.zeros`, ...).

    >>> mesh = init_device_mesh("cpu", (2,))  # doctest: +SKIP
    >>> x = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])  # doctest: +SKIP
    >>> x.to_local()  # doctest: +SKIP
    tensor([0., 1., 2.])   # on rank 0
    """

    # Slots: read by attribute descriptors instead of the instance dict, which a wrapper then does
    # not need at all (cheaper to read in a list plan's loops, to create and to free; torch's
    # `__torch_function__` lookup on each tensor argument skips the dict too).
    __slots__ = ("_local_value", "_spec")
    _local_value: torch.Tensor | None
    _pending: object | None = None  # an async redistribute's result to wait for (`_wrap` leaves it unset)
    _waiting = _waiting  # read through the class by the engine below it (`list_plans`)
    _spec: DTensorSpec
    _view_of_copy = None  # a view of a moved copy: the copy's `CopySource`, which reads and writes go through (`write_back.py`)

    # Public torch functions, methods and operators reach `torch_function` (bound to the class as
    # `__torch_function__` by `FastTensorMethods.__init_subclass__`), then aten ops `dispatch`.
    __torch_dispatch__ = classmethod(dispatch)

    @staticmethod
    def __new__(cls, local_tensor, spec: DTensorSpec, *, requires_grad: bool = False, pending=None):
        if isinstance(local_tensor, DTensor):
            raise TypeError("the local tensor of a DTensor must be a plain torch.Tensor, got a DTensor")
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.layout.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        wrapper._local_value = None if pending is not None else local_tensor
        if pending is not None:  # else the class default: no instance dict
            wrapper._pending = pending
            key = id(wrapper)
            _waiting[key] = weakref.ref(wrapper, lambda _, key=key: _waiting.pop(key, None))
        wrapper._spec = interned_spec(spec)
        if local_tensor.is_conj() or local_tensor.is_neg():
            _mirror_math_bits(wrapper, local_tensor)
        return wrapper

    @classmethod
    def _wrap(cls, local_tensor: torch.Tensor, spec: DTensorSpec) -> DTensor:
        """`DTensor(local_tensor, spec)` for an op's output on the hot path: no checks, positional
        arguments (about 1 us cheaper per output than keywords)."""
        wrapper = _make_wrapper_subclass(
            cls, spec.layout.shape, spec.stride, None, None, spec.dtype, local_tensor.layout, local_tensor.device
        )
        wrapper._local_value = local_tensor
        wrapper._spec = spec
        if local_tensor.is_conj() or local_tensor.is_neg():
            _mirror_math_bits(wrapper, local_tensor)
        return wrapper

    @classmethod
    def _wrap_new(cls, local_tensors, specs) -> list[DTensor]:
        """`_wrap` of each of a multi-tensor op's outputs, which are new tensors (never conjugate or
        negative views): no math bits to mirror, one call for the list (24 Adam outputs: ~6 us less)."""
        wrappers = []
        for local_tensor, spec in zip(local_tensors, specs):
            wrapper = _make_wrapper_subclass(
                cls, spec.layout.shape, spec.stride, None, None, spec.dtype, local_tensor.layout, local_tensor.device
            )
            wrapper._local_value = local_tensor
            wrapper._spec = spec
            wrappers.append(wrapper)
        return wrappers

    # ---- metadata --------------------------------------------------------------------------------

    @property
    def _local_tensor(self) -> torch.Tensor:
        """This rank's shard; waits here for an async redistribute that produced it. A view of a
        moved copy first gets the values its base was given since (`CopySource.refresh`): every read
        of a DTensor's shard comes here, cached plans and `to_local()` included."""
        if self._pending is not None:
            self._local_value = self._pending.wait()
            self._pending = None
            _waiting.pop(id(self), None)
        source = self._view_of_copy
        if source is not None:
            source.refresh()
        return self._local_value

    @_local_tensor.setter
    def _local_tensor(self, local_tensor: torch.Tensor) -> None:
        """Replace the shard by one of the same shape: torch's subclass protocol does this to a gradient
        entering a compiled backward (made contiguous)."""
        if self._pending is not None:
            self._pending = None
            _waiting.pop(id(self), None)
        self._local_value = local_tensor

    def _take_value_of(self, other: DTensor) -> None:
        """Become `other` in place (its shard and spec): how in-place views such as `squeeze_` and
        `x.data = y` land. What `x` views follows too: a view of a copy no longer reads or writes
        its base after `x.data = y`, as on one device."""
        self._local_value, self._pending, self._spec = other._local_tensor, None, other._spec
        _waiting.pop(id(self), None)
        if other._view_of_copy is not self._view_of_copy:
            self._view_of_copy = other._view_of_copy

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.layout.placements

    @property
    def sharding(self) -> Layout:
        """The exact `Layout`: placements, shard order and every rank's shard sizes (uneven included)."""
        return self._spec.layout

    def offsets(self, mesh_dim: int | str | None = None) -> tuple[int, ...] | int:
        """Where this rank's shard starts in the global tensor, exact for uneven shards.

        Without `mesh_dim`: one global offset per tensor dim. With it: the offset along the tensor dim
        that `mesh_dim` shards, counting the shards of the peers before this rank along `mesh_dim`
        (the global offset unless another mesh dim splits that tensor dim too); 0 for a mesh dim
        that does not shard (PhysicsNeMo ShardTensor's `offsets(mesh_dim)`).

        >>> DTensor.from_local(torch.ones(rank + 1), mesh, [Shard(0)]).offsets()  # doctest: +SKIP
        (1,)   # on rank 1 of 2: rank 0 holds one row
        """
        coordinate = self.device_mesh.get_coordinate()
        if coordinate is None:
            raise RuntimeError(
                f"offsets: rank {self.device_mesh.get_rank()} is not in {self.device_mesh!r} and holds no shard; "
                f"ask on a rank of the mesh"
            )
        layout = self._spec.layout
        if mesh_dim is None:
            return layout.local_offset(coordinate)
        index = self.device_mesh._mesh_dim_index(mesh_dim, needed_for="offsets")
        placement = layout.placements[index]
        if not isinstance(placement, Shard):
            return 0
        return sum(layout.sizes_along(index, placement.dim, coordinate)[: coordinate[index]])

    def __repr__(self) -> str:
        sizes = _uneven_sizes_text(self._spec.layout)
        source = self._view_of_copy
        if source is not None and source.needs_refresh():  # printing may run on one rank: no collective here
            local = (f"{self._local_value!r} (stale: a view of a redistributed copy whose base was written since; "
                     f"the next op on it reads the base's new values)")
        else:
            local = repr(self._local_tensor)
        return (
            f"DTensor(local_tensor={local}, device_mesh={self._spec.mesh!r}, "
            f"placements={self.placements!r}{sizes})"
        )

    # ---- conversions -----------------------------------------------------------------------------

    @classmethod
    def from_local(
        cls,
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        shard_sizes: str | Mapping[int, Sequence[int]] | None = None,
        sharding_shapes: str | Mapping[int, Sequence[Sequence[int]]] | None = None,
    ) -> DTensor:
        """Make a DTensor from every rank's local shard (differentiable; no data moves by default).

        Shard sizes: with `shape`, the shards are the `torch.chunk` split of `shape` (or
        `shard_sizes={mesh_dim: sizes}` if given too) and this rank's shape is checked against it.
        Without `shape`, a Shard placement makes every rank share its local shape once (one
        fixed-size all_gather), so uneven shards are exact (`shard_sizes="infer"`, the default);
        `shard_sizes="chunk"` skips that and assumes equal local shapes, as PyTorch does;
        `shard_sizes={mesh_dim: sizes}` gives them explicitly. `sharding_shapes` is PhysicsNeMo
        ShardTensor's spelling of the same: "infer", "chunk", or `{mesh_dim: [local shapes]}` (the
        local shape of each coordinate along mesh_dim; pass one of the two). `run_check=True` checks shapes,
        dtypes and placements on all ranks (raising the same error everywhere) and broadcasts
        Replicate data from coordinate 0 of each mesh dim. Inside a torch.compile graph the shapes
        cannot come from that exchange: they are assumed (equal shards, or `shape`/`shard_sizes`)
        and the graph checks every rank's against them, raising on a mismatch (docs/compile.md).

        On a rank outside the mesh the result holds a local tensor without elements (as after
        `distribute_tensor`) and no collective runs there; its global shape comes from `shape` if
        given, else from `shard_sizes` and the local tensor as if every shard had its shape.

        >>> x = DTensor.from_local(torch.ones(rank + 1, 2), mesh, [Shard(0)])  # doctest: +SKIP
        >>> x.shape  # with 2 ranks: 1 + 2 rows
        torch.Size([3, 2])
        """
        if isinstance(local_tensor, DTensor):
            raise TypeError("from_local takes this rank's plain local tensor, got a DTensor; use redistribute")
        mesh = device_mesh if device_mesh is not None else current_mesh()
        if placements is None:
            placements = [Replicate()] * mesh.ndim
        placements = tuple(placements)
        if sharding_shapes is not None:
            if shard_sizes is not None:
                raise ValueError(
                    "from_local: pass shard_sizes or sharding_shapes, not both (sharding_shapes is "
                    "PhysicsNeMo's name: local shapes per coordinate; shard_sizes: sizes along the sharded dim)"
                )
            shard_sizes = shard_sizes_from_shapes(sharding_shapes, local_tensor, mesh, placements,
                                                  check_local=not run_check)
        arguments = (local_tensor, mesh, placements, run_check, shape, stride, shard_sizes)
        if cls is DTensor:
            return _from_local_node(*arguments)
        return _from_local(cls, *arguments)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable).

        The gradient of the result is read with `grad_placements` (default: this DTensor's). A leaf's
        `.grad` still ends backward in the leaf's placements (`gradients.py`): a Replicate weight read
        with `grad_placements=[Partial()]` gets its Partial gradient reduced when backward ends.

        >>> x.to_local()  # doctest: +SKIP
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        watch_leaf(self)  # no torch function sees this leaf if it is used only here
        return ToLocal.apply(self, None if grad_placements is None else tuple(grad_placements))

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable; gathers as needed).

        >>> distribute_tensor(torch.arange(4), mesh, [Shard(0)]).full_tensor()  # doctest: +SKIP
        tensor([0, 1, 2, 3])
        """
        replicated = self.redistribute(placements=[Replicate()] * self.device_mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global tensor under other placements (differentiable).

        Targets may be Shard or Replicate (a mesh dim already Partial may stay so). The gradient
        goes back to this DTensor's layout, with Partial read as Replicate. With `async_op=True`
        the result returns at once and waits for its data on first use. `forward_dtype` casts the data
        before the collectives (the result has that dtype); `backward_dtype` is the dtype of the
        gradient's collectives (default: this DTensor's), and the gradient comes back in this dtype.

        `placements=None` (ours; PyTorch raises "placements is needed for redistribute!") keeps this
        DTensor's placements, Partial ones included: `x.redistribute()` is a new DTensor over the same
        local tensor, with no communication, and `x.redistribute(forward_dtype=torch.bfloat16)` only
        casts. A `device_mesh` other than this DTensor's needs placements for it (ValueError otherwise).

        `device_mesh` may be another mesh (other shape, rank order or ranks; docs/redistribute.md):
        every rank of the world must call, and ranks outside the target mesh get a local tensor
        without elements. On a rank outside this DTensor's mesh, a same-mesh redistribute is a
        no-op giving such a tensor (so `full_tensor()` is empty there, as in PyTorch).

        >>> x.redistribute(placements=[Replicate()])  # doctest: +SKIP
        """
        if torch.is_grad_enabled():
            watch_leaf(self)  # a leaf used only here (or by `full_tensor`) is seen by no torch function
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh != self.device_mesh:
            target = _cross_mesh_target(self, mesh, placements)
            if not torch.is_grad_enabled():
                return Redistribute.apply(self, mesh, target, async_op, forward_dtype, backward_dtype)
            # Whether the result requires grad comes from the source's holders with the data: the move is waited.
            source = _stand_in_requiring_grad(self, mesh)
            return Redistribute.apply(source, mesh, target, False, forward_dtype, backward_dtype, True)
        if placements is None:
            placements = self.placements
        target = self.sharding.with_placements(tuple(placements))
        for mesh_dim, (old, new) in enumerate(zip(self.placements, target.placements)):
            if isinstance(new, Partial) and new != old:
                raise ValueError(
                    f"redistribute target placements[{mesh_dim}] = {new!r}, but the source has {old!r} "
                    f"there; only Shard(dim) and Replicate() targets are allowed (a Partial is the "
                    f"result of an op, not a layout one can move data into). Given placements "
                    f"{tuple(placements)!r} from {self.placements!r}"
                )
        if forward_dtype is not None:
            check_partial_dtype(target.placements, forward_dtype, "DTensor.redistribute(forward_dtype=...)")
        if target == self.sharding:
            target = self.sharding  # keep exact pieces and shard order: no communication
        return Redistribute.apply(self, mesh, target, async_op, forward_dtype, backward_dtype)

    # ---- PhysicsNeMo ShardTensor's registry (handlers.py) and PyTorch's DTensor (torch_exchange.py) ----

    @classmethod
    def register_function_handler(cls, func, handler) -> None:
        """Run `handler(func, types, args, kwargs)` instead of the library's path when the torch function
        or method `func` gets a DTensor (above autograd; `handler=None` removes it; see `handlers.py`).

        >>> DTensor.register_function_handler(torch.nn.functional.gelu, my_gelu)  # doctest: +SKIP
        """
        handlers.register_function_handler(func, handler)

    @classmethod
    def register_named_function_handler(cls, name: str, handler) -> None:
        """`register_function_handler` by the function's name: a custom op `ns::op` is "ns.op.default"."""
        handlers.register_named_function_handler(name, handler)

    @classmethod
    def register_dispatch_handler(cls, op, handler) -> None:
        """Run `handler(*args, **kwargs)` instead of the library's rule for the aten overload `op` (below
        autograd: the op's derivative formula stays torch's; `handler=None` removes it)."""
        handlers.register_dispatch_handler(op, handler)

    @classmethod
    def patches_enabled(cls) -> bool:
        """Whether registered handlers are used (on unless inside `DTensor.enable_patches(False)`)."""
        return handlers.patches_enabled()

    @classmethod
    def enable_patches(cls, enabled: bool = True):
        """A context in which registered handlers are used (True) or not (False).

        >>> with DTensor.enable_patches(False):  # doctest: +SKIP
        ...     y = torch.nn.functional.gelu(x)  # the library's rule, not the handler
        """
        return handlers.enable_patches(enabled)

    @classmethod
    def from_dtensor(cls, tensor) -> DTensor:
        """This library's DTensor over the shard of PyTorch's `torch.distributed.tensor.DTensor` (the same
        storage, mesh ranks and placements; no collective; differentiable both ways).

        >>> ours = DTensor.from_dtensor(torch_dtensor)  # doctest: +SKIP
        """
        return from_torch_dtensor(cls, tensor)

    def to_dtensor(self):
        """PyTorch's `torch.distributed.tensor.DTensor` over this shard (the same storage, mesh ranks and
        placements; no collective; differentiable). Uneven shards that are not `torch.chunk`'s raise
        (PyTorch cannot describe them).

        >>> torch_dtensor = x.to_dtensor()  # doctest: +SKIP
        """
        return to_torch_dtensor(self)


@torch.compiler.allow_in_graph
def _from_local_node(local_tensor, mesh, placements, run_check, shape, stride, shard_sizes) -> DTensor:
    """`DTensor.from_local` as one node of a torch.compile graph (the mesh and placements are its
    constants), which AOTAutograd traces into."""
    return _from_local(DTensor, local_tensor, mesh, placements, run_check, shape, stride, shard_sizes)


def _cross_mesh_target(dtensor: DTensor, mesh: DeviceMesh, placements) -> Layout:
    """The target layout on another mesh: Shard and Replicate only (Partial sources are reduced first)."""
    if placements is None:
        raise ValueError(
            f"redistribute to another mesh needs placements for it: this DTensor lives on "
            f"{dtensor.device_mesh!r} with {dtensor.placements!r}, the target mesh is {mesh!r}; pass "
            f"one Shard(dim) or Replicate() per mesh dim of the target mesh"
        )
    target = Layout.create(mesh.shape, tuple(placements), dtensor.shape)
    if target.partial_mesh_dims():
        raise ValueError(
            f"redistribute to another mesh takes Shard(dim) and Replicate() targets only, got "
            f"{tuple(placements)!r} for {mesh!r}; a Partial source is reduced on its own mesh first"
        )
    return target


def _stand_in_requiring_grad(dtensor: DTensor, mesh: DeviceMesh) -> DTensor:
    """On a rank of `mesh` outside `dtensor`'s mesh, its stand-in requiring grad, so that the move's result
    can: whether it does is the source's holders' answer, which comes with the data
    (`cross_mesh.redistribute_across_meshes_with_requires_grad`). A stand-in holds no data, and its own
    `requires_grad` deciding alone left the holders waiting in backward for a gradient this rank never
    sent (or sent one that a frozen source never took)."""
    if dtensor.requires_grad or dtensor.device_mesh.get_coordinate() is not None or mesh.get_coordinate() is None:
        return dtensor
    return type(dtensor)(dtensor._local_tensor.detach(), dtensor._spec, requires_grad=True)


def _uneven_sizes_text(layout: Layout) -> str:
    if layout.is_chunked():
        return ""
    by_mesh_dim = {
        order[0]: list(pieces) for pieces, order in zip(layout.pieces, layout.shard_order) if len(order) == 1
    }
    nested = any(len(order) > 1 for order in layout.shard_order)
    if nested:
        return f", pieces={layout.pieces}"
    return f", shard_sizes={by_mesh_dim}"
