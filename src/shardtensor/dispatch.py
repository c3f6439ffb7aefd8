"""Run a torch op on DTensors: unwrap, decide layouts, redistribute, run locally, wrap.

`DTensor.__torch_dispatch__` is `dispatch`. A call whose key finds a plan in `plan_cache` runs
from it (the hot path). On a miss, an op with a rule in `ops.registry.RULES` gets a (cached)
decision from `propagation.decide`, which is stored as a plan when the call is flat; an op without
one (or whose rule has no sharded way for this call: `rules.ReplicateFallback`) goes to the fallback,
which gathers every input to Replicate, runs the op on full tensors and returns the single-device
result, logged once per op and counted in `fallback_counts`. The
switches that refuse the fallback or implicit communication are in `modes`; writes into DTensors
(in-place, `out=`, in-place views) in `write_back`.

This layer is below the DTensor class: the class passes itself (`dtensor_class`) through its hook.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter

import torch
from torch._C import _increment_version
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from . import ops  # noqa: F401  (registers every op family)
from . import plan_cache, propagation
from .handlers import DISPATCH_HANDLERS, dispatch_handler, run_handler
from .input_moves import KeptMoves, moved_local, moved_locals, with_kept_moves
from .layout import Layout
from .list_plans import ListPlan, is_multi_tensor, list_key
from .modes import describe, implicit_communication_error, is_explicit, is_strict
from .ops.common import meta_like
from .ops.foreach import canonical_arguments
from .ops.registry import RULES, functional_overload
from .ops.sparse import sparse_layout_error
from .placement import Replicate
from .plain_tensors import created_by_torch, value_sign
from .plan_cache import (
    Plan, counts_of, fast_key, key_modes, plans, reads_scale_signs, record, recording, strip_values, template,
)
from .propagation import decide
from .propagation import key_modes as key_modes_by_op
from .random import same_draws_on_every_rank, skip_random_calls
from .redistribute import redistribute_local_tensor
from .rules import OpCall, PlainTensor, ReplicateFallback, ResizesWritten, TensorMeta
from .spec import DTensorSpec
from .sub_mesh import has_ranks_outside, received_from_mesh, sent_to_world
from .write_back import (
    copy_source, inplace_view, mark_views_of_copies, mutated, returns_view, write_back, write_resized, write_through,
    writes, written, written_copy_sources,
)

__all__ = ["dispatch", "fallback_counts"]

logger = logging.getLogger(__name__)

# How often each op (by name) went through the replicate fallback in this process.
fallback_counts: Counter[str] = Counter()

_NO_KEYWORDS: dict = {}


def dispatch(dtensor_class: type, op, types, args: tuple = (), kwargs: dict | None = None):
    """`DTensor.__torch_dispatch__`: run `op` on DTensor arguments and return DTensor results (the
    single-device value)."""
    if kwargs is None:
        kwargs = _NO_KEYWORDS
    if DISPATCH_HANDLERS:  # the user's handler comes first (`handlers.py`)
        handler = dispatch_handler(op)
        if handler is not None:
            if recording:  # a public call that ran a handler is never learnt as a function plan
                record(None, args, kwargs)
            return run_handler(op, handler, args, kwargs)
    if KeptMoves.count:  # a Partial input reduced before is seen where it was moved (`input_moves`)
        args, kwargs = with_kept_moves(dtensor_class, op, args, kwargs)
    key = fast_key(dtensor_class, op, args, kwargs)
    if key is None and is_multi_tensor(op):
        key = list_key(dtensor_class, op, args, kwargs)
    if key is not None:
        plan = plans.get(key)
        if plan is None:  # the plan may be stored without the values that do not decide
            plan = plans.get(_value_free_key(dtensor_class, op, args, kwargs))
        if plan is not None and plan.generation == propagation.generation:
            plan.used = True
            plan.counts.hits += 1
            if recording:
                record(plan, args, kwargs)
            return plan.run(args, kwargs)
    if recording:
        record(None, args, kwargs)
    counts_of(op).misses += 1
    return _dispatch_slowly(dtensor_class, op, args, kwargs, key)


def _value_free_key(dtensor_class: type, op, args: tuple, kwargs: dict) -> tuple | None:
    """The call's key without the values that do not decide (None when every value decides)."""
    modes = key_modes_by_op.get(op)
    if modes is None:
        modes = key_modes(op)
    return fast_key(dtensor_class, op, args, kwargs, modes) if modes else None


