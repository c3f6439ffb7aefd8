"""A sharded-data-parallel unit: the parameters one `fully_shard` call manages, and its buffers.

Each parameter is cut along one tensor dim over the data-parallel ranks into exact `torch.chunk`
pieces (`slots`). The unit owns two flat buffers: the *gathered* buffer, coordinate-major (every
rank's pieces of all parameters, rank after rank, as one all-gather writes them), and the *unsharded*
buffer, parameter-major (each parameter whole and contiguous, which the module computes with). Their
storage is allocated on `unshard` and freed on `reshard`; views into them stay valid across, so
autograd's saved tensors see re-gathered data. Gradients go the other way (`reduction`): one
coordinate-major buffer, one reduce-scatter (sum), then a division; the unit decides when to sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import comm
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placement import Placement
from ..spec import contiguous_stride
from .policies import MixedPrecisionPolicy, reduce_dtype_for
from .post_forward import PostForwardShard, reshard_after_forward_choice
from .reduction import Reduction, gradient_dtensors, local_gradients, pack_gradients
from .slots import ParameterSlot, cut_parameters, managed_parameters, unit_error

__all__ = ["ParameterUnit"]


def _parameter(dtensor: DTensor) -> nn.Parameter:
    """`dtensor` itself marked as an `nn.Parameter`, as `nn.Parameter(dtensor)` does for tensor subclasses
    but without its `detach()`, whose view rule would re-derive the layout (and lose a nested shard order)."""
    dtensor._is_param = True
    return dtensor


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
        reshard_after_forward: bool | int | None,
        is_managed: Callable[[nn.Module], bool],
    ):
        if mesh.ndim not in (1, 2):
            raise unit_error(f"mesh {mesh!r} has {mesh.ndim} mesh dims",
                             "give a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate on mesh dim 0, shard on mesh dim 1)")
        self.modules = tuple(modules)
        self.mesh = mesh
        self.shard_mesh_dim = mesh.ndim - 1
        self.replicate_mesh_dim = 0 if mesh.ndim == 2 and mesh.size(0) > 1 else None
        self.mp_policy = mp_policy
        self.reshard_after_forward: bool | None = None
        self.post_forward: PostForwardShard | None = None  # reshard_after_forward=int: the block kept after forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP: False keeps the reduce-scatter's output for the next backward
        self.partial_reduce_output: torch.Tensor | None = None
        self.unshard_in_backward = True
        self.keep_unsharded_storage = False  # reshard keeps the unsharded buffer's storage (stable data pointers)
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.gradient_divide_factor: float | None = None
        self.coordinate = mesh.get_local_rank(self.shard_mesh_dim)
        self.size = mesh.size(self.shard_mesh_dim)
        self.sharded_parameters: list[nn.Parameter] = []
        self.slots: list[ParameterSlot] = []
        self._build(managed_parameters(self.modules, ignored_params, is_managed), shard_placement_fn)
        self._gather_handle = None
        # "kept": sharded, with the post-forward block kept for a gather over the sub-group (`post_forward`)
        self._gathered_state = "sharded"  # "sharded" | "kept" | "gathering" | "gathered"
        self._shown_unsharded: tuple | None = None  # after an explicit unshard(): registered until reshard()
        self._accumulated: torch.Tensor | None = None
        self._forward_tensors: tuple | None = None
        self._forward_tensors_with_grad = False
        # Set by the hooks: the step's shared state, explicit prefetch lists, modules of this unit done with forward.
        self.context = None
        self.forward_prefetch: list[ParameterUnit] | None = None
        self.backward_prefetch: list[ParameterUnit] | None = None
        self.finished_forward_modules: set[int] = set()
        self.set_reshard_after_forward(reshard_after_forward, "fully_shard")

    def set_reshard_after_forward(self, reshard_after_forward: bool | int | None, caller: str) -> None:
        """True, False, None (decided at the first forward: True except for the root) or an int k: reshard
        after forward to sub-groups of k ranks (`post_forward`); a kept block of the old choice is dropped."""
        choice = reshard_after_forward_choice(reshard_after_forward, self.size, caller)
        self.drop_kept()
        self.post_forward = None
        if choice is None or isinstance(choice, bool):
            self.reshard_after_forward = choice
            return
        self.reshard_after_forward = True
        if self.slots:
            self.post_forward = PostForwardShard(choice, self.mesh, self.shard_mesh_dim, self.segment_sizes)
            self._bind_post_forward()

    def _bind_post_forward(self) -> None:
        """Point the post-forward block's views at the unsharded buffer (views need its storage allocated)."""
        freed = self._unsharded.untyped_storage().nbytes() == 0
        self._allocate(self._unsharded)
        self.post_forward.bind(self.slots, self._unsharded_writer)
        if freed:
            self._free(self._unsharded)

    # ---- construction -----------------------------------------------------------------------------

    def _build(self, found, shard_placement_fn) -> None:
        by_parameter: dict[int, list] = {}
        for module, name, parameter in found:
            by_parameter.setdefault(id(parameter), [parameter, []])[1].append((module, name))
        self._set_dtypes(_single_dtype(
            [(locations[0][1], parameter.dtype) for parameter, locations in by_parameter.values()],
            torch.get_default_dtype(), "",
            "one unit gathers one flat buffer of one dtype: shard the modules with other dtypes in "
            "their own fully_shard call or list them in ignored_params",
        ))
        slots, pieces, self.segment_sizes = cut_parameters(by_parameter.values(), self.mesh, shard_placement_fn,
                                                           self.compute_dtype)
        for slot, (parameter, _), local in zip(slots, by_parameter.values(), pieces):
            sharded = _parameter(DTensor(local, slot.sharded_spec, requires_grad=parameter.requires_grad))
            for module, name in slot.locations:
                setattr(module, name, sharded)
            self.slots.append(slot)
            self.sharded_parameters.append(sharded)
        self._build_buffers(sum(slot.numel for slot in slots))
        self._home_shards()

    def _set_dtypes(self, parameter_dtype: torch.dtype) -> None:
        self.parameter_dtype = parameter_dtype
        self.compute_dtype = self.mp_policy.param_dtype or parameter_dtype
        self.reduce_dtype = reduce_dtype_for(self.mp_policy, parameter_dtype)

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
        if self.post_forward is not None:
            self._bind_post_forward()
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
        self._follow_conversion()
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

    def _follow_conversion(self) -> None:
        """After `module.to(dtype)`, `.double()` or `.to(device)` converted the sharded parameters (`param.data =
        new` swaps a DTensor's shard and spec), rebuild what their dtype and device decide: the unit's dtypes,
        the slots' specs, the flat buffers, the gradients accumulated so far."""
        dtype = _single_dtype(
            [(slot.locations[0][1], parameter.dtype) for slot, parameter in zip(self.slots, self.sharded_parameters)],
            self.parameter_dtype, " after a conversion",
            "convert every module of the unit alike (call .to(dtype) on a module holding them all)",
        )
        device = self.sharded_parameters[0].device if self.sharded_parameters else self.device
        if dtype == self.parameter_dtype and device == self.device:
            return
        self._set_dtypes(dtype)
        self.slots = [
            dataclasses.replace(
                slot,
                sharded_spec=dataclasses.replace(slot.sharded_spec, dtype=dtype),
                unsharded_spec=None if slot.unsharded_spec is None else dataclasses.replace(slot.unsharded_spec, dtype=self.compute_dtype),
            )
            for slot in self.slots
        ]
        self._build_buffers(self._unsharded.numel())
        if self._accumulated is not None:
            self._accumulated = self._accumulated.to(device=device, dtype=self.reduce_dtype)
        if self.partial_reduce_output is not None:
            self.partial_reduce_output = self.partial_reduce_output.to(device=device, dtype=self.reduce_dtype)

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
        """Start gathering every parameter (one collective: over the sub-group from the block kept after
        forward, else over the shard mesh dim); wait for it unless `async_op`."""
        if self._gathered_state == "kept":
            self._allocate(self._unsharded)
            self._allocate(self._gathered)
            self._gather_handle = self.post_forward.gather_into(self._gathered)
            self._gathered_state = "gathering"
        elif self._gathered_state == "sharded" and self.slots:
            send = self._send_buffer()  # first: it rebuilds the buffers after a conversion
            self._allocate(self._unsharded)
            self._allocate(self._gathered)
            self._gather_handle = comm.all_gather_into(self._gathered, send, self.mesh, self.shard_mesh_dim,
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
        if self.post_forward is not None:
            self.post_forward.drop()
        if self._copy_sources:
            torch._foreach_copy_(self._copy_targets, self._copy_sources)
            self._free(self._gathered)
        self._gathered_state = "gathered"

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters (an in-flight gather is finished first); the modules show the
        sharded ones again. `after_forward` with `reshard_after_forward=int` keeps this rank's block first."""
        self.wait_for_unshard()
        keep = after_forward and self.post_forward is not None and self._gathered_state == "gathered"
        if keep:
            self.post_forward.keep()
        elif self.post_forward is not None:
            self.post_forward.drop()
        if self._gathered_state == "gathered" and self.slots and not self.keep_unsharded_storage:
            self._free(self._unsharded)
        self._gathered_state = "kept" if keep else "sharded"
        self._forward_tensors = None
        if self._shown_unsharded is not None:
            self._shown_unsharded = None
            self.register_sharded()

    def drop_kept(self) -> None:
        """Free the block kept after forward, if any: the next gather reads the sharded parameters."""
        if self._gathered_state == "kept":
            self.reshard()

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
        the new device and dtype."""
        if self._gathered_state not in ("sharded", "kept"):
            return  # the modules show unsharded parameters
        for index, slot in enumerate(self.slots):
            module, name = slot.locations[0]
            current = module._parameters.get(name)
            if current is self.sharded_parameters[index]:
                continue
            if not isinstance(current, DTensor) or current.sharding != slot.sharded_spec.layout:
                raise unit_error(
                    f"parameter {name!r} was replaced by {type(current).__name__} "
                    f"{getattr(current, 'sharding', tuple(getattr(current, 'shape', ())))} after fully_shard",
                    f"keep its sharded layout {slot.sharded_spec.layout} (module.to_empty(device=...) does; "
                    f"copy new values into the parameter in place instead of assigning a new one)",
                )
            for location_module, location_name in slot.locations:
                setattr(location_module, location_name, current)
            self.sharded_parameters[index] = current
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
        grads = local_gradients(self.slots, grads)
        if not self.requires_gradient_sync:
            self._accumulate(grads)
            return [None] * len(self.slots), None
        if self._accumulated is not None:
            self._accumulate(grads)
            grads = [self._accumulated_view(slot) for slot in self.slots]
        scatter_input = pack_gradients(self.slots, grads, self.segment_sizes, self.reduce_dtype, self.device)
        self._accumulated = None
        handle = comm.reduce_scatter(scatter_input, self.mesh, self.shard_mesh_dim, reduce_op="sum", dim=0,
                                     sizes=self.segment_sizes, async_op=True)
        if self.replicate_mesh_dim is not None and not self.requires_all_reduce:
            self._keep_partial(handle.wait())
            return [None] * len(self.slots), None
        reduction = Reduction(self, handle)
        return gradient_dtensors(reduction, self.slots, self.sharded_parameters, self.coordinate, self._placeholder), reduction


def _single_dtype(named_dtypes: list[tuple[str, torch.dtype]], default: torch.dtype, when: str, hint: str) -> torch.dtype:
    """The one dtype of a unit's parameters (`default` when it has none): one unit gathers one flat
    buffer, so parameters of several dtypes raise, naming one parameter of each."""
    dtypes = {dtype for _, dtype in named_dtypes}
    if len(dtypes) > 1:
        names = {str(dtype): name for name, dtype in named_dtypes}
        raise unit_error(f"the parameters of one unit have different dtypes {names}{when}", hint)
    return dtypes.pop() if dtypes else default
