"""Sharding propagation: from an op's rule and its inputs' layouts to one decision, cached.

`decide` asks the rule for its rows (`rules.Row`, one mesh dim each), takes the cheapest row per
mesh dim (`row_costs.choose_rows`), and builds the full input layouts (pieces aligned with the inputs
they meet) and exact output layouts (each coordinate's local output shapes from the local op on meta
tensors). `out=` overloads decide their functional op and write into the out tensors; composed rules
build their own decision. Decisions are cached by (op, input layouts, dtypes, the non-tensor arguments
that decide): the hot path is one dict lookup. The cache is a bounded LRU (`MAX_DECISIONS`), and counts
decisions made per op.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from .layout import Layout
from .log import DEBUG, log_decision, propagation_logger
from .placement import REDUCE_OPS, NormPartial, Partial, Placement, Shard
from .row_costs import choose_rows
from .rules import (
    ComposedRule, DataDependentOutput, Decision, OpCall, OutVariantRule, ResizesWritten, Row, ShardingRule, TensorMeta,
    rows_keeping_self,
)

__all__ = ["decide", "clear_cache", "MAX_DECISIONS", "decisions_made", "decision_cache_hits"]


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


def _coordinates_covering(mesh_shape, input_layouts: Sequence[Layout], outputs) -> list[tuple[int, ...]]:
    """Coordinates that show every (set of local input shapes, output piece) pair the whole mesh shows,
    for a rule whose local output shapes follow from its local input shapes alone: a few per mesh dim
    instead of every coordinate of a 16,384-rank mesh.

    Mesh dims that shard one tensor dim of an input or an output together form a group; the local
    input shapes are a product over groups of what each group's sub-coordinate holds. Each group's
    sub-coordinates are classed by the input piece sizes they hold; the coordinates returned take,
    for every combination of classes, every member of each group's class with the other groups at
    their class's first member. So every output piece is reached from every class combination that
    holds it, and `Layout.from_local_shapes` checks the same pairs as on the whole mesh.
    """
    group_of = list(range(len(mesh_shape)))

    def find(mesh_dim: int) -> int:
        while group_of[mesh_dim] != mesh_dim:
            mesh_dim = group_of[mesh_dim]
        return mesh_dim

    orders = [order for layout in input_layouts for order in layout.shard_order if len(order) > 1]
    for placements, ndim in outputs:  # (placements, ndim) of each sharded output
        by_dim = defaultdict(list)
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                by_dim[placement.dim % ndim].append(mesh_dim)
        orders += [mesh_dims for mesh_dims in by_dim.values() if len(mesh_dims) > 1]
    for order in orders:
        for mesh_dim in order[1:]:
            group_of[find(mesh_dim)] = find(order[0])
    groups = defaultdict(list)
    for mesh_dim in range(len(mesh_shape)):
        groups[find(mesh_dim)].append(mesh_dim)
    classes_per_group = []
    for mesh_dims in groups.values():
        held = [(layout, dim) for layout in input_layouts for dim, order in enumerate(layout.shard_order)
                if order and set(order) <= set(mesh_dims)]
        classes: dict[tuple, list[tuple[int, ...]]] = {}
        for values in itertools.product(*(range(mesh_shape[mesh_dim]) for mesh_dim in mesh_dims)):
            coordinate = [0] * len(mesh_shape)
            for mesh_dim, value in zip(mesh_dims, values):
                coordinate[mesh_dim] = value
            signature = tuple(layout.pieces[dim][layout.piece_index(dim, coordinate)] for layout, dim in held)
            classes.setdefault(signature, []).append(values)
        classes_per_group.append((mesh_dims, list(classes.values())))
    coordinates = []
    for combination in itertools.product(*(classes for _, classes in classes_per_group)):
        first = [0] * len(mesh_shape)
        for (mesh_dims, _), members in zip(classes_per_group, combination):
            for mesh_dim, value in zip(mesh_dims, members[0]):
                first[mesh_dim] = value
        for (mesh_dims, _), members in zip(classes_per_group, combination):
            for values in members:
                coordinate = list(first)
                for mesh_dim, value in zip(mesh_dims, values):
                    coordinate[mesh_dim] = value
                coordinates.append(tuple(coordinate))
    return coordinates


def _exact_output_layouts(call, rule, mesh_shape, placements, metas, input_layouts) -> tuple[Layout | None, ...]:
    """Output layouts whose pieces are exactly what the local op produces on every coordinate.

    Sharded outputs are evaluated on meta tensors of each coordinate's local input shapes (once per
    distinct set of local shapes; `rule.local_output_shapes`), so uneven inputs, views and slices get
    exact shard sizes.
    """
    layouts: list[Layout | None] = []
    sharded = [meta is not None and any(isinstance(p, Shard) for p in placements[i]) for i, meta in enumerate(metas)]
    local_shapes: dict[tuple[int, ...], list] = {}
    if any(sharded):
        evaluated: dict = {}
        symbolic = any(layout.is_symbolic for layout in input_layouts)  # unhashable shapes: one evaluation per coordinate
        if rule.shapes_follow_local_inputs(call) and not symbolic:
            outputs = [(placements[i], metas[i].ndim) for i, is_sharded in enumerate(sharded) if is_sharded]
            coordinates = _coordinates_covering(mesh_shape, input_layouts, outputs)
        else:
            coordinates = itertools.product(*(range(size) for size in mesh_shape))
        for coordinate in coordinates:
            inputs = [
                _contiguous_meta(layout.local_shape(coordinate), meta.dtype)
                for layout, meta in zip(input_layouts, call.inputs)
            ]
            arguments = rule.local_arguments(call, input_layouts, coordinate) or (call.args, dict(call.kwargs))
            key = coordinate if symbolic else (
                tuple(meta.shape for meta in inputs), repr(arguments), rule.local_shape_key(call, input_layouts, coordinate)
            )
            if key not in evaluated:
                local_op = rule.local_op(call, input_layouts, coordinate)
                op = call.op if local_op is None else lambda *args, **kwargs: local_op(None, *args, **kwargs)
                evaluated[key] = rule.local_output_shapes(op, arguments, inputs)
            local_shapes[coordinate] = evaluated[key]
    for index, meta in enumerate(metas):
        if meta is None:
            layouts.append(None)
        elif not sharded[index]:
            layouts.append(Layout.create(mesh_shape, placements[index], meta.shape))
        else:
            shapes = {coordinate: outputs[index] for coordinate, outputs in local_shapes.items()}
            order = _inherited_shard_order(placements[index], meta.ndim, input_layouts)
            layout = Layout.from_local_shapes(mesh_shape, placements[index], shapes, shard_order=order)
            if layout.shape != meta.shape:
                raise RuntimeError(
                    f"sharding rule of {call.op} is wrong: placements {list(placements[index])} give local "
                    f"outputs that add up to shape {layout.shape}, not the global {meta.shape}"
                )
            layouts.append(layout)
    return tuple(layouts)


def _size_key(size):
    """A size as a dict key: a SymInt (unhashable) by its expression, so equal expressions align."""
    return size if isinstance(size, int) else str(size)


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
                reference.setdefault((tuple(sorted(order)), _size_key(target.shape[dim])), (order, target.pieces[dim]))
    if not reference:
        return targets
    aligned = []
    for target in targets:
        orders, pieces = list(target.shard_order), list(target.pieces)
        for dim, order in enumerate(target.shard_order):
            if order:
                orders[dim], pieces[dim] = reference.get((tuple(sorted(order)), _size_key(target.shape[dim])), (order, pieces[dim]))
        if tuple(pieces) == target.pieces and tuple(orders) == target.shard_order:
            aligned.append(target)
        else:
            aligned.append(dataclasses.replace(target, shard_order=tuple(orders), pieces=tuple(pieces)))
    return tuple(aligned)


# Decisions by cache key, least recently used first; at most MAX_DECISIONS (then the oldest goes).
MAX_DECISIONS = 4096
_cache: OrderedDict = OrderedDict()
# Per op: decisions made (cache misses) and decisions found in the cache, since the process started.
decisions_made: Counter = Counter()
decision_cache_hits: Counter = Counter()
# op -> how its arguments enter cache keys (dispatch fills it from the op's rule); cleared with the rules.
key_modes: dict = {}
# op or public function -> whether its keys hold a 0-d plain scale's sign (`plan_cache.reads_scale_signs`
# fills it from the rules); cleared with the rules.
sign_readers: dict = {}

# Counts `clear_cache` calls: a dispatch plan built from a decision is valid while this is unchanged.
generation = 0


def clear_cache() -> None:
    """Forget every decision (a rule was added or replaced), and with them the dispatch plans."""
    global generation
    _cache.clear()
    key_modes.clear()
    sign_readers.clear()
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


def _with_norm_partials(rows: Sequence[Row], layouts: Sequence[Layout]) -> Sequence[Row]:
    """The rows, and for each NormPartial among the input layouts the rows a rule gives alike for
    every reduce op: an op that keeps any Partial (it moves, copies or zero-fills elements, whatever
    combines them) keeps a p-norm's too, so stacked per-tensor norms stay unreduced."""
    norms = sorted({p for layout in layouts for p in layout.placements if isinstance(p, NormPartial)},
                   key=lambda placement: placement.order)
    if not norms:
        return rows
    reduce_ops_of: defaultdict[tuple, set[str]] = defaultdict(set)
    for row in rows:
        reduce_ops = {p.reduce_op for p in row.outputs + row.inputs if isinstance(p, Partial)}
        if len(reduce_ops) == 1:
            template = tuple(None if isinstance(p, Partial) else p for p in row.outputs + row.inputs)
            reduce_ops_of[(template, len(row.outputs), row.collectives)] |= reduce_ops
    added = []
    for (template, outputs, collectives), reduce_ops in reduce_ops_of.items():
        if reduce_ops >= set(REDUCE_OPS):
            for norm in norms:
                placements = tuple(norm if p is None else p for p in template)
                added.append(Row(placements[:outputs], placements[outputs:], collectives))
    return list(rows) + added


def _keeping_written_self(call: OpCall, rows: Sequence[Row], layouts: Sequence[Layout]) -> Sequence[Row]:
    """`rows_keeping_self` for an op writing into its first argument (`lerp_`, `addcmul_`)."""
    first = call.op._schema.arguments[0] if call.op._schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write or not call.args \
            or not isinstance(call.args[0], TensorMeta):
        return rows
    return rows_keeping_self(rows, layouts[0])


def _decide_rows(call: OpCall, layouts: Sequence[Layout], rule: ShardingRule, coordinate: Sequence[int]) -> Decision:
    rows = _keeping_written_self(call, _with_norm_partials(rule.rows_for_layouts(call, layouts), layouts), layouts)
    if not rows:
        raise NotImplementedError(f"the sharding rule of {call.op} returned no way to compute it")
    mesh_shape = layouts[0].mesh_shape
    try:
        metas = tuple(rule.global_outputs(call))
    except NotImplementedError as error:  # e.g. `nonzero` inside boolean indexing: shapes depend on data
        raise DataDependentOutput(f"{call.op} cannot be evaluated on meta tensors: {error}") from error
    chosen = choose_rows(rows, layouts, call.inputs, metas)
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
