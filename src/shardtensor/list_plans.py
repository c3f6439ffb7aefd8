"""Cached plans for multi-tensor ops (`_foreach_*`, `_fused_*`): one decision per list layout.

The plan key of a multi-tensor call (`"list"`, then the op) holds the spec of every DTensor of every list, the
dtypes of plain 0-d tensors (an optimizer's step counts; next to a Partial list, also the sign of a
0-d scale of `_foreach_mul`/`_foreach_div`: `plain_tensors.scale_signs`), and of each Python scalar
only its type and sign, which is all that the rules of `ops/foreach.py` read. So Adam's step sizes, new on every
step, hit the plan that the first step built. A plan runs the op once on the lists of local tensors
and wraps the outputs with the specs the decision promised; nothing per tensor is decided again.
Learnt from such a plan, a public function (`torch._foreach_mul_`) runs on the local lists in
`torch_function`, before the dispatcher. Keys start with "list", so they share `plan_cache`'s
dictionaries (and `clear_plans`) with the flat keys, which start with an id.

Like the rest of the engine below the class, this module gets the DTensor class as an argument.
"""

from __future__ import annotations

import functools
import math

import torch
from torch._C import _increment_version
from torch.utils._pytree import tree_flatten

from .ops.foreach import canonical_scalar
from .plain_tensors import scale_signs
from .plan_cache import PLAIN_TENSOR, CachedPlan, reads_scale_signs, store_function_plan
from .rules import ComposedRule, Decision, sign_of
from .spec import DTensorSpec, interned_spec
from .write_back import CopySource, write_through, written_copy_sources

__all__ = ["is_multi_tensor", "is_multi_tensor_function", "list_key", "ListPlan", "learn_function"]

_KEY_TYPES = frozenset((int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.memory_format))
_multi_tensor: dict = {}


def is_multi_tensor(op) -> bool:
    """Whether `op` is a `_foreach_*` or `_fused_*` op (decided by a composed rule, keyed by `list_key`)."""
    known = _multi_tensor.get(op)
    if known is None:
        known = _multi_tensor[op] = op._schema.name.startswith(("aten::_foreach_", "aten::_fused_"))
    return known


def _append(dtensor_class: type, value, key: list) -> bool | str:
    """Append what of `value` decides to `key`; False for a call no plan serves (mixed lists...),
    `PLAIN_TENSOR` after plain 0-d tensors."""
    kind = type(value)
    if kind is list or kind is tuple:
        if not value:
            key.append(kind)
            return True
        first = type(value[0])
        if first is dtensor_class:
            try:
                key.append(tuple([dtensor._spec for dtensor in value]))
            except AttributeError:  # a plain tensor among DTensors
                return False
        elif first is torch.Tensor:  # plain 0-d tensors (step counts): their dtypes
            if any(type(item) is not torch.Tensor or item.ndim for item in value):
                return False
            key.append(("plain", tuple(item.dtype for item in value)))
            return PLAIN_TENSOR
        elif first in _KEY_TYPES:
            types = tuple(map(type, value))
            key.append((kind, types, _signs(types, value)))
        else:
            return False
    elif kind is dtensor_class:
        key.append(id(value._spec))
    elif kind in _KEY_TYPES:
        key.append(kind)
        key.append(canonical_scalar(value))
    elif kind is torch.Tensor and not value.ndim:
        key.append(("plain", value.dtype))
        return PLAIN_TENSOR
    else:
        return False
    return True


_REAL_TYPES = frozenset((int, float))


def _signs(types: tuple, values) -> object:
    """What the decision reads of a scalar list: each value's sign (one summary for the common
    all-positive or all-negative list of finite real numbers, found without a Python loop; an inf or
    NaN anywhere makes the sum not finite, and the list is keyed value by value)."""
    if _REAL_TYPES.issuperset(types) and math.isfinite(sum(values)):
        if min(values) > 0:
            return 1
        if max(values) < 0:
            return -1
    return tuple(map(canonical_scalar, values))


