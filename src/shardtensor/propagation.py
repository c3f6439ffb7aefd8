"""Sharding propagation: from an op's rule and its inputs' layouts to one decision, cached.

A rule describes an op along a single mesh dim as rows `[outputs..., inputs...]` of placements
(`Row`). For an N-D mesh the engine picks one row per mesh dim, choosing the cheapest row (bytes
moved, then number of collectives, then bytes moved now, then the rule's own order). A row's cost is for
the step, not only the op (`row_cost`): moving the inputs, the collectives the rule's local op issues
itself (`Row.collectives`), and what an output layout nobody asked for forces later (a Shard on a mesh
dim where no input stays sharded must be gathered again, a Partial that the data does not imply must be
reduced: `_follows_the_data`); on a tie, the row that communicates later. When the choice moves a
nested-sharded input, the redistribute planner prices the best few combinations exactly. It builds the
full input and output layouts. Decisions are cached by (op, input layouts, dtypes, the non-tensor
arguments that decide): the hot path is one dict lookup. The cache is a bounded LRU (`MAX_DECISIONS`),
and counts decisions made per op.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layout import Layout
from .log import DEBUG, log_decision, propagation_logger
from .placement import Partial, Placement, Replicate, Shard
from .redistribute.planner import plan as plan_redistribute

__all__ = [
    "Row", "LocalCollective", "TensorMeta", "PlainTensor", "DataDependentOutput", "ResizesWritten", "OpCall",
    "schema_positions", "ShardingRule", "RowsRule", "OutVariantRule", "ComposedRule",
    "Decision", "decide", "TYPE_ONLY", "SIGN",
    "transition_cost", "row_cost", "clear_cache", "MAX_DECISIONS", "decisions_made", "decision_cache_hits",
]


@dataclass(frozen=True, slots=True)
class LocalCollective:
    """A collective that a rule's local op issues along its row's mesh dim (softmax over a sharded
    dim all_reduces its row maxima): the kind (`comm`'s name) and the bytes of the tensor it
    reduces or gathers, global (an upper bound of any rank's). Declared so that the cost of the row
    counts it and `explicit_communication()` refuses it like a move of an input."""

    kind: str
    bytes: int

    def __str__(self) -> str:
        return f"{self.kind}({self.bytes} B)"


@dataclass(frozen=True, slots=True)
class Row:
    """One way to compute an op along one mesh dim: a placement per output and per tensor input, and
    the collectives the rule's local op issues itself along that mesh dim when it computes this row."""

    outputs: tuple[Placement, ...]
    inputs: tuple[Placement, ...]
    collectives: tuple[LocalCollective, ...] = ()

    def __str__(self) -> str:
        outputs = ", ".join(str(p) for p in self.outputs)
        inputs = ", ".join(str(p) for p in self.inputs)
        communicates = f" + {', '.join(str(c) for c in self.collectives)}" if self.collectives else ""
        return f"[{outputs} <- {inputs}{communicates}]"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape, stride and dtype of a tensor argument or result."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class PlainTensor:
    """Stands for a 0-d plain tensor argument: its dtype matters to the op, its value does not."""

    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class OpCall:
    """What a rule sees: the op, its tensor inputs' global metadata, and the remaining arguments.

    In `args`/`kwargs`, tensor arguments stand as their `TensorMeta`; `inputs` lists the DTensor
    arguments in the order the rule's rows name them (the flattened argument order). `kwargs` keeps
    the call's keyword order: placeholders meet their tensors in that flattened order.
    """

    op: object
    inputs: tuple[TensorMeta, ...]
    args: tuple
    kwargs: tuple[tuple[str, object], ...]

    def kwarg(self, name: str, default=None):
        for key, value in self.kwargs:
            if key == name:
                return value
        return default

    def argument(self, name: str):
        """The value of the op's argument `name`, positional or keyword (its schema default when it
        was not given; None when the op has no such argument)."""
        found = schema_positions(self.op).get(name)
        if found is None:
            return None
        position, positional, default = found
        if positional and position < len(self.args):
            return self.args[position]
        return self.kwarg(name, default)

    def input_names(self) -> list[str]:
        """The schema name of each DTensor input, in the order `inputs` lists them (a tensor list
        argument such as `indices` names each of its DTensors)."""
        names = []
        for name in schema_positions(self.op):
            value = self.argument(name)
            values = value if isinstance(value, (list, tuple)) else [value]
            names += [name for item in values if isinstance(item, TensorMeta)]
        return names

    def with_arguments(self, **values) -> tuple[tuple, dict]:
        """(args, kwargs) of this call with the named arguments replaced: where they were given
        (by position or keyword), else added as keywords. For a rule's local arguments."""
        args, kwargs = list(self.args), dict(self.kwargs)
        positions = schema_positions(self.op)
        for name, value in values.items():
            position, positional, _ = positions[name]
            if positional and position < len(args):
                args[position] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs


@functools.cache
def schema_positions(op) -> dict[str, tuple[int, bool, object]]:
    """name -> (position, may be given by position, schema default or None) for each argument of `op`."""
    return {
        argument.name: (
            position, not argument.kwarg_only, argument.default_value if argument.has_default_value() else None,
        )
        for position, argument in enumerate(op._schema.arguments)
    }


class DataDependentOutput(Exception):
    """The op's output metadata depends on tensor values, so no rule can decide it ahead of the data."""


class ResizesWritten(Exception):
    """An in-place or `out=` op changes the shape of a tensor it writes (torch resizes an `out=` tensor
    of another shape, `addbmm_` a broadcast `self`): dispatch computes `functional_op` instead and
    gives its results to the written tensors."""

    def __init__(self, message: str, functional_op):
        super().__init__(message)
        self.functional_op = functional_op


class ShardingRule:
    """How to compute one op on sharded inputs.

    Subclasses implement `rows` (the ways to compute the op along one mesh dim). They inherit a
    `local_arguments` that runs the local op with the op's own arguments; rules whose arguments
    name global sizes (`view`, `expand`, ...) override it to give each coordinate's local ones.
    """

    # True: plain (non-DTensor) tensor arguments are accepted and treated as Replicate (index tensors).
    accepts_plain_tensors: bool = False
    # Non-tensor arguments (by schema name) whose value does not change the decision, each with what
    # of it does: TYPE_ONLY (2, 2.0 and True still differ: other dtypes) or SIGN (its sign picks
    # among Partial rows, as a negative scale swaps P(max) and P(min); without a Partial input only its
    # type counts). Calls that differ only there share one cached decision and dispatch plan, so the
    # rule's local arguments and local op must not depend on these values. Every argument not listed
    # decides with its value (views' sizes, dims, reduce ops...).
    value_keys: Mapping[str, str] = {}

    def rows(self, call: OpCall) -> Sequence[Row]:
        raise NotImplementedError

    def rows_for_layouts(self, call: OpCall, layouts: Sequence[Layout]) -> Sequence[Row]:
        """The rows for these input layouts: `rows(call)`, unless a row is right only for some shard
        sizes (a view splitting a sharded dim) and the rule checks them."""
        return self.rows(call)

    def global_outputs(self, call: OpCall) -> list[TensorMeta | None]:
        """Global metadata of the op's outputs (None for a non-tensor one), from the op on meta
        tensors; a rule whose op cannot run on them (`item()`) says what it returns."""
        return run_on_meta(call.op, call.args, dict(call.kwargs))

    def local_arguments(
        self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]
    ) -> tuple[tuple, dict] | None:
        """(args, kwargs) for the local op at `coordinate`, tensors left as their placeholders; None
        means the op's own arguments."""
        return None

    def local_op(
        self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]
    ) -> Callable | None:
        """A function `(mesh, *local_args, **local_kwargs)` run on the shards instead of the op, for
        rules whose local computation differs from it (masked embedding, per-shard random values);
        None runs the op itself. Output shard sizes come from it on meta tensors, with mesh None."""
        return None


