"""A sharded-data-parallel unit: the parameters one `fully_shard` call manages, and its buffers.

Each parameter is cut along one tensor dim over the data-parallel ranks into exact `torch.chunk`
pieces (uneven and empty pieces included, never padded). The unit owns two flat buffers: the
*gathered* buffer, coordinate-major (every rank's pieces of all parameters, rank after rank, as one
all-gather writes them), and the *unsharded* buffer, parameter-major (each parameter whole and
contiguous, which the module computes with). Their storage is allocated on `unshard` and freed on
`reshard`; views into them stay valid across, so autograd's saved tensors see re-gathered data.
Gradients go the other way: one coordinate-major buffer, one reduce-scatter (sum), then a division.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..dtensor import DTensor
from ..spec import DTensorSpec, contiguous_stride
from ..layout import Layout
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from ..redistribute.buckets import all_reduce_together, reduction_only
from .policies import MixedPrecisionPolicy

__all__ = ["ParameterSlot", "ParameterUnit", "Reduction"]


@dataclass(frozen=True, slots=True)
class ParameterSlot:
    """One managed parameter: where it is registered, how it is cut, where its elements sit.

    `unsharded_shape` is what the module computes with (the global shape, or the tensor-parallel
    local shape when the parameter was a DTensor on other mesh dims); `piece_sizes[c]` is the size
    on `dim` of data-parallel coordinate c's piece of it.
    """

    locations: tuple[tuple[nn.Module, str], ...]
    dim: int
    unsharded_shape: tuple[int, ...]
    piece_sizes: tuple[int, ...]
    unsharded_offset: int
    gathered_offsets: tuple[int, ...]  # per coordinate: first element of this parameter's piece
    sharded_spec: DTensorSpec
    unsharded_spec: DTensorSpec | None  # tensor-parallel parameters: their layout without the data-parallel dims

    @property
    def numel(self) -> int:
        return math.prod(self.unsharded_shape)

    def piece_shape(self, coordinate: int) -> tuple[int, ...]:
        shape = list(self.unsharded_shape)
        shape[self.dim] = self.piece_sizes[coordinate]
        return tuple(shape)

    def piece_numel(self, coordinate: int) -> int:
        return math.prod(self.piece_shape(coordinate))

    def piece_start(self, coordinate: int) -> int:
        return sum(self.piece_sizes[:coordinate])


def _unit_error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"fully_shard: {problem}; {allowed}")


def managed_parameters(modules: Sequence[nn.Module], ignored: set[int], is_managed: Callable[[nn.Module], bool]):
    """(module, name, parameter) of every parameter under `modules`, skipping the parameters whose id is
    in `ignored` and the subtrees of modules already managed by another unit (`is_managed`)."""
    found = []

    def visit(module: nn.Module, top: bool) -> None:
        if not top and is_managed(module):
            return
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in ignored:
                found.append((module, name, parameter))
        for child in module.children():
            visit(child, False)

    for module in modules:
        visit(module, True)
    return found


def combined_mesh(data_parallel: DeviceMesh, tensor_parallel: DeviceMesh) -> DeviceMesh:
    """The mesh with the data-parallel mesh dims first and the tensor-parallel ones after.

    Each rank knows only the two lines through it, so the ranks of the data-parallel line share
    their tensor-parallel lines once (one object all-gather at `fully_shard` time).
    """
    if set(data_parallel.mesh.flatten().tolist()) & set(tensor_parallel.mesh.flatten().tolist()) != {data_parallel.get_rank()}:
        raise _unit_error(
            f"the data-parallel mesh {data_parallel!r} and the mesh {tensor_parallel!r} of a DTensor parameter share "
            f"ranks other than this one",
            "shard with the mesh dims that the parameter's mesh does not use, e.g. mesh['dp'] after parallelize_module "
            "on mesh['tp']",
        )
    lines = comm.all_gather_object(tensor_parallel.mesh.tolist(), data_parallel, None)
    ranks = torch.tensor(lines, dtype=torch.int64, device="cpu").view(*data_parallel.shape, *tensor_parallel.shape)
    names = None
    if data_parallel.mesh_dim_names is not None and tensor_parallel.mesh_dim_names is not None:
        names = data_parallel.mesh_dim_names + tensor_parallel.mesh_dim_names
    return DeviceMesh(data_parallel.device_type, ranks, mesh_dim_names=names)


def _sharded_layout(parameter: torch.Tensor, mesh: DeviceMesh, dim: int) -> Layout:
    """The parameter's layout with the data-parallel mesh dims in front and `dim` split innermost on the last."""
    data_parallel_dims = mesh.ndim
    if isinstance(parameter, DTensor):
        inner = parameter.sharding
        shifted_order = tuple(tuple(mesh_dim + data_parallel_dims for mesh_dim in order) for order in inner.shard_order)
        layout = Layout(tuple(mesh.shape) + inner.mesh_shape, (Replicate(),) * data_parallel_dims + inner.placements,
                        inner.shape, shifted_order, inner.pieces)
    else:
        layout = Layout.create(mesh.shape, (Replicate(),) * data_parallel_dims, parameter.shape)
    return layout.transition(data_parallel_dims - 1, Shard(dim))


