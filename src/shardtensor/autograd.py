"""The autograd functions behind `from_local`, `to_local` and `redistribute`.

Gradients flow back with the layouts PyTorch documents: to the source's layout, with a Partial read
as Replicate (`Layout.without_partial`). These functions build DTensors of the class they are given
(`cls`, or the class of their DTensor argument): this layer is below the class, which calls them.
"""

from __future__ import annotations

import torch

from . import comm
from .placement import Replicate
from .redistribute import (
    is_relabel,
    redistribute_across_meshes_with_requires_grad,
    redistribute_between,
    redistribute_local_tensor,
)
from .spec import DTensorSpec, global_stride

__all__ = ["FromLocal", "ToLocal", "Redistribute"]


def _gradient_to(grad: torch.Tensor, spec: DTensorSpec, cls: type) -> torch.Tensor:
    """The local shard of a DTensor gradient moved to `spec`'s layout with Partial read as Replicate."""
    if not isinstance(grad, cls):
        raise TypeError(f"expected the gradient of a DTensor to be a DTensor, got {type(grad).__name__}")
    target = spec.layout.without_partial()
    if is_relabel(grad.sharding, target, grad._spec.dtype.itemsize):
        return grad._local_tensor
    return redistribute_local_tensor(grad._local_tensor, grad.sharding, target, spec.mesh)


class FromLocal(torch.autograd.Function):
    """A DTensor of class `cls` from this rank's shard; `run_check` broadcasts Replicate data."""

    @staticmethod
    def forward(ctx, local, spec, run_check, cls):
        ctx.spec, ctx.cls = spec, cls
        if spec.mesh.get_coordinate() is None:
            return cls(local.new_empty((0,) * max(local.ndim, 1)), spec)
        if run_check:
            for mesh_dim, placement in enumerate(spec.placements):
                if isinstance(placement, Replicate):
                    local = comm.broadcast(local.contiguous(), spec.mesh, mesh_dim, src=0)
        else:
            local = local.view_as(local)
        return cls(local, spec)

    @staticmethod
    def backward(ctx, grad):
        if ctx.spec.mesh.get_coordinate() is None:
            return None, None, None, None  # the local tensor was not used: no gradient
        return _gradient_to(grad, ctx.spec, ctx.cls), None, None, None


class ToLocal(torch.autograd.Function):
    """This rank's shard; its gradient is read with `grad_placements` (default: the DTensor's)."""

    @staticmethod
    def forward(ctx, dtensor, grad_placements):
        ctx.spec, ctx.cls = dtensor._spec, type(dtensor)
        ctx.grad_placements = grad_placements
        local = dtensor._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        layout = spec.layout
        if ctx.grad_placements is not None:
            layout = layout.with_placements(ctx.grad_placements)
        coordinate = spec.mesh.get_coordinate()
        if coordinate is not None and tuple(grad.shape) != layout.local_shape(coordinate):
            raise ValueError(
                f"to_local backward: the local gradient has shape {tuple(grad.shape)}, but placements "
                f"{layout.placements!r} expect {layout.local_shape(coordinate)} at mesh coordinate {tuple(coordinate)}"
            )
        grad_spec = DTensorSpec(spec.mesh, layout, global_stride(grad, layout.shape), grad.dtype)
        return ctx.cls(grad, grad_spec), None


class Redistribute(torch.autograd.Function):
    """The same global tensor under `target` on `mesh` (asynchronously with `async_op`), its data cast to
    `forward_dtype` before the collectives; backward's collectives run in `backward_dtype` (default: the
    input's dtype) and the gradient comes back in the input's dtype.

    `holders_decide` (a waited move to another mesh): the result requires grad where the source's
    holders' source does, told with the data (`cross_mesh.redistribute_across_meshes_with_requires_grad`);
    a stand-in passed requiring grad gives a result that does not when the holders say no."""

    @staticmethod
    def forward(ctx, dtensor, mesh, target, async_op, forward_dtype=None, backward_dtype=None, holders_decide=False):
        cls = type(dtensor)
        ctx.spec, ctx.cls, ctx.backward_dtype = dtensor._spec, cls, backward_dtype
        source = dtensor._spec
        local = dtensor._local_tensor
        if forward_dtype is not None and forward_dtype != source.dtype:
            local = local.to(forward_dtype)
        spec = DTensorSpec(mesh, target, source.stride, local.dtype)
        if mesh == source.mesh and is_relabel(source.layout, target, local.element_size()):
            return cls(local, spec)
        if holders_decide:
            result, requires_grad = redistribute_across_meshes_with_requires_grad(
                local, source.layout, source.mesh, target, mesh, dtensor.requires_grad)
            output = cls(result, spec)
            if not requires_grad:
                ctx.mark_non_differentiable(output)
            return output
        result = redistribute_between(local, source.layout, source.mesh, target, mesh, async_op=async_op)
        if isinstance(result, torch.Tensor):
            return cls(result, spec)
        return cls(local, spec, pending=result)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        target = spec.layout.without_partial()
        collective_dtype = ctx.backward_dtype or spec.dtype
        if isinstance(grad, ctx.cls) and grad.dtype != collective_dtype:
            grad = ctx.cls(grad._local_tensor.to(collective_dtype),
                           DTensorSpec(grad.device_mesh, grad.sharding, grad._spec.stride, collective_dtype))
        if isinstance(grad, ctx.cls) and (grad.device_mesh != spec.mesh or spec.mesh.get_coordinate() is None):
            local = redistribute_between(grad._local_tensor, grad.sharding, grad.device_mesh, target, spec.mesh)
        else:
            local = _gradient_to(grad, spec, ctx.cls)
        local = local.to(spec.dtype)
        grad_spec = DTensorSpec(spec.mesh, target, spec.stride, spec.dtype)
        return ctx.cls(local, grad_spec), None, None, None, None, None, None
