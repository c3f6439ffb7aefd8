"""Run a torch op on DTensors: unwrap, decide layouts, redistribute, run locally, wrap.

`DTensor.__torch_dispatch__` calls `dispatch`. An op with a rule in `ops.registry.RULES` gets a
(cached) decision from `propagation.decide`; an op without one goes to the fallback, which
gathers every input to Replicate, runs the op on full tensors and returns the single-device
result, logged once per op and counted in `fallback_counts`. Under `strict_mode()` (or with the
environment variable `SHARDTENSOR_STRICT=1`) the fallback raises instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .dtensor import DTensor, DTensorSpec, partial_from_replicate, without_partial
from .layout import Layout
from . import ops  # noqa: F401  (registers every op family)
from .ops.registry import RULES
from .placement import Replicate
from .propagation import OpCall, PlainTensor, TensorMeta, decide
from .redistribute import redistribute_local_tensor

__all__ = ["dispatch", "fallback_counts", "strict_mode"]

logger = logging.getLogger(__name__)

# How often each op (by name) went through the replicate fallback in this process.
fallback_counts: Counter[str] = Counter()

_strict_depth = 0
_mutated_arguments: dict[object, tuple[tuple[int, str], ...]] = {}


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Inside this block an op without a sharding rule raises instead of gathering to Replicate.

    >>> with shardtensor.strict_mode():  # doctest: +SKIP
    ...     torch.mm(a, b)  # NotImplementedError if aten.mm has no rule
    """
    global _strict_depth
    _strict_depth += 1
    try:
        yield
    finally:
        _strict_depth -= 1


def _is_strict() -> bool:
    return _strict_depth > 0 or os.environ.get("SHARDTENSOR_STRICT", "0") not in ("", "0")


def _describe(dtensors: list[DTensor]) -> str:
    return ", ".join(f"[{', '.join(str(p) for p in d.placements)}] shape={tuple(d.shape)}" for d in dtensors)


def _common_mesh(op, dtensors: list[DTensor]):
    mesh = dtensors[0].device_mesh
    for other in dtensors[1:]:
        if other.device_mesh != mesh:
            raise ValueError(
                f"{op}: DTensor arguments live on different meshes, {mesh!r} and {other.device_mesh!r}; "
                f"all DTensors of one op must share a mesh (redistribute across meshes is not supported yet)"
            )
    return mesh


def _check_plain_tensors(op, flat: list) -> None:
    for value in flat:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.ndim > 0:
            # Not a TypeError: torch turns a TypeError in an operator into NotImplemented and the message is lost.
            raise RuntimeError(
                f"{op}: got a plain torch.Tensor of shape {tuple(value.shape)} mixed with DTensors; only "
                f"Python scalars and 0-d tensors may be mixed in. Make it a DTensor first, e.g. "
                f"distribute_tensor(tensor, mesh, [Replicate()] * mesh.ndim) or DTensor.from_local(...)"
            )


def _mutated(op, args: tuple, kwargs: dict) -> list[DTensor]:
    """DTensor arguments that the op writes to (`self` of `add_`, `out=` of `add.out`)."""
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
        mutated.extend(item for item in values if isinstance(item, DTensor))
    return mutated


def _cache_key(op, layouts, call: OpCall):
    key = (op, tuple(layouts), call.inputs, call.args, call.kwargs)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(item) for item in value)
    if isinstance(value, torch.Tensor):
        return PlainTensor(value.dtype)  # a 0-d plain tensor: its dtype matters to the op, not its value
    return value


def dispatch(op, args: tuple, kwargs: dict):
    """Run `op` on DTensor arguments and return DTensor results (the single-device value)."""
    flat, tree = tree_flatten((args, kwargs))
    positions = [index for index, value in enumerate(flat) if isinstance(value, DTensor)]
    dtensors = [flat[index] for index in positions]
    mesh = _common_mesh(op, dtensors)
    _check_plain_tensors(op, flat)
    mutated = _mutated(op, args, kwargs)
    rule = RULES.get(op)
    if rule is None:
        return _fallback(op, flat, tree, positions, dtensors, mutated, mesh)
    metas = tuple(TensorMeta(tuple(dtensor.shape), dtensor._spec.stride, dtensor.dtype) for dtensor in dtensors)
    stand_ins = list(flat)
    for index, meta in zip(positions, metas):
        stand_ins[index] = meta
    call_args, call_kwargs = tree_unflatten([_hashable(value) for value in stand_ins], tree)
    call = OpCall(op, metas, tuple(call_args), tuple(sorted(call_kwargs.items())))
    layouts = [dtensor.sharding for dtensor in dtensors]
    decision = decide(call, layouts, rule, mesh.get_coordinate(), _cache_key(op, layouts, call))
    if decision.local_arguments is not None:
        flat, tree = _local_flat(flat, decision.local_arguments)
        positions = [index for index, value in enumerate(flat) if isinstance(value, DTensor)]
    return _run(op, flat, tree, positions, dtensors, mutated, mesh, decision.input_layouts, decision.output_layouts, decision.output_metas)


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
            f"{_describe(dtensors)}); redistribute the inputs to Replicate yourself, add a rule, or "
            f"leave strict mode (shardtensor.strict_mode / SHARDTENSOR_STRICT=1)"
        )
    name = str(op)
    if name not in fallback_counts:
        logger.info("%s has no sharding rule: gathering its inputs (%s) to Replicate", name, _describe(dtensors))
    fallback_counts[name] += 1
    replicated = [d.sharding.with_placements([Replicate()] * d.sharding.mesh_ndim) for d in dtensors]
    return _run(op, flat, tree, positions, dtensors, mutated, mesh, replicated, None, None)


def _run(op, flat, tree, positions, dtensors, mutated, mesh, input_layouts, output_layouts, output_metas):
    """Move inputs to `input_layouts`, run the local op, write back mutated inputs, wrap outputs.

    `output_layouts is None` means fallback outputs: Replicate, or the first input's layout (with
    Partial read as Replicate) when the output has the first input's shape.
    """
    local_flat = list(flat)
    copies: dict[int, tuple[DTensor, Layout, torch.Tensor]] = {}  # id(copy) -> (mutated DTensor, copy's layout, copy)
    passed_through: dict[int, DTensor] = {}
    mutated_ids = {id(dtensor) for dtensor in mutated}
    for index, dtensor, target in zip(positions, dtensors, input_layouts):
        local = dtensor._local_tensor
        if target != dtensor.sharding:
            local = redistribute_local_tensor(local, dtensor.sharding, target, mesh)
            if id(dtensor) in mutated_ids:
                copies[id(local)] = (dtensor, target, local)
        else:
            passed_through[id(local)] = dtensor
        local_flat[index] = local
    local_args, local_kwargs = tree_unflatten(local_flat, tree)
    result = op(*local_args, **local_kwargs)
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
    return tree_unflatten(wrapped, output_tree)


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
