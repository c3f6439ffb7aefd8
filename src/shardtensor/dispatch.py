"""Run a torch op on DTensors: unwrap, decide layouts, redistribute, run locally, wrap.

`DTensor.__torch_dispatch__` calls `dispatch`. The hot path: a key built from the op, the
identity of each DTensor argument's spec (specs are interned: equal metadata, one object) and the
other arguments finds a `_Plan` (the decision with the output specs and, for rules with local
arguments such as `view`, this rank's arguments already built), which runs the local op and wraps
its outputs. On a miss,
an op with a rule in `ops.registry.RULES` gets a (cached) decision from `propagation.decide`; an
op without one goes to the fallback, which gathers every input to Replicate, runs the op on full
tensors and returns the single-device result, logged once per op and counted in
`fallback_counts`.

Two switches, each a context manager and an environment variable read once at import
(`read_environment()` re-reads them):
- `strict_mode()` / `SHARDTENSOR_STRICT=1`: the fallback raises instead;
- `explicit_communication()` / `SHARDTENSOR_EXPLICIT_COMM=1`: any communication an op would do
  implicitly (a rule moving an input, a rule's local op issuing its declared collectives, or the
  fallback gathering an input) raises, naming the plan.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import dtensor as _dtensor_module
from . import ops  # noqa: F401  (registers every op family)
from . import propagation
from .dtensor import DTensor, DTensorSpec, created_by_torch, interned_spec, partial_from_replicate, without_partial
from .input_moves import KeptMoves, moved_local, with_kept_moves
from .layout import Layout
from .ops.registry import RULES
from .placement import Replicate, Shard
from .propagation import DataDependentOutput, Decision, OpCall, PlainTensor, ResizesWritten, TensorMeta, decide
from .redistribute import explain, redistribute_local_tensor

__all__ = [
    "dispatch", "fallback_counts", "strict_mode", "explicit_communication", "read_environment", "clear_plans",
]

logger = logging.getLogger(__name__)

# How often each op (by name) went through the replicate fallback in this process.
fallback_counts: Counter[str] = Counter()

_mutated_arguments: dict[object, tuple[tuple[int, str], ...]] = {}


class _Switches:
    """Strict and explicit-communication modes: environment (read once) or context managers."""

    strict_environment = False
    explicit_environment = False
    strict_depth = 0
    explicit_depth = 0


def _environment_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def read_environment() -> None:
    """(Re-)read `SHARDTENSOR_STRICT` and `SHARDTENSOR_EXPLICIT_COMM`; done once at import."""
    _Switches.strict_environment = _environment_flag("SHARDTENSOR_STRICT")
    _Switches.explicit_environment = _environment_flag("SHARDTENSOR_EXPLICIT_COMM")


read_environment()


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Inside this block an op without a sharding rule raises instead of gathering to Replicate.

    >>> with shardtensor.strict_mode():  # doctest: +SKIP
    ...     torch.cumsum(x, 0)  # NotImplementedError if aten.cumsum has no rule
    """
    _Switches.strict_depth += 1
    try:
        yield
    finally:
        _Switches.strict_depth -= 1


@contextlib.contextmanager
def explicit_communication() -> Iterator[None]:
    """Inside this block an op that would communicate implicitly raises instead, showing the plan.

    That is an op whose rule moves an input, or whose rule's local op issues collectives itself
    (softmax over a sharded dim, nll_loss 'mean' over a sharded batch, batch-norm running
    statistics, `equal` of sharded tensors: `Row.collectives`). Communication then happens only
    where the program asks for it (`redistribute`, `full_tensor`); ops whose rules compute locally
    (or yield Partial) still run. (The agreement on out-of-range indices of sharded index tensors is
    a check, not part of the computation: `shardtensor.trusted_indices()` skips it.)

    >>> with shardtensor.explicit_communication():  # doctest: +SKIP
    ...     x_row_sharded + y_column_sharded  # RuntimeError naming aten.add.Tensor and the plan
    """
    _Switches.explicit_depth += 1
    try:
        yield
    finally:
        _Switches.explicit_depth -= 1