def _common_mesh(op, dtensors: list):
    mesh = dtensors[0].device_mesh
    for other in dtensors[1:]:
        if other.device_mesh != mesh:
            raise ValueError(
                f"{op}: DTensor arguments live on different meshes, {mesh!r} and {other.device_mesh!r}; "
                f"all DTensors of one op must share a mesh: redistribute one of them onto the other's "
                f"mesh first (x.redistribute(other.device_mesh, placements))"
            )
    return mesh


def _plain_tensors_as_replicate(dtensor_class: type, op, flat: list, mesh, accepted: bool,
                                written_ids: frozenset = frozenset()) -> None:
    """Refuse plain tensors of more than one element, or (for rules that accept them) make them Replicate;
    refuse sparse ones.

    A one-element plain tensor of any shape (`torch.masked.var` divides by a (1, 1, 1) count it builds
    from the global shape) is read as Replicate, as a 0-d one is read as a scalar and as PyTorch's
    DTensor reads it. Inside a backward formula every op accepts them: autograd formulas build plain
    tensors from global sizes only (`torch.ones` in prod's, `zeros` in cumprod's), so they are equal on every rank.
    A plain tensor the op writes to (ids in `written_ids`, 0-d too) becomes Replicate: it must receive the
    full value, not this rank's shard or partial sum.
    """
    accepted = accepted or torch._C._current_autograd_node() is not None
    for index, value in enumerate(flat):
        if not isinstance(value, torch.Tensor) or isinstance(value, dtensor_class):
            continue
        if value.layout != torch.strided:
            raise sparse_layout_error(op, f"got a plain {value.layout} tensor of shape {tuple(value.shape)} mixed with DTensors")
        if value.ndim > 0 or id(value) in written_ids:
            if accepted or value.numel() == 1 or created_by_torch(value):
                layout = Layout.create(mesh.shape, [Replicate()] * mesh.ndim, value.shape)
                flat[index] = dtensor_class(value, DTensorSpec(mesh, layout, tuple(value.stride()), value.dtype))
                continue
            # Not a TypeError: torch turns a TypeError in an operator into NotImplemented and the message is lost.
            raise RuntimeError(
                f"{op}: got a plain torch.Tensor of shape {tuple(value.shape)} mixed with DTensors; only "
                f"Python scalars and one-element tensors may be mixed in. Make it a DTensor first, e.g. "
                f"distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim) or DTensor.from_local(...)"
            )