class RowsRule(ShardingRule):
    """A rule given as a plain function from an `OpCall` to rows (and, optionally, its `value_keys`)."""

    def __init__(self, rows: Callable[[OpCall], Sequence[Row]], value_keys: Mapping[str, str] | None = None):
        self._rows = rows
        self.__name__ = getattr(rows, "__name__", type(self).__name__)
        if value_keys:
            self.value_keys = dict(value_keys)

    def rows(self, call: OpCall) -> Sequence[Row]:
        return self._rows(call)


class OutVariantRule(ShardingRule):
    """The `out=` overload of an op that has a rule (`mm.out` of `mm`, `sort.values` of `sort`).

    `decide` decides the functional op on its operands, then moves each out tensor to exactly the
    layout of the output it receives (pieces included, so the local op writes a shard of the right
    shape; dispatch writes a moved out tensor back into its own layout). The functional rule is
    looked up per call, so replacing it (`register_sharding`) replaces this one too.
    """

    def __init__(self, op, functional_op, rules: dict):
        self.op, self.functional_op, self._rules = op, functional_op, rules
        self.out_names = self.out_names_of(op)
        self.__name__ = f"out_variant({functional_op})"

    @staticmethod
    def out_names_of(op) -> tuple[str, ...]:
        """The keyword-only arguments an overload writes its results into (`out`, `values`, ...)."""
        return tuple(
            argument.name for argument in op._schema.arguments
            if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
        )

    def functional_rule(self) -> ShardingRule:
        return self._rules[self.functional_op]

    @property
    def value_keys(self) -> Mapping[str, str]:
        return self.functional_rule().value_keys

    def split(self, call: OpCall) -> tuple[OpCall, list[int], list[int]]:
        """The functional call, and the indices in `call.inputs` of its operands and of the out tensors."""
        operands, outs, position = [], [], 0
        for value, is_out in [(value, False) for value in call.args] + [
            (value, name in self.out_names) for name, value in call.kwargs
        ]:
            count = sum(isinstance(leaf, TensorMeta) for leaf in tree_flatten(value)[0])
            (outs if is_out else operands).extend(range(position, position + count))
            position += count
        kwargs = tuple((name, value) for name, value in call.kwargs if name not in self.out_names)
        functional = OpCall(self.functional_op, tuple(call.inputs[index] for index in operands), call.args, kwargs)
        return functional, operands, outs

    def rows(self, call: OpCall) -> Sequence[Row]:
        raise NotImplementedError(f"{self.__name__} is decided by `decide` from its functional op's rule")


