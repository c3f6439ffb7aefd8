"""Every rank of a world in this one process: threads over an in-memory process group, one rank at a time.

`launch.simulate` runs each rank in a thread of its own, but only one rank runs at any moment: it holds
the baton, and hands it on only where a real rank would wait for others (a collective or a receive that
is not complete yet, or the end of its function). So the state that torch and this library keep per
process is switched like a thread's context at each hand-over: torch.distributed's world (the default
group and its registries, `distributed_c10d._world`, which torch names as the extension point to
override), torch's default CPU generator, and the library's per-rank state (`rank_state`). The eager
hot path reads its globals as before.

Collectives are deposited, not waited for: the last rank of a group to reach one computes every rank's
result (reductions in group rank order) and marks the others' work done, so async calls overlap as on
gloo. When no rank can run while some wait (a collective some rank never calls, a rank that returned
early) the simulation stops at once, saying which rank waits on what; nothing hangs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import rank_state

__all__ = ["BACKEND", "Simulation", "SimulationStopped", "process_context", "install_context"]

BACKEND = "shardtensor_simulated"
_current = threading.local()  # in a rank's thread: `simulation`, the Simulation it belongs to


class SimulationStopped(BaseException):
    """Raised in a rank's thread when the simulation stopped (deadlock, timeout): not an error of this
    rank's own, so not an `Exception` a program might catch."""


class _RankWorld(distributed_c10d._World):
    """torch.distributed's per-process world (default group, group registries), one per simulated rank."""

    def __init__(self):
        super().__init__()
        self._pg_map, self._pg_names, self._pg_group_ranks, self._pg_backend_config = {}, {}, {}, {}
        self._tags_to_pg, self._pg_to_tag, self._group_count = {}, {}, 0

    pg_map = property(lambda self: self._pg_map)
    pg_names = property(lambda self: self._pg_names)
    pg_group_ranks = property(lambda self: self._pg_group_ranks)
    pg_backend_config = property(lambda self: self._pg_backend_config)
    tags_to_pg = property(lambda self: self._tags_to_pg)
    pg_to_tag = property(lambda self: self._pg_to_tag)

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


@dataclasses.dataclass(slots=True)
class _RankContext:
    """What a rank's thread switches in when it takes the baton."""

    world: distributed_c10d._World
    generator_state: torch.Tensor
    library: dict


def process_context() -> _RankContext:
    return _RankContext(distributed_c10d._world, torch.default_generator.get_state(), rank_state.saved_state())


def install_context(context: _RankContext) -> None:
    distributed_c10d._world = context.world
    torch.default_generator.set_state(context.generator_state)
    rank_state.install_state(context.library)


class _Work(dist.Work):
    """One rank's handle on an operation; `wait` hands the baton on until the operation is done."""

    def __init__(self, simulation: Simulation, rank: int, what: str):
        super().__init__()
        self.simulation, self.rank, self.what, self.done = simulation, rank, what, False

    def wait(self, timeout=None) -> bool:
        self.simulation.wait(self)
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future = torch.futures.Future()
        future.set_result(None)
        return future


@dataclasses.dataclass(slots=True)
class _Operation:
    """A collective some ranks of a group have reached: their deposits and works, by group rank."""

    kind: str
    deposits: dict = dataclasses.field(default_factory=dict)
    works: list = dataclasses.field(default_factory=list)


