"""The vocabulary of sharding rules: what a rule sees (`OpCall`, `TensorMeta`), what it returns (`Row`s
of placements for one mesh dim, with the `LocalCollective`s its local op issues), the interface it
implements (`ShardingRule` and its kinds: `RowsRule`, `OutVariantRule`, `ComposedRule`), and the
`Decision` that propagation builds from it. Kept apart from `propagation`, which chooses among rows,
so that the op modules that write rules import only these values.
"""

from __future__ import annotations

import cmath
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layout import Layout
from .placement import Placement

__all__ = [
    "Row", "LocalCollective", "TensorMeta", "PlainTensor", "ReplicateFallback", "DataDependentOutput", "ResizesWritten", "OpCall",
    "schema_positions", "ShardingRule", "RowsRule", "OutVariantRule", "ComposedRule", "Decision",
    "TYPE_ONLY", "SIGN", "UNREAD", "sign_of", "scale_sign", "run_on_meta", "rows_keeping_self",
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


# `PlainTensor.sign` of a 0-d plain tensor whose value was not read (or is a finite complex number).
UNREAD = "unread"


@dataclass(frozen=True, slots=True)
class PlainTensor:
    """Stands for a 0-d plain tensor argument: its dtype matters to the op, and its value only as
    a scale of a Partial: `sign` is then `scale_sign` of it (read by `plain_tensors.scale_signs`), else `UNREAD`."""

    dtype: torch.dtype
    sign: int | None | str = UNREAD


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
    _global_outputs: list | None = field(default=None, init=False, repr=False, compare=False, hash=False)

    def global_output_metas(self) -> list:
        """`run_on_meta` of the op on the global inputs, run once per call: a rule asks for it several
        times per decision (a view per coordinate), and under torch.compile's symbolic shapes a run
        costs milliseconds of sympy."""
        if self._global_outputs is None:
            object.__setattr__(self, "_global_outputs", run_on_meta(self.op, self.args, dict(self.kwargs)))
        return list(self._global_outputs)

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


class ReplicateFallback(Exception):
    """A rule's verdict that it has no way to compute this call on shards: dispatch takes the replicate
    fallback, as for an op without a rule (logged, counted in `fallback_counts`, refused in strict mode),
    so that every computation that gathers all inputs and runs whole on every rank is accounted alike.
    `draws`: whether the op draws from torch's generator (seeded alike on every rank); None: as its
    `nondeterministic_seeded` tag says."""

    def __init__(self, message: str, draws: bool | None = None):
        super().__init__(message)
        self.draws = draws


class DataDependentOutput(ReplicateFallback):
    """The op's output metadata depends on tensor values, so no rule can decide it ahead of the data."""


class ResizesWritten(Exception):
    """An in-place or `out=` op changes the shape of a tensor it writes (torch resizes an `out=` tensor
    of another shape, `addbmm_` a broadcast `self`): dispatch computes `functional_op` instead and
    gives its results to the written tensors."""

    def __init__(self, message: str, functional_op):
        super().__init__(message)
        self.functional_op = functional_op


def rows_keeping_self(rows: Sequence[Row], written: Layout) -> Sequence[Row]:
    """The rows of an op writing into its first input in which the result lies like that input, and
    of those the ones that keep it where it lies (`written`'s placements), when some do.

    The result is written into the input's shard and keeps its placement, so a row that changes it
    is wrong in place: `x.mul_(-1)` of a P(max) `x` holds the operands of a P(min), and its own
    P(max) would read them as a maximum. Computing into a moved copy moves the result back when it
    is written (a Partial copy of a Replicate tensor reduced, a Shard copy gathered): a collective
    per call that the row cost does not see, where moving the other inputs costs at most as much
    (and a multi-tensor call reduces them together: `exp_avg.lerp_(grad)` with a Partial gradient).
    An op that returns nothing (a custom op that only mutates its input) has no result to compare.
    """
    rows = [row for row in rows if not row.outputs or row.outputs[0] == row.inputs[0]]
    placements = set(written.placements)
    return [row for row in rows if row.inputs[0] in placements] or rows


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
    # True: the rule's local op reads the values `value_keys` leaves out from each call's arguments, so
    # that a plan may keep it for calls with other values (otherwise dispatch refuses the combination).
    local_op_reads_values: bool = False
    # The rule a multi-tensor op decides its elements with (`ops.foreach`: it runs no local op per
    # element), when rows of this one need a local op; None: this one.
    rule_for_lists: ShardingRule | None = None
    # True: the op returns one Python value read from the data (`item()`, `equal`), which meta tensors
    # cannot give; on a sub-mesh its ranks send it to the ranks outside (`sub_mesh`, from `dispatch`).
    returns_value: bool = False

    def rows(self, call: OpCall) -> Sequence[Row]:
        raise NotImplementedError

    def rows_for_layouts(self, call: OpCall, layouts: Sequence[Layout]) -> Sequence[Row]:
        """The rows for these input layouts: `rows(call)`, unless a row is right only for some shard
        sizes (a view splitting a sharded dim) and the rule checks them."""
        return self.rows(call)

    def global_outputs(self, call: OpCall) -> list[TensorMeta | None]:
        """Global metadata of the op's outputs (None for a non-tensor one), from the op on meta
        tensors; a rule whose op cannot run on them (`histogram`) says what it returns."""
        if self.returns_value:
            return [None]
        return call.global_output_metas()

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

    def random_calls(self, call: OpCall) -> int:
        """How many numbers of shardtensor's random counter (`random.next_random_call`) the local op
        takes. Ranks outside the mesh do not run it and take as many without drawing, so that the
        counter stays the same on every rank of the world."""
        return 0

    def local_output_shapes(self, op: Callable, arguments: tuple[tuple, dict], local_inputs: list[TensorMeta]) -> list:
        """Shapes of the local op's outputs (None for a non-tensor one) on tensors of `local_inputs`
        (placeholder order) with `arguments`: `op` (the op, or the rule's local op without a mesh) on
        meta tensors. A rule whose meta kernel is slow and whose shapes are simple says them itself."""
        return [None if meta is None else meta.shape for meta in run_on_meta(op, arguments[0], arguments[1], local_inputs)]

    def local_shape_key(self, call: OpCall, input_layouts: Sequence[Layout], coordinate: Sequence[int]):
        """What the local op's output shapes depend on at `coordinate` besides its local input shapes
        and arguments (a halo exchange's window); coordinates with equal keys share one evaluation on
        meta tensors. None: nothing else."""
        return None

    def shapes_follow_local_inputs(self, call: OpCall) -> bool:
        """Whether the local outputs' shapes depend on the coordinate only through its local input
        shapes (the rule has no per-coordinate arguments or shape key), so propagation can evaluate one
        coordinate per distinct set of local input shapes without visiting every coordinate of the mesh."""
        rule = type(self)
        return rule.local_arguments is ShardingRule.local_arguments and rule.local_shape_key is ShardingRule.local_shape_key


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

    @property
    def local_op_reads_values(self) -> bool:
        return self.functional_rule().local_op_reads_values

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

    def random_calls(self, call: OpCall) -> int:
        return self.functional_rule().random_calls(self.split(call)[0])

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


# How a non-tensor argument's value enters a cache key when it does not decide (`ShardingRule.value_keys`).
TYPE_ONLY = "type"
SIGN = "sign"


def sign_of(value: int | float) -> int | None:
    """What of a SIGN argument decides: its sign (-1, 0 or 1), or None when it is not finite.

    Scaling every operand of a Partial by inf or NaN is not scaling their reduction (a sum of +inf
    and -inf operands is NaN where inf times the sum is +-inf), so such a scale is a class of its own.
    """
    if not math.isfinite(value):
        return None
    return (value > 0) - (value < 0)


def scale_sign(value: int | float | complex) -> int | None | str:
    """`sign_of` a scale that may be complex: a complex one has no sign, so it is None when not finite, 0
    when zero and `UNREAD` otherwise (a Partial scaled by it stays linear, nothing more)."""
    if not isinstance(value, complex):
        return sign_of(value)
    if not cmath.isfinite(value):
        return None
    return 0 if value == 0 else UNREAD


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
    """Run `op` on meta tensors standing for the placeholders; `local_metas` replaces DTensor ones in order.

    Below any dispatch mode: meta tensors need none, and under torch.compile's fake, functional and
    proxy modes each meta tensor and op would be wrapped and traced into the graph (then dropped)."""
    flat, tree = tree_flatten((args, kwargs))
    queue = list(local_metas) if local_metas is not None else None
    with torch._C._DisableTorchDispatch():
        meta_args, meta_kwargs = tree_unflatten([_to_meta_tensor(value, queue) for value in flat], tree)
        outputs, _ = tree_flatten(op(*meta_args, **meta_kwargs))
    return [
        TensorMeta(tuple(output.shape), tuple(output.stride()), output.dtype) if isinstance(output, torch.Tensor) else None
        for output in outputs
    ]