class ComposedRule(ShardingRule):
    """A rule that builds its whole decision from the decisions of other rules (a multi-tensor op
    decides each list element with its single-tensor op's rule, `ops/foreach.py`): `decide` calls
    `decision` instead of choosing rows."""

    def decision(self, call: OpCall, layouts: Sequence[Layout], coordinate: Sequence[int]) -> Decision:
        raise NotImplementedError

    def rows(self, call: OpCall) -> Sequence[Row]:
        raise NotImplementedError(f"{self.__name__} is decided by its `decision`, not by rows")


def _local_op_into_out(local_op: Callable, out_names: tuple[str, ...], returns_out: bool) -> Callable:
    """A functional rule's local op run into the out tensors: torch's meaning of `out=`."""

    def run(mesh, *args, **kwargs):
        outs = [kwargs.pop(name) for name in out_names if name in kwargs]
        results = tree_flatten(local_op(mesh, *args, **kwargs))[0]
        targets = tree_flatten(outs)[0]
        for target, value in zip(targets, results):
            target.copy_(value)
        if not returns_out:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _decide_out_variant(call: OpCall, layouts: Sequence[Layout], rule: OutVariantRule, coordinate) -> Decision:
    functional_call, operands, outs = rule.split(call)
    inner = decide(functional_call, [layouts[index] for index in operands], rule.functional_rule(), coordinate, None)
    results = [layout for layout in inner.output_layouts if layout is not None]
    out_shapes = [call.inputs[index].shape for index in outs]
    result_shapes = [layout.shape for layout in results]
    if out_shapes != result_shapes:
        raise ResizesWritten(f"{call.op}: out= shapes {out_shapes}, results {result_shapes}", rule.functional_op)
    try:
        metas = tuple(rule.global_outputs(call))  # the out op on meta tensors: torch's dtype checks, on every rank
    except NotImplementedError as error:
        raise DataDependentOutput(f"{call.op} cannot be evaluated on meta tensors: {error}") from error
    input_layouts = list(layouts)
    for index, layout in zip(operands, inner.input_layouts):
        input_layouts[index] = layout
    for index, layout in zip(outs, results):
        input_layouts[index] = layout
    output_layouts = tuple(None if meta is None else results[position] for position, meta in enumerate(metas))
    local_arguments = inner.local_arguments
    if local_arguments is not None:
        local_args, local_kwargs = local_arguments
        out_values = dict(call.kwargs)
        local_kwargs = {name: out_values[name] if name in rule.out_names else local_kwargs[name]
                        for name, _ in call.kwargs if name in rule.out_names or name in local_kwargs}
        local_arguments = (local_args, local_kwargs)
    local_op = inner.local_op
    if local_op is not None:
        local_op = _local_op_into_out(local_op, rule.out_names, bool(call.op._schema.returns))
    return Decision(tuple(input_layouts), output_layouts, metas, inner.rows, local_arguments, local_op)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where each tensor input must be before the local op runs, and the layout of each output."""

    input_layouts: tuple[Layout, ...]
    output_layouts: tuple[Layout | None, ...]
    output_metas: tuple[TensorMeta | None, ...]
    rows: tuple[Row, ...]
    local_arguments: tuple[tuple, dict] | None
    local_op: Callable | None = None

    def moves_inputs(self, current: Sequence[Layout]) -> bool:
        return any(target != layout for target, layout in zip(self.input_layouts, current))

    @property
    def local_collectives(self) -> tuple[tuple[int, LocalCollective], ...]:
        """(mesh dim, collective) for each collective the local op issues (mesh dims of size 1 issue none)."""
        if not self.input_layouts:
            return ()
        mesh_shape = self.input_layouts[0].mesh_shape
        return tuple(
            (mesh_dim, collective)
            for mesh_dim, row in enumerate(self.rows) if mesh_shape[mesh_dim] > 1
            for collective in row.collectives
        )


def transition_cost(layout: Layout, mesh_dim: int, target: Placement, itemsize: int) -> tuple[float, int]:
    """(bytes a rank moves, collectives) to change one mesh dim of `layout` to `target`.

    An estimate for choosing rows: it prices the single step on that mesh dim the way the planner
    does; the exact multi-step plan is left to the redistribute planner.
    """
    source = layout.placements[mesh_dim]
    if source == target:
        return 0.0, 0
    parts = layout.mesh_shape[mesh_dim]
    local_bytes = math.prod(max(pieces) if pieces else 0 for pieces in layout.pieces) * itemsize
    if isinstance(source, Replicate) and isinstance(target, (Shard, Partial)):
        return 0.0, 0
    if isinstance(source, Shard) and isinstance(target, Replicate):
        return float((parts - 1) * local_bytes), 1
    if isinstance(source, Shard) and isinstance(target, Shard):
        return local_bytes * (parts - 1) / parts, 1
    if isinstance(source, Partial) and isinstance(target, Replicate):
        return 2 * local_bytes * (parts - 1) / parts, 1
    if isinstance(source, Partial) and isinstance(target, Shard):
        return local_bytes * (parts - 1) / parts, 1
    # Partial(a) -> Partial(b) and Shard -> Partial go through Replicate.
    return float((parts - 1) * local_bytes) * 2, 2


def _collective_cost(collective: LocalCollective, parts: int) -> float:
    """Bytes a rank moves for a declared in-op collective over `parts` ranks (like `comm.CommRecord`)."""
    if collective.kind == "all_reduce":
        return 2 * collective.bytes * (parts - 1) / parts
    if collective.kind == "all_gather":
        return float(collective.bytes * (parts - 1))
    return float(collective.bytes * (parts - 1) / parts)


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


def _follows_the_data(row: Row, layouts: Sequence[Layout], mesh_dim: int) -> tuple[bool, bool]:
    """(a Shard output follows the data, the Partial outputs do) along `mesh_dim`.

    A Shard output follows the data when some input that the row leaves where it is is sharded
    there. Partial outputs do when no input must be communicated to get there and either some
    input stays sharded (a sum over a sharded dim, a matmul of matching shards) or there are no
    more Partial outputs than Partial inputs staying (a Partial scaled, cast, padded or summed).
    Keeping a Partial by gathering another input only postpones the reduction and pays the gather
    on top; a Partial that fans out into several Partial outputs (a LayerNorm backward giving input
    and weight gradients) needs a reduction for each instead of one now.
    """
    staying = [
        layout.placements[mesh_dim] for layout, target in zip(layouts, row.inputs) if layout.placements[mesh_dim] == target
    ]
    sharded = any(isinstance(placement, Shard) for placement in staying)
    moves_data = any(transition_cost(layout, mesh_dim, target, 1)[1] for layout, target in zip(layouts, row.inputs))
    partial_in = sum(isinstance(placement, Partial) for placement in staying)
    partial_out = sum(isinstance(placement, Partial) for placement in row.outputs)
    partial = not moves_data and (sharded or partial_out <= partial_in)
    return sharded, partial


def _forced_later(
    row: Row, output_metas: Sequence[TensorMeta], mesh_dim: int, parts: int, follows: tuple[bool, bool]
) -> tuple[float, int]:
    """What an output layout nobody asked for costs later, estimated as undoing it once.

    A Shard output on a mesh dim where no input stays sharded (a Partial reduce-scattered over the
    batch, a Replicate input sliced, the only sharded input moved to another dim) leaves the rest of
    the step to run sharded on a dim the program never chose: its consumers gather it (an
    all_gather) or their gradients arrive sharded. Partial outputs that do not follow the data
    must be reduced (an all_reduce each). Outputs that follow the data cost nothing here.
    """
    shard_follows, partial_follows = follows
    bytes_moved, collectives = 0.0, 0
    for placement, meta in zip(row.outputs, output_metas):
        full_bytes = _numel(meta) * meta.dtype.itemsize
        if isinstance(placement, Partial) and not partial_follows:
            bytes_moved += 2 * full_bytes * (parts - 1) / parts
            collectives += 1
        elif isinstance(placement, Shard) and not shard_follows:
            bytes_moved += full_bytes * (parts - 1) / parts
            collectives += 1
    return bytes_moved, collectives


def row_cost(
    row: Row, layouts: Sequence[Layout], metas: Sequence[TensorMeta], output_metas: Sequence[TensorMeta | None],
    mesh_dim: int,
) -> tuple[int, int, int]:
    """(bytes a rank moves, collectives, bytes moved now) for the step when the op computes `row`
    on `mesh_dim`: moving the inputs there and the local op's own collectives (now), and what the
    output forces later. Rows that cost the same overall prefer to communicate later (a Partial
    scaled by a number stays Partial), so that explicit-communication programs keep running."""
    parts = layouts[0].mesh_shape[mesh_dim] if layouts else 1
    bytes_moved, collectives = 0.0, 0
    for layout, meta, target in zip(layouts, metas, row.inputs):
        moved, count = transition_cost(layout, mesh_dim, target, meta.dtype.itemsize)
        bytes_moved += moved
        collectives += count
    if parts > 1:
        for collective in row.collectives:
            bytes_moved += _collective_cost(collective, parts)
            collectives += 1
    now = bytes_moved
    if parts > 1:
        tensor_outputs = [meta for meta in output_metas if meta is not None]  # rows name tensor outputs only
        follows = _follows_the_data(row, layouts, mesh_dim)
        later, count = _forced_later(row, tensor_outputs, mesh_dim, parts, follows)
        bytes_moved += later
        collectives += count
    return round(bytes_moved), collectives, round(now)  # rounded: equal paths priced in two ways tie exactly


def _ranked_rows(
    rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta],
    output_metas: Sequence[TensorMeta | None], mesh_dim: int,
) -> list[Row]:
    """The rows by estimated step cost on one mesh dim, cheapest first (ties: the one communicating
    later, then the rule's order)."""
    keyed = [
        (*row_cost(row, layouts, metas, output_metas, mesh_dim), rank_in_rule, row)
        for rank_in_rule, row in enumerate(rows)
    ]
    keyed.sort(key=lambda entry: entry[:4])
    return [entry[4] for entry in keyed]


def _planned_cost(rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta]) -> float:
    """What the redistribute planner charges (us) to move every input to the rows' placements."""
    total = 0.0
    for index, (layout, meta) in enumerate(zip(layouts, metas)):
        target = layout.with_placements([row.inputs[index] for row in rows])
        if target != layout:
            total += plan_redistribute(layout, target, meta.dtype.itemsize).total_cost_us
    return total


