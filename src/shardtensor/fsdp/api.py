"""`fully_shard` and `FSDPModule`: PyTorch FSDP2's public names, on shardtensor DTensors.

    >>> mesh = init_device_mesh("cpu", (4,))  # doctest: +SKIP
    >>> for block in model.blocks:  # doctest: +SKIP
    ...     fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)  # doctest: +SKIP
    >>> model.blocks[0].weight.placements  # doctest: +SKIP
    (Shard(dim=0),)
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import DeviceMesh, init_device_mesh
from ..placement import Placement
from .hooks import post_forward, pre_forward
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .post_forward import reshard_after_forward_choice
from .unit import ParameterUnit

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


class UnshardHandle:
    """What `FSDPModule.unshard(async_op=True)` returns: `wait()` finishes the gather."""

    __slots__ = ("_unit",)

    def __init__(self, unit: ParameterUnit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()
        self._unit.show_unsharded()


class FSDPModule:
    """The methods `fully_shard` adds: its module's class becomes a subclass with `FSDPModule` first.

    Outside its forward the module's parameters are the sharded DTensors (what optimizers,
    `state_dict` and DCP see); during its forward, and from an explicit `unshard()` until
    `reshard()`, they are the unsharded tensors.
    """

    _fsdp_unit: ParameterUnit

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [module for module in self.modules() if isinstance(module, FSDPModule)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (one collective); with `async_op`, return a handle to wait on.

        Once gathered (after `wait()`), the modules' parameters are the unsharded ones until `reshard()`
        (or the reshard that forward or backward does); the next forward uses them without gathering
        (explicit prefetching).
        """
        unit = self._fsdp_unit
        unit.drop_kept()  # gather the sharded parameters as they are now
        unit.adopt_replaced_parameters()
        unit.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(unit)
        unit.show_unsharded()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones (which are always kept)."""
        self._fsdp_unit.reshard()

    def _apply(self, fn, *args, **kwargs):
        """`module.to(dtype)`, `.double()`, `.to(device)`: reshard first (as FSDP2 does), so the conversion
        reaches the sharded parameters and no gathered data of the old dtype is reused; the unit rebuilds
        its buffers for the new dtype and device before its next gather."""
        self._fsdp_unit.reshard()
        return super()._apply(fn, *args, **kwargs)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward accumulates unsharded gradients locally without communicating (gradient
        accumulation); the next backward with True reduces the sum once."""
        for module in self._fsdp_modules(recurse):
            module._fsdp_unit.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        """Whether forward frees the unsharded parameters (backward then gathers them again); an int k, as
        `fully_shard` takes (PyTorch's method takes a bool only), reshards to sub-groups of k ranks. Call it
        on every rank: the first use of a split makes every sub-group's process group, with every rank."""
        for module in self._fsdp_modules(recurse):
            module._fsdp_unit.set_reshard_after_forward(reshard_after_forward, "set_reshard_after_forward")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the unsharded parameters; False keeps them for the next forward (useful
        between gradient-accumulation micro-batches, which do not change the parameters)."""
        for module in self._fsdp_modules(recurse):
            module._fsdp_unit.reshard_after_backward = reshard_after_backward

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """With True, resharding keeps the unsharded parameters' storage (it is gathered into again, so its data
        pointers stay the same, as CUDA graph capture needs) at the cost of holding it; False frees it (default)."""
        if not isinstance(keep, bool):
            raise TypeError(f"set_keep_unsharded_storage takes a bool, got {keep!r}")
        for module in self._fsdp_modules(recurse):
            module._fsdp_unit.keep_unsharded_storage = keep

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Gather these units asynchronously when this one's forward starts (instead of the next one run)."""
        self._fsdp_unit.forward_prefetch = [_unit_of(module, "set_modules_to_forward_prefetch") for module in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Gather these units asynchronously when this one's backward starts (instead of the one before it)."""
        self._fsdp_unit.backward_prefetch = [_unit_of(module, "set_modules_to_backward_prefetch") for module in modules]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the number of data-parallel ranks."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be positive, got {factor!r}")
        self._fsdp_unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of `set_gradient_divide_factor` (as in PyTorch)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor", FutureWarning,
                      stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, backward reduce-scatters the gradients but skips the all-reduce over the replicating
        mesh dim and sets no gradient; the next backward with True adds those pieces to its own, all-reduces
        once and sets the gradients of both (gradient accumulation at a lower cost). No effect on a 1-D mesh."""
        for module in self._fsdp_modules(recurse):
            module._fsdp_unit.requires_all_reduce = requires_all_reduce

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not gather this unit's parameters: only for units whose backward needs no
        parameter value (an embedding's gradient needs the indices and the output's gradient only)."""
        self._fsdp_unit.unshard_in_backward = unshard_in_backward

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call `hook(reduced)` on this rank's flat gradient piece once reduced (after the reduce-scatter, or the
        HSDP all-reduce) and before the division, in place (e.g. an all-reduce over another group).
        `stream` is for CUDA streams, which this library does not manage: it must be None."""
        if stream is not None:
            raise ValueError("set_all_reduce_hook: stream is not supported (the hook runs where the reduction is waited on); pass None")
        self._fsdp_unit.all_reduce_hook = hook

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for PyTorch's API: the gradient collectives here always sum, then divide (`enable` is always met)."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for PyTorch's API: every backward here ends by finishing its reductions and resharding,
        which is what PyTorch does for the last one (False only lets PyTorch defer that wait)."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"set_is_last_backward takes a bool, got {is_last_backward!r}")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for PyTorch's API with True, which is always the case here: parameters that got no gradient
        take part in their unit's one reduce-scatter with zeros, so ranks that used different ones still match."""
        if reduce_scatter_unused_params is not True:
            raise NotImplementedError("set_reduce_scatter_unused_params(False): a unit reduces all its parameters "
                                      "in one collective, unused ones as zeros; only True is supported")

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short, make the next step start clean: on the root
        module, reshard every unit and drop the failed step's state (its gradients, accumulated ones included)."""
        context = self._fsdp_unit.context
        if context is not None and context.root is not self._fsdp_unit:
            raise RuntimeError(f"reset_iter_state: call it on the root FSDP module (the one first run forward), "
                               f"not on {type(self).__name__}")
        if context is not None:
            context.reset()


