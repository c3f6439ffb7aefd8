"""The one registry of sharding rules: `RULES[op] = rule`, each op registered exactly once.

A rule maps an `OpCall` (global metadata of the op's DTensor inputs and its other arguments) to
rows `[outputs <- inputs]` of placements for one mesh dim; `propagation.decide` extends them to
N-D meshes and picks the cheapest. Here live the registry and the generic rules that op families
reuse: ops that keep their input's layout, `*_like` factories, and the broadcast rows of
elementwise ops (the elementwise family itself is `ops/pointwise.py`). Replicate rows come first:
moving Replicate to Shard is free, so on a tie the rule's order keeps a Replicate input where it is.

Op families name their ops through `aten` below, which reads a name the running torch lacks
(`aten.cholesky` in torch 2.14) as a `MissingOp`: `register_rule` skips it (`skipped_ops()` lists
it, with a DEBUG log line), so one table serves every torch version we support. (An overload that
torch drops from an op it keeps would still fail at import; torch retires whole ops, as `cholesky`.)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable

import torch

from ..placement import REDUCE_OPS, Partial, Replicate, Shard
from ..propagation import clear_cache
from ..rules import (
    OpCall, OutVariantRule, ResizesWritten, Row, RowsRule, ShardingRule, TensorMeta, rows_keeping_self, run_on_meta,
)
from .common import one_input_row

__all__ = [
    "RULES", "FUNCTION_REWRITES", "aten", "MissingOp", "skipped_ops", "register_rule", "register_function_rewrite",
    "register_variants", "functional_overload", "InPlaceVariantRule", "same_layout", "like_factory", "pointwise",
]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class MissingOp:
    """An aten op (`overload=None`: its packet) that the running torch does not have; its rule is
    skipped at registration. Reading an overload of a missing packet gives a missing overload."""

    name: str
    overload: str | None = None

    def __getattr__(self, overload: str) -> MissingOp:
        if self.overload is not None or overload.startswith("__"):
            raise AttributeError(f"{self} is not in torch {torch.__version__}, so it has no attribute {overload!r}")
        return MissingOp(self.name, overload)

    def __str__(self) -> str:
        return f"aten.{self.name}" + ("" if self.overload is None else f".{self.overload}")


class _OptionalOps:
    """`torch.ops.aten` for rule tables: an op this torch lacks reads as a `MissingOp` instead of
    raising at import. Each name resolves once (then it is a plain attribute), so calls cost nothing."""

    def __getattr__(self, name: str):
        try:
            op = getattr(torch.ops.aten, name)
        except AttributeError:
            if name.startswith("__"):  # a Python protocol probe (`__deepcopy__`), not an op name
                raise
            op = MissingOp(name)
        setattr(self, name, op)
        return op


aten = _OptionalOps()

RULES: dict[torch._ops.OpOverload, ShardingRule] = {}

# Public torch function -> rewrite(args, kwargs) giving (op, args, kwargs) to call instead, or None to
# keep the call: for functions that torch decomposes before any aten op reaches `dispatch` in a form
# no rule can shard (F.pad's circular mode: slices copied into a new tensor).
FUNCTION_REWRITES: dict = {}

# Ops whose rules were not registered because this torch does not have them (`skipped_ops()`).
_SKIPPED: set[str] = set()


def skipped_ops() -> list[str]:
    """The names of the ops whose rules this torch version skipped (`['aten.cholesky.default']` on
    torch 2.14): a call of them cannot reach `dispatch` on this version anyway."""
    return sorted(_SKIPPED)


def register_rule(ops: Iterable, rule, *, override: bool = False) -> None:
    """Register `rule` (a `ShardingRule`, or a function from `OpCall` to rows) for each op.

    A packet (`aten.add`) stands for its overloads that return one Tensor. Registering an op that
    has a rule is an error unless `override=True` (what `experimental.register_sharding` does). An
    op this torch does not have (a `MissingOp`) is skipped and listed by `skipped_ops()`.
    """
    if not isinstance(rule, ShardingRule):
        rule = RowsRule(rule)
    for op in ops:
        if isinstance(op, MissingOp):
            _logger.debug("skipped the rule of %s: torch %s has no such op", op, torch.__version__)
            _SKIPPED.add(str(op))
            continue
        overloads = [op]
        if isinstance(op, torch._ops.OpOverloadPacket):
            overloads = [getattr(op, name) for name in op.overloads()]
            overloads = [overload for overload in overloads if _returns_one_tensor(overload)]
        for overload in overloads:
            if overload in RULES and not override:
                raise RuntimeError(
                    f"{overload} is registered twice (already as {RULES[overload].__name__}, now as "
                    f"{rule.__name__}); each op has exactly one rule (replace one on purpose with "
                    f"shardtensor.experimental.register_sharding)"
                )
            RULES[overload] = rule
    clear_cache()  # decisions made with a replaced rule must not be reused


def register_function_rewrite(function, rewrite) -> None:
    """Route calls of the public `function` on DTensors through `rewrite` (see `FUNCTION_REWRITES`)."""
    if function in FUNCTION_REWRITES:
        raise RuntimeError(f"{function} has a rewrite already; each public function has at most one")
    FUNCTION_REWRITES[function] = rewrite


class InPlaceVariantRule(ShardingRule):
    """The in-place overload of an op that has a rule (`addmm_` of `addmm`): the functional rule's
    rows in which the output lies like `self`, since the local op writes its result into `self`'s
    shard. The functional rule is looked up per call (`register_sharding` replaces both)."""

    def __init__(self, functional_op, rules: dict):
        self.functional_op, self._rules = functional_op, rules
        self.__name__ = f"in_place_variant({functional_op})"

    def _functional(self, call: OpCall) -> tuple[ShardingRule, OpCall]:
        return self._rules[self.functional_op], dataclasses.replace(call, op=self.functional_op)

    @property
    def value_keys(self):
        return self._rules[self.functional_op].value_keys

    @property
    def local_op_reads_values(self) -> bool:
        return self._rules[self.functional_op].local_op_reads_values

    @property
    def rule_for_lists(self) -> ShardingRule | None:
        for_lists = self._rules[self.functional_op].rule_for_lists
        return None if for_lists is None else InPlaceVariantRule(self.functional_op, {self.functional_op: for_lists})

    def rows_for_layouts(self, call, layouts):
        rule, functional_call = self._functional(call)
        return rows_keeping_self(rule.rows_for_layouts(functional_call, layouts), layouts[0])

    def global_outputs(self, call: OpCall) -> list[TensorMeta | None]:
        result = run_on_meta(self.functional_op, call.args, dict(call.kwargs))[0]
        if result.shape != call.inputs[0].shape:  # torch resizes self (the meta in-place op refuses to)
            raise ResizesWritten(f"{call.op} resizes self from {call.inputs[0].shape} to {result.shape}",
                                 self.functional_op)
        return call.global_output_metas()

    def local_arguments(self, call, input_layouts, coordinate):
        rule, functional_call = self._functional(call)
        return rule.local_arguments(functional_call, input_layouts, coordinate)

    def local_op(self, call, input_layouts, coordinate):
        rule, functional_call = self._functional(call)
        local_op = rule.local_op(functional_call, input_layouts, coordinate)
        return None if local_op is None else _into_self(local_op)

    def shapes_follow_local_inputs(self, call: OpCall) -> bool:
        rule, functional_call = self._functional(call)
        return rule.shapes_follow_local_inputs(functional_call)

    def random_calls(self, call: OpCall) -> int:
        rule, functional_call = self._functional(call)
        return rule.random_calls(functional_call)


def _into_self(local_op):
    def run(mesh, self, *args, **kwargs):
        return self.copy_(local_op(mesh, self, *args, **kwargs))

    return run


def register_variants() -> None:
    """Derive the rules of in-place and `out=` overloads from their functional overload's rule; run
    once, after every family registered its table.

    The functional overload of `mm.out`, `sort.values` or `max.dim_max` is the one of the same packet
    whose arguments are the out overload's without its out tensors (by name and type); it gives its
    rule to the out overload (`OutVariantRule`) unless that has one of its own (one the functional
    overload does not share: a packet registration gives both the same). An in-place overload
    (`addmm_.default`) without a rule takes the one of `addmm` with the same arguments.
    """
    # Every aten op name (`dir(aten)` lists only the packets loaded so far); only packets with a rule
    # (out overloads) or whose functional packet has one (in-place `name_`) can gain one, and loading
    # the others' overloads cost a third of `import shardtensor`.
    names = sorted({name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                    if name.startswith("aten::")})
    ruled = {op._schema.name.split("::")[1] for op in RULES if isinstance(op, torch._ops.OpOverload)}
    for name in names:
        if name not in ruled and not (name.endswith("_") and name[:-1] in ruled):
            continue
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        overloads = [getattr(packet, overload) for overload in packet.overloads()]
        functional = _functional_by_signature(packet)
        for overload in overloads:
            out_names = OutVariantRule.out_names_of(overload)
            match = functional.get(_argument_signature(overload, out_names)) if out_names else None
            if match not in RULES or RULES.get(overload, RULES[match]) is not RULES[match]:
                continue  # no functional rule, or an out= rule of its own
            if len(match._schema.returns) in (len(overload._schema.returns), len(out_names)):
                RULES[overload] = OutVariantRule(overload, match, RULES)
        functional_packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") and not name.startswith("_") else None
        if isinstance(functional_packet, torch._ops.OpOverloadPacket):
            functional_overloads = [getattr(functional_packet, overload) for overload in functional_packet.overloads()]
            by_signature = {_argument_signature(overload): overload for overload in functional_overloads}
            for overload in overloads:
                match = by_signature.get(_argument_signature(overload))
                if overload not in RULES and match in RULES and torch.Tag.inplace_view not in overload.tags:
                    RULES[overload] = InPlaceVariantRule(match, RULES)
    clear_cache()


@functools.cache
def functional_overload(overload):
    """The functional overload of an `out=` overload (`nonzero.default` of `nonzero.out`), as
    `register_variants` matches them; None for an overload without out tensors or without a match."""
    out_names = OutVariantRule.out_names_of(overload)
    if not out_names:
        return None
    packet = getattr(torch.ops.aten, overload._schema.name.split("::")[1])
    return _functional_by_signature(packet).get(_argument_signature(overload, out_names))


def _functional_by_signature(packet) -> dict:
    """The packet's overloads without out tensors, by their arguments' names and types."""
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return {
        _argument_signature(overload): overload for overload in overloads if not OutVariantRule.out_names_of(overload)
    }


def _argument_signature(overload, leave_out: tuple[str, ...] = ()) -> tuple:
    return tuple((argument.name, str(argument.type)) for argument in overload._schema.arguments
                 if argument.name not in leave_out)


def _returns_one_tensor(overload) -> bool:
    """Skips the TorchScript scalar overloads (`aten.add.int`) and list comparisons (`eq.int_list`)."""
    returns = overload._schema.returns
    return len(returns) == 1 and str(returns[0].type) == "Tensor"


def same_layout(call: OpCall) -> list[Row]:
    """The output lies exactly like the input: any placement, Partial included, passes through."""
    inputs = len(call.inputs)
    placements = [Replicate()] + [Shard(dim) for dim in range(call.inputs[0].ndim)]
    placements += [Partial(op) for op in REDUCE_OPS]
    return [one_input_row(placement, placement, inputs) for placement in placements]


def like_factory(call: OpCall) -> list[Row]:
    """`zeros_like` & co: a new value per shard; a Partial input gives a Replicate output.

    `ones_like(P(sum))` must not stay Partial: every rank's ones would sum to the rank count.
    """
    inputs = len(call.inputs)
    rows = [one_input_row(Replicate(), Replicate(), inputs)]
    rows += [one_input_row(Shard(dim), Shard(dim), inputs) for dim in range(call.inputs[0].ndim)]
    return rows + [one_input_row(Replicate(), Partial(op), inputs) for op in REDUCE_OPS]


def pointwise(call: OpCall) -> list[Row]:
    """Elementwise with broadcasting: shard an output dim where every input that spans it is sharded.

    An input broadcast along a dim (missing or of size 1) is Replicate there. No Partial rows: a
    nonlinear op (or a Partial plus a scalar, which would add the scalar once per rank) needs the
    reduced value first.
    """
    out_ndim = max(meta.ndim for meta in call.inputs)
    out_shape = [1] * out_ndim
    for meta in call.inputs:
        for dim, size in enumerate(meta.shape):
            position = dim + out_ndim - meta.ndim
            out_shape[position] = max(out_shape[position], size)
    rows = [Row((Replicate(),), (Replicate(),) * len(call.inputs))]
    for dim in range(out_ndim):
        inputs = []
        for meta in call.inputs:
            input_dim = dim - (out_ndim - meta.ndim)
            spans = input_dim >= 0 and meta.shape[input_dim] == out_shape[dim]
            inputs.append(Shard(input_dim) if spans else Replicate())
        rows.append(Row((Shard(dim),), tuple(inputs)))
    return rows


_SAME_LAYOUT = [aten.detach, aten.alias, aten.clone, aten.contiguous]
_LIKE_FACTORIES = [aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like]

register_rule(_SAME_LAYOUT, same_layout)
register_rule(_LIKE_FACTORIES, like_factory)