def _is_strict() -> bool:
    return _Switches.strict_depth > 0 or _Switches.strict_environment


def _is_explicit() -> bool:
    return _Switches.explicit_depth > 0 or _Switches.explicit_environment


def _describe(dtensors: list[DTensor]) -> str:
    return ", ".join(f"[{', '.join(str(p) for p in d.placements)}] shape={tuple(d.shape)}" for d in dtensors)


def _implicit_communication_error(op, dtensors, targets, what: str, local_collectives=()) -> RuntimeError:
    lines = [
        f"{op} would communicate implicitly ({what}), which explicit-communication mode "
        f"forbids. Inputs: {_describe(dtensors)}. The plan it would run:"
    ]
    for number, (dtensor, target) in enumerate(zip(dtensors, targets)):
        if target is not None and target != dtensor.sharding:
            lines.append(f"input {number}: " + explain(dtensor.sharding, target, dtensor.element_size()))
    for mesh_dim, collective in local_collectives:
        lines.append(f"inside the op (its sharding rule's local computation): {collective} on mesh dim {mesh_dim}")
    lines.append(
        "Redistribute the inputs yourself first (x.redistribute(mesh, placements)), or leave "
        "shardtensor.explicit_communication() / unset SHARDTENSOR_EXPLICIT_COMM."
    )
    return RuntimeError("\n".join(lines))


def _common_mesh(op, dtensors: list[DTensor]):
    mesh = dtensors[0].device_mesh
    for other in dtensors[1:]:
        if other.device_mesh != mesh:
            raise ValueError(
                f"{op}: DTensor arguments live on different meshes, {mesh!r} and {other.device_mesh!r}; "
                f"all DTensors of one op must share a mesh: redistribute one of them onto the other's "
                f"mesh first (x.redistribute(other.device_mesh, placements))"
            )
    return mesh


def _plain_tensors_as_replicate(op, flat: list, mesh, accepted: bool, written: frozenset = frozenset()) -> None:
    """Refuse plain tensors that are not 0-d, or (for rules that accept them) make them Replicate.

    Inside a backward formula every op accepts them: autograd formulas build plain tensors from
    global sizes only (`torch.ones` in prod's, `zeros` in cumprod's), so they are equal on every rank.
    A plain tensor the op writes to (ids in `written`, 0-d too) becomes Replicate: it must receive the
    full value, not this rank's shard or partial sum.
    """
    accepted = accepted or torch._C._current_autograd_node() is not None
    for index, value in enumerate(flat):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and (value.ndim > 0 or id(value) in written):
            if accepted or value.ndim == 0 or created_by_torch(value):
                layout = Layout.create(mesh.shape, [Replicate()] * mesh.ndim, value.shape)
                flat[index] = DTensor(value, DTensorSpec(mesh, layout, tuple(value.stride()), value.dtype))
                continue
            # Not a TypeError: torch turns a TypeError in an operator into NotImplemented and the message is lost.
            raise RuntimeError(
                f"{op}: got a plain torch.Tensor of shape {tuple(value.shape)} mixed with DTensors; only "
                f"Python scalars and 0-d tensors may be mixed in. Make it a DTensor first, e.g. "
                f"distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim) or DTensor.from_local(...)"
            )


def _mutated(op, args: tuple, kwargs: dict) -> list[DTensor]:
    """DTensor arguments that the op writes to (`self` of `add_`, `out=` of `add.out`)."""
    return [value for value in _written(op, args, kwargs) if isinstance(value, DTensor)]


