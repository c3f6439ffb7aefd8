"""Sharding rules: multi-tensor ops (`_foreach_*`) and fused optimizer steps (`_fused_adam_` & co).

A multi-tensor op is a list of independent single-tensor ops run by one kernel: element i takes the
i-th tensor of every list argument (`self`, `other`, `tensor1`...), the i-th scalar of a scalar
list, and the arguments that are not lists. So its decision is one decision per element, each made
by the element's single-tensor op's own rule (`_foreach_addcmul_` by `addcmul`'s, in place: the
output lies like `self`), then run as one multi-tensor call on the local tensors. The elements of a
list keep their own layouts: a list may mix `Shard(0)`, `Shard(1)` and `Replicate` parameters.

Scalars do not take part in the decision beyond their sign and whether they are finite (the only
things the pointwise rules read of a scalar: `P(max) * c` is `P(min)` for a negative `c`), so Adam's bias-corrected step sizes,
new on every step, decide nothing new; the dispatch fast path keys these ops the same way.

Full reductions of every tensor of a list (`_foreach_norm`, `_foreach_powsum`, `_foreach_max`) give
Replicate results from ONE all_reduce for the whole list: each rank reduces its shards, the partial
results are stacked and combined over the mesh dims that shard any of the tensors. That is what
makes `clip_grad_norm_(foreach=True)` one collective per mesh.

Fused optimizer steps are elementwise in (param, grad, state...) of one parameter: all of one
parameter's tensors take the parameter's layout, never Partial (Adam is not linear in its gradient).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import torch

from .. import comm
from ..layout import Layout
from ..placement import Replicate, Shard
from ..propagation import decide
from ..rules import ComposedRule, Decision, OpCall, ResizesWritten, TensorMeta, sign_of
from .registry import InPlaceVariantRule, RULES, aten, register_rule

__all__ = ["ForeachRule", "ListReductionRule", "FusedStepRule", "canonical_scalar", "canonical_arguments"]


# Element ops whose packet has no overload for the foreach op's arguments (`maximum(x, 0.5)`).
_RENAMED = {("maximum", "Scalar"): "clamp_min", ("maximum", "ScalarList"): "clamp_min",
            ("minimum", "Scalar"): "clamp_max", ("minimum", "ScalarList"): "clamp_max"}
_PER_ELEMENT_TYPES = ("List[Tensor]", "List[number]")


def canonical_scalar(value):
    """A Python number replaced by one of its type with the same sign (-1, 0, 1), or inf, -inf and NaN
    kept (`rules.sign_of`): what a rule may read of a scalar. Everything else is returned as it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return value
    if isinstance(value, complex):
        return complex(1)
    sign = sign_of(value)
    if sign is None:
        return math.nan if math.isnan(value) else value  # one NaN object, so that keys holding it compare equal
    return type(value)(sign)


def canonical_arguments(values: tuple) -> tuple:
    """`canonical_scalar` of every number in (nested) tuples: a multi-tensor call's arguments as its
    decision reads them."""
    return tuple(canonical_arguments(value) if isinstance(value, tuple) else canonical_scalar(value) for value in values)


def _typed(values) -> tuple:
    """Values with their types, for cache keys: 1, 1.0 and True hash alike but give other dtypes."""
    return tuple((type(value), value) for value in values)


@dataclasses.dataclass(frozen=True, slots=True)
class _Argument:
    """One argument of a multi-tensor op: where it sits, and whether it holds one entry per element."""

    name: str
    per_element: bool
    element_name: str | None  # the single-tensor op's argument it becomes (None: not passed on)
    element_kwarg_only: bool


def _call_values(call: OpCall) -> list[tuple[str, object]]:
    """(argument name, value) in flattened order: positional arguments, then keywords in call order."""
    names = [argument.name for argument in call.op._schema.arguments]
    return [(names[position], value) for position, value in enumerate(call.args)] + list(call.kwargs)


def _list_length_error(op, lengths: dict[str, int]) -> ValueError:
    given = ", ".join(f"{name}: {length}" for name, length in lengths.items())
    return ValueError(
        f"{op}: its tensor and scalar lists must have one entry per tensor of the first list, or none; got "
        f"lengths {given}. Pass lists of equal length (one entry per parameter)."
    )