# Rows per mesh dim whose combinations the planner prices when the per-mesh-dim estimate moves data.
_CANDIDATES_PER_MESH_DIM = 2


def _choose_rows(
    rows: Sequence[Row], layouts: Sequence[Layout], metas: Sequence[TensorMeta],
    output_metas: Sequence[TensorMeta | None],
) -> tuple[Row, ...]:
    """One row per mesh dim: the per-mesh-dim estimate's best, unless an input is sharded on one
    tensor dim by several mesh dims (nested) and that choice moves data. Then the estimate cannot
    see the order constraints, and the redistribute planner prices the combinations of each mesh
    dim's top candidates exactly (slower: a planner search per input and combination)."""
    ranked = [
        _ranked_rows(rows, layouts, metas, output_metas, mesh_dim) for mesh_dim in range(len(layouts[0].mesh_shape))
    ]
    greedy = tuple(candidates[0] for candidates in ranked)
    nested = any(len(order) > 1 for layout in layouts for order in layout.shard_order)
    if not nested or all(
        layout.with_placements([row.inputs[index] for row in greedy]) == layout for index, layout in enumerate(layouts)
    ):
        return greedy
    best, best_cost = greedy, _planned_cost(greedy, layouts, metas)
    for combination in itertools.product(*(candidates[:_CANDIDATES_PER_MESH_DIM] for candidates in ranked)):
        if combination == greedy:
            continue
        try:
            cost = _planned_cost(combination, layouts, metas)
        except ValueError:  # a target the planner cannot reach (two Partials of different reduce ops)
            continue
        if cost < best_cost:
            best, best_cost = combination, cost
    return best


