"""CommDebugMode: the collectives (and their bytes) a block of code issues, per module and op.

Mirrors `torch.distributed.tensor.debug.CommDebugMode`: `get_total_counts`, `get_comm_counts`,
per-module tracing (`generate_comm_debug_tracing_table(noise_level)`, `generate_json_dump`,
`log_comm_debug_tracing_table_to_file`, forward and backward apart), `get_parameter_info`,
`get_sharding_info`, `comm_module_counts`. It adds what PyTorch lacks: the bytes this rank sent and
received per kind and per module, the collectives each torch op caused, the redistribute plans that
ran (with their explain text), and the ops that took the replicate fallback.

What it counts, as torch's mode does for the same program: every collective of `shardtensor.comm`
(read from `comm.observe()` records, so collectives issued in backward, inside sharding rules and in
module hooks are all there; none on a one-rank group), and every collective the program calls directly
through `torch.distributed` (`dist.all_reduce`, `all_gather_into_tensor`, `broadcast`, `gather`,
`all_gather_object`'s two all_gathers, ...) or torch's functional collectives (`funcol.all_reduce`, ...),
seen as c10d ops by a dispatch mode pushed only while the mode is entered (`DirectRecord`, keyed like
torch: `direct_collectives`; counted on one-rank groups too, bytes not measured). Like torch's, it does
not count `dist.barrier`, `dist.send` or `dist.recv` (`comm`'s send, recv and batch_p2p do count). c10d
calls that `comm` makes itself count once, as its record.

Unlike torch's, it counts a torch.compile'd step (docs/compile.md, "Counting a compiled step's
collectives"): its dispatch mode lets dynamo compile under it (`ignore_compile_internals`), a graph's
collectives of ours are recorded by the op each leaves in the graph, and collective ops a compiled
graph issues are not counted again as direct calls; a compiled region counts for the module called
eagerly around it.

Counts are keyed by our collective kinds (strings); torch's collective ops read them too, with torch's
counts (`counts[torch.ops.c10d_functional.all_reduce]`, 0 for one that did not run: `CommCounts`).
Their c10d counterparts (`C10D_NAMES`):

| kind | c10d / functional collective |
|---|---|
| all_gather | all_gather_into_tensor (uneven sizes: all_to_all_single, still counted as all_gather) |
| all_to_all | all_to_all_single |
| all_reduce | all_reduce |
| reduce_scatter | reduce_scatter_tensor |
| broadcast | broadcast |
| scatter | scatter |
| send, recv, batch_p2p | send, recv, batch_isend_irecv |
| gather, reduce | gather, reduce (called directly only) |

    >>> with CommDebugMode() as mode:  # doctest: +SKIP
    ...     model(x).sum().backward()
    >>> mode.get_comm_module_counts()["MLP.net2"]  # doctest: +SKIP
    {'forward': {'all_reduce': 1}, 'backward': {}}
    >>> print(mode.generate_comm_debug_tracing_table(noise_level=1))  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import comm, dispatch
from ..comm.records import record_collective
from ..dtensor import DTensor
from ..redistribute.executor import observe_plans
from ..redistribute.planner import Plan
from . import direct_collectives, tracing_table
from .direct_collectives import KIND_TORCH_KEYS, TORCH_KEY_KINDS, DirectRecord
from .module_tracker import FORWARD, GLOBAL, ModuleInfo, ModuleTracker
from .tracing_table import C10D_NAMES, PHASES

__all__ = ["CommDebugMode", "CommBytes", "CommCounts", "DirectRecord", "Operation", "C10D_NAMES", "OUTSIDE_OPS"]

# Collectives not issued inside a torch op: redistribute, full_tensor, distribute_tensor, from_local.
OUTSIDE_OPS = "(no op: redistribute, full_tensor, distribute_tensor)"


@dataclasses.dataclass(frozen=True, slots=True)
class CommBytes:
    """Bytes this rank sent and received, for an ideal algorithm (see `comm.CommRecord`)."""

    sent: int
    received: int


# Our kinds: comm's and those of collectives called directly (gather and reduce).
_KINDS = frozenset(C10D_NAMES) | frozenset(TORCH_KEY_KINDS.values())


class CommCounts(dict):
    """Collectives by our kind (`{'all_reduce': 1}`) that also answers PyTorch's keys, so that code
    written for torch's CommDebugMode runs unchanged, with torch's counts: a torch op (or its key as
    text) reads the collectives torch would count under it. Ours count under the key torch DTensor's
    own collective of that kind has (`torch.ops.c10d_functional.all_reduce` for an all_reduce,
    `torch.ops.c10d.broadcast_` for distribute_tensor's broadcast: `KIND_TORCH_KEYS`); a collective
    the program called directly counts under its own op (`dist.all_reduce`: `torch.ops.c10d.allreduce_`).
    A known kind or collective op that did not run counts 0 (torch returns a defaultdict);
    `by_torch_key` holds the counts by torch key as text (`{"c10d.allreduce_": 1}`)."""

    def __init__(self, by_kind=(), by_torch_key=None):
        super().__init__(by_kind)
        self.by_torch_key: dict[str, int] = dict(by_torch_key or {})

    @classmethod
    def of(cls, records) -> CommCounts:
        """The counts of `records` (ours and `DirectRecord`s)."""
        by_kind = collections.Counter(record.kind for record in records)
        keys = (record.torch_key if isinstance(record, DirectRecord) else KIND_TORCH_KEYS.get(record.kind)
                for record in records)
        return cls(by_kind, collections.Counter(key for key in keys if key is not None))

    def __missing__(self, key):
        if isinstance(key, str) and key in _KINDS:
            return 0
        torch_key = direct_collectives.torch_key(key)
        if torch_key is None:
            raise KeyError(f"{key!r} is not a collective that CommDebugMode counts; keys are our kinds "
                           f"{sorted(_KINDS)} or torch's collective ops (torch.ops.c10d_functional.all_reduce, "
                           f"torch.ops.c10d.allreduce_, or that key as text: 'c10d.allreduce_')")
        return self.by_torch_key.get(torch_key, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Operation:
    """A torch op seen inside the mode: on DTensors ("dtensor"), on a DTensor op's local tensors
    ("local") or on plain tensors outside any DTensor op ("plain"), with the module it ran in."""

    name: str
    kind: str
    module: str
    phase: str
    input_shapes: tuple[tuple[int, ...], ...]
    input_placements: tuple[str, ...]  # of the DTensor inputs, e.g. "[S(0), R]"
    device_mesh: str
    records: range  # the collectives it issued (positions in `CommDebugMode.records`)


@dataclasses.dataclass(frozen=True, slots=True)
class _Context:
    """From collective `first_record` and plan `first_plan` on, the running module and phase."""

    first_record: int
    first_plan: int
    module: str
    phase: str


def _tensor_arguments(values) -> list[torch.Tensor]:
    tensors = []
    for value in values:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors += _tensor_arguments(value)
    return tensors


class _LocalOps(TorchDispatchMode):
    """Inside a DTensor op: notes the ops on local tensors (not the meta tensors of propagation)."""

    def __init__(self, mode: CommDebugMode):
        super().__init__()
        self.mode = mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = _tensor_arguments(args)
        if any(tensor.is_meta for tensor in tensors):
            return func(*args, **(kwargs or {}))
        return self.mode._run_plain(func, "local", tensors, args, kwargs or {})


class _Operations(TorchDispatchMode):
    """Notes every op: a DTensor op with the collectives it issued, the others as plain ops."""

    def __init__(self, mode: CommDebugMode):
        super().__init__()
        self.mode = mode
        self.local_ops = _LocalOps(mode)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let dynamo compile while the mode is active (it skips every frame under any other dispatch mode);
        the mode is off while compiling and sees the compiled code's ops when it runs."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensor_arguments(args) + _tensor_arguments(kwargs.values())
        if not any(issubclass(kind, DTensor) for kind in types):
            return self.mode._run_plain(func, "plain", tensors, args, kwargs)
        start = len(self.mode.records)
        index = self.mode._note_operation(func, "dtensor", tensors, range(start, start))  # before its local ops
        with self.local_ops:
            result = func(*args, **kwargs)
        operations = self.mode.operations
        operations[index] = dataclasses.replace(operations[index], records=range(start, len(self.mode.records)))
        return result


class CommDebugMode:
    """A context manager that records every collective this rank issues inside it, through
    `shardtensor.comm` or directly through torch.distributed and its functional collectives, with the
    module (forward or backward) and the torch op that issued it.

    The mode is reusable: entering it again starts a fresh recording. Modes nest: each counts the
    collectives run inside it; entering a mode that is already active raises (its recording would be
    replaced mid-block; torch's restarts its counts there). Outside a mode nothing is watched (no
    dispatch mode is pushed).
    """

    def __init__(self):
        self.records: list[comm.CommRecord] = []
        self.plans: list[Plan] = []
        self.operations: list[Operation] = []
        self._contexts: list[_Context] = []
        self._tracker = ModuleTracker(self._context_changed)
        self._operations_mode = _Operations(self)
        self._observers: list = []
        self._fallbacks_before: collections.Counter[str] = collections.Counter()
        self._fallbacks: collections.Counter[str] | None = None

    def __enter__(self) -> CommDebugMode:
        if self._observers:
            raise RuntimeError(
                "this CommDebugMode is already active: entering it again inside its own block would replace "
                "its recording; nest a second CommDebugMode() instead"
            )
        self._observers = [comm.observe(), observe_plans()]
        self.records = self._observers[0].__enter__()
        self.plans = self._observers[1].__enter__()
        self.operations = []
        self._contexts = [_Context(0, 0, GLOBAL, FORWARD)]
        self._tracker.__enter__()
        self._operations_mode.__enter__()
        self._fallbacks_before = collections.Counter(dispatch.fallback_counts)
        self._fallbacks = None
        return self

    def __exit__(self, *exc_info) -> None:
        self._fallbacks = collections.Counter(dispatch.fallback_counts) - self._fallbacks_before
        self._operations_mode.__exit__(*exc_info)
        self._tracker.__exit__(*exc_info)
        for observer in reversed(self._observers):
            observer.__exit__(*exc_info)
        self._observers = []

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

    # --- recording ------------------------------------------------------------------------------------
    def _context_changed(self, module: str, phase: str) -> None:
        self._contexts.append(_Context(len(self.records), len(self.plans), module, phase))

    def _note_operation(self, func, kind: str, tensors: list[torch.Tensor], records: range) -> int:
        """Append the op to `operations` (with the running module and phase); returns its position."""
        module, phase = self._tracker.current
        dtensors = [tensor for tensor in tensors if isinstance(tensor, DTensor)]
        placements = tuple("[" + ", ".join(map(str, tensor.placements)) + "]" for tensor in dtensors)
        mesh = str(dtensors[0].device_mesh) if dtensors else ""
        shapes = tuple(tuple(tensor.shape) for tensor in (dtensors if kind == "dtensor" else tensors))
        self.operations.append(Operation(str(func), kind, module, phase, shapes, placements, mesh, records))
        return len(self.operations) - 1

    def _run_plain(self, func, kind: str, tensors: list[torch.Tensor], args, kwargs):
        """Run an op on plain tensors, noted as `kind`; a collective the program called directly (not
        through `shardtensor.comm`, which records its own) is recorded as issued by that op."""
        index = self._note_operation(func, kind, tensors, range(0))
        start = len(self.records)
        result = func(*args, **kwargs)
        if func is record_collective:  # a compiled graph's collective of ours: the op recorded it
            self.operations[index] = dataclasses.replace(self.operations[index], records=range(start, len(self.records)))
            return result
        record = direct_collectives.direct_record(func, args, kwargs)
        if record is not None:
            self.records.append(record)
            records = range(len(self.records) - 1, len(self.records))
            self.operations[index] = dataclasses.replace(self.operations[index], records=records)
        return result

    def _contexts_for(self, count: int, field: str) -> list[_Context]:
        """The context of each of the first `count` collectives (field "first_record") or plans ("first_plan")."""
        starts = [getattr(context, field) for context in self._contexts]
        return [self._contexts[bisect.bisect_right(starts, index) - 1] for index in range(count)]

    def _lineage(self, module: str) -> tuple[str, ...]:
        """The module and everything it ran inside (its counts add up into theirs)."""
        info = self._tracker.modules.get(module)
        return (module,) if info is None else (*info.parents, module)

    # --- PyTorch's API ---------------------------------------------------------------------------------
    def get_total_counts(self) -> int:
        """How many collectives ran inside the block: ours (none on one-rank groups) and those called
        directly (counted as torch counts them)."""
        return len(self.records)

    def get_comm_counts(self) -> CommCounts:
        """Collectives by kind, e.g. `{'all_gather': 2, 'all_reduce': 1}`, direct calls included; torch's
        op keys read torch's counts (`counts[torch.ops.c10d.allreduce_]`: the direct `dist.all_reduce`s)."""
        return CommCounts.of(self.records)

    def get_comm_module_counts(self) -> dict[str, dict[str, CommCounts]]:
        """Per module (`Global`, `MLP`, `MLP.net1`, ... in the order first run), per phase
        (`forward`, `backward`), collectives by kind; a module's counts include its submodules'."""
        return self._by_module(CommCounts.of)

    @property
    def comm_module_counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """PyTorch's attribute name for `get_comm_module_counts()`."""
        return self.get_comm_module_counts()

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per module that ran and has parameters of its own: `{name: parameter}`."""
        return {info.fqn: dict(info.parameters) for info in self._tracker.modules.values() if info.parameters}

    def get_sharding_info(self) -> dict[str, tuple]:
        """`{"MLP.net1.weight": placements}` for every DTensor parameter of the modules that ran."""
        return self._tracker.sharding_info()

    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """The module tree with each module's collectives (counts and bytes), forward and backward.

        noise_level 0: collectives per module; 1: also module types, parameter placements, the
        DTensor ops (shapes, placements, mesh, the collectives each issued), collectives by mesh dim
        and replicate fallbacks; 2: also the ops on plain and local tensors; 3: also trivial ops
        (views, detach, ...) and the redistribute plans that ran, with their explain text.
        """
        return tracing_table.table(self, noise_level)

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: int = 3) -> None:
        """Write the tracing information as a JSON tree of modules (see `generate_comm_debug_tracing_table`)."""
        tracing_table.write_json(self, file_name, noise_level)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        """Write `generate_comm_debug_tracing_table(noise_level)` to `file_name`."""
        with open(file_name, "w") as log_file:
            log_file.write(self.generate_comm_debug_tracing_table(noise_level))

    # --- what PyTorch lacks ----------------------------------------------------------------------------
    def get_comm_bytes(self) -> dict[str, CommBytes]:
        """Bytes this rank sent and received, by collective kind (collectives called directly add 0:
        their bytes are not measured)."""
        return _bytes_by_kind(self.records)

    def get_total_bytes(self) -> CommBytes:
        """Bytes this rank sent and received over all collectives (direct calls: see `get_comm_bytes`)."""
        return CommBytes(sum(r.bytes_sent for r in self.records), sum(r.bytes_received for r in self.records))

    def get_comm_module_bytes(self) -> dict[str, dict[str, dict[str, CommBytes]]]:
        """Like `get_comm_module_counts`, with the bytes this rank sent and received per kind."""
        return self._by_module(_bytes_by_kind)

    def get_modules(self) -> dict[str, ModuleInfo]:
        """The modules that ran, in the order first run, with their type, depth and parents."""
        return dict(self._tracker.modules)

    def get_redistribute_plans(self) -> list[tuple[str, str, Plan]]:
        """Every redistribute plan that ran, in order, as (module, phase, plan); `str(plan)` explains it."""
        contexts = self._contexts_for(len(self.plans), "first_plan")
        return [(context.module, context.phase, plan) for context, plan in zip(contexts, self.plans)]

    def get_fallback_counts(self) -> dict[str, int]:
        """Ops (by name) that took the replicate fallback, with counts: no sharding rule, or a rule with no
        sharded way for the arguments (attention with dropout: `rules.ReplicateFallback`)."""
        if self._fallbacks is not None:
            return dict(self._fallbacks)
        return dict(collections.Counter(dispatch.fallback_counts) - self._fallbacks_before)

    def get_comm_counts_by_op(self) -> dict[str, dict[str, int]]:
        """Collectives by the torch op that issued them (a direct call: its c10d op); `OUTSIDE_OPS` holds
        the rest."""
        by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        inside = set()
        for operation in self.operations:
            for index in operation.records:
                by_op[operation.name][self.records[index].kind] += 1
                inside.add(index)
        for index, record in enumerate(self.records):
            if index not in inside:
                by_op[OUTSIDE_OPS][record.kind] += 1
        return {name: dict(counts) for name, counts in by_op.items()}

    def _by_module(self, summarize) -> dict:
        """`summarize(records)` per module (submodules included) and phase."""
        grouped: dict[str, dict[str, list]] = {module: {phase: [] for phase in PHASES} for module in self._tracker.modules}
        for context, record in zip(self._contexts_for(len(self.records), "first_record"), self.records):
            for module in self._lineage(context.module):
                grouped.setdefault(module, {phase: [] for phase in PHASES})[context.phase].append(record)
        return {module: {phase: summarize(records) for phase, records in phases.items()} for module, phases in grouped.items()}


def _bytes_by_kind(records) -> dict[str, CommBytes]:
    sent: collections.Counter[str] = collections.Counter()
    received: collections.Counter[str] = collections.Counter()
    for record in records:
        sent[record.kind] += record.bytes_sent
        received[record.kind] += record.bytes_received
    return {kind: CommBytes(sent[kind], received[kind]) for kind in sent}