def _parameter(dtensor: DTensor) -> nn.Parameter:
    """`dtensor` itself marked as an `nn.Parameter`, as `nn.Parameter(dtensor)` does for tensor subclasses
    but without its `detach()`, whose view rule would re-derive the layout (and lose a nested shard order)."""
    dtensor._is_param = True
    return dtensor


class Reduction:
    """One backward's reduced gradients of a unit, in flight: a reduce-scatter over the sharding mesh
    dim, for HSDP then an all-reduce over the replicating one, then the division and the cast back."""

    def __init__(self, unit: ParameterUnit, handle):
        self._unit = unit
        self._handle = handle
        self._replicate_handle = None
        self._result: torch.Tensor | None = None

    def start_replicate_reduce(self) -> None:
        """Issue the HSDP all-reduce (called in a deterministic place: every rank issues it at the same point)."""
        unit = self._unit
        if unit.replicate_mesh_dim is None or self._replicate_handle is not None or self._result is not None:
            return
        scattered = self._handle.wait()
        if unit.partial_reduce_output is not None:  # earlier backwards' pieces, reduced on the sharding dim only
            scattered.add_(unit.partial_reduce_output)
            unit.partial_reduce_output = None
        self._replicate_handle = comm.all_reduce(scattered, unit.mesh, unit.replicate_mesh_dim, reduce_op="sum", async_op=True)

    def wait(self) -> torch.Tensor:
        """This rank's flat gradient pieces: summed over every data-parallel rank, divided, in the parameters' dtype."""
        if self._result is None:
            self.start_replicate_reduce()
            handle = self._replicate_handle if self._replicate_handle is not None else self._handle
            summed = handle.wait()
            if self._unit.all_reduce_hook is not None:
                self._unit.all_reduce_hook(summed)
            summed = summed.div_(self._unit.divide_factor()) if summed.is_floating_point() else summed
            self._result = summed.to(self._unit.parameter_dtype)
            self._handle = self._replicate_handle = None
        return self._result


class _GradientPiece:
    """A `pending` for one parameter's gradient DTensor: its slice of the unit's `Reduction`."""

    __slots__ = ("reduction", "offset", "shape")

    def __init__(self, reduction: Reduction, offset: int, shape: tuple[int, ...]):
        self.reduction, self.offset, self.shape = reduction, offset, shape

    def wait(self) -> torch.Tensor:
        return self.reduction.wait()[self.offset : self.offset + math.prod(self.shape)].view(self.shape)


