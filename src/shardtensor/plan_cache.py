"""The dispatch plan cache: a call's key, and the plan that runs a cached decision.

The hot path of `dispatch`: a key built from the op, the identity of each DTensor argument's spec
(specs are interned: equal metadata, one object) and the other arguments finds a `Plan` (the
decision with the output specs and, for rules with local arguments such as `view`, this rank's
arguments already built), which runs the local op and wraps its outputs. `torch_function` keeps
its plans for public functions here too, so that one `clear_plans` forgets both.

A plan is stored under the call's key, in which every non-tensor argument counts with its type and
value, and, when the op's rule declares arguments whose value does not decide
(`ShardingRule.value_keys`: `mul`'s scalar by its sign only, `add`'s `alpha` by its type only),
also under the key without those values (`fast_key(..., modes)`). A 0-d plain tensor counts with
its dtype, and, for rules that read a scale's sign, next to a Partial input with its sign too
(`plain_tensors.scale_signs`). A call first looks up its own key (the hot path, unchanged for
repeated values) and then the other: `x * step_size` with a new step size every call is a hit.
Each cache holds at most `MAX_PLANS` entries; when full, the least recently used go first,
approximated as CLOCK does (a plan used since the last sweep is kept once more), so that a hit
only sets a flag. `cache_counts()` reports hits, misses and decisions per op
(`shardtensor.debug.plan_cache_counts`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import propagation
from .modes import implicit_communication_error, is_explicit
from .input_moves import moved_local
from .ops.registry import RULES
from .plain_tensors import scale_signs
from .rank_state import per_rank_contents
from .process_groups import on_new_world
from .redistribute import is_relabel, redistribute_local_tensor
from .rules import SIGN, Decision, PlainTensor, TensorMeta, sign_of
from .spec import DTensorSpec, interned_spec
from .write_back import (
    copy_source, mark_views_of_copies, returns_view, write_back, write_through, written_arguments, written_copy_sources,
)

__all__ = [
    "fast_key", "key_modes", "strip_values", "template", "Plan", "plans", "function_plans", "recording", "store",
    "store_function_plan", "function_key_modes", "reads_scale_signs", "PLAIN_TENSOR", "clear_plans", "Recording", "record", "CachedPlan", "MAX_PLANS", "CacheCounts", "cache_counts", "counts_of",
]

# fast key -> Plan, least recently used first. Keys hold the id of each DTensor argument's spec; the
# plan keeps those specs alive, so an id cannot be reused while its key exists.
plans: OrderedDict[tuple, Plan] = OrderedDict()
# fast key (holding the public function's id) -> `torch_function`'s plan for it, least recently used first.
function_plans: OrderedDict[tuple, object] = OrderedDict()
# The size of each of the two caches; when one is full its least recently used plan is dropped.
MAX_PLANS = 8192

# (public function, number of positional arguments) -> key modes learnt by `torch_function` from the
# one aten op such calls run with their arguments unchanged (`key_modes` of that op); () once two
# calls disagree (other overloads, or arguments not passed through), so that no value is left out.
function_key_modes: dict = {}


class _OpCounts:
    """One op's plan-cache hits and misses, shared by its plans (so a dropped plan keeps its count)."""

    __slots__ = ("hits", "misses")

    def __init__(self):
        self.hits = self.misses = 0


_op_counts: dict = {}


def counts_of(op) -> _OpCounts:
    counts = _op_counts.get(op)
    if counts is None:
        counts = _op_counts[op] = _OpCounts()
    return counts


# While `torch_function` learns a public function, the plan each aten op ran from (None: a miss).
recording: list[list] = []
per_rank_contents("plan_cache.recording", recording)


class Recording(list):
    """One public call's entry in `recording`: the plans, and the (args, kwargs) each aten op got."""

    __slots__ = ("arguments",)

    def __init__(self):
        super().__init__()
        self.arguments: list[tuple[tuple, dict]] = []


def record(plan, args: tuple, kwargs: dict) -> None:
    """Note in the innermost `recording` entry that an aten op ran from `plan` (None: a miss)."""
    entry = recording[-1]
    entry.append(plan)
    if type(entry) is Recording:
        entry.arguments.append((args, kwargs))


class CachedPlan:
    """What every entry of `plans` has for the hot path: the `propagation.generation` it was made in,
    whether it was used since the last sweep (`used`), and its op's shared hit and miss counts."""

    __slots__ = ("generation", "used", "counts")

    def __init__(self, op):
        self.generation, self.used, self.counts = propagation.generation, False, counts_of(op)


