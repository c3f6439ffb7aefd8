"""The dispatch plan cache: a call's key, and the plan that runs a cached decision.

The hot path of `dispatch`: a key built from the op, the identity of each DTensor argument's spec
(specs are interned: equal metadata, one object) and the other arguments finds a `Plan` (the
decision with the output specs and, for rules with local arguments such as `view`, this rank's
arguments already built), which runs the local op and wraps its outputs. `torch_function` keeps
its plans for public functions here too, so that one `clear_plans` forgets both.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import propagation
from .mesh import on_new_world
from .modes import implicit_communication_error, is_explicit
from .propagation import Decision, PlainTensor, TensorMeta
from .redistribute import redistribute_local_tensor
from .spec import DTensorSpec, interned_spec
from .write_back import mark_views_of_copies, mutated, refuse_writes_into_views_of_copies, returns_view

__all__ = ["fast_key", "template", "Plan", "plans", "function_plans", "recording", "store", "clear_plans", "MAX_PLANS"]

# fast key -> Plan. Keys hold the id of each DTensor argument's spec; the plan keeps those specs
# alive, so an id cannot be reused while its key exists.
plans: dict[tuple, Plan] = {}
# fast key (holding the public function's id) -> `torch_function`'s plan for it.
function_plans: dict[tuple, object] = {}
MAX_PLANS = 8192

# While `torch_function` learns a public function, the plan each aten op ran from (None: a miss).
recording: list[list] = []

_KEY_SCALAR_TYPES = frozenset(
    (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
)
_KEY_LIST_ITEM_TYPES = frozenset((int, float, bool, type(None)))


def store(key: tuple, plan: Plan) -> None:
    """Keep `plan` under `key` (emptying the cache first when it is full)."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan


def clear_plans() -> None:
    """Forget every cached plan: the aten ones and the public functions learnt from them."""
    plans.clear()
    function_plans.clear()


on_new_world(clear_plans)  # plans hold specs of the old world's meshes


def _key_value(dtensor_class: type, value, key: list) -> bool:
    """Append `value` to a fast key; False when the call is not flat (nested or plain tensors)."""
    kind = type(value)
    if kind is dtensor_class:
        key.append(id(value._spec))
    elif kind in _KEY_SCALAR_TYPES:
        key.append(kind)  # 1, 1.0 and True hash alike but give different dtypes
        key.append(value)
    elif kind is list or kind is tuple:
        item_types = tuple(map(type, value))
        if not _KEY_LIST_ITEM_TYPES.issuperset(item_types):
            return False
        key += (kind, item_types, tuple(value))  # [1, 2] and [1.0, 2.0] hash alike
    elif isinstance(value, dtensor_class):
        key.append(id(value._spec))
    elif isinstance(value, torch.Tensor):
        if value.ndim:
            return False
        key.append(value.dtype)
    else:
        return False
    return True


def fast_key(dtensor_class: type, op, args: tuple, kwargs: dict) -> tuple | None:
    """The plan-cache key of a flat call (DTensors, scalars, flat lists of numbers); None otherwise."""
    key = [id(op)]  # ops live as long as the process; hashing an OpOverload runs Python code
    for value in args:
        kind = type(value)
        if kind is dtensor_class:  # the common cases, without a call
            key.append(id(value._spec))
        elif kind is int:
            key.append(int)
            key.append(value)
        elif not _key_value(dtensor_class, value, key):
            return None
    if kwargs:
        for name, value in kwargs.items():
            key.append(name)
            if not _key_value(dtensor_class, value, key):
                return None
    return tuple(key)


def template(decision: Decision, args: tuple, kwargs: dict) -> tuple[list, dict, list] | None:
    """The decision's local arguments as a template for a plan: (args, kwargs, where each of the call's
    tensors goes). None when a placeholder is nested in a list (the slow path handles those)."""
    local_args, local_kwargs = decision.local_arguments
    placeholders = (TensorMeta, PlainTensor)
    destinations = [(False, index) for index, value in enumerate(local_args) if isinstance(value, placeholders)]
    destinations += [(True, name) for name, value in local_kwargs.items() if isinstance(value, placeholders)]
    tensors = sum(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values()))
    nested, _ = tree_flatten((local_args, local_kwargs))
    if len(destinations) != tensors or sum(isinstance(value, placeholders) for value in nested) != tensors:
        return None
    return list(local_args), dict(local_kwargs), destinations