def _frozen(value, read_signs: bool):
    """A call's non-tensor argument as a hashable value: lists become tuples (at any depth), a 0-d
    plain tensor its `PlainTensor` (its dtype, and with `read_signs` the sign of its value: see
    `plain_tensors.scale_signs`, which keys plans by the same signs)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item, read_signs) for item in value)
    if isinstance(value, torch.Tensor):
        return PlainTensor(value.dtype, value_sign(value)) if read_signs else PlainTensor(value.dtype)
    return value


def _decision_cache_key(op, layouts, call: OpCall, coordinate: tuple[int, ...] | None, flat: list, modes: tuple):
    """What a decision depends on. The type of every argument is in it because 2, 2.0 and True are
    equal keys but give other dtypes; the values that decide (`modes`); the coordinate because local
    arguments and local ops are this rank's, and two meshes of one shape may place this rank at
    different coordinates."""
    types = tuple(type(value) for value in flat)
    partial_input = any(layout.partial_mesh_dims() for layout in layouts)
    args, kwargs = strip_values(call.args, call.kwargs, modes, partial_input)
    if is_multi_tensor(op):  # its rules read scalars' signs only: Adam's new step sizes must not miss
        args, kwargs = canonical_arguments(args), canonical_arguments(kwargs)
    key = (op, tuple(layouts), call.inputs, args, kwargs, types, coordinate)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _value_keys_error(op, rule) -> RuntimeError:
    return RuntimeError(
        f"the sharding rule of {op} ({getattr(rule, '__name__', type(rule).__name__)}) declares that the values of "
        f"{sorted(rule.value_keys)} do not decide, but it builds local arguments or a local op, which would keep "
        f"the first call's values for every later call; leave those arguments out of its value_keys"
    )


def _process_group_call_error(op) -> TypeError:
    return TypeError(
        f"{op} got a DTensor: torch.distributed's own collectives and point-to-point calls (send, recv, isend, "
        f"batch_isend_irecv, a pipeline stage's hand-off, all_reduce, ...) move plain tensors, and a DTensor's "
        f"value is spread over the ranks of its mesh (gathering it there first would hang a peer outside the mesh). "
        f"Send this rank's shard, dtensor.to_local(), and rebuild it on the receiving ranks with "
        f"DTensor.from_local(local, mesh, placements, shape=..., stride=...), or send dtensor.full_tensor(); "
        f"over a DTensor's own mesh use redistribute() or shardtensor.comm"
    )


def _dispatch_slowly(dtensor_class: type, op, args: tuple, kwargs: dict, key: tuple | None):
    """The miss path: flatten the arguments, decide (or fall back), run, and store a plan; what the op
    wrote into views of moved copies is then stored into the tensors they view."""
    if op.namespace == "c10d":  # a process group's own call: no layout to decide, and the fallback's gather hangs
        raise _process_group_call_error(op)
    if torch.Tag.inplace_view in op.tags:
        return inplace_view(op, args, kwargs)
    sources = written_copy_sources(dtensor_class, op, args, kwargs) if writes(op) else ()
    generations = [source.generation for source in sources]
    result = _decide_and_run(dtensor_class, op, args, kwargs, key)
    # A plan built and run here has stored its copies already (their generation moved): not twice.
    unstored = [source for source, generation in zip(sources, generations) if source.generation == generation]
    if unstored:
        write_through(op, unstored)
    return result


def _decide_and_run(dtensor_class: type, op, args: tuple, kwargs: dict, key: tuple | None):
    flat, tree = tree_flatten((args, kwargs))
    positions = [index for index, value in enumerate(flat) if isinstance(value, dtensor_class)]
    mesh = _common_mesh(op, [flat[index] for index in positions])
    mesh.check_world(op)  # a DTensor of a destroyed world (plans are forgotten with the world)
    rule = RULES.get(op)
    written_ids = frozenset(id(value) for value in written(op, args, kwargs) if not isinstance(value, dtensor_class))
    if written_ids and not is_multi_tensor(op):  # a plan would run the op on the plain tensor itself, without
        key = None  # the write-back `_run` does (a list plan passes plain tensors on untouched: they must not move)
    _plain_tensors_as_replicate(dtensor_class, op, flat, mesh, getattr(rule, "accepts_plain_tensors", False), written_ids)
    positions = [index for index, value in enumerate(flat) if isinstance(value, dtensor_class)]
    dtensors = [flat[index] for index in positions]
    # After the wrapping: a plain tensor the op writes to (`out=` of a buffer in a backward formula)
    # is written through its Replicate wrapper, which `_run` must write back when it moves.
    mutated_dtensors = mutated(dtensor_class, op, *tree_unflatten(flat, tree))
    if rule is None:
        functional = functional_overload(op)
        if functional is not None and _shapes_depend_on_data(op, flat, tree, positions, dtensors):
            # `nonzero(x, out=y)`: torch resizes `y` to a shape of the data's, which the fallback's write
            # into `y`'s own shard cannot do: the functional op's result is given to `y` (on every rank)
            return write_resized(dtensor_class, op, args, kwargs, *tree_unflatten(flat, tree), functional)
        return _fallback(dtensor_class, op, flat, tree, positions, dtensors, mutated_dtensors, mesh)
    metas = tuple(TensorMeta(tuple(dtensor.shape), dtensor._spec.stride, dtensor.dtype) for dtensor in dtensors)
    stand_ins = list(flat)
    for index, meta in zip(positions, metas):
        stand_ins[index] = meta
    call_args, call_kwargs = tree_unflatten(stand_ins, tree)
    # Keywords in the call's order, not sorted: placeholders are matched to the call's tensors in
    # flattened order (`_local_flat`, plans, the per-coordinate meta evaluation), and sorting swapped
    # two tensor keywords such as `frexp.Tensor_out`'s `mantissa` and `exponent`.
    layouts = [dtensor.sharding for dtensor in dtensors]
    if key is not None and any(layout.is_symbolic for layout in layouts):  # the symbols of one trace: no plan keeps them
        key = None
    read_signs = reads_scale_signs(op) and any(layout.partial_mesh_dims() for layout in layouts)
    call = OpCall(op, metas, _frozen(call_args, read_signs),
                  tuple((name, _frozen(value, read_signs)) for name, value in call_kwargs.items()))
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: the layouts the mesh's ranks get, no data
        try:
            decision = decide(call, layouts, rule, (0,) * mesh.ndim, None)
        except ReplicateFallback as verdict:
            return _fallback(dtensor_class, op, flat, tree, positions, dtensors, mutated_dtensors, mesh, verdict)
        except ResizesWritten as resize:  # as on the mesh: the functional op, given to the written tensors
            return write_resized(dtensor_class, op, args, kwargs, *tree_unflatten(flat, tree), resize.functional_op)
        if is_explicit() and (decision.moves_inputs(layouts) or decision.local_collectives):  # as on the mesh
            raise implicit_communication_error(
                op, dtensors, decision.input_layouts, "its sharding rule needs other layouts or communicates",
                decision.local_collectives,
            )
        if rule.returns_value:  # read from the data: the mesh's first rank sends it
            return received_from_mesh(mesh, op)
        return _outside_mesh(dtensor_class, op, flat, tree, positions, dtensors, mesh, decision.output_layouts,
                             rule.random_calls(call), decision.output_metas)
    coordinate = tuple(coordinate)
    modes = key_modes(op)
    try:
        decision = decide(call, layouts, rule, coordinate, _decision_cache_key(op, layouts, call, coordinate, flat, modes))
    except ReplicateFallback as verdict:  # every rank reaches the same verdict: the replicate fallback computes it
        return _fallback(dtensor_class, op, flat, tree, positions, dtensors, mutated_dtensors, mesh, verdict)
    except ResizesWritten as resize:
        return write_resized(dtensor_class, op, args, kwargs, *tree_unflatten(flat, tree), resize.functional_op)
    sends_value = rule.returns_value and has_ranks_outside(mesh)
    if sends_value:  # every call sends its value to the ranks outside the mesh, which a plan would not do
        key = None
    if modes and (decision.local_arguments is not None or (decision.local_op is not None and not rule.local_op_reads_values)):
        raise _value_keys_error(op, rule)
    if key is not None and is_multi_tensor(op):
        list_plan = ListPlan.build(dtensor_class, op, rule, mesh, args, kwargs, flat, decision)
        if list_plan is not None:
            plan_cache.store(key, list_plan)
            return list_plan.run(args, kwargs)
    elif key is not None:
        local_template = None if decision.local_arguments is None else template(decision, args, kwargs)
        if decision.local_arguments is None or local_template is not None:
            plan = Plan(dtensor_class, op, mesh, args, kwargs, decision, writes(op), local_template)
            plan_cache.store(key, plan)
            if modes:
                plan_cache.store(_value_free_key(dtensor_class, op, args, kwargs), plan)
            return plan.run(args, kwargs)
    if is_explicit() and (decision.moves_inputs(layouts) or decision.local_collectives):
        raise implicit_communication_error(
            op, dtensors, decision.input_layouts, "its sharding rule needs other layouts or communicates",
            decision.local_collectives,
        )
    if decision.local_arguments is not None:
        flat, tree = _local_flat(flat, decision.local_arguments)
        positions = [index for index, value in enumerate(flat) if isinstance(value, dtensor_class)]
    run = functools.partial(_run, dtensor_class, op, flat, tree, positions, dtensors, mutated_dtensors, mesh,
                            decision.input_layouts, decision.output_layouts, decision.output_metas, decision.local_op)
    return sent_to_world(mesh, run) if sends_value else run()


def _local_flat(flat: list, local_arguments: tuple[tuple, dict]) -> tuple[list, object]:
    """The rule's local arguments with its placeholders replaced by the call's tensors, in order."""
    tensors = [value for value in flat if isinstance(value, torch.Tensor)]
    local_flat, tree = tree_flatten(local_arguments)
    local_flat = [tensors.pop(0) if isinstance(value, (TensorMeta, PlainTensor)) else value for value in local_flat]
    return local_flat, tree


def _fallback(dtensor_class: type, op, flat, tree, positions, dtensors, mutated_dtensors, mesh,
              verdict: ReplicateFallback | None = None):
    """No rule (or a rule's `verdict`): gather every input to Replicate, compute the single-device result,
    return it. On a mesh that may have ranks outside (`sub_mesh.has_ranks_outside`), an op whose output
    shapes depend on data (`_output_metas` is None) sends them to those ranks, which cannot compute them."""
    why = "has no sharding rule" if verdict is None else f"has no sharded way for these arguments ({verdict})"
    if is_strict():
        raise NotImplementedError(
            f"{op} {why} and strict mode forbids the replicate fallback (inputs: "
            f"{describe(dtensors)}); redistribute the inputs to Replicate yourself, add a rule "
            f"(shardtensor.experimental.register_sharding), or leave strict mode "
            f"(shardtensor.strict_mode / SHARDTENSOR_STRICT=1)"
        )
    replicated = [d.sharding.with_placements([Replicate()] * d.sharding.mesh_ndim) for d in dtensors]
    if is_explicit() and any(target != d.sharding for d, target in zip(dtensors, replicated)):
        raise implicit_communication_error(op, dtensors, replicated, f"it {why}: replicate fallback")
    draws = verdict.draws if verdict is not None else None
    if draws is None:
        draws = torch.Tag.nondeterministic_seeded in op.tags  # every rank computes the whole op: draw alike
    if mesh.get_coordinate() is None:
        return _outside_mesh(dtensor_class, op, flat, tree, positions, dtensors, mesh, None, int(draws))
    name = str(op)
    if name not in fallback_counts:
        logger.info("%s %s: gathering its inputs (%s) to Replicate", name, why, describe(dtensors))
    fallback_counts[name] += 1
    data_dependent = has_ranks_outside(mesh) and _shapes_depend_on_data(op, flat, tree, positions, dtensors)

    def run():
        with same_draws_on_every_rank(mesh) if draws else contextlib.nullcontext():
            return _run(dtensor_class, op, flat, tree, positions, dtensors, mutated_dtensors, mesh, replicated, None, None)

    if data_dependent:  # the ranks outside the mesh wait for the outputs' shapes (or the op's error)
        return sent_to_world(mesh, run, functools.partial(tree_map_only, dtensor_class, _global_meta))
    return run()


def _output_metas(op, flat, tree, positions, dtensors) -> tuple[object, dict[int, object]] | None:
    """The op's outputs on meta tensors of the global shapes, and its DTensor arguments by the id of
    their meta stand-ins; None when meta tensors cannot say the outputs' shapes (`nonzero`,
    `unique`, boolean-mask indexing: they depend on the data)."""
    meta_flat, arguments = list(flat), {}
    for index, dtensor in zip(positions, dtensors):
        meta_flat[index] = meta_like(dtensor)
        arguments[id(meta_flat[index])] = dtensor
    meta_args, meta_kwargs = tree_unflatten(meta_flat, tree)
    try:
        return op(*meta_args, **meta_kwargs), arguments
    except NotImplementedError:
        return None


def _shapes_depend_on_data(op, flat, tree, positions, dtensors) -> bool:
    """Whether meta tensors cannot say the op's output shapes, so that the ranks outside a sub-mesh wait
    for them: asked before the op runs, on the global shapes every rank has. Another error on meta
    tensors is not that (the ranks outside raise it without waiting)."""
    try:
        return _output_metas(op, flat, tree, positions, dtensors) is None
    except Exception:
        return False


def _global_meta(dtensor) -> TensorMeta:
    return TensorMeta(tuple(dtensor.shape), dtensor._spec.stride, dtensor.dtype)


def _outside_mesh(dtensor_class: type, op, flat, tree, positions, dtensors, mesh, output_layouts, random_calls: int,
                  output_metas: tuple | None = None):
    """The op on a rank outside the mesh: no data, only metadata.

    The op runs on meta tensors of the global shapes; outputs are DTensors with the layouts the
    mesh's ranks get (`output_layouts`, or the fallback's when None) and a local tensor without
    elements, and in-place or `out=` ops return their DTensor argument. Where meta tensors cannot
    run the op, a rule's decision has the outputs' metadata (`output_metas`: `histogram`'s rule says
    them); without a rule the output shapes depend on data and the mesh's first rank sends them,
    the one communication of this path. A random op takes its `random_calls` numbers of the random
    counter as the mesh's ranks do, so the counter stays in step.
    """
    skip_random_calls(mesh, random_calls)
    computed = _output_metas(op, flat, tree, positions, dtensors)
    if computed is None and output_metas is not None:
        computed = (output_metas[0] if len(output_metas) == 1 else tuple(output_metas)), {}
    elif computed is None:
        computed = received_from_mesh(mesh, op), {}
    result, arguments = computed
    outputs, output_tree = tree_flatten(result)
    wrapped = []
    for position, output in enumerate(outputs):
        if isinstance(output, torch.Tensor) and id(output) not in arguments:
            output = TensorMeta(tuple(output.shape), tuple(output.stride()), output.dtype)
        if not isinstance(output, TensorMeta):
            wrapped.append(arguments.get(id(output), output))
            continue
        if output_layouts is not None:
            layout = output_layouts[position]
        elif output.shape == tuple(dtensors[0].shape):
            layout = dtensors[0].sharding.without_partial()
        else:
            layout = Layout.create(mesh.shape, [Replicate()] * mesh.ndim, output.shape)
        local = torch.empty((0,) * max(output.ndim, 1), dtype=output.dtype, device=mesh.device_type)
        wrapped.append(dtensor_class(local, DTensorSpec(mesh, layout, output.stride, output.dtype)))
    return tree_unflatten(wrapped, output_tree)


def _run(dtensor_class: type, op, flat, tree, positions, dtensors, mutated_dtensors, mesh, input_layouts, output_layouts,
         output_metas, local_op=None):
    """Move inputs to `input_layouts`, run the local op, write back mutated inputs, wrap outputs.

    `output_layouts is None` means fallback outputs: Replicate, or the first input's layout (with
    Partial read as Replicate) when the output has the first input's shape.
    """
    local_flat = list(flat)
    moved = False
    copies: dict[int, tuple[object, Layout, torch.Tensor]] = {}  # id(copy) -> (mutated DTensor, copy's layout, copy)
    passed_through: dict[int, object] = {}
    mutated_ids = {id(dtensor) for dtensor in mutated_dtensors}
    moving = {(id(dtensor), target): (dtensor, target, id(dtensor) in mutated_ids)
              for dtensor, target in zip(dtensors, input_layouts) if target != dtensor.sharding}
    moved_inputs = {}  # Partial inputs needing only an all_reduce are reduced together
    if len(moving) > 1:
        moved_inputs = dict(zip(moving, moved_locals(*zip(*moving.values()), mesh)))
    for index, dtensor, target in zip(positions, dtensors, input_layouts):
        local = dtensor._local_tensor
        if target != dtensor.sharding:
            moved = True
            local = moved_inputs.get((id(dtensor), target))
            if id(dtensor) in mutated_ids:
                if local is None:
                    local = redistribute_local_tensor(dtensor._local_tensor, dtensor.sharding, target, mesh)
                copies[id(local)] = (dtensor, target, local)
            elif local is None:
                local = moved_local(dtensor, target, mesh)
        else:
            passed_through[id(local)] = dtensor
        local_flat[index] = local
    local_args, local_kwargs = tree_unflatten(local_flat, tree)
    result = op(*local_args, **local_kwargs) if local_op is None else local_op(mesh, *local_args, **local_kwargs)
    for dtensor, layout, local in copies.values():
        write_back(op, dtensor, local, layout, mesh)
    if mutated_dtensors and is_multi_tensor(op):  # the dispatcher does not count these writes (see ListPlan)
        _increment_version(list(mutated_dtensors))
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
            wrapped.append(_wrap_fallback_output(dtensor_class, output, dtensors[0], mesh))
        else:
            meta = output_metas[position]
            wrapped.append(dtensor_class(output, DTensorSpec(mesh, output_layouts[position], meta.stride, meta.dtype)))
    result = tree_unflatten(wrapped, output_tree)
    if not returns_view(op):
        return result
    return mark_views_of_copies(dtensor_class, result, copy_source(dtensors[0], local_flat[positions[0]], input_layouts[0]))


def _wrap_fallback_output(dtensor_class: type, output: torch.Tensor, first, mesh):
    replicate = Layout.create(first.sharding.mesh_shape, [Replicate()] * first.sharding.mesh_ndim, output.shape)
    spec = DTensorSpec(mesh, replicate, tuple(output.stride()), output.dtype)
    if tuple(output.shape) != tuple(first.shape):
        return dtensor_class(output, spec)
    target = first.sharding.without_partial()
    if target == replicate:
        return dtensor_class(output, spec)
    local = redistribute_local_tensor(output, replicate, target, mesh)
    return dtensor_class(local, DTensorSpec(mesh, target, tuple(output.stride()), output.dtype))