def _written(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor arguments, plain or DTensor, that the op writes to."""
    positions = _mutated_arguments.get(op)
    if positions is None:
        positions = tuple(
            (index, argument.name)
            for index, argument in enumerate(op._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        _mutated_arguments[op] = positions
    mutated = []
    for index, name in positions:
        value = args[index] if index < len(args) else kwargs.get(name)
        values = value if isinstance(value, (list, tuple)) else [value]
        mutated.extend(item for item in values if isinstance(item, torch.Tensor))
    return mutated


def _frozen(value):
    """A call's non-tensor argument as a hashable value: lists become tuples (at any depth), a 0-d
    plain tensor its `PlainTensor` (its dtype matters to the op, not its value)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, torch.Tensor):
        return PlainTensor(value.dtype)
    return value


def _decision_cache_key(op, layouts, call: OpCall, coordinate: tuple[int, ...] | None, flat: list):
    """What a decision depends on. The type of every argument is in it because 2, 2.0 and True are
    equal keys but give other dtypes; the coordinate because local arguments and local ops are this
    rank's, and two meshes of one shape may place this rank at different coordinates."""
    types = tuple(type(value) for value in flat)
    key = (op, tuple(layouts), call.inputs, call.args, call.kwargs, types, coordinate)
    try:
        hash(key)
    except TypeError:
        return None
    return key


# ---- the hot path ---------------------------------------------------------------------------------