class Simulation:
    """One simulated world of `world_size` ranks: the baton, the collectives in progress, the mailboxes."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.store = dist.HashStore()
        self._lock = threading.Lock()
        self._turns = [threading.Condition(self._lock) for _ in range(world_size)]
        self._running: int | None = None
        self._ready: set[int] = set()  # ranks that can run, waiting for the baton
        self._waiting: dict[int, _Work] = {}  # ranks waiting for an operation to complete
        self._arrived = 0
        self._finished: set[int] = set()
        self._contexts: list[_RankContext | None] = [None] * world_size
        self.stopped: str | None = None
        self.operations: dict[tuple, _Operation] = {}  # (group name, call number) -> collective in progress
        self.sent: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)  # (group, src, dst, tag)
        self.receiving: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    # --- a rank's life ---------------------------------------------------------------------------
    def run_rank(self, rank: int, body: Callable[[], object]) -> object:
        """Run `body` as `rank` (in that rank's thread): wait for every rank's thread, then take turns."""
        _current.simulation = self
        fresh = torch.Generator()
        fresh.manual_seed(0)  # as `spawn`'s workers seed torch before each task
        self._contexts[rank] = _RankContext(_RankWorld(), fresh.get_state(), rank_state.fresh_state())
        with self._lock:
            self._arrived += 1
            self._ready.add(rank)
            if self._arrived == self.world_size:
                self._schedule()
        try:
            with self._lock:
                self._await_turn(rank)
            dist.init_process_group(BACKEND, store=self.store, rank=rank, world_size=self.world_size)
            return body()
        finally:
            with self._lock:
                self._finished.add(rank)
                self._running = None
                self._schedule()

    def wait(self, work: _Work) -> None:
        """Hand the baton on until `work` is done (at once if it is, unless the simulation stopped)."""
        with self._lock:
            if work.done and self.stopped is None:
                return
            if self.stopped is not None:
                raise SimulationStopped(self.stopped)
            self._waiting[work.rank] = work
            self._contexts[work.rank] = process_context()
            self._running = None
            self._schedule()
            self._await_turn(work.rank)

    def complete(self, works: list[_Work]) -> None:
        """Mark `works` done: their ranks can run again (after the running one hands the baton on)."""
        with self._lock:
            for work in works:
                work.done = True
                if self._waiting.get(work.rank) is work:
                    del self._waiting[work.rank]
                    self._ready.add(work.rank)

    def stop(self, reason: str) -> None:
        """Stop every rank: each waiting one raises `SimulationStopped` in turn (from anywhere but a rank)."""
        with self._lock:
            self._stop(reason)
            if self._running is None:
                self._schedule()

    # --- the baton (all under the lock) -----------------------------------------------------------
    def _schedule(self) -> None:
        if self._ready:
            rank = min(self._ready)
            self._ready.discard(rank)
            self._running = rank
            self._turns[rank].notify()
        elif self._waiting and self.stopped is None:
            self._stop(self._deadlock_message())
            self._schedule()

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        self._ready.update(self._waiting)  # each raises SimulationStopped when its turn comes
        self._waiting.clear()

    def _await_turn(self, rank: int) -> None:
        while self._running != rank:
            self._turns[rank].wait(timeout=1.0)
        install_context(self._contexts[rank])
        if self.stopped is not None:
            raise SimulationStopped(self.stopped)

    def _deadlock_message(self) -> str:
        lines = ["deadlock: every rank that has not returned waits for others, and none can run"]
        for rank in sorted(self._waiting):
            lines.append(f"  rank {rank} waits in {self._waiting[rank].what}")
        if self._finished:
            lines.append(f"  rank(s) {sorted(self._finished)} returned (or raised) already")
        return "\n".join(lines)


def current_simulation() -> Simulation:
    simulation = getattr(_current, "simulation", None)
    if simulation is None:
        raise RuntimeError(
            f"the {BACKEND!r} backend only runs inside shardtensor.launch.simulate, which creates its world; "
            "call simulate(main, world_size) instead of init_process_group"
        )
    return simulation


# --- what the last rank to arrive computes, given every rank's deposit in group rank order --------------
def _reduce(tensors: list[torch.Tensor], op) -> torch.Tensor:
    combine = _REDUCTIONS.get(op)
    if combine is None:
        raise ValueError(f"the simulated backend does not support reduce op {op}; it supports {sorted(map(str, _REDUCTIONS))}")
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        result = combine(result, tensor)
    return result / len(tensors) if op == dist.ReduceOp.AVG else result


_REDUCTIONS = {
    dist.ReduceOp.SUM: torch.add, dist.ReduceOp.AVG: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or, dist.ReduceOp.BXOR: torch.bitwise_xor,
}


def _reduce_op(opts):
    op = opts.reduceOp
    return getattr(op, "op", op)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    target.detach().copy_(source)  # hidden from autograd, as c10d's in-place collectives are


def _all_reduce(deposits, op) -> None:
    for index in range(len(deposits[0])):
        result = _reduce([tensors[index] for tensors in deposits], op)
        for tensors in deposits:
            _copy(tensors[index], result)


def _broadcast(deposits, root: int) -> None:
    for tensors in deposits:
        for target, source in zip(tensors, deposits[root]):
            _copy(target, source)


def _all_gather(deposits) -> None:
    for outputs, _ in deposits:
        for output_list in outputs:
            for source_rank, target in enumerate(output_list):
                _copy(target, deposits[source_rank][1][0])


def _all_gather_single(deposits) -> None:
    for output, _ in deposits:
        pieces = output.view(len(deposits), -1) if output.numel() else [output] * len(deposits)
        for source_rank, (_, source) in enumerate(deposits):
            if source.numel():
                _copy(pieces[source_rank], source.reshape(-1))


def _reduce_scatter(deposits, op) -> None:
    for rank, (outputs, inputs) in enumerate(deposits):
        _copy(outputs[0], _reduce([lists[0][rank] for _, lists in deposits], op))


def _reduce_scatter_single(deposits, op) -> None:
    size = len(deposits)
    for rank, (output, _) in enumerate(deposits):
        pieces = [source.reshape(size, -1)[rank] for _, source in deposits]
        _copy(output.view(-1), _reduce(pieces, op))


def _splits(tensor: torch.Tensor, sizes, count: int) -> list[torch.Tensor]:
    sizes = list(sizes) if sizes is not None and len(sizes) else [tensor.shape[0] // count] * count
    return list(torch.split(tensor, sizes))


def _all_to_all_single(deposits) -> None:
    size = len(deposits)
    inputs = [_splits(source, in_sizes, size) for _, source, _, in_sizes in deposits]
    for rank, (output, _, out_sizes, _) in enumerate(deposits):
        for source_rank, target in enumerate(_splits(output, out_sizes, size)):
            _copy(target, inputs[source_rank][rank])


def _all_to_all(deposits) -> None:
    for rank, (outputs, _) in enumerate(deposits):
        for source_rank, target in enumerate(outputs):
            _copy(target, deposits[source_rank][1][rank])


def _gather(deposits, root: int) -> None:
    for source_rank, (_, inputs) in enumerate(deposits):
        _copy(deposits[root][0][0][source_rank], inputs[0])


def _scatter(deposits, root: int) -> None:
    for rank, (outputs, _) in enumerate(deposits):
        _copy(outputs[0], deposits[root][1][0][rank])


class SimulatedGroup(dist.ProcessGroup):
    """One rank's view of a process group of a `Simulation`: c10d calls its methods from `dist.*`."""

    def __init__(self, simulation: Simulation, name: str, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size)
        self._simulation, self._name, self._global_ranks, self._calls = simulation, name, list(global_ranks), 0

    # torch 2.14's `batch_isend_irecv` asks the group's backend for the tensors' device whether it
    # coalesces point-to-point calls (NCCL's way); this group is its own backend and sends them one by one.
    supports_coalescing = False

    def _get_backend(self, device) -> SimulatedGroup:
        return self

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"SimulatedGroup(ranks={self._global_ranks}, rank={self.rank()})"

    def _collective(self, kind: str, deposit, finish: Callable[[list], None]) -> _Work:
        """Deposit this rank's part of the group's next collective; the last rank to come computes it."""
        simulation = self._simulation
        self._calls += 1
        key = (self._name, self._calls)
        operation = simulation.operations.setdefault(key, _Operation(kind))
        if operation.kind != kind:
            raise RuntimeError(
                f"collective mismatch on the group of ranks {self._global_ranks}, call #{self._calls}: rank "
                f"{self._global_ranks[self.rank()]} calls {kind}, another rank of the group called "
                f"{operation.kind}; every rank of a group must call the same collectives in the same order"
            )
        work = _Work(simulation, self._global_ranks[self.rank()],
                     f"{kind} over ranks {self._global_ranks} (call #{self._calls} on this group)")
        operation.deposits[self.rank()] = deposit
        operation.works.append(work)
        if len(operation.deposits) == self.size():
            del simulation.operations[key]
            with torch.no_grad():
                finish([operation.deposits[rank] for rank in range(self.size())])
            simulation.complete(operation.works)
        return work

    # --- collectives (c10d's Python ProcessGroup interface) ---------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM
        return self._collective("all_reduce", list(tensors), functools.partial(_all_reduce, op=op))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self._collective(f"broadcast from {opts.rootRank}", list(tensors),
                                functools.partial(_broadcast, root=opts.rootRank))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._collective("all_gather", (output_tensors, input_tensors), _all_gather)

    def all_gather_single(self, output, input, opts=None):
        return self._collective("all_gather_single", (output, input), _all_gather_single)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM
        return self._collective("reduce_scatter", (output_tensors, input_tensors), functools.partial(_reduce_scatter, op=op))

    def reduce_scatter_single(self, output, input, opts=None):
        op = _reduce_op(opts) if opts is not None else dist.ReduceOp.SUM
        return self._collective("reduce_scatter_single", (output, input), functools.partial(_reduce_scatter_single, op=op))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._collective("all_to_all_single", (output, input, output_split_sizes, input_split_sizes), _all_to_all_single)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        return self._collective("all_to_all", (output_tensors, input_tensors), _all_to_all)

    def gather(self, output_tensors, input_tensors, opts):
        return self._collective(f"gather to {opts.rootRank}", (output_tensors, input_tensors),
                                functools.partial(_gather, root=opts.rootRank))

    def scatter(self, output_tensors, input_tensors, opts):
        return self._collective(f"scatter from {opts.rootRank}", (output_tensors, input_tensors),
                                functools.partial(_scatter, root=opts.rootRank))

    def barrier(self, opts=None):
        return self._collective("barrier", None, lambda deposits: None)

    # --- point to point: a send is kept until its receive comes (FIFO per pair and tag) -------------
    def send(self, tensors, dst: int, tag: int = 0):
        simulation = self._simulation
        key = (self._name, self.rank(), dst, tag)
        work = _Work(simulation, self._global_ranks[self.rank()], "send")
        if simulation.receiving[key]:
            target, receive = simulation.receiving[key].popleft()
            _copy(target, tensors[0])
            simulation.complete([receive])
        else:
            simulation.sent[key].append(tensors[0].detach().clone())
        simulation.complete([work])
        return work

    def recv(self, tensors, src: int, tag: int = 0):
        simulation = self._simulation
        key = (self._name, src, self.rank(), tag)
        work = _Work(simulation, self._global_ranks[self.rank()],
                     f"recv from rank {self._global_ranks[src]} (group of ranks {self._global_ranks})")
        if simulation.sent[key]:
            _copy(tensors[0], simulation.sent[key].popleft())
            simulation.complete([work])
        else:
            simulation.receiving[key].append((tensors[0], work))
        return work

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError("the simulated backend does not support recv without a source rank")


def _create_group(options, backend_options) -> SimulatedGroup:
    global_ranks = list(options.global_ranks_in_group) or list(range(options.group_size))  # empty: the world
    return SimulatedGroup(current_simulation(), options.group_id, options.group_rank, options.group_size, global_ranks)


dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])