def list_key(dtensor_class: type, op, args: tuple, kwargs: dict) -> tuple | None:
    """The plan key of a multi-tensor call (op or public function), or None when no plan can serve it."""
    key = ["list", id(op)]
    plain_tensor = False
    for value in args:
        kind = type(value)
        if kind is list and value and type(value[0]) is dtensor_class:  # the common cases, inline
            try:
                key.append(tuple([dtensor._spec for dtensor in value]))
            except AttributeError:  # a plain tensor among DTensors
                return None
        elif kind is float:  # what `canonical_scalar` keeps: its sign, None when not finite
            key.append(kind)
            key.append(sign_of(value))
        else:
            appended = _append(dtensor_class, value, key)
            if not appended:
                return None
            plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    for name, value in kwargs.items():
        key.append(name)
        appended = _append(dtensor_class, value, key)
        if not appended:
            return None
        plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    if plain_tensor and reads_scale_signs(op):
        key += scale_signs(dtensor_class, (*args, *kwargs.values()))
    return tuple(key)


class ListPlan(CachedPlan):
    """A multi-tensor decision in which no tensor moves: which arguments are DTensor lists (given
    their local tensors), what to call on them (the aten op, a rule's local op, or the public torch
    function it was learnt from), the specs of the outputs (none for in-place ops), and the lists it
    writes (whose wrappers' version counters it bumps, as the dispatcher does). The op's own outputs
    are new tensors, wrapped by `_wrap_new`; a rule's local op's go through `_wrap` (math bits).
    While views of moved copies exist, it reads every shard through `_local_tensor` (which refreshes
    such a view) and stores what it wrote into one back into its base (`write_back.write_through`)."""

    __slots__ = ("dtensor_class", "wrap", "op", "specs", "list_positions", "list_names", "single_positions", "single_names",
                 "call", "output_specs", "written_positions", "returned_argument")

    def __init__(self, dtensor_class: type, op, call, output_specs: tuple, args: tuple, kwargs: dict,
                 written_positions: tuple[int, ...] = (), returned_argument: int | None = None):
        super().__init__(op)  # a rule registered later makes the plan stale (its generation)
        self.dtensor_class = dtensor_class
        rule_local_op = isinstance(call, functools.partial)  # else the op or its public function
        self.wrap = functools.partial(_wrap_each, dtensor_class._wrap) if rule_local_op else dtensor_class._wrap_new
        self.op, self.call, self.output_specs, self.written_positions = op, call, output_specs, written_positions
        self.returned_argument = returned_argument  # an in-place public function returns its `self` list
        is_list = functools.partial(_is_dtensor_list, dtensor_class)
        self.list_positions = tuple(index for index, value in enumerate(args) if is_list(value))
        self.list_names = tuple(name for name, value in kwargs.items() if is_list(value))
        self.single_positions = tuple(index for index, value in enumerate(args) if type(value) is dtensor_class)
        self.single_names = tuple(name for name, value in kwargs.items() if type(value) is dtensor_class)
        # The key holds the ids of these specs: keeping them alive keeps the ids from being reused.
        self.specs = tuple(value._spec for value in tree_flatten((args, kwargs))[0] if type(value) is dtensor_class)

    @classmethod
    def build(cls, dtensor_class: type, op, rule, mesh, args: tuple, kwargs: dict, flat: list,
              decision: Decision) -> ListPlan | None:
        """A plan for this aten call, or None: a tensor moves, an output is not a tensor, or a plain
        tensor was made a DTensor for the decision (`flat` holds the call's values after that)."""
        if not isinstance(rule, ComposedRule) or decision.local_arguments is not None:
            return None
        dtensors = [value for value in flat if isinstance(value, dtensor_class)]
        if any(target != dtensor.sharding for dtensor, target in zip(dtensors, decision.input_layouts)):
            return None
        original = tree_flatten((args, kwargs))[0]
        if any(isinstance(value, dtensor_class) != isinstance(before, dtensor_class) for value, before in zip(flat, original)):
            return None
        if any(meta is None for meta in decision.output_metas):
            return None
        call = op._op if decision.local_op is None else functools.partial(decision.local_op, mesh)
        output_specs = tuple(
            interned_spec(DTensorSpec(mesh, layout, meta.stride, meta.dtype))
            for layout, meta in zip(decision.output_layouts, decision.output_metas)
        )
        # The dispatcher does not count a multi-tensor op's writes into DTensors: the plan does, so
        # that a kept move (`input_moves`) of a written Partial tensor is not reused.
        return cls(dtensor_class, op, call, output_specs, args, kwargs, _written_lists(dtensor_class, op, args))

    def run(self, args: tuple, kwargs: dict):
        local_args = list(args)
        waiting = self.dtensor_class._waiting
        sources = None
        if CopySource.live:  # a view of a moved copy may be among the tensors: read it fresh, write it through
            waiting = True  # `_locals` reads `_local_tensor`, which refreshes it
            sources = written_copy_sources(self.dtensor_class, self.op, args, kwargs)
        for position in self.list_positions:
            local_args[position] = _locals(args[position]) if waiting else [t._local_value for t in args[position]]
        for position in self.single_positions:
            local_args[position] = args[position]._local_tensor
        if self.list_names or self.single_names:
            kwargs = dict(kwargs)
            for name in self.list_names:
                kwargs[name] = _locals(kwargs[name])
            for name in self.single_names:
                kwargs[name] = kwargs[name]._local_tensor
        result = self.call(*local_args, **kwargs)
        if sources:
            write_through(self.op, sources)
        for position in self.written_positions:
            _increment_version(args[position])
        if not self.output_specs:
            return result if self.returned_argument is None else args[self.returned_argument]
        wrapped = self.wrap(result, self.output_specs)
        return tuple(wrapped) if type(result) is tuple else wrapped  # a public function returns a tuple


