"""Public torch functions on DTensors: the `__torch_function__` layer, above `dispatch`.

`DTensor.__torch_function__` is `torch_function`, called for every public torch function, method
and operator that gets a DTensor argument, except the metadata reads (`.shape`, `.requires_grad`,
`.size()`...) and views (`.t()`, `.view()`, `x[1:]`...) that `tensor_methods.FastTensorMethods`
defines on the class (they run torch's own code, minus a `__torch_function__` round trip).
It does three things before the call reaches the aten level:

- **Fast path.** A call that records no autograd history (grad mode off, or no DTensor argument
  requires grad), runs under no dispatch mode or autocast, and is known to run exactly one aten op
  whose cached plan computes locally (no redistribution, no rule-specific local op or arguments, no
  view, no `out=` write, not random) is served here: the same public function runs on the local
  tensors and its result is wrapped with the plan's output spec. That skips the C++ dispatcher
  round trip into Python, the aten-level argument normalisation and the plan key of `dispatch`.
  An in-place call (`p.mul_(s)`, `x += y`: the op writes only its first argument, which it returns,
  where it lies) returns that DTensor after bumping its version counter, as the dispatcher's
  ADInplaceOrView kernel does (autograd's saved-tensor checks and kept moves read it); a write into
  a view of a moved copy takes the normal path, which stores it into the copy's base. Reads of such a
  view refresh it from its base where they read its shard (`DTensor._local_tensor`). A function is learnt on a call
  that runs through `dispatch` on cached plans only (`plan_cache.recording`), and checked once by
  running it on the local tensors (in place: on meta stand-ins of them, so the check neither writes
  the DTensor a second time nor allocates a copy of it): it must run the same single
  aten op and give a local result of the same shape, stride and dtype (in place: its first argument).
  A 0-d plain tensor argument (`x * torch.tensor(2.0)`) is passed on as it is: like the aten plan's,
  the function's key holds its dtype, and next to a Partial its sign, not its value.
- **Data arguments.** Functions that read a tensor argument's values in C++ before any aten op
  sees it (`tensor_split`'s `indices_or_sections`) get the Python values a DTensor there stands
  for (`_tolist`, the same on every rank of the world); `x.tolist()` itself, which torch refuses
  for tensor subclasses, returns them too.
- **Tensors torch creates.** While the outermost public call runs, plain tensors that torch
  creates inside it from global metadata (the causal mask of `scaled_dot_product_attention`'s
  math path, `combinations`' mask, `matrix_rank`'s tolerance) are read as Replicate
  (`plain_tensors.created_by_torch`): see that function for the exact rule.

Like `dispatch`, this layer is below the DTensor class, which passes itself as `cls`.
"""

from __future__ import annotations

import math
import operator
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import propagation
from .gradients import watch_leaves
from .handlers import FUNCTION_HANDLERS, function_handler, run_handler
from .list_plans import is_multi_tensor_function, learn_function, list_key
from .ops.common import meta_like
from .ops.registry import FUNCTION_REWRITES
from .placement import Replicate
from .plain_tensors import outermost_call
from .plan_cache import (
    Recording, counts_of, fast_key, function_key_modes, function_plans, key_modes, recording, store_function_plan,
)
from .rules import schema_positions
from .spec import DTensorSpec
from .sub_mesh import has_ranks_outside, received_from_mesh, sent_to_world
from .write_back import returns_view, written

__all__ = ["torch_function", "fast_path_enabled"]

_disabled = torch._C.DisableTorchFunctionSubclass
_run_normally = torch._C._disabled_torch_function_impl  # the call with `__torch_function__` off, in C++
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled
_any_requires_grad = torch._C._any_requires_grad  # reads `requires_grad` without coming back here
_increment_version = torch._C._increment_version
_NO_KEYWORDS: dict = {}
_GETTER = types.MethodWrapperType  # `.shape`, `.requires_grad`...: `getset_descriptor.__get__` (or `__set__`)
# `x.data = y` (what `module.to(dtype)` does to every parameter and gradient): equal to every binding of it.
_SET_DATA = vars(torch._C.TensorBase)["data"].__set__