class Plan:
    """A decision for flat calls with everything per call precomputed: where each tensor argument
    comes from and goes to (a rule's local arguments are a template filled with the local tensors),
    where each DTensor must move (None: stays), and the output specs."""

    __slots__ = (
        "generation", "dtensor_class", "wrap", "op", "mesh", "specs", "slots", "moves", "output_specs", "call",
        "runs_op", "mutates", "local_args", "local_kwargs", "writes_kwargs", "simple_positions", "single_spec",
        "view_of_copy",
    )

    def __init__(self, dtensor_class: type, op, mesh, args: tuple, kwargs: dict, decision: Decision, mutates: bool,
                 template):
        self.op, self.mesh, self.mutates = op, mesh, mutates
        self.dtensor_class, self.wrap = dtensor_class, dtensor_class._wrap
        self.generation = propagation.generation  # a rule registered later makes the plan stale
        # The op's C++ callable skips `OpOverload.__call__`'s Python frame.
        self.runs_op = decision.local_op is None
        self.call = op._op if self.runs_op else functools.partial(decision.local_op, mesh)
        # Every tensor argument in flattened order (DTensors are the decision's inputs, in that order).
        sources = [(False, index) for index, value in enumerate(args) if isinstance(value, torch.Tensor)]
        sources += [(True, name) for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
        values = [kwargs[where] if in_kwargs else args[where] for in_kwargs, where in sources]
        dtensors = [value for value in values if isinstance(value, dtensor_class)]
        self.specs = tuple(dtensor._spec for dtensor in dtensors)
        targets = iter(
            None if target == dtensor.sharding else target
            for dtensor, target in zip(dtensors, decision.input_layouts)
        )
        if template is None:
            self.local_args = self.local_kwargs = None
            destinations = sources
        else:
            self.local_args, self.local_kwargs, destinations = template
        slots = []
        for (in_kwargs, source), destination, value in zip(sources, destinations, values):
            is_dtensor = isinstance(value, dtensor_class)
            if is_dtensor or template is not None:  # without a template a plain 0-d tensor stays where it is
                slots.append((in_kwargs, source, is_dtensor, next(targets) if is_dtensor else None) + destination)
        self.slots = tuple(slots)
        self.moves = any(target is not None for *_, target, _, _ in self.slots)
        self.view_of_copy = self.moves and returns_view(op)
        self.writes_kwargs = any(to_kwargs for *_, to_kwargs, _ in self.slots)
        self.output_specs = tuple(
            None if layout is None else interned_spec(DTensorSpec(mesh, layout, meta.stride, meta.dtype))
            for layout, meta in zip(decision.output_layouts, decision.output_metas)
        )
        single = not mutates and len(self.output_specs) == 1 and self.output_specs[0] is not None
        self.single_spec = self.output_specs[0] if single else None
        # The common case, run by a short loop: positional DTensors that stay where they are.
        simple = single and template is None and not self.moves and not self.writes_kwargs
        self.simple_positions = tuple(source for _, source, *_ in self.slots) if simple else None

    def run(self, args: tuple, kwargs: dict):
        positions = self.simple_positions
        if positions is not None:
            local_args = list(args)
            for index in positions:
                local_args[index] = args[index]._local_tensor
            result = self.call(*local_args, **kwargs)
            if type(result) is torch.Tensor:
                return self.wrap(result, self.single_spec)
            return self._wrap_result(result, [])
        if self.mutates:
            refuse_writes_into_views_of_copies(self.op, mutated(self.dtensor_class, self.op, args, kwargs))
        if self.moves and is_explicit():
            dtensors = [(kwargs if in_kwargs else args)[where] for in_kwargs, where, is_dtensor, *_ in self.slots
                        if is_dtensor]
            targets = [target for _, _, is_dtensor, target, _, _ in self.slots if is_dtensor]
            raise implicit_communication_error(self.op, dtensors, targets, "its sharding rule needs other layouts")
        if self.local_args is None:
            local_args, local_kwargs = list(args), kwargs
        else:
            local_args, local_kwargs = list(self.local_args), self.local_kwargs
        if self.writes_kwargs:
            local_kwargs = dict(local_kwargs)
        inputs = []
        for in_kwargs, source, is_dtensor, target, to_kwargs, destination in self.slots:
            value = kwargs[source] if in_kwargs else args[source]
            local = value
            if is_dtensor:
                local = value._local_tensor
                if target is not None:
                    local = redistribute_local_tensor(local, value._spec.layout, target, self.mesh)
                if self.mutates:
                    inputs.append((local, value))
            if to_kwargs:
                local_kwargs[destination] = local
            else:
                local_args[destination] = local
        result = self._wrap_result(self.call(*local_args, **local_kwargs), inputs)
        return mark_views_of_copies(self.dtensor_class, result) if self.view_of_copy else result

    def _wrap_result(self, result, inputs: list):
        if self.single_spec is not None and type(result) is torch.Tensor:
            return self.wrap(result, self.single_spec)
        if isinstance(result, torch.Tensor):
            return self._wrap(result, 0, inputs)
        outputs, output_tree = tree_flatten(result)
        return tree_unflatten([self._wrap(output, position, inputs) for position, output in enumerate(outputs)], output_tree)

    def _wrap(self, output, position: int, inputs: list):
        if not isinstance(output, torch.Tensor):
            return output
        for local, dtensor in inputs:
            if output is local:  # in-place and out= ops return their argument
                return dtensor
        return self.wrap(output, self.output_specs[position])