_META = torch.device("meta")


def _to_meta_tensor(value, local_metas: list | None = None):
    if isinstance(value, TensorMeta):
        meta = local_metas.pop(0) if local_metas is not None else value
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    if isinstance(value, PlainTensor):
        return torch.empty((), dtype=value.dtype, device="meta")
    if isinstance(value, torch.device):
        return _META  # `_to_copy(..., device=cpu)` on meta inputs would try to copy data out of meta
    return value


def run_on_meta(op, args: tuple, kwargs: dict, local_metas: list[TensorMeta] | None = None) -> list:
    """Run `op` on meta tensors standing for the placeholders; `local_metas` replaces DTensor ones in order."""
    flat, tree = tree_flatten((args, kwargs))
    queue = list(local_metas) if local_metas is not None else None
    meta_args, meta_kwargs = tree_unflatten([_to_meta_tensor(value, queue) for value in flat], tree)
    outputs, _ = tree_flatten(op(*meta_args, **meta_kwargs))
    return [
        TensorMeta(tuple(output.shape), tuple(output.stride()), output.dtype) if isinstance(output, torch.Tensor) else None
        for output in outputs
    ]


def _contiguous_meta(shape: tuple[int, ...], dtype: torch.dtype) -> TensorMeta:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return TensorMeta(shape, tuple(reversed(stride)), dtype)


