"""What a redistribute plan is made of: the collectives a step may issue, the alpha-beta `CostModel`
that prices them, `Step` and `Plan`, and `received_bytes` (what one rank receives in a step). The
planner (`planner.py`) searches over these; the forecast prices its records with the same model."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import Layout
from ..placement import Placement, flattened_partial
from .bounds import overlap

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "CostModel", "DEFAULT_COST_MODEL", "EXCHANGE", "LOCAL_STEPS",
    "MAKE_PARTIAL", "PER_MESH_DIM_COST_MODEL", "Plan", "REDUCE_SCATTER", "RELABEL", "SLICE", "Step", "received_bytes",
]

ALL_GATHER = "all_gather"
ALL_TO_ALL = "all_to_all"
ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
SLICE = "slice"
MAKE_PARTIAL = "make_partial"
RELABEL = "relabel"
EXCHANGE = "batch_p2p"
LOCAL_STEPS = frozenset({SLICE, MAKE_PARTIAL, RELABEL})


@dataclass(frozen=True, slots=True)
class CostModel:
    """Alpha-beta constants, in microseconds: a collective costs `latency_us + bytes / bytes_per_us`.

    A `batch_p2p` exchange over the whole mesh starts slower than one collective along a mesh dim
    (`exchange_latency_us`: many messages, no collective algorithm), so it wins only when it saves
    bytes or steps. `local_step_us` is the small cost of a step without communication, so that
    among plans moving the same bytes the one with fewer steps wins. Override with e.g.
    `CostModel(latency_us=5.0)`. `flattened_groups`: whether a reduction over several Partial mesh
    dims runs as one collective; on a slice of the world it runs as one per mesh dim (`comm`), so the
    planner plans those steps and prices them as such (`PER_MESH_DIM_COST_MODEL`).
    `latency_by_kind`: (collective, latency_us) pairs that replace `latency_us` for those collectives
    (a calibrated machine's reduce_scatter may start slower than its all_gather). The same model prices
    a forecast's collectives (`shardtensor.forecast`), one per link class.
    """

    latency_us: float = 20.0
    exchange_latency_us: float = 60.0
    bytes_per_us: float = 1000.0
    local_step_us: float = 0.01
    flattened_groups: bool = True
    latency_by_kind: tuple[tuple[str, float], ...] = ()

    def step_cost(self, collective: str, bytes_per_rank: int) -> float:
        if collective in LOCAL_STEPS:
            return self.local_step_us
        return self.latency_of(collective) + bytes_per_rank / self.bytes_per_us

    def latency_of(self, collective: str) -> float:
        """The start-up time of one `collective` (any communicating kind, `batch_p2p` included)."""
        for kind, latency in self.latency_by_kind:
            if kind == collective:
                return latency
        return self.exchange_latency_us if collective == EXCHANGE else self.latency_us

    @property
    def least_latency_us(self) -> float:
        """The smallest start-up time of a collective along mesh dims (the search's admissible estimate)."""
        if not self.latency_by_kind:
            return self.latency_us
        return min([self.latency_us, *(latency for kind, latency in self.latency_by_kind if kind != EXCHANGE)])


DEFAULT_COST_MODEL = CostModel()
PER_MESH_DIM_COST_MODEL = CostModel(flattened_groups=False)


@dataclass(frozen=True, slots=True)
class Step:
    """One mesh dim changes placement. `bytes_per_rank` is the most bytes any rank receives.

    A `batch_p2p` step changes every mesh dim at once: its `mesh_dim` is None and its placements
    are the whole placement tuples. A flattened all_reduce / reduce_scatter over several Partial
    mesh dims, or all_gather over several Shard mesh dims, has a tuple `mesh_dim` (the row-major
    order of its flattened sub-mesh) and placement tuples for those mesh dims; over a
    P(sum)/P(avg) mix it prints how it reduces (`sum / 2`).
    """

    mesh_dim: int | tuple[int, ...] | None
    source_placement: Placement | tuple[Placement, ...]
    target_placement: Placement | tuple[Placement, ...]
    collective: str
    group_size: int
    bytes_per_rank: int
    cost_us: float
    before: Layout
    after: Layout

    def __str__(self) -> str:
        if self.mesh_dim is None or isinstance(self.mesh_dim, tuple):
            where = "all mesh dims" if self.mesh_dim is None else f"mesh dims {self.mesh_dim}"
            where += f": [{', '.join(map(str, self.source_placement))}] -> "
            where += f"[{', '.join(map(str, self.target_placement))}]"
        else:
            where = f"mesh dim {self.mesh_dim}: {self.source_placement} -> {self.target_placement}"
        group = f"group {self.group_size}"
        if isinstance(self.mesh_dim, tuple) and len(set(self.source_placement)) > 1:
            sizes = [self.before.mesh_shape[mesh_dim] for mesh_dim in self.mesh_dim]
            reduced_as, divisor = flattened_partial(self.source_placement, sizes)
            group += f", {reduced_as.reduce_op} / {divisor}"
        return (
            f"{where}  "
            f"{self.collective} ({group}), {self.bytes_per_rank} bytes/rank, "
            f"{self.cost_us:.2f} us"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """The steps from `source` to `target`, and what they cost against the lower bound."""

    source: Layout
    target: Layout
    itemsize: int
    steps: tuple[Step, ...]
    lower_bound_bytes: int

    @property
    def total_bytes(self) -> int:
        """Sum over steps of the most bytes any rank receives in that step."""
        return sum(step.bytes_per_rank for step in self.steps)

    @property
    def total_cost_us(self) -> float:
        return sum(step.cost_us for step in self.steps)

    @property
    def relabels_only(self) -> bool:
        """True when the local tensor does not change (no steps, or only mesh dims of size 1 move)."""
        return all(step.collective == RELABEL for step in self.steps)

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives the plan issues, in order (local steps left out)."""
        return tuple(step.collective for step in self.steps if step.collective not in LOCAL_STEPS)

    def __str__(self) -> str:
        lines = [f"redistribute {self.source}  ->  [{', '.join(map(str, self.target.placements))}], "
                 f"{self.itemsize}-byte items: {len(self.steps)} step(s)"]
        lines += [f"  {number}. {step}" for number, step in enumerate(self.steps, 1)]
        ratio = f" ({self.total_bytes / self.lower_bound_bytes:.2f}x)" if self.lower_bound_bytes else ""
        lines.append(
            f"  total {self.total_bytes} bytes/rank, {self.total_cost_us:.2f} us; "
            f"lower bound {self.lower_bound_bytes} bytes/rank{ratio}"
        )
        return "\n".join(lines)


def received_bytes(collective: str, group_size: int, before_box, after_box, itemsize: int) -> int:
    """Bytes one rank receives in a step, from its (offset, shape) boxes before and after.

    Data movement (all_gather, all_to_all) receives what the rank does not hold yet; reduce_scatter
    receives its piece from each of the other `group_size - 1` ranks; all_reduce is counted as the
    bandwidth-optimal reduce_scatter + all_gather, `2 * (group_size - 1) / group_size` of the
    tensor (rounded down, as `comm` records it).
    """
    if collective in LOCAL_STEPS:
        return 0
    after_numel = math.prod(after_box[1])
    if collective in (ALL_GATHER, ALL_TO_ALL, EXCHANGE):
        return (after_numel - overlap(before_box, after_box)) * itemsize
    if collective == REDUCE_SCATTER:
        return (group_size - 1) * after_numel * itemsize
    if collective == ALL_REDUCE:
        return 2 * (group_size - 1) * after_numel * itemsize // group_size
    raise ValueError(f"unknown collective {collective!r}")