# ---- public functions ---------------------------------------------------------------------------

_list_functions: dict = {}


def is_multi_tensor_function(function) -> bool:
    """Whether a public torch function is a multi-tensor one (`torch._foreach_mul_`, `torch._fused_adam_`)."""
    known = _list_functions.get(function)
    if known is None:
        name = getattr(function, "__name__", "")
        known = _list_functions[function] = isinstance(name, str) and name.startswith(("_foreach_", "_fused_"))
    return known


def learn_function(dtensor_class: type, function, key: tuple, args: tuple, kwargs: dict, recorded: list, result) -> None:
    """After a public multi-tensor call that ran exactly one aten op from a `ListPlan` computing with
    the op itself: remember a plan that calls the public function on the local lists. The key
    holds every argument's type, so the function resolves to the same aten overload again."""
    if len(recorded) != 1 or not isinstance(recorded[0], ListPlan) or recorded[0].call is not recorded[0].op._op:
        return
    plan = recorded[0]
    returned = next((position for position, value in enumerate(args) if result is value), None)
    if plan.output_specs:
        if not isinstance(result, (list, tuple)) or len(result) != len(plan.output_specs) or returned is not None:
            return
    elif result is not None and returned is None:
        return
    if len(args) > len(plan.op._schema.arguments):
        return
    written = _written_lists(dtensor_class, plan.op, args)
    if any(name in kwargs for name in _written_names(plan.op)):
        return
    store_function_plan(key, ListPlan(dtensor_class, plan.op, function, plan.output_specs, args, kwargs, written, returned))


def _written_lists(dtensor_class: type, op, args: tuple) -> tuple[int, ...]:
    """Positions of the DTensor lists among `args` that `op` writes."""
    return tuple(
        position for position, argument in enumerate(op._schema.arguments[:len(args)])
        if argument.alias_info is not None and argument.alias_info.is_write and _is_dtensor_list(dtensor_class, args[position])
    )


def _written_names(op) -> list[str]:
    return [argument.name for argument in op._schema.arguments if argument.alias_info is not None and argument.alias_info.is_write]


def _locals(dtensors) -> list:
    """The local tensors of a list of DTensors, through `_local_tensor`, which waits for a shard
    still on its way (`run` reads `_local_value` directly while no wrapper waits)."""
    return [dtensor._local_tensor for dtensor in dtensors]


def _wrap_each(wrap, local_tensors, specs) -> list:
    return [wrap(local_tensor, spec) for local_tensor, spec in zip(local_tensors, specs)]


def _is_dtensor_list(dtensor_class: type, value) -> bool:
    return type(value) in (list, tuple) and bool(value) and type(value[0]) is dtensor_class
