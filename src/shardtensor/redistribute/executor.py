"""Executor: run a redistribute `Plan` on this rank's local tensor, one step at a time through `comm`.

Sizes come from the step's layouts (`sizes_along`, `local_offset`, `local_shape`), so uneven and
empty shards are exact and no padding reaches the result. Local steps (slice, make_partial,
relabel) issue no collective.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import torch

from .. import comm
from ..rank_state import per_rank_contents
from ..placement import Partial, Replicate, flattened_partial
from .planner import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    DEFAULT_COST_MODEL,
    EXCHANGE,
    LOCAL_STEPS,
    MAKE_PARTIAL,
    PER_MESH_DIM_COST_MODEL,
    REDUCE_SCATTER,
    RELABEL,
    SLICE,
    CostModel,
    Plan,
    Step,
)

__all__ = ["execute", "observe_plans", "cost_model_for", "PendingRedistribute"]


class PendingRedistribute:
    """An async redistribute: the first collective is in flight; `wait()` finishes the plan."""

    def __init__(self, handle, remaining: Sequence[Step], mesh, coordinate: tuple[int, ...]):
        self._handle = handle
        self._remaining = tuple(remaining)
        self._mesh = mesh
        self._coordinate = coordinate
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            local = self._handle.wait()
            for step in self._remaining:
                local = _run_step(local, step, self._mesh, self._coordinate)
            self._result = local
            self._handle = None
        return self._result

    @classmethod
    def done(cls, local: torch.Tensor) -> PendingRedistribute:
        pending = cls(None, (), None, ())
        pending._result = local
        return pending


_plan_observers: list[list[Plan]] = []
per_rank_contents("redistribute.plan_observers", _plan_observers)


@contextlib.contextmanager
def observe_plans():
    """Collect every plan `execute` runs inside the block (nestable), for debug tools."""
    plans: list[Plan] = []
    _plan_observers.append(plans)
    try:
        yield plans
    finally:  # by identity: two lists of the same plans compare equal
        del _plan_observers[next(index for index, held in enumerate(_plan_observers) if held is plans)]


def cost_model_for(mesh) -> CostModel:
    """The cost model of what runs on `mesh`: on a mesh smaller than the world (a slice, e.g. a pipeline
    stage's), a reduction over several mesh dims runs as one collective per mesh dim (`comm`), so the
    planner plans and prices those steps (as torch's DTensor runs them) instead of one flattened step."""
    return DEFAULT_COST_MODEL if mesh._spans_world else PER_MESH_DIM_COST_MODEL


def _execute_error(local: torch.Tensor, plan: Plan, coordinate, expected) -> ValueError:
    return ValueError(
        f"the local tensor of shape {tuple(local.shape)} at mesh coordinate {coordinate} is not this "
        f"rank's shard of the plan's source {plan.source}, which has shape {expected}; pass the "
        f"local tensor that matches the source layout"
    )


def execute(local: torch.Tensor, plan: Plan, mesh, *, async_op: bool = False):
    """This rank's shard of `plan.target`, given its shard `local` of `plan.source`.

    With `async_op=True` the first collective is launched asynchronously and a handle is returned
    whose `wait()` runs the remaining steps and returns the tensor.
    """
    coordinate = tuple(mesh.get_coordinate())
    expected = plan.source.local_shape(coordinate)
    if tuple(local.shape) != expected:
        raise _execute_error(local, plan, coordinate, expected)
    for plans in _plan_observers:
        plans.append(plan)
    if not async_op:
        for step in plan.steps:
            local = _run_step(local, step, mesh, coordinate)
        return local
    for index, step in enumerate(plan.steps):
        if step.collective not in LOCAL_STEPS:
            handle = _run_step(local, step, mesh, coordinate, async_op=True)
            return PendingRedistribute(handle, plan.steps[index + 1 :], mesh, coordinate)
        local = _run_step(local, step, mesh, coordinate)
    return PendingRedistribute.done(local)


def _interval(layout, dim: int, coordinate: Sequence[int]) -> tuple[int, int]:
    """(start, stop) on tensor dim `dim` of the shard held at `coordinate`."""
    start = layout.local_offset(coordinate)[dim]
    return start, start + layout.local_shape(coordinate)[dim]


def _overlap_length(first: tuple[int, int], second: tuple[int, int]) -> int:
    return max(0, min(first[1], second[1]) - max(first[0], second[0]))


def _resplit_sizes(step: Step, dim: int, coordinate: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Split sizes (mine before ∩ each peer's after) and concat sizes (each peer's before ∩ mine after)."""
    mine_before = _interval(step.before, dim, coordinate)
    mine_after = _interval(step.after, dim, coordinate)
    split_sizes, concat_sizes = [], []
    peer = list(coordinate)
    for position in range(step.group_size):
        peer[step.mesh_dim] = position
        split_sizes.append(_overlap_length(mine_before, _interval(step.after, dim, peer)))
        concat_sizes.append(_overlap_length(_interval(step.before, dim, peer), mine_after))
    return split_sizes, concat_sizes


def _slice(local: torch.Tensor, step: Step, coordinate: tuple[int, ...]) -> torch.Tensor:
    before_offset = step.before.local_offset(coordinate)
    after_offset = step.after.local_offset(coordinate)
    after_shape = step.after.local_shape(coordinate)
    for dim in range(local.ndim):
        if after_shape[dim] != local.shape[dim]:
            local = local.narrow(dim, after_offset[dim] - before_offset[dim], after_shape[dim])
    return local.contiguous()


def _region(first_offset, first_shape, second_offset, second_shape):
    """(offset, shape) of the intersection of two boxes, or None when it is empty."""
    offset = tuple(max(a, b) for a, b in zip(first_offset, second_offset))
    stop = tuple(min(a + m, b + n) for a, m, b, n in zip(first_offset, first_shape, second_offset, second_shape))
    shape = tuple(end - start for start, end in zip(offset, stop))
    return (offset, shape) if all(size > 0 for size in shape) else None


def _narrow(tensor: torch.Tensor, tensor_offset, region) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(region[0], region[1])):
        tensor = tensor.narrow(dim, start - tensor_offset[dim], length)
    return tensor


def _sender_for(receiver: tuple[int, ...], holder: tuple[int, ...], before) -> tuple[int, ...]:
    """Which replica of `holder`'s source shard serves `receiver`: the one sharing its coordinates on
    the mesh dims that replicate the source (so every replica serves its own part of the mesh)."""
    return tuple(
        receiver[mesh_dim] if isinstance(placement, Replicate) else holder[mesh_dim]
        for mesh_dim, placement in enumerate(before.placements)
    )


def _exchange(local: torch.Tensor, step: Step, mesh, me: tuple[int, ...], *, async_op: bool = False):
    """Every rank receives exactly the target elements it lacks, point to point over the whole mesh."""
    before, after = step.before, step.after
    coordinates = list(itertools.product(*(range(size) for size in before.mesh_shape)))
    box = {c: (before.local_offset(c), before.local_shape(c)) for c in coordinates}
    wanted = {c: (after.local_offset(c), after.local_shape(c)) for c in coordinates}
    operations, placements = [], []
    for peer in coordinates:
        if peer == me:
            continue
        if box[me] != box[peer] and _sender_for(peer, me, before) == me:
            region = _region(*box[me], *wanted[peer])
            if region is not None:
                send = _narrow(local, box[me][0], region)
                operations.append(comm.PointToPoint("send", send, _global_rank(mesh, peer)))
        if box[me] != box[peer] and _sender_for(me, peer, before) == peer:
            region = _region(*box[peer], *wanted[me])
            if region is not None:
                buffer = torch.empty(region[1], dtype=local.dtype, device=local.device)
                operations.append(comm.PointToPoint("recv", buffer, _global_rank(mesh, peer)))
                placements.append(region)
    output = torch.empty(wanted[me][1], dtype=local.dtype, device=local.device)
    kept = _region(*box[me], *wanted[me])
    if kept is not None:
        _narrow(output, wanted[me][0], kept).copy_(_narrow(local, box[me][0], kept))

    # Peers differ from this rank only on mesh dims the source does not replicate (`_sender_for`).
    mesh_dims = tuple(mesh_dim for mesh_dim, placement in enumerate(before.placements)
                      if not isinstance(placement, Replicate) and before.mesh_shape[mesh_dim] > 1)
    return exchange_into(output, wanted[me][0], operations, placements, async_op=async_op, mesh=mesh, mesh_dims=mesh_dims)


def exchange_into(output: torch.Tensor, output_offset, operations: list, regions: list, *, async_op: bool,
                  mesh=None, mesh_dims: tuple[int, ...] | None = None):
    """Run point-to-point `operations` and copy each received piece into its region of `output`; the
    peers lie along `mesh_dims` of `mesh` (named in the record), or anywhere without a mesh."""

    def assemble(received) -> torch.Tensor:
        for region, piece in zip(regions, received):
            _narrow(output, output_offset, region).copy_(piece)
        return output

    if not operations:
        return _Done(output) if async_op else output
    if async_op:
        return _Assembled(comm.batch_p2p(operations, async_op=True, mesh=mesh, mesh_dim=mesh_dims), assemble)
    return assemble(comm.batch_p2p(operations, mesh=mesh, mesh_dim=mesh_dims))


def _global_rank(mesh, coordinate: tuple[int, ...]) -> int:
    return int(mesh.mesh[coordinate])


class _Done:
    """A finished async result."""

    def __init__(self, result: torch.Tensor):
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


class _Assembled:
    """An async exchange: wait for the messages, then place them in the output."""

    def __init__(self, handle, assemble):
        self._handle = handle
        self._assemble = assemble
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._assemble(self._handle.wait())
        return self._result


def _flattened_reduction(local: torch.Tensor, step: Step, mesh, coordinate: tuple[int, ...], *, async_op: bool):
    """One all_reduce or reduce_scatter over the sub-mesh of `step.mesh_dim` flattened row-major
    (a P(sum)/P(avg) mix: a sum, divided by the ranks along the avg mesh dims)."""
    source, divisor = flattened_partial(step.source_placement, [step.before.mesh_shape[m] for m in step.mesh_dim])
    result = _flattened_collective(source, local, step, mesh, coordinate, async_op=async_op)
    if divisor == 1:
        return result
    return _Assembled(result, lambda total: total.div_(divisor)) if async_op else result.div_(divisor)


def _flattened_gather(local: torch.Tensor, step: Step, mesh, coordinate: tuple[int, ...], *, async_op: bool):
    """One all_gather over the sub-mesh of `step.mesh_dim` flattened row-major (in shard order, so
    the peers' pieces are consecutive on the tensor dim), with their exact sizes."""
    dim = step.source_placement[0].dim
    sizes = _flattened_sizes(step.before, step.mesh_dim, dim, coordinate)
    return comm.all_gather(local, mesh, step.mesh_dim, dim=dim, sizes=sizes, async_op=async_op)


def _flattened_sizes(layout, mesh_dims: tuple[int, ...], dim: int, coordinate: tuple[int, ...]) -> list[int]:
    """Sizes on tensor dim `dim` of `layout`'s shards at the peers along `mesh_dims`, row-major."""
    sizes = []
    for peer_position in itertools.product(*(range(layout.mesh_shape[m]) for m in mesh_dims)):
        peer = list(coordinate)
        for mesh_dim, position in zip(mesh_dims, peer_position):
            peer[mesh_dim] = position
        sizes.append(layout.local_shape(peer)[dim])
    return sizes


def _flattened_collective(source: Partial, local: torch.Tensor, step: Step, mesh, coordinate: tuple[int, ...], *,
                          async_op: bool):
    if step.collective == ALL_REDUCE:
        return _reduced(source, local, async_op, lambda operands, reduce_op: comm.all_reduce(
            operands, mesh, step.mesh_dim, reduce_op=reduce_op, async_op=async_op))
    dim = step.target_placement[0].dim
    sizes = _flattened_sizes(step.after, step.mesh_dim, dim, coordinate)
    return _reduced(source, local, async_op, lambda operands, reduce_op: comm.reduce_scatter(
        operands, mesh, step.mesh_dim, reduce_op=reduce_op, dim=dim, sizes=sizes, async_op=async_op))


def _reduced(source, local: torch.Tensor, async_op: bool, collective):
    """`collective(operands, reduce_op)` (an all_reduce or reduce_scatter) run the way the Partial
    `source` combines: its operands and reduce op in, its value out (a p-norm's powers and root)."""
    result = collective(source.to_collective(local), source.collective_op)
    if type(source) is Partial:  # plain reduce ops: the collective's result is the value
        return result
    return _Assembled(result, source.from_collective) if async_op else source.from_collective(result)


def _run_step(local: torch.Tensor, step: Step, mesh, coordinate: tuple[int, ...], *, async_op: bool = False):
    """One step; returns the new local tensor, or with `async_op` a handle whose `wait()` returns it."""
    collective, mesh_dim = step.collective, step.mesh_dim
    source, target = step.source_placement, step.target_placement
    if collective == RELABEL:
        return local
    if collective == EXCHANGE:
        return _exchange(local, step, mesh, coordinate, async_op=async_op)
    if isinstance(mesh_dim, tuple) and collective == ALL_GATHER:
        return _flattened_gather(local, step, mesh, coordinate, async_op=async_op)
    if isinstance(mesh_dim, tuple):
        return _flattened_reduction(local, step, mesh, coordinate, async_op=async_op)
    if collective == SLICE:
        return _slice(local, step, coordinate)
    if collective == MAKE_PARTIAL:
        return target.operand_of(local, first=coordinate[mesh_dim] == 0)
    if collective == ALL_GATHER:
        sizes = step.before.sizes_along(mesh_dim, source.dim, coordinate)
        return comm.all_gather(local, mesh, mesh_dim, dim=source.dim, sizes=sizes, async_op=async_op)
    if collective == ALL_TO_ALL:
        if source == target:
            split_sizes, concat_sizes = _resplit_sizes(step, source.dim, coordinate)
        else:
            split_sizes = step.after.sizes_along(mesh_dim, target.dim, coordinate)
            concat_sizes = step.before.sizes_along(mesh_dim, source.dim, coordinate)
        return comm.all_to_all(
            local, mesh, mesh_dim, split_dim=target.dim, split_sizes=split_sizes,
            concat_dim=source.dim, concat_sizes=concat_sizes, async_op=async_op,
        )
    if collective == ALL_REDUCE:
        return _reduced(source, local, async_op, lambda operands, reduce_op: comm.all_reduce(
            operands, mesh, mesh_dim, reduce_op=reduce_op, async_op=async_op))
    if collective == REDUCE_SCATTER:
        sizes = step.after.sizes_along(mesh_dim, target.dim, coordinate)
        return _reduced(source, local, async_op, lambda operands, reduce_op: comm.reduce_scatter(
            operands, mesh, mesh_dim, reduce_op=reduce_op, dim=target.dim, sizes=sizes, async_op=async_op))
    raise ValueError(f"unknown collective {collective!r} in step {step}")