def _inherited_shard_order(placements, ndim: int, input_layouts) -> tuple[tuple[int, ...], ...] | None:
    """The output's shard order: a tensor dim split by several mesh dims takes the order of an input dim
    split by the same mesh dims (the local op keeps each coordinate's piece where it was), else the default.

    Without this, an input whose nested order is not ascending (FSDP's data-parallel split inside a
    tensor-parallel one) would give an output whose pieces are labelled with the wrong coordinates.
    """
    mesh_dims_of = [[] for _ in range(ndim)]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            mesh_dims_of[placement.dim % ndim].append(mesh_dim)
    orders = [tuple(mesh_dims) for mesh_dims in mesh_dims_of]
    changed = False
    for dim, mesh_dims in enumerate(mesh_dims_of):
        if len(mesh_dims) < 2:
            continue
        for layout in input_layouts:
            found = next((order for order in layout.shard_order if sorted(order) == mesh_dims), None)
            if found is not None:
                changed = changed or found != orders[dim]
                orders[dim] = found
                break
    return tuple(orders) if changed else None


def _exact_output_layouts(call, rule, mesh_shape, placements, metas, input_layouts) -> tuple[Layout | None, ...]:
    """Output layouts whose pieces are exactly what the local op produces on every coordinate.

    Sharded outputs are evaluated on meta tensors of each coordinate's local input shapes (once per
    distinct set of local shapes), so uneven inputs, views and slices get exact shard sizes.
    """
    layouts: list[Layout | None] = []
    sharded = [meta is not None and any(isinstance(p, Shard) for p in placements[i]) for i, meta in enumerate(metas)]
    local_shapes: dict[tuple[int, ...], list] = {}
    if any(sharded):
        evaluated: dict = {}
        for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
            inputs = [
                _contiguous_meta(layout.local_shape(coordinate), meta.dtype)
                for layout, meta in zip(input_layouts, call.inputs)
            ]
            arguments = rule.local_arguments(call, input_layouts, coordinate) or (call.args, dict(call.kwargs))
            key = (tuple(meta.shape for meta in inputs), repr(arguments))
            if key not in evaluated:
                local_op = rule.local_op(call, input_layouts, coordinate)
                op = call.op if local_op is None else lambda *args, **kwargs: local_op(None, *args, **kwargs)
                evaluated[key] = run_on_meta(op, arguments[0], arguments[1], inputs)
            local_shapes[coordinate] = evaluated[key]
    for index, meta in enumerate(metas):
        if meta is None:
            layouts.append(None)
        elif not sharded[index]:
            layouts.append(Layout.create(mesh_shape, placements[index], meta.shape))
        else:
            shapes = {coordinate: outputs[index].shape for coordinate, outputs in local_shapes.items()}
            order = _inherited_shard_order(placements[index], meta.ndim, input_layouts)
            layout = Layout.from_local_shapes(mesh_shape, placements[index], shapes, shard_order=order)
            if layout.shape != meta.shape:
                raise RuntimeError(
                    f"sharding rule of {call.op} is wrong: placements {list(placements[index])} give local "
                    f"outputs that add up to shape {layout.shape}, not the global {meta.shape}"
                )
            layouts.append(layout)
    return tuple(layouts)