_KEY_SCALAR_TYPES = frozenset(
    (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
)
_KEY_LIST_ITEM_TYPES = frozenset((int, float, bool, type(None)))


def store(key: tuple, plan: Plan) -> None:
    """Keep `plan` under `key`, dropping the least recently used plan when the cache is full."""
    _store(plans, key, plan)


def store_function_plan(key: tuple, plan) -> None:
    """Keep a `torch_function` plan under `key`, dropping the least recently used one when full."""
    _store(function_plans, key, plan)


def _store(cache: OrderedDict, key: tuple, plan) -> None:
    spared: set[int] = set()  # plans whose flag this sweep cleared
    while len(cache) >= MAX_PLANS:  # CLOCK: the oldest entry goes unless it was used since the last sweep
        oldest_key, oldest = next(iter(cache.items()))
        if oldest.used:
            oldest.used = False
            spared.add(id(oldest))
            cache.move_to_end(oldest_key)
        elif id(oldest) in spared:  # the same plan under its other key (values and value-free): used too
            spared.discard(id(oldest))
            cache.move_to_end(oldest_key)
        else:
            del cache[oldest_key]
    cache[key] = plan


def clear_plans() -> None:
    """Forget every cached plan: the aten ones and the public functions learnt from them."""
    plans.clear()
    function_plans.clear()
    function_key_modes.clear()


@dataclass(frozen=True, slots=True)
class CacheCounts:
    """One op's calls since the process started: served from a cached plan (`hits`, the public-function
    fast path included), missed (`misses`: the slow path), and how the misses got their decision:
    made by the rule (`decisions`) or found in propagation's cache (`decision_hits`)."""

    hits: int
    misses: int
    decisions: int
    decision_hits: int

    def __str__(self) -> str:
        return f"{self.hits} hits, {self.misses} misses, {self.decisions} decisions, {self.decision_hits} decision hits"


def cache_counts() -> dict[str, CacheCounts]:
    """`CacheCounts` per op (by name), for ops that ran at least once on DTensors."""
    ops = set(_op_counts) | set(propagation.decisions_made) | set(propagation.decision_cache_hits)
    empty = _OpCounts()
    counts = {
        str(op): CacheCounts(_op_counts.get(op, empty).hits, _op_counts.get(op, empty).misses,
                             propagation.decisions_made[op], propagation.decision_cache_hits[op])
        for op in ops
    }
    return dict(sorted(counts.items()))


# ---- keys -----------------------------------------------------------------------------------------

_SCALAR_KINDS = frozenset((int, float, bool, complex))


def key_modes(op) -> tuple:
    """How the arguments of `op` enter keys: `(mode per position, {name: mode})` from its rule's
    `value_keys` (None: the value decides), or `()` when every value decides (most ops)."""
    modes = propagation.key_modes.get(op)
    if modes is None:
        rule = RULES.get(op)
        arguments = op._schema.arguments
        declared = rule.value_keys if rule is not None else {}
        value_keys = {argument.name: declared[argument.name] for argument in arguments if argument.name in declared}
        modes = ()
        if value_keys:
            modes = (tuple(None if argument.kwarg_only else value_keys.get(argument.name) for argument in arguments),
                     value_keys)
        propagation.key_modes[op] = modes
    return modes


def _mode_key(value, mode: str | None, key: list, sign_decides: bool = True) -> bool:
    """Append a scalar that does not decide as its type (and sign, for SIGN); False: it decides."""
    kind = type(value)
    if mode is None or kind not in _SCALAR_KINDS or (mode == SIGN and kind is complex):
        return False
    key.append(kind)
    if mode == SIGN and sign_decides:
        key.append(sign_of(value))
    return True


def strip_values(values: tuple, named: tuple, modes: tuple, partial_input: bool) -> tuple[tuple, tuple]:
    """`(args, kwargs items)` of a call with each value that does not decide replaced by its key. A
    SIGN only picks among Partial rows, so without a `partial_input` it counts by its type only."""
    if not modes:
        return values, named
    positional, by_name = modes

    def stripped(value, mode):
        key: list = []
        return (_STRIPPED, *key) if _mode_key(value, mode, key, partial_input) else value

    args = tuple(stripped(value, positional[index] if index < len(positional) else None)
                 for index, value in enumerate(values))
    return args, tuple((name, stripped(value, by_name.get(name))) for name, value in named)


_STRIPPED = object()  # marks a value replaced by its type (and sign) in a decision cache key


on_new_world(clear_plans)  # plans hold specs of the old world's meshes


def _key_value(dtensor_class: type, value, key: list) -> bool | str:
    """Append `value` to a fast key; False when the call is not flat (nested or plain tensors other
    than 0-d ones), `PLAIN_TENSOR` after a 0-d plain tensor."""
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
        return PLAIN_TENSOR
    else:
        return False
    return True


# What `_key_value` (and `list_plans`' key builder) returns, truthy, after appending a 0-d plain tensor.
PLAIN_TENSOR = "plain tensor"


def reads_scale_signs(op) -> bool:
    """Whether a 0-d plain tensor next to a Partial input of `op` (an aten op or a public function)
    decides by its sign (`plain_tensors.scale_signs`), so that keys hold it. One dict lookup: the
    answer is kept until a rule is added or replaced (`propagation.clear_cache` forgets it)."""
    known = propagation.sign_readers.get(op)
    if known is None:
        known = propagation.sign_readers[op] = _reads_scale_signs(op)
    return known


def _reads_scale_signs(op) -> bool:
    """An aten op: whether its rule reads a scale's sign (a SIGN value key). A multi-tensor public
    function (`torch._foreach_mul_`, keyed by `list_plans`): whether an aten op of its name does."""
    if isinstance(op, torch._ops.OpOverload):
        rule = RULES.get(op)
        element_rule = getattr(rule, "element_rule", None)  # a multi-tensor op reads what its element op reads
        if element_rule is not None:
            rule = element_rule()
        return rule is not None and SIGN in rule.value_keys.values()
    # Other public functions: the aten op they run is not known before the key is built, and a plan may
    # pass a 0-d plain tensor to it (`torch_function._learn`): next to a Partial, its sign counts.
    name = getattr(op, "__name__", None)
    if not isinstance(name, str) or not name.startswith(("_foreach_", "_fused_")):
        return True
    packet = getattr(torch.ops.aten, name, None)
    return packet is not None and any(_reads_scale_signs(getattr(packet, overload)) for overload in packet.overloads())


def fast_key(dtensor_class: type, op, args: tuple, kwargs: dict, modes: tuple = ()) -> tuple | None:
    """The plan-cache key of a flat call (DTensors, scalars, flat lists of numbers); None otherwise.
    `modes` (from `key_modes`) leave out the values that do not decide."""
    if modes:
        return _fast_key_with_modes(dtensor_class, op, args, kwargs, modes)
    key = [id(op)]  # ops live as long as the process; hashing an OpOverload runs Python code
    plain_tensor = False
    for value in args:
        kind = type(value)
        if kind is dtensor_class:  # the common cases, without a call
            key.append(id(value._spec))
        elif kind is int:
            key.append(int)
            key.append(value)
        else:
            appended = _key_value(dtensor_class, value, key)
            if not appended:
                return None
            plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    if kwargs:
        for name, value in kwargs.items():
            key.append(name)
            appended = _key_value(dtensor_class, value, key)
            if not appended:
                return None
            plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    if plain_tensor and reads_scale_signs(op):
        key += scale_signs(dtensor_class, (*args, *kwargs.values()))
    return tuple(key)


def _fast_key_with_modes(dtensor_class: type, op, args: tuple, kwargs: dict, modes: tuple) -> tuple | None:
    positional, by_name = modes
    key = [id(op)]
    plain_tensor = False
    for index, value in enumerate(args):
        kind = type(value)
        if kind is dtensor_class:
            key.append(id(value._spec))
        elif kind not in _SCALAR_KINDS or index >= len(positional) or not _mode_key(value, positional[index], key):
            appended = _key_value(dtensor_class, value, key)
            if not appended:
                return None
            plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    for name, value in kwargs.items():
        key.append(name)
        if type(value) not in _SCALAR_KINDS or not _mode_key(value, by_name.get(name), key):
            appended = _key_value(dtensor_class, value, key)
            if not appended:
                return None
            plain_tensor = plain_tensor or appended is PLAIN_TENSOR
    if plain_tensor and SIGN in by_name.values():
        key += scale_signs(dtensor_class, (*args, *kwargs.values()))
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


class Plan(CachedPlan):
    """A decision for flat calls with everything per call precomputed: where each tensor argument
    comes from and goes to (a rule's local arguments are a template filled with the local tensors),
    where each DTensor must move (None: stays), and the output specs."""

    __slots__ = (
        "dtensor_class", "wrap", "op", "mesh", "specs", "slots", "moves", "local_collectives", "output_specs", "call",
        "runs_op", "mutates", "local_args", "local_kwargs", "writes_kwargs", "simple_positions", "single_spec",
        "is_view", "copied",
    )

    def __init__(self, dtensor_class: type, op, mesh, args: tuple, kwargs: dict, decision: Decision, mutates: bool,
                 template):
        super().__init__(op)  # a rule registered later makes the plan stale (its generation)
        self.op, self.mesh, self.mutates = op, mesh, mutates
        self.dtensor_class, self.wrap = dtensor_class, dtensor_class._wrap
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
            None if is_relabel(dtensor.sharding, target, dtensor._spec.dtype.itemsize) else target
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
        # Written arguments that move (a scalar added in place to a Partial, reduced first) run on a copy,
        # stored back after the op (`write_back`) as the slow path does: the DTensor keeps its spec, so
        # the decision holds for every such call. Known by position: a read of the same DTensor moved
        # alike (`p.add_(p)`, `add(p, q, out=p)`) reads that copy, as on one device it reads what is written.
        written_places = {(False, index) for index, _ in written_arguments(op)}
        written_places |= {(True, name) for _, name in written_arguments(op)}
        self.copied = tuple(
            (in_kwargs, source, target) for in_kwargs, source, is_dtensor, target, _, _ in self.slots
            if is_dtensor and target is not None and (in_kwargs, source) in written_places
        )
        self.local_collectives = decision.local_collectives
        self.is_view = returns_view(op)
        self.writes_kwargs = any(to_kwargs for *_, to_kwargs, _ in self.slots)
        self.output_specs = tuple(
            None if layout is None else interned_spec(DTensorSpec(mesh, layout, meta.stride, meta.dtype))
            for layout, meta in zip(decision.output_layouts, decision.output_metas)
        )
        single = not mutates and len(self.output_specs) == 1 and self.output_specs[0] is not None
        self.single_spec = self.output_specs[0] if single else None
        # The common case, run by a short loop: positional DTensors that stay where they are.
        simple = (single and template is None and not self.moves and not self.writes_kwargs
                  and not self.local_collectives)
        self.simple_positions = tuple(source for _, source, *_ in self.slots) if simple else None

    def run(self, args: tuple, kwargs: dict):
        positions = self.simple_positions
        if positions is not None:
            local_args = list(args)
            for index in positions:
                local_args[index] = args[index]._local_tensor
            result = self.call(*local_args, **kwargs)
            if type(result) is torch.Tensor:
                result = self.wrap(result, self.single_spec)
                if self.is_view and args[0]._view_of_copy is not None:  # a view of a view of a copy
                    result._view_of_copy = args[0]._view_of_copy
                return result
            return self._wrap_result(result, [])
        sources = written_copy_sources(self.dtensor_class, self.op, args, kwargs) if self.mutates else ()
        if (self.moves or self.local_collectives) and is_explicit():
            dtensors = [(kwargs if in_kwargs else args)[where] for in_kwargs, where, is_dtensor, *_ in self.slots
                        if is_dtensor]
            targets = [target for _, _, is_dtensor, target, _, _ in self.slots if is_dtensor]
            raise implicit_communication_error(
                self.op, dtensors, targets, "its sharding rule needs other layouts or communicates",
                self.local_collectives,
            )
        if self.local_args is None:
            local_args, local_kwargs = list(args), kwargs
        else:
            local_args, local_kwargs = list(self.local_args), self.local_kwargs
        if self.writes_kwargs:
            local_kwargs = dict(local_kwargs)
        inputs = []
        copies = {}  # id(DTensor) -> (DTensor, its moved copy that the op writes, the copy's layout)
        for in_kwargs, source, target in self.copied:
            value = kwargs[source] if in_kwargs else args[source]
            if id(value) not in copies:
                copy = redistribute_local_tensor(value._local_tensor, value._spec.layout, target, self.mesh)
                copies[id(value)] = (value, copy, target)
        viewed = None  # a view op's input: (DTensor, local tensor it ran as, its layout if moved)
        for in_kwargs, source, is_dtensor, target, to_kwargs, destination in self.slots:
            value = kwargs[source] if in_kwargs else args[source]
            local = value
            if is_dtensor:
                local = value._local_tensor
                if target is not None:
                    copied = copies.get(id(value))
                    if copied is not None and copied[2] == target:
                        local = copied[1]
                    else:
                        local = moved_local(value, target, self.mesh)
                if self.mutates:
                    inputs.append((local, value))
                if self.is_view and viewed is None:
                    viewed = (value, local, target)
            if to_kwargs:
                local_kwargs[destination] = local
            else:
                local_args[destination] = local
        result = self._wrap_result(self.call(*local_args, **local_kwargs), inputs)
        for dtensor, local, layout in copies.values():
            write_back(self.op, dtensor, local, layout, self.mesh)
        if sources:
            write_through(self.op, sources)
        return mark_views_of_copies(self.dtensor_class, result, copy_source(*viewed)) if self.is_view else result

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