class ParameterUnit:
    """The parameters of one `fully_shard` call: sharded on construction, gathered and reduced as one."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        mesh: DeviceMesh,
        *,
        shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
        mp_policy: MixedPrecisionPolicy,
        ignored_params: set[int],
        reshard_after_forward: bool | None,
        is_managed: Callable[[nn.Module], bool],
    ):
        if mesh.ndim not in (1, 2):
            raise _unit_error(f"mesh {mesh!r} has {mesh.ndim} mesh dims",
                              "give a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate on mesh dim 0, shard on mesh dim 1)")
        self.modules = tuple(modules)
        self.mesh = mesh
        self.shard_mesh_dim = mesh.ndim - 1
        self.replicate_mesh_dim = 0 if mesh.ndim == 2 and mesh.size(0) > 1 else None
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: False keeps the reduce-scatter's output for the next backward
        self.partial_reduce_output: torch.Tensor | None = None
        self.unshard_in_backward = True
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.gradient_divide_factor: float | None = None
        self.coordinate = mesh.get_local_rank(self.shard_mesh_dim)
        self.size = mesh.size(self.shard_mesh_dim)
        self.sharded_parameters: list[nn.Parameter] = []
        self.slots: list[ParameterSlot] = []
        self._build(managed_parameters(self.modules, ignored_params, is_managed), shard_placement_fn)
        self._gather_handle = None
        self._gathered_state = "sharded"  # "sharded" | "gathering" | "gathered"
        self._shown_unsharded: tuple | None = None  # after an explicit unshard(): registered until reshard()
        self._accumulated: torch.Tensor | None = None
        self._forward_tensors: tuple | None = None
        self._forward_tensors_with_grad = False
        # Set by the hooks: the step's shared state, explicit prefetch lists, modules of this unit done with forward.
        self.context = None
        self.forward_prefetch: list[ParameterUnit] | None = None
        self.backward_prefetch: list[ParameterUnit] | None = None
        self.finished_forward_modules: set[int] = set()

    # ---- construction -----------------------------------------------------------------------------

    def _build(self, found, shard_placement_fn) -> None:
        by_parameter: dict[int, list] = {}
        for module, name, parameter in found:
            by_parameter.setdefault(id(parameter), [parameter, []])[1].append((module, name))
        dtypes = {parameter.dtype for parameter, _ in by_parameter.values()}
        if len(dtypes) > 1:
            names = {str(parameter.dtype): locations[0][1] for parameter, locations in by_parameter.values()}
            raise _unit_error(f"the parameters of one unit have different dtypes {names}",
                              "one unit gathers one flat buffer of one dtype: shard the modules with other dtypes in "
                              "their own fully_shard call or list them in ignored_params")
        self.parameter_dtype = dtypes.pop() if dtypes else torch.get_default_dtype()
        self.compute_dtype = self.mp_policy.param_dtype or self.parameter_dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.compute_dtype
        meshes: dict[DeviceMesh, DeviceMesh] = {}
        layouts = []
        for parameter, locations in by_parameter.values():
            dim = self._shard_dim(parameter, shard_placement_fn, locations[0][1])
            full_mesh = self.mesh
            if isinstance(parameter, DTensor):
                if parameter.device_mesh not in meshes:
                    meshes[parameter.device_mesh] = combined_mesh(self.mesh, parameter.device_mesh)
                full_mesh = meshes[parameter.device_mesh]
            layout = _sharded_layout(parameter, self.mesh, dim)
            layouts.append((parameter, locations, dim, full_mesh, layout))
        segment_sizes = [0] * self.size
        unsharded_offset = 0
        pending_slots = []
        for parameter, locations, dim, full_mesh, layout in layouts:
            coordinate = full_mesh.get_coordinate()
            piece_sizes = tuple(layout.sizes_along(self.shard_mesh_dim, dim, coordinate))
            with torch.no_grad():
                whole = parameter.to_local() if isinstance(parameter, DTensor) else parameter.detach()
            unsharded_shape = tuple(whole.shape)
            gathered_offsets = []
            row = math.prod(unsharded_shape) // max(unsharded_shape[dim], 1) if unsharded_shape[dim] else 0
            for c in range(self.size):
                gathered_offsets.append(segment_sizes[c])
                segment_sizes[c] += piece_sizes[c] * row
            start = sum(piece_sizes[: self.coordinate])
            local = whole.narrow(dim, start, piece_sizes[self.coordinate]).clone(memory_format=torch.contiguous_format)
            sharded_spec = DTensorSpec(full_mesh, layout, contiguous_stride(layout.shape), parameter.dtype)
            unsharded_spec = None
            if isinstance(parameter, DTensor):
                unsharded_spec = DTensorSpec(parameter.device_mesh, parameter.sharding, tuple(parameter.stride()), self.compute_dtype)
            pending_slots.append((parameter, locations, dim, unsharded_shape, piece_sizes, unsharded_offset,
                                  tuple(gathered_offsets), sharded_spec, unsharded_spec, local))
            unsharded_offset += math.prod(unsharded_shape)
        self.segment_sizes = tuple(segment_sizes)
        bases = [sum(segment_sizes[:c]) for c in range(self.size)]
        for parameter, locations, dim, shape, pieces, offset, gathered, sharded_spec, unsharded_spec, local in pending_slots:
            absolute = tuple(base + relative for base, relative in zip(bases, gathered))
            slot = ParameterSlot(tuple(locations), dim, shape, pieces, offset, absolute, sharded_spec, unsharded_spec)
            sharded = _parameter(DTensor(local, sharded_spec, requires_grad=parameter.requires_grad))
            for module, name in locations:
                setattr(module, name, sharded)
            self.slots.append(slot)
            self.sharded_parameters.append(sharded)
        self._build_buffers(unsharded_offset)
        self._home_shards()

    def _shard_dim(self, parameter, shard_placement_fn, name: str) -> int:
        placement = shard_placement_fn(parameter) if shard_placement_fn is not None else None
        placement = Shard(0) if placement is None else placement
        if not isinstance(placement, Shard):
            raise _unit_error(f"shard_placement_fn returned {placement!r} for parameter {name!r}",
                              "return Shard(dim) for a tensor dim of the parameter, or None for Shard(0)")
        if parameter.ndim == 0 or not -parameter.ndim <= placement.dim < parameter.ndim:
            raise _unit_error(f"parameter {name!r} of shape {tuple(parameter.shape)} cannot be sharded with {placement!r}",
                              "0-d parameters cannot be sharded (list them in ignored_params); other parameters take "
                              "Shard(dim) with -ndim <= dim < ndim")
        return placement.dim % parameter.ndim

    def _build_buffers(self, total: int) -> None:
        device = self.sharded_parameters[0].device if self.sharded_parameters else torch.device(self.mesh.device_type)
        self.device = device
        self._unsharded = torch.empty(total, dtype=self.compute_dtype, device=device)
        # Writes go through an alias with its own version counter: re-gathering for backward must not
        # look like an in-place change of the tensors autograd saved in forward.
        self._unsharded_writer = self._unsharded.data
        single = len(self.slots) == 1 and self.slots[0].dim == 0
        self._gathered = self._unsharded_writer if single else torch.empty(total, dtype=self.compute_dtype, device=device)
        self._copy_sources, self._copy_targets = [], []
        if not single:
            for slot in self.slots:
                whole = self._unsharded_writer[slot.unsharded_offset : slot.unsharded_offset + slot.numel].view(slot.unsharded_shape)
                for c in range(self.size):
                    numel = slot.piece_numel(c)
                    if numel:
                        self._copy_sources.append(self._gathered[slot.gathered_offsets[c] : slot.gathered_offsets[c] + numel].view(slot.piece_shape(c)))
                        self._copy_targets.append(whole.narrow(slot.dim, slot.piece_start(c), slot.piece_sizes[c]))
        self._placeholder = torch.empty(0, dtype=self.parameter_dtype, device=device)
        self._free(self._unsharded)
        self._free(self._gathered)

    # ---- gathering -------------------------------------------------------------------------------

    @staticmethod
    def _free(buffer: torch.Tensor) -> None:
        buffer.untyped_storage().resize_(0)

    @staticmethod
    def _allocate(buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.untyped_storage().nbytes() != nbytes:
            buffer.untyped_storage().resize_(nbytes)

    @property
    def is_gathered(self) -> bool:
        return self._gathered_state == "gathered"

    @property
    def is_sharded(self) -> bool:
        return self._gathered_state == "sharded"

    def _home_shards(self) -> None:
        """Make the sharded parameters' local tensors views of one flat buffer, this rank's segment in the
        order the all-gather sends it, so that gathering sends the buffer itself (no copy-in); the
        optimizer's in-place updates and in-place loads keep them there."""
        with torch.no_grad():
            locals_ = [parameter._local_tensor for parameter in self.sharded_parameters]
            self._shard_data = torch.empty(self.segment_sizes[self.coordinate], dtype=self.parameter_dtype, device=self.device)
            storage, offset = self._shard_data.untyped_storage(), 0
            for local in locals_:
                count = local.numel()
                self._shard_data[offset : offset + count].copy_(local.reshape(-1))
                local.set_(storage, offset, local.shape, contiguous_stride(local.shape))
                offset += count
        self._shard_pointers = [local.data_ptr() for local in locals_]

    def _send_buffer(self) -> torch.Tensor:
        """This rank's pieces of every parameter, flat and in the compute dtype (the all-gather's input).

        The pieces already sit in one buffer (`_home_shards`); a local tensor that was replaced behind
        the parameter's back (`param.data = ...`) is copied back in first."""
        if [parameter._local_tensor.data_ptr() for parameter in self.sharded_parameters] != self._shard_pointers:
            self._home_shards()
        if self._shard_data.dtype == self.compute_dtype:
            return self._shard_data
        return self._shard_data.to(self.compute_dtype)

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering every parameter (one collective); wait for it unless `async_op`."""
        if self._gathered_state == "sharded" and self.slots:
            self._allocate(self._unsharded)
            self._allocate(self._gathered)
            self._gather_handle = comm.all_gather_into(self._gathered, self._send_buffer(), self.mesh, self.shard_mesh_dim,
                                                       sizes=self.segment_sizes, async_op=True)
            self._gathered_state = "gathering"
        elif self._gathered_state == "sharded":
            self._gathered_state = "gathered"
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight gather: wait, copy each piece to its parameter, free the gathered buffer."""
        if self._gathered_state != "gathering":
            return
        self._gather_handle.wait()
        self._gather_handle = None
        if self._copy_sources:
            torch._foreach_copy_(self._copy_targets, self._copy_sources)
            self._free(self._gathered)
        self._gathered_state = "gathered"

    def reshard(self) -> None:
        """Free the unsharded parameters (an in-flight gather is finished first); the modules show the
        sharded ones again."""
        self.wait_for_unshard()
        if self._gathered_state == "gathered" and self.slots:
            self._free(self._unsharded)
        self._gathered_state = "sharded"
        self._forward_tensors = None
        if self._shown_unsharded is not None:
            self._shown_unsharded = None
            self.register_sharded()

    def show_unsharded(self) -> None:
        """Register the unsharded parameters on the modules until `reshard` (FSDP2's explicit `unshard()`):
        `nn.Parameter`s viewing the gathered data (DTensors on their own mesh for tensor-parallel ones)."""
        if self._shown_unsharded is None:
            self._shown_unsharded = tuple(
                _parameter(tensor.requires_grad_(sharded.requires_grad)) if isinstance(tensor, DTensor)
                else nn.Parameter(tensor, requires_grad=sharded.requires_grad)
                for tensor, sharded in zip(self.unsharded_tensors(), self.sharded_parameters)
            )
        self.register(self._shown_unsharded)

    def forget_step(self) -> None:
        """After a step an exception cut short: reshard, show the sharded parameters, drop the gradients
        accumulated without sync and the HSDP pieces kept for the next all-reduce."""
        self.reshard()
        self.register_sharded()
        self.finished_forward_modules.clear()
        self._accumulated = None
        self.partial_reduce_output = None

    def register_at_rest(self) -> None:
        """What the modules show outside forward: the unsharded parameters after an explicit unshard, else
        the sharded ones."""
        if self._shown_unsharded is not None:
            self.register(self._shown_unsharded)
        else:
            self.register_sharded()

    def adopt_replaced_parameters(self) -> None:
        """Take over parameters that a module conversion replaced, such as `to_empty(device=...)` after
        building the model on the meta device (the new DTensors must keep their layout); buffers follow
        the new device."""
        if self._gathered_state != "sharded":
            return  # the modules show unsharded parameters
        for index, slot in enumerate(self.slots):
            module, name = slot.locations[0]
            current = module._parameters.get(name)
            if current is self.sharded_parameters[index]:
                continue
            if not isinstance(current, DTensor) or current.sharding != slot.sharded_spec.layout:
                raise _unit_error(
                    f"parameter {name!r} was replaced by {type(current).__name__} "
                    f"{getattr(current, 'sharding', tuple(getattr(current, 'shape', ())))} after fully_shard",
                    f"keep its sharded layout {slot.sharded_spec.layout} (module.to_empty(device=...) does; "
                    f"copy new values into the parameter in place instead of assigning a new one)",
                )
            for location_module, location_name in slot.locations:
                setattr(location_module, location_name, current)
            self.sharded_parameters[index] = current
        device = self.sharded_parameters[0].device if self.sharded_parameters else self.device
        if device != self.device:
            self._build_buffers(self._unsharded.numel())
        if [parameter._local_tensor.data_ptr() for parameter in self.sharded_parameters] != self._shard_pointers:
            self._home_shards()

    def unsharded_tensors(self) -> tuple[torch.Tensor, ...]:
        """New views of the unsharded parameters (DTensors on their own mesh for tensor-parallel ones)."""
        tensors = []
        for slot in self.slots:
            view = self._unsharded[slot.unsharded_offset : slot.unsharded_offset + slot.numel].view(slot.unsharded_shape)
            tensors.append(view if slot.unsharded_spec is None else DTensor(view, slot.unsharded_spec))
        return tuple(tensors)

    def forward_tensors(self, make: Callable[[ParameterUnit], tuple]) -> tuple:
        """The unsharded tensors this forward uses, made once per gather (and per grad mode), so that a
        module called twice, or a unit of several modules, gives one autograd node: one reduce-scatter."""
        with_grad = torch.is_grad_enabled()
        if self._forward_tensors is None or self._forward_tensors_with_grad != with_grad:
            self._forward_tensors = make(self)
            self._forward_tensors_with_grad = with_grad
        return self._forward_tensors

    def clear_forward_tensors(self) -> None:
        self._forward_tensors = None

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        for slot, tensor in zip(self.slots, tensors):
            for module, name in slot.locations:
                module._parameters[name] = tensor

    def register_sharded(self) -> None:
        self.register(self.sharded_parameters)

    # ---- gradients -------------------------------------------------------------------------------

    def divide_factor(self) -> float:
        if self.gradient_divide_factor is not None:
            return self.gradient_divide_factor
        return self.mesh.size()

    def _local_gradients(self, grads: Sequence) -> list[torch.Tensor | None]:
        """Each gradient as a plain tensor of its unsharded shape. Tensor-parallel gradients that are Partial
        where their parameter is Replicate (norms and biases fed by a sequence-sharded stream) are summed in
        one all_reduce per (mesh, mesh dims, reduce op); any other layout is redistributed on its own."""
        locals_: list = list(grads)
        groups: dict[tuple, list[int]] = {}
        for index, (slot, grad) in enumerate(zip(self.slots, grads)):
            if grad is None or slot.unsharded_spec is None:
                continue
            target = slot.unsharded_spec.layout
            reduction = reduction_only(grad.sharding, target) if grad.sharding != target else None
            if reduction is not None:
                groups.setdefault((grad.device_mesh, reduction, grad.dtype), []).append(index)
                continue
            with torch.no_grad():
                if grad.sharding != target:
                    grad = grad.redistribute(slot.unsharded_spec.mesh, target.placements)
                locals_[index] = self._checked_local(slot, grad)
        for (mesh, (mesh_dims, reduce_op), _), indices in groups.items():
            pieces = [grads[index].to_local() for index in indices]
            for index, summed in zip(indices, all_reduce_together(pieces, mesh, mesh_dims, reduce_op)):
                locals_[index] = summed.view(self.slots[index].unsharded_shape)
        return locals_

    @staticmethod
    def _checked_local(slot: ParameterSlot, grad) -> torch.Tensor:
        local = grad.to_local()
        if tuple(local.shape) != slot.unsharded_shape:
            raise RuntimeError(
                f"fully_shard: the gradient of a tensor-parallel parameter came back as {grad.sharding} "
                f"(local shape {tuple(local.shape)}), which does not redistribute to its layout "
                f"{slot.unsharded_spec.layout} (local shape {slot.unsharded_shape})"
            )
        return local

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        if self._accumulated is None:
            self._accumulated = torch.zeros(self._unsharded.numel(), dtype=self.reduce_dtype, device=self.device)
        for slot, grad in zip(self.slots, grads):
            if grad is not None:
                self._accumulated_view(slot).add_(grad)

    def _keep_partial(self, scattered: torch.Tensor) -> None:
        """HSDP without all-reduce: add this backward's reduce-scatter output to what the next all-reduce sends."""
        if self.partial_reduce_output is None:
            self.partial_reduce_output = scattered
        else:
            self.partial_reduce_output.add_(scattered)

    def _accumulated_view(self, slot: ParameterSlot) -> torch.Tensor:
        return self._accumulated[slot.unsharded_offset : slot.unsharded_offset + slot.numel].view(slot.unsharded_shape)

    def reduce_gradients(self, grads: Sequence) -> tuple[list, Reduction | None]:
        """Gradient DTensors (Shard on the data-parallel dims) for the sharded parameters, and the reduction
        they wait for; with gradient sync off, the gradients are only accumulated (no communication)."""
        grads = self._local_gradients(grads)
        if not self.requires_gradient_sync:
            self._accumulate(grads)
            return [None] * len(self.slots), None
        if self._accumulated is not None:
            self._accumulate(grads)
            grads = [self._accumulated_view(slot) for slot in self.slots]
        scatter_input = torch.empty(sum(self.segment_sizes), dtype=self.reduce_dtype, device=self.device)
        sources, targets = [], []
        for slot, grad in zip(self.slots, grads):
            for c in range(self.size):
                numel = slot.piece_numel(c)
                if not numel:
                    continue
                target = scatter_input[slot.gathered_offsets[c] : slot.gathered_offsets[c] + numel].view(slot.piece_shape(c))
                if grad is None:
                    target.zero_()
                else:
                    sources.append(grad.narrow(slot.dim, slot.piece_start(c), slot.piece_sizes[c]))
                    targets.append(target)
        if targets:
            torch._foreach_copy_(targets, sources)
        self._accumulated = None
        handle = comm.reduce_scatter(scatter_input, self.mesh, self.shard_mesh_dim, reduce_op="sum", dim=0,
                                     sizes=self.segment_sizes, async_op=True)
        if self.replicate_mesh_dim is not None and not self.requires_all_reduce:
            self._keep_partial(handle.wait())
            return [None] * len(self.slots), None
        reduction = Reduction(self, handle)
        results, offset = [], 0
        for slot, parameter in zip(self.slots, self.sharded_parameters):
            shape = slot.piece_shape(self.coordinate)
            if parameter.requires_grad:
                piece = _GradientPiece(reduction, offset, shape)
                results.append(DTensor(self._placeholder, slot.sharded_spec, pending=piece))
            else:
                results.append(None)
            offset += math.prod(shape)
        return results, reduction