class ForeachRule(ComposedRule):
    """A multi-tensor op decided element by element with `element_rule` (a function of no argument
    returning the single-tensor op's rule, looked up per decision so that `register_sharding`
    replacements apply). `element_op` runs on meta tensors; `arguments` map the op's arguments to
    the element op's."""

    def __init__(self, op, element_op, arguments: dict[str, _Argument], element_rule):
        self.op, self.element_op, self.arguments, self.element_rule = op, element_op, arguments, element_rule
        self.__name__ = f"foreach({element_op})"

    def element_calls(self, call: OpCall) -> list[tuple[OpCall, list[int]]]:
        """For each element: its single-tensor call (scalars canonical) and the indices into
        `call.inputs` of its DTensor inputs, in the element call's order."""
        values = _call_values(call)
        lengths = {name: len(value) for name, value in values if self.arguments[name].per_element and len(value)}
        if len(set(lengths.values())) > 1:
            raise _list_length_error(call.op, lengths)
        count = next(iter(lengths.values()), 0)
        # Index into `call.inputs` of every TensorMeta, per argument (a list: per entry).
        positions: dict[str, list[int] | int | None] = {}
        next_input = 0
        for name, value in values:
            if isinstance(value, tuple):
                positions[name] = []
                for item in value:
                    positions[name].append(next_input if isinstance(item, TensorMeta) else None)
                    next_input += isinstance(item, TensorMeta)
            else:
                positions[name] = next_input if isinstance(value, TensorMeta) else None
                next_input += isinstance(value, TensorMeta)
        elements = []
        for element in range(count):
            args, kwargs, inputs = [], [], []
            for name, value in values:
                argument = self.arguments[name]
                if argument.element_name is None or (argument.per_element and not len(value)):
                    continue
                position = positions[name][element] if argument.per_element else positions[name]
                item = value[element] if argument.per_element else value
                if position is not None:
                    inputs.append(position)
                item = canonical_scalar(item)
                if argument.element_kwarg_only:
                    kwargs.append((argument.element_name, item))
                else:
                    args.append(item)
            metas = tuple(call.inputs[position] for position in inputs)
            elements.append((OpCall(self.element_op, metas, tuple(args), tuple(kwargs)), inputs))
        return elements

    def decision(self, call: OpCall, layouts: Sequence[Layout], coordinate: Sequence[int]) -> Decision:
        rule = self.element_rule()
        rule = rule.rule_for_lists or rule
        input_layouts: list[Layout | None] = [None] * len(layouts)
        output_layouts, output_metas = [], []
        for element_call, inputs in self.element_calls(call):
            element_layouts = [input_layouts[index] or layouts[index] for index in inputs]
            key = ("foreach element", self.element_op, tuple(element_layouts), element_call.inputs,
                   _typed(element_call.args), _typed(value for _, value in element_call.kwargs), tuple(coordinate))
            try:
                element = decide(element_call, element_layouts, rule, coordinate, key)
            except ResizesWritten as error:
                raise RuntimeError(f"{call.op}: an in-place element would change its tensor's shape ({error})") from None
            if element.local_arguments is not None or element.local_op is not None:
                raise NotImplementedError(
                    f"{call.op}: the rule of {self.element_op} computes its elements with a local op of its "
                    f"own, which a multi-tensor call cannot run; call {self.element_op} per tensor instead"
                )
            for index, target in zip(inputs, element.input_layouts):
                if input_layouts[index] is not None and input_layouts[index] != target:
                    raise NotImplementedError(
                        f"{call.op}: its tensor argument shared by every element would need two layouts "
                        f"({input_layouts[index].placements} and {target.placements}); redistribute it to "
                        f"Replicate first"
                    )
                input_layouts[index] = target
            output_layouts += element.output_layouts
            output_metas += element.output_metas
        resolved = tuple(target or layout for target, layout in zip(input_layouts, layouts))
        if not call.op._schema.returns:  # in place: the elements' results are written, not returned
            output_layouts, output_metas = [], []
        return Decision(resolved, tuple(output_layouts), tuple(output_metas), (), None, None)


def _replicate(layout: Layout) -> Layout:
    return Layout.create(layout.mesh_shape, [Replicate()] * layout.mesh_ndim, ())


def _without_partial(layout: Layout) -> Layout:
    if not layout.partial_mesh_dims():
        return layout
    return layout.with_placements([Replicate() if p.is_partial() else p for p in layout.placements])