class _FunctionPlan:
    """What a learnt public function needs: where its DTensors are and the spec of its result
    (None: not servable here, but known to run from cached aten plans only); `in_place`: the call
    writes its first argument where it lies and returns it."""

    __slots__ = ("function", "positions", "spec", "in_place", "input_specs", "generation", "counts", "used")

    def __init__(self, cls, function, args: tuple, kwargs: dict, positions: tuple[int, ...], spec: DTensorSpec | None,
                 op=None, in_place: bool = False):
        self.function, self.positions, self.spec, self.in_place = function, positions, spec, in_place
        # A servable plan counts its calls as hits of the one aten op it stands for.
        self.counts, self.used = (None if op is None else counts_of(op)), False
        # The key holds the ids of these specs: keeping them alive keeps the ids from being reused.
        self.input_specs = tuple(value._spec for value in (*args, *kwargs.values()) if isinstance(value, cls))
        self.generation = propagation.generation


# `Module._apply` (`module.double()`) asks this of every parameter with grad mode on, then swaps the
# parameter with its converted copy (`torch.utils.swap_tensors`, for tensor subclasses torch can trace),
# which refuses a tensor holding weak references: watching the leaf here would add one.
_COMPATIBLE_SHALLOW_COPY = torch._has_compatible_shallow_copy_type

# False: every call takes the normal path (tests compare the two; `bench/bench_ops.py` times both).
fast_path_enabled = True


# Functions that read only a tensor's metadata (dtype, global shape), which the spec holds: answered
# from it, as torch answers them from the wrapper (an optimizer asks `torch.is_complex(p)` of every
# parameter on every step: 11 us each through the normal path, 0.6 us here).
METADATA_FUNCTIONS = {
    torch.is_complex: operator.attrgetter("dtype.is_complex"),
    torch.is_floating_point: operator.attrgetter("dtype.is_floating_point"),
    torch.numel: lambda spec: math.prod(spec.layout.shape),
}


def torch_function(cls, function, types, args=(), kwargs=None):
    """`DTensor.__torch_function__`: serve the call from a function plan, or run it normally."""
    if FUNCTION_HANDLERS:  # the user's handler comes first (`handlers.py`)
        handler = function_handler(function)
        if handler is not None:
            return run_handler(function, handler, (function, types, args, kwargs if kwargs is not None else {}), _NO_KEYWORDS)
    if args and ((first := type(args[0])) is list or first is tuple) and is_multi_tensor_function(function):
        # an optimizer's step (lists, or tuples: `_foreach_sqrt` returns one, which optimizers pass on)
        return _multi_tensor_call(cls, function, args, kwargs or _NO_KEYWORDS)
    if type(function) is _GETTER:
        with _disabled():
            result = function(*args)
        if function == _SET_DATA and type(args[1]) is cls:
            args[0]._take_value_of(args[1])  # torch copied the wrapper's metadata; the shard and spec follow
        return result
    if function is _COMPATIBLE_SHALLOW_COPY:  # a metadata query of `Module._apply`: no leaf to watch (see below)
        return _run_normally(function, types, args, kwargs or _NO_KEYWORDS)
    metadata = METADATA_FUNCTIONS.get(function)
    if metadata is not None:
        if len(args) == 1 and not kwargs and type(args[0]) is cls:
            return metadata(args[0]._spec)
        return _run_normally(function, types, args, kwargs or _NO_KEYWORDS)
    if kwargs is None:
        kwargs = _NO_KEYWORDS
    if not kwargs and len(args) == 1 and type(args[0]) is cls:  # `x.relu()`, `x.t()`: no loop
        key = (id(function), id(args[0]._spec))
    else:
        key = fast_key(cls, function, args, kwargs)
    plan = function_plans.get(key) if key is not None else None
    if plan is None and key is not None:  # the plan may be stored without the values that do not decide
        modes = function_key_modes.get((function, len(args)))
        if modes:
            plan = function_plans.get(fast_key(cls, function, args, kwargs, modes))
    if plan is not None and plan.function is function and plan.generation == propagation.generation:
        plan.used = True
        if (
            plan.spec is not None
            and fast_path_enabled
            and not _dispatch_modes()
            and not _autocast()
            and (not _grad_enabled() or not _any_requires_grad(*args))
        ):
            local_args = list(args)
            for position in plan.positions:
                local_args[position] = args[position]._local_tensor
            if not plan.in_place:
                plan.counts.hits += 1
                return cls._wrap(function(*local_args, **kwargs), plan.spec)
            target = args[0]
            if not target._view_of_copy:  # else the normal path stores the copy into its base (`write_through`)
                plan.counts.hits += 1
                function(*local_args, **kwargs)
                _increment_version((target,))  # what the dispatcher's ADInplaceOrView kernel does
                return target
        # Known to run from cached aten plans only, so no plain tensor gets mixed in: no need to
        # mark the call for `created_by_torch`.
        watch_leaves(cls, args, kwargs)
        replicated = _plain_scalars_as_replicate(cls, args, kwargs)
        if replicated is not None:
            return _call(cls, function, *replicated, None)
        return _run_normally(function, types, args, kwargs)
    watch_leaves(cls, args, kwargs)
    replicated = _plain_scalars_as_replicate(cls, args, kwargs)
    if replicated is not None:  # never learnt: the plan would have a DTensor where later calls pass a plain tensor
        return _call(cls, function, *replicated, None)
    return _call(cls, function, args, kwargs, key)