# fast key -> _Plan. Keys hold the id of each DTensor argument's spec; the plan keeps those specs
# alive, so an id cannot be reused while its key exists.
_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 8192
_KEY_SCALAR_TYPES = frozenset(
    (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
)
_KEY_LIST_ITEM_TYPES = frozenset((int, float, bool, type(None)))


def clear_plans() -> None:
    """Forget every cached plan: the aten ones and the public functions learnt from them."""
    from .torch_function import clear_function_plans  # that module imports this one

    _plans.clear()
    clear_function_plans()


def _key_value(value, key: list) -> bool:
    """Append `value` to a fast key; False when the call is not flat (nested or plain tensors)."""
    kind = type(value)
    if kind is DTensor:
        key.append(id(value._spec))
    elif kind in _KEY_SCALAR_TYPES:
        key.append(kind)  # 1, 1.0 and True hash alike but give different dtypes
        key.append(value)
    elif kind is list or kind is tuple:
        item_types = tuple(map(type, value))
        if not _KEY_LIST_ITEM_TYPES.issuperset(item_types):
            return False
        key += (kind, item_types, tuple(value))  # [1, 2] and [1.0, 2.0] hash alike
    elif isinstance(value, DTensor):
        key.append(id(value._spec))
    elif isinstance(value, torch.Tensor):
        if value.ndim:
            return False
        key.append(value.dtype)
    else:
        return False
    return True


def _fast_key(op, args: tuple, kwargs: dict) -> tuple | None:
    key = [id(op)]  # ops live as long as the process; hashing an OpOverload runs Python code
    for value in args:
        kind = type(value)
        if kind is DTensor:  # the common cases, without a call
            key.append(id(value._spec))
        elif kind is int:
            key.append(int)
            key.append(value)
        elif not _key_value(value, key):
            return None
    if kwargs:
        for name, value in kwargs.items():
            key.append(name)
            if not _key_value(value, key):
                return None
    return tuple(key)


def _template(decision: Decision, args: tuple, kwargs: dict) -> tuple[list, dict, list] | None:
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


class _Plan:
    """A decision for flat calls with everything per call precomputed: where each tensor argument
    comes from and goes to (a rule's local arguments are a template filled with the local tensors),
    where each DTensor must move (None: stays), and the output specs."""

    __slots__ = (
        "generation", "op", "mesh", "specs", "slots", "moves", "output_specs", "call", "runs_op", "mutates",
        "local_args", "local_kwargs", "writes_kwargs", "simple_positions", "single_spec", "view_of_copy",
        "local_collectives",
    )

    def __init__(self, op, mesh, args: tuple, kwargs: dict, decision: Decision, mutates: bool, template):
        self.op, self.mesh, self.mutates = op, mesh, mutates
        self.generation = propagation.generation  # a rule registered later makes the plan stale
        # The op's C++ callable skips `OpOverload.__call__`'s Python frame.
        self.runs_op = decision.local_op is None
        self.call = op._op if self.runs_op else functools.partial(decision.local_op, mesh)
        # Every tensor argument in flattened order (DTensors are the decision's inputs, in that order).
        sources = [(False, index) for index, value in enumerate(args) if isinstance(value, torch.Tensor)]
        sources += [(True, name) for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
        values = [kwargs[where] if in_kwargs else args[where] for in_kwargs, where in sources]
        dtensors = [value for value in values if isinstance(value, DTensor)]
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
            is_dtensor = isinstance(value, DTensor)
            if is_dtensor or template is not None:  # without a template a plain 0-d tensor stays where it is
                slots.append((in_kwargs, source, is_dtensor, next(targets) if is_dtensor else None) + destination)
        self.slots = tuple(slots)
        self.moves = any(target is not None for *_, target, _, _ in self.slots)
        self.local_collectives = decision.local_collectives
        self.view_of_copy = self.moves and _returns_view(op)
        self.writes_kwargs = any(to_kwargs for *_, to_kwargs, _ in self.slots)
        self.output_specs = tuple(
            None if layout is None else interned_spec(DTensorSpec(mesh, layout, meta.stride, meta.dtype))
            for layout, meta in zip(decision.output_layouts, decision.output_metas)
        )
        single = not mutates and len(self.output_specs) == 1 and self.output_specs[0] is not None
        self.single_spec = self.output_specs[0] if single else None
        # The common case, run by a short loop: positional DTensors that stay where they are.
        simple = single and template is None and not self.moves and not self.writes_kwargs and not self.local_collectives
        self.simple_positions = tuple(source for _, source, *_ in self.slots) if simple else None

    def run(self, args: tuple, kwargs: dict):
        positions = self.simple_positions
        if positions is not None:
            local_args = list(args)
            for index in positions:
                local_args[index] = args[index]._local_tensor
            result = self.call(*local_args, **kwargs)
            if type(result) is torch.Tensor:
                return DTensor._wrap(result, self.single_spec)
            return self._wrap_result(result, [])
        if self.mutates:
            _refuse_writes_into_views_of_copies(self.op, _mutated(self.op, args, kwargs))
        if (self.moves or self.local_collectives) and _is_explicit():
            dtensors = [(kwargs if in_kwargs else args)[where] for in_kwargs, where, is_dtensor, *_ in self.slots
                        if is_dtensor]
            targets = [target for _, _, is_dtensor, target, _, _ in self.slots if is_dtensor]
            raise _implicit_communication_error(
                self.op, dtensors, targets, "its sharding rule needs other layouts or communicates", self.local_collectives
            )
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
                    local = moved_local(value, target, self.mesh)  # plans move no written input
                if self.mutates:
                    inputs.append((local, value))
            if to_kwargs:
                local_kwargs[destination] = local
            else:
                local_args[destination] = local
        result = self._wrap_result(self.call(*local_args, **local_kwargs), inputs)
        return _mark_views_of_copies(result) if self.view_of_copy else result

    def _wrap_result(self, result, inputs: list):
        if self.single_spec is not None and type(result) is torch.Tensor:
            return DTensor._wrap(result, self.single_spec)
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
        return DTensor._wrap(output, self.output_specs[position])


# While `torch_function` learns a public function, the plan each aten op ran from (None: a miss).
recording: list[list] = []


def dispatch(op, args: tuple, kwargs: dict):
    """Run `op` on DTensor arguments and return DTensor results (the single-device value)."""
    if KeptMoves.count:  # a Partial input reduced before is seen where it was moved (`input_moves`)
        args, kwargs = with_kept_moves(op, args, kwargs)
    key = _fast_key(op, args, kwargs)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None and plan.generation == propagation.generation:
            if recording:
                recording[-1].append(plan)
            return plan.run(args, kwargs)
    if recording:
        recording[-1].append(None)
    return _dispatch_slowly(op, args, kwargs, key)


_dtensor_module._dispatch = dispatch


def _torch_dispatch(cls, op, types, args=(), kwargs=None):
    """`DTensor.__torch_dispatch__` from now on: `dispatch` one Python frame sooner."""
    return dispatch(op, args, kwargs or _NO_KEYWORDS)


_NO_KEYWORDS: dict = {}
DTensor.__torch_dispatch__ = classmethod(_torch_dispatch)


def _moves_no_mutated_input(decision: Decision, mutated: list[DTensor], dtensors: list[DTensor]) -> bool:
    """A plan runs an op on the local tensors it is given, so it cannot write a moved copy back."""
    mutated_ids = {id(dtensor) for dtensor in mutated}
    return all(
        target == dtensor.sharding
        for dtensor, target in zip(dtensors, decision.input_layouts)
        if id(dtensor) in mutated_ids
    )


def _dispatch_slowly(op, args: tuple, kwargs: dict, key: tuple | None):
    """The miss path: flatten the arguments, decide (or fall back), run, and store a plan."""
    if torch.Tag.inplace_view in op.tags:
        return _inplace_view(op, args, kwargs)
    flat, tree = tree_flatten((args, kwargs))
    positions = [index for index, value in enumerate(flat) if isinstance(value, DTensor)]
    mesh = _common_mesh(op, [flat[index] for index in positions])
    rule = RULES.get(op)
    written = frozenset(id(value) for value in _written(op, args, kwargs) if not isinstance(value, DTensor))
    if written:  # a plan would run the op on the plain tensor itself, without the write-back `_run` does
        key = None
    _plain_tensors_as_replicate(op, flat, mesh, getattr(rule, "accepts_plain_tensors", False), written)
    positions = [index for index, value in enumerate(flat) if isinstance(value, DTensor)]
    dtensors = [flat[index] for index in positions]
    # After the wrapping: a plain tensor the op writes to (`out=` of a buffer in a backward formula)
    # is written through its Replicate wrapper, which `_run` must write back when it moves.
    mutated = _mutated(op, *tree_unflatten(flat, tree))
    _refuse_writes_into_views_of_copies(op, mutated)
    if rule is None:
        return _fallback(op, flat, tree, positions, dtensors, mutated, mesh)
    metas = tuple(TensorMeta(tuple(dtensor.shape), dtensor._spec.stride, dtensor.dtype) for dtensor in dtensors)
    stand_ins = list(flat)
    for index, meta in zip(positions, metas):
        stand_ins[index] = meta
    call_args, call_kwargs = tree_unflatten(stand_ins, tree)
    # Keywords in the call's order, not sorted: placeholders are matched to the call's tensors in
    # flattened order (`_local_flat`, plans, the per-coordinate meta evaluation), and sorting swapped
    # two tensor keywords such as `frexp.Tensor_out`'s `mantissa` and `exponent`.
    call = OpCall(op, metas, _frozen(call_args), tuple((name, _frozen(value)) for name, value in call_kwargs.items()))
    layouts = [dtensor.sharding for dtensor in dtensors]
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: the layouts the mesh's ranks get, no data
        decision = decide(call, layouts, rule, (0,) * mesh.ndim, None)
        if _is_explicit() and decision.moves_inputs(layouts):
            raise _implicit_communication_error(op, dtensors, decision.input_layouts, "its sharding rule needs other layouts")
        return _outside_mesh(op, flat, tree, positions, dtensors, mesh, decision.output_layouts)
    coordinate = tuple(coordinate)
    try:
        decision = decide(call, layouts, rule, coordinate, _decision_cache_key(op, layouts, call, coordinate, flat))
    except DataDependentOutput:  # every rank reaches the same verdict: the replicate fallback computes it
        return _fallback(op, flat, tree, positions, dtensors, mutated, mesh)
    except ResizesWritten as resize:
        return _write_resized(op, args, kwargs, *tree_unflatten(flat, tree), resize.functional_op)
    if key is not None and _moves_no_mutated_input(decision, mutated, dtensors):
        template = None if decision.local_arguments is None else _template(decision, args, kwargs)
        if decision.local_arguments is None or template is not None:
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            plan = _Plan(op, mesh, args, kwargs, decision, bool(_mutated_arguments[op]), template)
            _plans[key] = plan
            return plan.run(args, kwargs)
    if _is_explicit() and (decision.moves_inputs(layouts) or decision.local_collectives):
        raise _implicit_communication_error(
            op, dtensors, decision.input_layouts, "its sharding rule needs other layouts or communicates",
            decision.local_collectives,
        )
    if decision.local_arguments is not None:
        flat, tree = _local_flat(flat, decision.local_arguments)
        positions = [index for index, value in enumerate(flat) if isinstance(value, DTensor)]
    return _run(op, flat, tree, positions, dtensors, mutated, mesh, decision.input_layouts, decision.output_layouts,
                decision.output_metas, decision.local_op)


def _write_resized(op, args: tuple, kwargs: dict, dtensor_args: tuple, dtensor_kwargs: dict, functional_op):
    """An in-place or `out=` op that resizes what it writes (`addbmm_` of a broadcast `self`, an empty
    `out=`): run `functional_op` and give its results (in the written tensors' dtypes, and their
    placements where these fit) to them, as torch's resize and copy do. A plain tensor gets the full value."""
    out_names = {argument.name for argument in op._schema.arguments
                 if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write}
    functional_kwargs = {name: value for name, value in dtensor_kwargs.items() if name not in out_names}
    results = tree_flatten(functional_op(*dtensor_args, **functional_kwargs))[0]
    written = _written(op, args, kwargs)
    for target, value in zip(written, results):
        if value.dtype != target.dtype:
            value = torch.ops.aten._to_copy.default(value, dtype=target.dtype)
        if isinstance(target, DTensor):
            placements = target.placements  # kept where they fit the new shape
            if any(isinstance(placement, Shard) and placement.dim >= value.ndim for placement in placements):
                placements = without_partial(value.sharding).placements
            value = value.redistribute(target.device_mesh, placements)
            target._take_value_of(value)
            _set_wrapper_sizes(target, tuple(value.shape), value._spec.stride)
        else:
            target.resize_(value.shape).copy_(value.full_tensor())
    if not op._schema.returns:
        return None
    return written[0] if len(op._schema.returns) == 1 else tuple(written)


def _set_wrapper_sizes(dtensor: DTensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """Give a DTensor's wrapper new sizes without dispatching (as `return_and_correct_aliasing` does
    for `squeeze_`): its shape and strides are what torch code reads next."""
    with torch.utils._mode_utils.no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            torch.ops.aten.resize_.default(dtensor, shape)
            torch.ops.aten.as_strided_.default(dtensor, shape, stride)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _local_flat(flat: list, local_arguments: tuple[tuple, dict]) -> tuple[list, object]:
    """The rule's local arguments with its placeholders replaced by the call's tensors, in order."""
    tensors = [value for value in flat if isinstance(value, torch.Tensor)]
    local_flat, tree = tree_flatten(local_arguments)
    local_flat = [tensors.pop(0) if isinstance(value, (TensorMeta, PlainTensor)) else value for value in local_flat]
    return local_flat, tree


def _fallback(op, flat, tree, positions, dtensors, mutated, mesh):
    """No rule: gather every input to Replicate, compute the single-device result, return it."""
    if _is_strict():
        raise NotImplementedError(
            f"{op} has no sharding rule and strict mode forbids the replicate fallback (inputs: "
            f"{_describe(dtensors)}); redistribute the inputs to Replicate yourself, add a rule "
            f"(shardtensor.experimental.register_sharding), or leave strict mode "
            f"(shardtensor.strict_mode / SHARDTENSOR_STRICT=1)"
        )
    replicated = [d.sharding.with_placements([Replicate()] * d.sharding.mesh_ndim) for d in dtensors]
    if _is_explicit() and any(target != d.sharding for d, target in zip(dtensors, replicated)):
        raise _implicit_communication_error(op, dtensors, replicated, "it has no sharding rule: replicate fallback")
    if mesh.get_coordinate() is None:
        return _outside_mesh(op, flat, tree, positions, dtensors, mesh, None)
    name = str(op)
    if name not in fallback_counts:
        logger.info("%s has no sharding rule: gathering its inputs (%s) to Replicate", name, _describe(dtensors))
    fallback_counts[name] += 1
    return _run(op, flat, tree, positions, dtensors, mutated, mesh, replicated, None, None)


def _outside_mesh(op, flat, tree, positions, dtensors, mesh, output_layouts):
    """The op on a rank outside the mesh: no data and no communication, only metadata.

    The op runs on meta tensors of the global shapes; outputs are DTensors with the layouts the
    mesh's ranks get (`output_layouts`, or the fallback's when None) and a local tensor without
    elements, and in-place or `out=` ops return their DTensor argument.
    """
    meta_flat, arguments = list(flat), {}
    for index, dtensor in zip(positions, dtensors):
        meta_flat[index] = torch.empty_strided(dtensor.shape, dtensor.stride(), dtype=dtensor.dtype, device="meta")
        arguments[id(meta_flat[index])] = dtensor
    meta_args, meta_kwargs = tree_unflatten(meta_flat, tree)
    outputs, output_tree = tree_flatten(op(*meta_args, **meta_kwargs))
    wrapped = []
    for position, output in enumerate(outputs):
        if not isinstance(output, torch.Tensor) or id(output) in arguments:
            wrapped.append(arguments.get(id(output), output))
            continue
        if output_layouts is not None:
            layout = output_layouts[position]
        elif tuple(output.shape) == tuple(dtensors[0].shape):
            layout = without_partial(dtensors[0].sharding)
        else:
            layout = Layout.create(mesh.shape, [Replicate()] * mesh.ndim, output.shape)
        local = torch.empty((0,) * max(output.ndim, 1), dtype=output.dtype, device=mesh.device_type)
        wrapped.append(DTensor(local, DTensorSpec(mesh, layout, tuple(output.stride()), output.dtype)))
    return tree_unflatten(wrapped, output_tree)


def _run(op, flat, tree, positions, dtensors, mutated, mesh, input_layouts, output_layouts, output_metas, local_op=None):
    """Move inputs to `input_layouts`, run the local op, write back mutated inputs, wrap outputs.

    `output_layouts is None` means fallback outputs: Replicate, or the first input's layout (with
    Partial read as Replicate) when the output has the first input's shape.
    """
    local_flat = list(flat)
    moved = False
    copies: dict[int, tuple[DTensor, Layout, torch.Tensor]] = {}  # id(copy) -> (mutated DTensor, copy's layout, copy)
    passed_through: dict[int, DTensor] = {}
    mutated_ids = {id(dtensor) for dtensor in mutated}
    for index, dtensor, target in zip(positions, dtensors, input_layouts):
        local = dtensor._local_tensor
        if target != dtensor.sharding:
            moved = True
            if id(dtensor) in mutated_ids:
                local = redistribute_local_tensor(local, dtensor.sharding, target, mesh)
                copies[id(local)] = (dtensor, target, local)
            else:
                local = moved_local(dtensor, target, mesh)
        else:
            passed_through[id(local)] = dtensor
        local_flat[index] = local
    local_args, local_kwargs = tree_unflatten(local_flat, tree)
    result = op(*local_args, **local_kwargs) if local_op is None else local_op(mesh, *local_args, **local_kwargs)
    for dtensor, layout, local in copies.values():
        _write_back(op, dtensor, local, layout, mesh)
    outputs, output_tree = tree_flatten(result)
    wrapped = []
    for position, output in enumerate(outputs):
        if not isinstance(output, torch.Tensor):
            wrapped.append(output)
        elif id(output) in passed_through:
            wrapped.append(passed_through[id(output)])
        elif id(output) in copies:
            wrapped.append(copies[id(output)][0])
        elif output_layouts is None:
            wrapped.append(_wrap_fallback_output(output, dtensors[0], mesh))
        else:
            meta = output_metas[position]
            wrapped.append(DTensor(output, DTensorSpec(mesh, output_layouts[position], meta.stride, meta.dtype)))
    result = tree_unflatten(wrapped, output_tree)
    return _mark_views_of_copies(result) if moved and _returns_view(op) else result


_returns_view_by_op: dict = {}


def _returns_view(op) -> bool:
    """Whether the op's result aliases an input (`diagonal`, `view`, `as_strided`, ...).

    `_unsafe_view` returns a view its schema does not declare: `kron(..., out=out)` writes through
    `out._unsafe_view(...)`, and such a write must not be lost in a moved copy.
    """
    known = _returns_view_by_op.get(op)
    if known is None:
        known = op is torch.ops.aten._unsafe_view.default or any(
            returned.alias_info is not None and not returned.alias_info.is_write for returned in op._schema.returns
        )
        _returns_view_by_op[op] = known
    return known


def _mark_views_of_copies(result):
    """A view op whose input had to move returns a view of the moved copy, not of the input: mark it.

    Reading it is exact; writing into it in place would never reach the input, so such writes raise
    (`_refuse_writes_into_views_of_copies`) instead of being silently lost.
    """
    for output in tree_flatten(result)[0]:
        if isinstance(output, DTensor):
            output._view_of_copy = True
    return result


def _refuse_writes_into_views_of_copies(op, mutated: list) -> None:
    for dtensor in mutated:
        if getattr(dtensor, "_view_of_copy", False):
            raise RuntimeError(
                f"{op} writes in place into a DTensor that is a view of a redistributed copy (a view op "
                f"whose input had to move, e.g. through the replicate fallback): the write would not reach "
                f"the tensor it views. Placements of the view: {list(dtensor.placements)}. Redistribute the "
                f"base tensor to a layout the view op keeps (often Replicate) before taking the view, or "
                f"write with an out-of-place op and copy_ into the base"
            )


def _write_back(op, dtensor: DTensor, local: torch.Tensor, layout: Layout, mesh) -> None:
    """An in-place op ran on a redistributed copy: store the new value into the DTensor's own shard."""
    target = without_partial(dtensor.sharding)
    if tuple(local.shape) != layout.local_shape(mesh.get_coordinate()):
        raise NotImplementedError(f"{op} changed the shape of a DTensor in place; this is not supported")
    value = redistribute_local_tensor(local, layout, target, mesh) if layout != target else local
    dtensor._local_tensor.copy_(partial_from_replicate(value, dtensor.sharding, mesh))


def _wrap_fallback_output(output: torch.Tensor, first: DTensor, mesh) -> DTensor:
    replicate = Layout.create(first.sharding.mesh_shape, [Replicate()] * first.sharding.mesh_ndim, output.shape)
    spec = DTensorSpec(mesh, replicate, tuple(output.stride()), output.dtype)
    if tuple(output.shape) != tuple(first.shape):
        return DTensor(output, spec)
    target = without_partial(first.sharding)
    if target == replicate:
        return DTensor(output, spec)
    local = redistribute_local_tensor(output, replicate, target, mesh)
    return DTensor(local, DTensorSpec(mesh, target, tuple(output.stride()), output.dtype))


def _inplace_view(op, args: tuple, kwargs: dict):
    """`squeeze_`, `unsqueeze_`, `transpose_`, `t_`...: change a DTensor's shape in place.

    Runs the out-of-place view through its own rule, then gives the DTensor that result's shard and
    spec, and its wrapper the new sizes (matmul of a vector ends in `squeeze_(0)`).
    """
    # The packet picks the overload: `transpose_.default` corresponds to `transpose.int`.
    out_of_place = getattr(torch.ops.aten, op._schema.name.split("::")[1].rstrip("_"))
    view = out_of_place(*args, **kwargs)
    dtensor = args[0]
    dtensor._take_value_of(view)
    return return_and_correct_aliasing(op, args, kwargs, dtensor)