@dataclasses.dataclass(frozen=True, slots=True)
class _Reduction:
    """How one list reduction combines: the reduce op over ranks, the value of a tensor a rank does
    not count (its identity; an empty shard of a max-like reduction, which cannot be reduced
    locally, too), and the last step on the combined value."""

    reduce_op: str
    identity: float
    skips_empty: bool = False
    root: float | None = None  # combined ** (1 / root): finite norms other than 0


def _reduction(kind: str, order) -> _Reduction:
    if kind == "max":
        return _Reduction("max", -math.inf, skips_empty=True)
    if kind == "norm" and order == math.inf:
        return _Reduction("max", 0.0, skips_empty=True)  # norms are >= 0: 0 is the identity of their max
    if kind == "norm" and order == -math.inf:
        return _Reduction("min", math.inf, skips_empty=True)
    return _Reduction("sum", 0.0, root=None if kind == "powsum" or order == 0 else order)


def _local_values(kind: str, tensors: list[torch.Tensor], order, dtype, reduction: _Reduction) -> list:
    """Each shard's contribution (None for a skipped empty shard): sum |x|^p for finite norms other
    than 0 and for powsum, the norm for orders 0/inf/-inf, the max."""
    present = [tensor for tensor in tensors if tensor.numel() or not reduction.skips_empty]
    if not present:
        computed = []
    elif kind == "max":
        computed = list(aten._foreach_max.default(present))
    elif reduction.root is not None or kind == "powsum":
        computed = list(aten._foreach_powsum.Scalar(present, order, dtype))
    else:
        computed = list(aten._foreach_norm.Scalar(present, order, dtype))
    values = iter(computed)
    return [next(values) if tensor.numel() or not reduction.skips_empty else None for tensor in tensors]


def _reduce_list(kind: str, mesh_dims: tuple[int, ...], contributes: tuple[bool, ...], output_dtypes: tuple,
                 mesh, tensors, order=2, dtype=None):
    """The local op of a list reduction: this rank's values stacked, one all_reduce over `mesh_dims`,
    then each tensor's result. A tensor this rank holds a replica of that another rank also counts
    (Replicate on a reduced mesh dim, coordinate not 0) gives the identity."""
    reduction = _reduction(kind, order)
    values = _local_values(kind, list(tensors), order, dtype, reduction)
    common = functools.reduce(torch.promote_types, output_dtypes)
    identity = reduction.identity
    if not common.is_floating_point and identity == -math.inf:
        identity = torch.iinfo(common).min if common != torch.bool else False
    device = tensors[0].device
    stacked = torch.stack([
        value.to(common) if value is not None and counted else torch.full((), identity, dtype=common, device=device)
        for value, counted in zip(values, contributes)
    ])
    if mesh_dims and mesh is not None:
        stacked = comm.all_reduce(stacked, mesh, mesh_dims, reduce_op=reduction.reduce_op)
    if reduction.root is not None:
        stacked = stacked.pow(1.0 / reduction.root)
    return [value.to(dtype) for value, dtype in zip(stacked.unbind(), output_dtypes)]