def _plain_scalars_as_replicate(cls, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments with each one-element plain tensor that requires grad made a Replicate DTensor by
    `from_local` (None if there is none). The dispatcher reads such a tensor as Replicate anyway; made
    by `from_local`, its gradient comes back as this rank's plain tensor. So a data-parallel loss plus a
    DTensor term (a penalty on sharded parameters) sends plain gradients into the plain graph that made
    the loss, instead of DTensors that its ops would read its saved, rank-local tensors with as Replicate."""
    # One loop per container and no helper call: this runs on every call that records autograd history.
    for value in args:
        if type(value) is not cls and isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1:
            break
    else:
        for value in kwargs.values():
            if type(value) is not cls and isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1:
                break
        else:
            return None
    if not _grad_enabled():
        return None
    dtensor = next((value for value in (*args, *kwargs.values()) if type(value) is cls), None)
    if dtensor is None:  # the DTensors are nested (`index_put(s, (index,), v)`): the dispatcher reads `s` as Replicate
        return None
    mesh = dtensor.device_mesh

    def replicated(value):
        if type(value) is cls or not isinstance(value, torch.Tensor) or not value.requires_grad or value.numel() != 1:
            return value
        return cls.from_local(value, mesh, [Replicate()] * mesh.ndim, shape=tuple(value.shape))

    return tuple(replicated(value) for value in args), {name: replicated(value) for name, value in kwargs.items()}


def _multi_tensor_call(cls, function, args: tuple, kwargs: dict):
    """`torch._foreach_*` / `torch._fused_*` on DTensor lists: served from a learnt list plan (the
    function runs on the local lists) when no autograd history, mode or autocast is involved, or
    run normally and learnt from the aten list plan it ran (`list_plans`)."""
    key = list_key(cls, function, args, kwargs)
    if key is None:
        return _call(cls, function, args, kwargs, None)
    plan = function_plans.get(key)
    if (
        plan is not None
        and plan.generation == propagation.generation
        and fast_path_enabled
        and not _dispatch_modes()
        and not _autocast()
        and (not _grad_enabled() or not _any_requires_grad(*args))
    ):
        plan.used = True
        plan.counts.hits += 1
        return plan.run(args, kwargs)
    recorded: list = []
    recording.append(recorded)
    try:
        with outermost_call(cls, args, kwargs), _disabled():
            result = function(*args, **kwargs)
    finally:
        recording.pop()
    learn_function(cls, function, key, args, kwargs, recorded, result)
    return result


def _call(cls, function, args: tuple, kwargs: dict, key: tuple | None):
    """The normal path: data arguments read, the call marked as outermost, learnt if it qualifies."""
    if function is torch.Tensor.tolist and len(args) == 1 and not kwargs:
        return _tolist(args[0])
    rewrite = FUNCTION_REWRITES.get(function)
    rewritten = rewrite(args, kwargs) if rewrite is not None else None
    if rewritten is not None:  # never learnt: the function itself would run the decomposition
        function, args, kwargs = rewritten
        key = None
    reader = _DATA_ARGUMENTS.get(function)
    if reader is not None:
        args, kwargs = _read_data_arguments(cls, reader, args, kwargs)
        key = None  # never learnt: every call must read its data arguments first
    with outermost_call(cls, args, kwargs):
        if key is None or _dispatch_modes() or _autocast():
            with _disabled():
                return function(*args, **kwargs)
        recorded = Recording()
        recording.append(recorded)
        try:
            with _disabled():
                result = function(*args, **kwargs)
        finally:
            recording.pop()
    # Every aten op ran from a cached plan: the verdict is final (unless a kept move stood in for an argument).
    if None not in recorded and not _ran_on_kept_moves(cls, args, kwargs, recorded):
        plan = _learn(cls, function, args, kwargs, recorded, result)
        # Later calls that differ only in values that do not decide find this plan too.
        signature = (function, len(args))
        modes = _modes_passed_through(args, kwargs, recorded)
        if function_key_modes.setdefault(signature, modes) != modes:
            function_key_modes[signature] = ()
        store_function_plan(key, plan)
        if function_key_modes[signature]:
            store_function_plan(fast_key(cls, function, args, kwargs, function_key_modes[signature]), plan)
    return result


def _ran_on_kept_moves(cls, args: tuple, kwargs: dict, recorded: Recording) -> bool:
    """Whether the one aten op got a DTensor the call did not pass: a Partial argument's kept move
    (`input_moves.with_kept_moves`), whose plan is for the moved layout, not for the argument's."""
    if len(recorded) != 1:  # the DTensors a later op gets are made by the earlier ones
        return False
    given = {id(value) for value in (*args, *kwargs.values()) if isinstance(value, cls)}
    aten_args, aten_kwargs = recorded.arguments[0]
    return any(isinstance(value, cls) and id(value) not in given for value in (*aten_args, *aten_kwargs.values()))


def _modes_passed_through(args: tuple, kwargs: dict, recorded: Recording) -> tuple:
    """The aten op's key modes (`plan_cache.key_modes`) when the function ran one aten op and passed
    it its own arguments unchanged, position for position and keyword for keyword (torch leaves out
    a keyword equal to its default: `x.add_(y, alpha=1)` reaches aten without `alpha`); else ()."""
    if len(recorded) != 1:
        return ()
    plan, (aten_args, aten_kwargs) = recorded[0], recorded.arguments[0]
    modes = key_modes(plan.op)
    if not modes or len(aten_args) != len(args) or not kwargs.keys() >= aten_kwargs.keys():
        return ()
    schema = schema_positions(plan.op)
    pairs = list(zip(args, aten_args))
    for name, value in kwargs.items():
        if name in aten_kwargs:
            pairs.append((value, aten_kwargs[name]))
        elif name not in schema or isinstance(value, torch.Tensor) or value != schema[name][2]:  # its default
            return ()
    if all(given is passed or (type(given) is type(passed) and not isinstance(given, torch.Tensor) and given == passed)
           for given, passed in pairs):
        return modes
    return ()


class _AtenOps(TorchDispatchMode):
    """The aten ops a call on plain tensors runs (to check a function before it is learnt)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.ops.append(op)
        return op(*args, **(kwargs or {}))


def _learn(cls, function, args: tuple, kwargs: dict, recorded: Recording, result) -> _FunctionPlan:
    """A plan serving the call here if it ran one aten op that computes locally (or writes its first
    argument in place where it lies), else one that only says the call needs no marking."""
    positions = tuple(index for index, value in enumerate(args) if type(value) is cls)
    if len(recorded) != 1 or type(result) is not cls:
        return _FunctionPlan(cls, function, args, kwargs, positions, None)
    plan = recorded[0]
    op = plan.op
    in_place = _writes_first_argument_in_place(plan, args, recorded.arguments[0], result)
    computes_locally = (
        plan.single_spec is not None and plan.simple_positions is not None and result._spec is plan.single_spec
    )
    if (
        not (computes_locally or in_place)
        or not plan.runs_op
        or returns_view(op)
        or torch.Tag.nondeterministic_seeded in op.tags
        or any(isinstance(value, torch.Tensor) for value in kwargs.values())
        or not all(_is_plain_scalar(value) for index, value in enumerate(args)
                   if isinstance(value, torch.Tensor) and index not in positions)
    ):
        return _FunctionPlan(cls, function, args, kwargs, positions, None)
    local_args = list(args)
    for position in positions:
        local_args[position] = args[position]._local_tensor
    if in_place:  # the check must not write the DTensor a second time: meta stand-ins, no data, no copy
        local_args = [meta_like(value) if isinstance(value, torch.Tensor) else value for value in local_args]
    with torch.no_grad(), _AtenOps() as seen:
        local = function(*local_args, **kwargs)
    if seen.ops != [op]:
        return _FunctionPlan(cls, function, args, kwargs, positions, None)
    if in_place:
        served = local is local_args[0]
    else:
        expected = result._local_tensor
        served = (
            type(local) is torch.Tensor
            and local.shape == expected.shape
            and local.stride() == expected.stride()
            and local.dtype == expected.dtype
        )
    if not served:
        return _FunctionPlan(cls, function, args, kwargs, positions, None)
    return _FunctionPlan(cls, function, args, kwargs, positions, result._spec, op, in_place)


def _is_plain_scalar(value: torch.Tensor) -> bool:
    """A 0-d plain tensor, which a plan may pass on as it is: the aten plan read it as a scalar (keyed by
    its dtype, and next to a Partial by its sign: `plan_cache.fast_key`), so its value does not decide."""
    return type(value) is torch.Tensor and value.ndim == 0


def _writes_first_argument_in_place(plan, args: tuple, aten_arguments: tuple[tuple, dict], result) -> bool:
    """Whether the aten plan writes only the call's first argument, a DTensor it returns, where it lies:
    no input moves, no rule-specific local op or arguments, and the layout it keeps."""
    if not plan.mutates or not args or result is not args[0]:
        return False
    targets = written(plan.op, *aten_arguments)
    return (
        len(targets) == 1
        and targets[0] is result
        and not plan.moves
        and not plan.local_collectives
        and plan.local_args is None
        and plan.output_specs == (result._spec,)
    )


# ---- arguments read as data ----------------------------------------------------------------------

# function -> (position, keyword names) of an argument whose values the function reads in C++.
_DATA_ARGUMENTS = {
    torch.tensor_split: (1, ("indices_or_sections", "tensor_indices_or_sections", "indices", "sections")),
    torch.Tensor.tensor_split: (1, ("indices_or_sections", "tensor_indices_or_sections", "indices", "sections")),
}


def _as_values(cls, value):
    """A DTensor argument read as data: the Python value(s) it holds, the same on every rank."""
    return _tolist(value) if isinstance(value, cls) else value


def _tolist(dtensor) -> list:
    """`Tensor.tolist`, which torch refuses for tensor subclasses (torch's DTensor too): the whole
    tensor's values, the same on every rank of the world (on a sub-mesh, its first rank sends them
    to the ranks outside it: their data-free DTensor has no values to list)."""
    mesh = dtensor.device_mesh
    if mesh.get_coordinate() is None:
        return received_from_mesh(mesh, torch.Tensor.tolist)

    def values() -> list:
        full = dtensor.full_tensor()
        with _disabled():
            return full.tolist()

    return sent_to_world(mesh, values) if has_ranks_outside(mesh) else values()


def _read_data_arguments(cls, reader, args: tuple, kwargs: dict):
    position, names = reader
    if len(args) > position and isinstance(args[position], cls):
        args = (*args[:position], _as_values(cls, args[position]), *args[position + 1:])
    for name in names:
        if isinstance(kwargs.get(name), cls):
            kwargs = {**kwargs, name: _as_values(cls, kwargs[name])}
    return args, kwargs