def _aligned_pieces(layouts: Sequence[Layout], targets: tuple[Layout, ...]) -> tuple[Layout, ...]:
    """Targets whose co-sharded tensor dims have the same pieces, taken from an input that keeps them.

    A row that shards two inputs over the same mesh dims pairs their pieces coordinate by coordinate.
    `with_placements` gives a newly sharded dim `torch.chunk` pieces in the default shard order, so
    an input moved next to an unevenly sharded one (`a + b`, `a` with explicit shard sizes) would
    not line up. A target dim sharded over the same mesh dims as a dim that some input keeps as it
    is, with the same global size, takes that input's shard order and pieces (the first such input);
    the redistribute planner reaches exact target pieces.
    """
    reference: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for layout, target in zip(layouts, targets):
        for dim, order in enumerate(target.shard_order):
            if order and order == layout.shard_order[dim]:
                reference.setdefault((tuple(sorted(order)), target.shape[dim]), (order, target.pieces[dim]))
    if not reference:
        return targets
    aligned = []
    for target in targets:
        orders, pieces = list(target.shard_order), list(target.pieces)
        for dim, order in enumerate(target.shard_order):
            if order:
                orders[dim], pieces[dim] = reference.get((tuple(sorted(order)), target.shape[dim]), (order, pieces[dim]))
        if tuple(pieces) == target.pieces and tuple(orders) == target.shard_order:
            aligned.append(target)
        else:
            aligned.append(dataclasses.replace(target, shard_order=tuple(orders), pieces=tuple(pieces)))
    return tuple(aligned)