class ListReductionRule(ComposedRule):
    """`_foreach_norm`, `_foreach_powsum`, `_foreach_max`: a full reduction of every tensor of a list.

    Tensors keep their shards (a Partial one is reduced first: the norm of a partial sum is not a sum
    of norms); results are Replicate 0-d tensors, combined for the whole list in one all_reduce over
    the mesh dims that shard any tensor (sum of |x|^p then the p-th root, max for inf, min for -inf).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.__name__ = f"foreach_{kind}"

    def decision(self, call: OpCall, layouts: Sequence[Layout], coordinate: Sequence[int]) -> Decision:
        targets = tuple(_without_partial(layout) for layout in layouts)
        metas = tuple(call.global_output_metas())
        sharded = [{mesh_dim for mesh_dim, p in enumerate(layout.placements) if isinstance(p, Shard)} for layout in targets]
        mesh_dims = tuple(sorted(set().union(*sharded))) if sharded else ()
        contributes = tuple(
            all(coordinate[mesh_dim] == 0 for mesh_dim in mesh_dims if mesh_dim not in dims) for dims in sharded
        )
        dtypes = tuple(meta.dtype for meta in metas)
        local_op = functools.partial(_reduce_list, self.kind, mesh_dims, contributes, dtypes) if metas else None
        outputs = tuple(_replicate(layout) for layout in layouts)
        return Decision(targets, outputs, metas, (), None, local_op)


class FusedStepRule(ComposedRule):
    """One parameter's tensors in a fused optimizer step (param, grad, moments): each takes the
    parameter's layout (a Partial one read as Replicate), exactly, shard sizes included; a 0-d step
    count or learning rate stays where it is. The parameter and its states are written, so they
    keep their layouts (moving them would cost a second move back); a gradient laid out otherwise
    (Partial from data parallelism) is moved once. Returns nothing."""

    __name__ = "fused_step"

    def decision(self, call: OpCall, layouts: Sequence[Layout], coordinate: Sequence[int]) -> Decision:
        parameter = _without_partial(layouts[0])
        targets = tuple(
            layout if meta.ndim == 0 else parameter if layout.shape == parameter.shape
            else layout.with_placements(parameter.placements)
            for layout, meta in zip(layouts, call.inputs)
        )
        return Decision(targets, (), (), (), None, None)


def _strip_list(type_text: str) -> str:
    return type_text[len("List["):-1] if type_text in _PER_ELEMENT_TYPES else type_text


def _matching_overload(packet, op):
    """The overload of `packet` whose arguments are `op`'s with lists read as one entry, extra ones
    having defaults (`add.Scalar`'s alpha for `_foreach_add.Scalar`)."""
    wanted = [_strip_list(str(argument.type)) for argument in op._schema.arguments]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        if len(arguments) < len(wanted) or any(str(argument.type) != text for argument, text in zip(arguments, wanted)):
            continue
        if all(argument.has_default_value() for argument in arguments[len(wanted):]):
            return candidate
    return None


def _element_op(name: str, op):
    """The overload of `aten.<name>` matching `op`'s arguments, when it has a rule."""
    packet = getattr(aten, name, None)
    element_op = _matching_overload(packet, op) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    return element_op if element_op in RULES else None


def _arguments(op, element_op) -> dict[str, _Argument]:
    arguments = {}
    element_arguments = element_op._schema.arguments if element_op is not None else []
    for position, argument in enumerate(op._schema.arguments):
        per_element = str(argument.type) in _PER_ELEMENT_TYPES
        if element_op is None:  # a fused step: every argument is passed on under its own name
            arguments[argument.name] = _Argument(argument.name, per_element, argument.name, argument.kwarg_only)
            continue
        element_argument = element_arguments[position]
        arguments[argument.name] = _Argument(argument.name, per_element, element_argument.name, element_argument.kwarg_only)
    return arguments


def _foreach_rule(op) -> ForeachRule | None:
    """The rule of `_foreach_<name>[_].<overload>` from the single-tensor op `<name>`, or None."""
    name = op._schema.name.split("::")[1][len("_foreach_"):]
    in_place = name.endswith("_")
    base = _RENAMED.get((name.rstrip("_"), op._overloadname), name.rstrip("_"))
    if in_place:  # `copy_` and `zero_` have rules of their own; other in-place ops take their functional op's
        own = _element_op(base + "_", op)
        if own is not None and _element_op(base, op) not in RULES:
            return ForeachRule(op, own, _arguments(op, own), lambda: RULES[own])
    element_op = _element_op(base, op)
    if element_op is None:
        return None
    if in_place:
        in_place_rule = InPlaceVariantRule(element_op, RULES)
        return ForeachRule(op, element_op, _arguments(op, element_op), lambda: in_place_rule)
    return ForeachRule(op, element_op, _arguments(op, element_op), lambda: RULES[element_op])


def _multi_tensor_overloads(prefix: str) -> list:
    names = sorted({name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("aten::" + prefix)})
    overloads = []
    for full_name in names:
        name, _, overload = full_name.partition(".")
        op = getattr(getattr(aten, name), overload or "default")
        if not any(argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
                   for argument in op._schema.arguments):  # `out=` overloads are not ours
            overloads.append(op)
    return overloads


def _register() -> None:
    reductions = {"_foreach_norm": "norm", "_foreach_powsum": "powsum", "_foreach_max": "max"}
    for op in _multi_tensor_overloads("_foreach_"):
        kind = reductions.get(op._schema.name.split("::")[1])
        rule = ListReductionRule(kind) if kind is not None else _foreach_rule(op)
        if rule is not None:
            register_rule([op], rule)
    fused_step = FusedStepRule()
    for op in _multi_tensor_overloads("_fused_"):
        if op._schema.name.split("::")[1] in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
            register_rule([op], ForeachRule(op, op, _arguments(op, None), lambda: fused_step))


_register()