def _unit_of(module, caller: str) -> ParameterUnit:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{caller}: {type(module).__name__} is not an FSDPModule; pass modules that fully_shard was applied to")
    return module._fsdp_unit


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` gather and reshard the parameters as `forward` does (e.g. `generate`); a
    no-op when `module` is not an FSDPModule, so the same code runs with and without `fully_shard`.

    >>> register_fsdp_forward_method(model, "generate")  # doctest: +SKIP
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def forward_method(*args, **kwargs):
        unit = module._fsdp_unit
        args, kwargs = pre_forward(unit, module, args, kwargs)
        return post_forward(unit, module, args, method(*args, **kwargs))

    setattr(module, method_name, forward_method)  # on the instance, as PyTorch's does


@functools.cache
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})


def _argument_error(problem: str, allowed: str) -> TypeError:
    return TypeError(f"fully_shard: {problem}; {allowed}")


def _default_device_type(modules: Sequence[nn.Module]) -> str:
    """The device type of the mesh `fully_shard` makes when given none: where the parameters are; for a
    model without data yet (parameters on meta, to be materialized with `to_empty(device=...)`), the
    device the world's backend serves (nccl: cuda), else cuda when there is one, as FSDP2 does."""
    devices = {parameter.device.type for module in modules for parameter in module.parameters()} - {"meta"}
    if devices:
        return "cuda" if "cuda" in devices else "cpu"
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_mesh(modules: Sequence[nn.Module]) -> DeviceMesh:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return init_device_mesh(_default_device_type(modules), (world,))


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
):
    """Shard a module's parameters over the data-parallel `mesh` and gather them around its forward/backward.

    Every parameter under `module` not managed by an earlier `fully_shard` (apply it to the blocks
    first, then to the whole model) becomes an `nn.Parameter` holding a DTensor with `Shard(0)`
    (or `shard_placement_fn(param)`) on `mesh`, in exact `torch.chunk` pieces with no padding; on
    a 2-D mesh (HSDP) it is `(Replicate(), Shard(0))`. A parameter that is already a DTensor on
    other mesh dims (tensor parallel, from `parallelize_module` on `mesh_2d["tp"]`) keeps its
    placement there and is sharded further on `mesh_2d["dp"]`. Forward all-gathers the unit's
    parameters with one collective (the next unit's gather overlaps this unit's compute); backward
    reduce-scatters its gradients with one collective (sum, then division by the number of
    data-parallel ranks). `reshard_after_forward=None` frees after forward everywhere but in the
    root module; an int k (dividing the shard mesh dim's size) keeps, after forward, what a sub-group
    of k ranks needs, so that backward all-gathers within it (see `post_forward`). `module` may be a
    list of modules that are gathered as one unit. Returns `module`, whose class now starts with
    `FSDPModule`.

    >>> fully_shard(model, mesh=init_device_mesh("cpu", (2,)))  # doctest: +SKIP
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(item, nn.Module) for item in modules):
        raise _argument_error(f"got {type(module).__name__} {module!r:.80}", "pass an nn.Module or a non-empty list of them")
    for item in modules:
        if isinstance(item, FSDPModule):
            raise ValueError(f"fully_shard: {type(item).__name__} is already sharded; apply fully_shard once per module")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise _argument_error(f"mp_policy={mp_policy!r}", "pass a shardtensor.fsdp.MixedPrecisionPolicy")
    if not isinstance(offload_policy, OffloadPolicy):
        raise _argument_error(f"offload_policy={offload_policy!r}", "pass OffloadPolicy() or CPUOffloadPolicy()")
    mesh = mesh if mesh is not None else _default_mesh(modules)
    reshard_after_forward = reshard_after_forward_choice(reshard_after_forward, mesh.size(mesh.ndim - 1), "fully_shard")
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError(
            f"fully_shard: CPUOffloadPolicy on a {mesh.device_type!r} mesh is not implemented; on CPU meshes it is a "
            f"no-op, elsewhere use OffloadPolicy()"
        )
    ignored = {id(parameter) for parameter in ignored_params or ()}
    unit = ParameterUnit(modules, mesh, shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                         ignored_params=ignored, reshard_after_forward=reshard_after_forward,
                         is_managed=lambda candidate: isinstance(candidate, FSDPModule))
    for item in modules:
        item.__class__ = _fsdp_class(type(item))
        item._fsdp_unit = unit
        item.register_forward_pre_hook(functools.partial(pre_forward, unit), prepend=True, with_kwargs=True)
        item.register_forward_hook(functools.partial(post_forward, unit))
    return module
