"""How units meet torch: module forward hooks, one autograd function, gradient hooks, one end-of-backward callback.

Forward: a unit's pre-hook waits for its gather (issuing it first if no prefetch did), issues the
next unit's gather asynchronously, and registers the unsharded parameters on its modules through
`_Unshard`, whose backward is called by autograd once every gradient of the unit is computed: that
is where the unit's one reduce-scatter starts. The post-hook puts the sharded parameters back,
frees the unsharded ones (`reshard_after_forward`; an int keeps a sub-group's block, `post_forward`)
and hooks the outputs' gradients to re-gather before the unit's backward (and prefetch the one after
it). The root's backward ends with a
callback that finishes what is left (HSDP all-reduces, resharding).

Activation checkpointing recomputes forwards inside backward: a unit about to run backward shows its
gathered parameters on its modules (a `checkpoint_wrapper` inside the unit recomputes without our
hooks), and a forward hook that runs during backward only registers gathered parameters: it neither
prefetches nor reshards (the backward still reads them) nor hooks gradients.

Under torch.compile the two forward hooks run eagerly (`torch.compiler.disable`): they manage buffers'
storage and issue collectives, which a graph cannot do safely. A compiled module under fully_shard graph-
calls its hooks eagerly and compiles its forward between them (dynamo starts below `nn.Module.__call__`);
a compiled function that calls a fully_shard module breaks at the hooks, so `fullgraph=True` fails naming them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .reduction import Reduction
from .unit import ParameterUnit

__all__ = ["TrainingContext", "pre_forward", "post_forward"]


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], value):
    """`value` with `function` applied to every tensor inside tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuples keep their type
        return type(value)(*(map_tensors(function, item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(function, item) for item in value)
    if isinstance(value, dict):
        return {key: map_tensors(function, item) for key, item in value.items()}
    return value


def _tensors_requiring_grad(value) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            found.append(tensor)
        return tensor

    map_tensors(collect, value)
    return found


def _cast_floating(dtype: torch.dtype):
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    return cast


class TrainingContext:
    """What the units under one root share during a step: the orders they ran in (for prefetching), the
    HSDP reductions still to finish, and whether the end-of-backward callback is queued."""

    def __init__(self, root: ParameterUnit, units: list[ParameterUnit]):
        self.root = root
        self.units = units
        self.in_forward = False
        self.forward_order: list[ParameterUnit] = []
        self.post_forward_order: list[ParameterUnit] = []
        self.next_in_forward: dict[ParameterUnit, ParameterUnit] = {}  # from the previous step
        self.next_in_backward: dict[ParameterUnit, ParameterUnit] = {}
        self.reductions: list[Reduction] = []
        self.backward_queued = False
        self.in_backward = False  # a forward hook that runs now is activation checkpointing's recomputation

    # ---- forward ----------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self.in_forward = True
        self.forward_order.clear()
        self.post_forward_order.clear()
        for unit in self.units:
            unit.drop_kept()  # a block kept by a forward without backward may be older than the parameters
            unit.clear_forward_tensors()
            unit.finished_forward_modules.clear()

    def end_forward(self) -> None:
        self.in_forward = False
        order, post = self.forward_order, self.post_forward_order
        self.next_in_forward = {order[index]: order[index + 1] for index in range(len(order) - 1)}
        self.next_in_backward = {post[index]: post[index - 1] for index in range(1, len(post))}

    def forward_prefetch(self, unit: ParameterUnit) -> list[ParameterUnit]:
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        following = self.next_in_forward.get(unit)
        return [] if following is None else [following]

    def backward_prefetch(self, unit: ParameterUnit) -> list[ParameterUnit]:
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        following = self.next_in_backward.get(unit)
        return [] if following is None else [following]

    # ---- backward ---------------------------------------------------------------------------------

    def pre_backward(self, unit: ParameterUnit) -> None:
        """The gradient of one of the unit's outputs is ready: its backward is next, so gather it now."""
        self.queue_end_of_backward()
        self.in_backward = True
        for gathered in [unit, *self.backward_prefetch(unit)]:
            if gathered.unshard_in_backward:
                gathered.unshard(async_op=True)
        unit.wait_for_unshard()
        if unit.is_gathered:
            show_gathered(unit, self)

    def post_backward(self, unit: ParameterUnit, grads) -> list:
        """Every gradient of the unit is computed: start its reduction, free its parameters."""
        self.queue_end_of_backward()
        self.start_replicate_reductions()
        results, reduction = unit.reduce_gradients(grads)
        if reduction is not None and unit.replicate_mesh_dim is not None:
            self.reductions.append(reduction)
        if unit.reshard_after_backward:
            unit.reshard()
        unit.clear_forward_tensors()
        unit.register_at_rest()
        return results

    def start_replicate_reductions(self) -> None:
        """HSDP: all-reduce the reduce-scatters started earlier, at points every rank reaches in the same order."""
        for reduction in self.reductions:
            reduction.start_replicate_reduce()
        self.reductions.clear()

    def queue_end_of_backward(self) -> None:
        if not self.backward_queued:
            self.backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        self.backward_queued = False
        self.in_backward = False
        self.start_replicate_reductions()
        for unit in self.units:
            unit.wait_for_unshard()
            if unit.reshard_after_backward:
                unit.reshard()
            unit.drop_kept()  # of a unit whose backward did not run
            unit.clear_forward_tensors()
            unit.register_at_rest()

    def reset(self) -> None:
        """Forget a step an exception cut short: every unit resharded, orders and pending reductions dropped
        (the next forward starts a new step; its gradients are those of the steps that finished)."""
        self.in_forward = False
        self.backward_queued = False
        self.in_backward = False
        self.forward_order.clear()
        self.post_forward_order.clear()
        self.reductions.clear()
        for unit in self.units:
            unit.forget_step()


class _Unshard(torch.autograd.Function):
    """Sharded parameters in, unsharded views out; backward receives every gradient of the unit at once."""

    @staticmethod
    def forward(ctx, unit: ParameterUnit, context: TrainingContext, *sharded):
        ctx.unit, ctx.context = unit, context
        ctx.set_materialize_grads(False)
        return unit.unsharded_tensors()

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *ctx.context.post_backward(ctx.unit, grads))


def _context_for(unit: ParameterUnit, module: nn.Module) -> TrainingContext:
    """The step's shared state; the first module to run forward becomes the root of the units below it
    (which then take over parameters replaced since `fully_shard`, e.g. by `to_empty` after meta init)."""
    if unit.context is not None:
        return unit.context
    units: list[ParameterUnit] = []
    for submodule in module.modules():
        found = getattr(submodule, "_fsdp_unit", None)
        if found is not None and found.context is None and found not in units:
            units.append(found)
    context = TrainingContext(unit, units)
    for found in units:
        found.adopt_replaced_parameters()
        found.context = context
        if found.reshard_after_forward is None:
            found.reshard_after_forward = found is not unit
    return context


def _forward_tensors(unit: ParameterUnit, context: TrainingContext) -> Callable[[ParameterUnit], tuple]:
    def make(unit: ParameterUnit) -> tuple:
        if torch.is_grad_enabled() and any(parameter.requires_grad for parameter in unit.sharded_parameters):
            return _Unshard.apply(unit, context, *unit.sharded_parameters)
        return unit.unsharded_tensors()

    return make


def show_gathered(unit: ParameterUnit, context: TrainingContext) -> None:
    """Register the gathered parameters on the unit's modules, requiring grad as in forward, for a
    forward recomputed in backward (its saved tensors must be those of the original forward)."""
    with torch.enable_grad():
        unit.register(unit.forward_tensors(_forward_tensors(unit, context)))


_EAGER_ONLY = (
    "fully_shard's forward hooks gather and free parameter buffers, so they run eagerly under torch.compile and a "
    "graph that calls a fully_shard module breaks at them. Compile the blocks inside fully_shard instead "
    "(block.compile() before fully_shard, as torchtitan does; fullgraph=True works there), or compile this "
    "function without fullgraph=True"
)


@torch.compiler.disable(reason=_EAGER_ONLY)
def pre_forward(unit: ParameterUnit, module: nn.Module, args, kwargs):
    """Forward pre-hook: gather (overlapping the next unit's gather), register the unsharded parameters."""
    context = _context_for(unit, module)
    policy = unit.mp_policy
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        cast = _cast_floating(policy.param_dtype)
        args, kwargs = map_tensors(cast, args), map_tensors(cast, kwargs)
    if context.in_backward:
        unit.unshard()
        show_gathered(unit, context)
        return args, kwargs
    if unit is context.root and not context.in_forward:
        context.begin_forward()
    unit.unshard(async_op=True)
    for following in context.forward_prefetch(unit):
        following.unshard(async_op=True)
    unit.wait_for_unshard()
    context.forward_order.append(unit)
    unit.register(unit.forward_tensors(_forward_tensors(unit, context)))
    return args, kwargs


@torch.compiler.disable(reason=_EAGER_ONLY)
def post_forward(unit: ParameterUnit, module: nn.Module, args, output):
    """Forward post-hook: sharded parameters back, free the unsharded ones, hook the outputs' gradients."""
    context = unit.context
    if context.in_backward:
        return _cast_output(unit, output)
    context.post_forward_order.append(unit)
    unit.finished_forward_modules.add(id(module))
    if unit.reshard_after_forward and len(unit.finished_forward_modules) == len(unit.modules):
        unit.reshard(after_forward=True)
        unit.finished_forward_modules.clear()
    unit.register_at_rest()
    if torch.is_grad_enabled():
        needing_grad = _tensors_requiring_grad(output)
        if needing_grad:
            torch.autograd.graph.register_multi_grad_hook(needing_grad, lambda grads: context.pre_backward(unit), mode="any")
    output = _cast_output(unit, output)
    if unit is context.root and context.in_forward:
        context.end_forward()
    return output


def _cast_output(unit: ParameterUnit, output):
    if unit.mp_policy.output_dtype is None:
        return output
    return map_tensors(_cast_floating(unit.mp_policy.output_dtype), output)