# How a non-tensor argument's value enters a cache key when it does not decide (`ShardingRule.value_keys`).
TYPE_ONLY = "type"
SIGN = "sign"

# Decisions by cache key, least recently used first; at most MAX_DECISIONS (then the oldest goes).
MAX_DECISIONS = 4096
_cache: OrderedDict = OrderedDict()
# Per op: decisions made (cache misses) and decisions found in the cache, since the process started.
decisions_made: Counter = Counter()
decision_cache_hits: Counter = Counter()
# op -> how its arguments enter cache keys (dispatch fills it from the op's rule); cleared with the rules.
key_modes: dict = {}

# Counts `clear_cache` calls: a dispatch plan built from a decision is valid while this is unchanged.
generation = 0


def clear_cache() -> None:
    """Forget every decision (a rule was added or replaced), and with them the dispatch plans."""
    global generation
    _cache.clear()
    key_modes.clear()
    generation += 1


def decide(
    call: OpCall,
    layouts: Sequence[Layout],
    rule: ShardingRule,
    coordinate: Sequence[int],
    cache_key: object | None,
) -> Decision:
    """Pick a row per mesh dim and build the decision; cached under `cache_key` when it is not None."""
    if cache_key is not None:
        cached = _cache.get(cache_key)
        if cached is not None:
            _cache.move_to_end(cache_key)
            decision_cache_hits[call.op] += 1
            return cached
    if isinstance(rule, OutVariantRule):
        decision = _decide_out_variant(call, layouts, rule, coordinate)
    elif isinstance(rule, ComposedRule):
        decision = rule.decision(call, layouts, coordinate)
    else:
        decision = _decide_rows(call, layouts, rule, coordinate)
    decisions_made[call.op] += 1
    if cache_key is not None:
        while len(_cache) >= MAX_DECISIONS:
            _cache.popitem(last=False)
        _cache[cache_key] = decision
    if propagation_logger.isEnabledFor(DEBUG):
        log_decision(call.op, layouts, decision, [meta.dtype.itemsize for meta in call.inputs])
    return decision


def _decide_rows(call: OpCall, layouts: Sequence[Layout], rule: ShardingRule, coordinate: Sequence[int]) -> Decision:
    rows = rule.rows_for_layouts(call, layouts)
    if not rows:
        raise NotImplementedError(f"the sharding rule of {call.op} returned no way to compute it")
    mesh_shape = layouts[0].mesh_shape
    try:
        metas = tuple(rule.global_outputs(call))
    except NotImplementedError as error:  # e.g. `nonzero` inside boolean indexing: shapes depend on data
        raise DataDependentOutput(f"{call.op} cannot be evaluated on meta tensors: {error}") from error
    chosen = _choose_rows(rows, layouts, call.inputs, metas)
    input_layouts = _aligned_pieces(
        layouts,
        tuple(layout.with_placements([row.inputs[index] for row in chosen]) for index, layout in enumerate(layouts)),
    )
    placements: list[tuple[Placement, ...] | None] = []
    for meta in metas:  # rows name tensor outputs only, in order
        tensor_index = len([p for p in placements if p is not None])
        placements.append(None if meta is None else tuple(row.outputs[tensor_index] for row in chosen))
    output_layouts = _exact_output_layouts(call, rule, mesh_shape, placements, metas, input_layouts)
    local_arguments = rule.local_arguments(call, input_layouts, coordinate)
    local_op = rule.local_op(call, input_layouts, coordinate)
    return Decision(input_layouts, output_layouts, metas, chosen, local_arguments, local_op)
