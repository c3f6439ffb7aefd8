"""Local ranks without a launcher: a pool of worker processes that share one gloo world.

Each worker initializes the default process group once and then runs tasks forever, so process
groups, meshes and caches persist between tasks (which keeps tests fast). A task runs on every rank;
results come back in rank order, failures come back as one `RankFailure` with every traceback.

    >>> def body():
    ...     import torch.distributed as dist
    ...     return dist.get_rank()
    >>> spawn(body, 2)  # doctest: +SKIP
    [0, 1]
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["LocalWorkers", "RankFailure", "RegisteredFunction", "register", "simulate", "spawn"]

# Starting a pool only waits on imports and the rendezvous; a dead worker is noticed at once, so this
# bound is only against a stuck rendezvous and is generous for many ranks on a loaded machine.
_STARTUP_TIMEOUT = 600.0
_POLL_INTERVAL = 0.05
# Tasks and results travel over one pipe each way per worker: pipes hold no named semaphores
# (multiprocessing queues do, and the resource tracker then warned now and then at exit of
# "leaked semaphore objects" that a queue's finalizer had already unlinked).
_STOP = b""

# Functions registered by name, so that a worker can find a function that its module replaces
# (for example a test body that a pytest decorator wraps).
_registry: dict[tuple[str, str], Callable] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredFunction:
    """A picklable reference to a function in `_registry`; importing its module registers it."""

    module: str
    qualname: str

    def resolve(self) -> Callable:
        importlib.import_module(self.module)
        try:
            return _registry[(self.module, self.qualname)]
        except KeyError:
            raise LookupError(
                f"no function registered as {self.qualname!r} after importing module "
                f"{self.module!r}; register it at import time with shardtensor.launch.register"
            ) from None


def register(function: Callable) -> RegisteredFunction:
    """Register `function` under (module, qualname) and return a picklable reference to it."""
    _registry[(function.__module__, function.__qualname__)] = function
    return RegisteredFunction(function.__module__, function.__qualname__)


class RankFailure(RuntimeError):
    """A task failed on some ranks: `failures` maps rank -> traceback, `timed_out` lists silent ranks."""

    def __init__(self, failures: dict[int, str], timed_out: list[int], answered: list[int], why_silent: str | None = None):
        self.failures = failures
        self.timed_out = timed_out
        self.answered = answered
        super().__init__(_rank_failure_message(failures, timed_out, answered, why_silent))


def _rank_failure_message(failures: dict[int, str], timed_out: list[int], answered: list[int], why_silent: str | None) -> str:
    lines = [f"task failed on rank(s) {sorted(failures)}" if failures else "task did not finish"]
    if timed_out and why_silent:
        lines.append(f"rank(s) {timed_out} did not finish: {why_silent}")
    elif timed_out:
        lines.append(
            f"rank(s) {timed_out} did not answer (probably stuck in a collective waiting for a "
            f"failed rank); ranks that answered: {answered}. The workers were killed and will "
            "restart on the next run."
        )
    for rank in sorted(failures):
        lines.append(f"\n----- rank {rank} -----\n{failures[rank].rstrip()}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _worker_main(rank, world_size, backend, port, timeout, tasks, results, parent_pid) -> None:
    """Worker loop: initialize the default process group once, then run tasks until told to stop."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except BaseException:
        results.send_bytes(pickle.dumps((None, rank, False, traceback.format_exc())))
        return
    results.send_bytes(pickle.dumps((None, rank, True, "ready")))
    _serve(rank, tasks, results, parent_pid)
    _release_world()


def _serve(rank, tasks, results, parent_pid) -> None:
    """Run tasks until told to stop (or until the parent dies)."""
    import torch

    while True:
        if not tasks.poll(1.0):
            if os.getppid() != parent_pid:  # the parent died: do not linger
                return
            continue
        try:
            payload = tasks.recv_bytes()
        except EOFError:  # the parent closed the pipe
            return
        if payload == _STOP:  # the caller releases the world (`_release_world`) after this returns
            return
        task_id, function, args, kwargs, parent_path = pickle.loads(payload)
        if sys.path != parent_path:
            sys.path[:] = parent_path
        try:
            torch.manual_seed(0)
            if isinstance(function, RegisteredFunction):
                function = function.resolve()
            answer = pickle.dumps((task_id, rank, True, function(*args, **kwargs)))
        except BaseException:
            answer = pickle.dumps((task_id, rank, False, traceback.format_exc()))
        results.send_bytes(answer)


def _release_world() -> None:
    """Destroy the library's groups, then the world this worker made, while Python is fully alive
    (a gloo group left to interpreter exit can abort the process)."""
    import torch.distributed as dist

    from .process_groups import release_process_groups

    release_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalWorkers:
    """`world_size` local processes that share one default process group and run tasks on demand.

    A failed or hung task kills the pool (no hang: SIGKILL) and the next `run` restarts it.
    `timeout` is the process-group timeout and the default task timeout, in seconds; `grace` is how
    long the other ranks may take to answer after one rank failed.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout: float = 300.0, grace: float = 5.0):
        if world_size < 1:
            raise ValueError(f"LocalWorkers needs world_size >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.grace = grace
        self._processes: list[multiprocessing.Process] = []
        self._task_pipes: list = []  # the parent's write end of each worker's task pipe
        self._result_pipes: list = []  # the parent's read end of each worker's result pipe
        self._ready = False
        self._task_id = 0

    def start(self) -> None:
        """Spawn the workers without waiting for them (several pools can start concurrently)."""
        if self._processes:
            return
        context = multiprocessing.get_context("spawn")
        port = _free_port()
        for rank in range(self.world_size):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, port, self.timeout, task_reader, result_writer, os.getpid()),
                daemon=True,
                name=f"shardtensor-rank{rank}",
            )
            process.start()
            task_reader.close()  # the worker has its own copies: a dead worker then reads as EOF here
            result_writer.close()
            self._processes.append(process)
            self._task_pipes.append(task_writer)
            self._result_pipes.append(result_reader)

    def _wait_ready(self) -> None:
        self.start()
        if self._ready:
            return
        try:
            self._collect(None, _STARTUP_TIMEOUT)
        except RankFailure:
            self._kill()
            raise
        self._ready = True

    def run(self, function: Callable | RegisteredFunction, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run `function(*args, **kwargs)` on every rank; return the results in rank order.

        A pool with a dead worker (killed by a signal, `os._exit`) is restarted before the task runs.
        """
        payload = pickle.dumps((self._task_id + 1, function, args, kwargs, list(sys.path)))
        if any(not process.is_alive() for process in self._processes):
            self._kill()
        self._wait_ready()
        self._task_id += 1
        for task_pipe in self._task_pipes:
            try:
                task_pipe.send_bytes(payload)
            except OSError:  # the worker died since the check above: `_collect` reports it
                pass
        return self._collect(self._task_id, self.timeout if timeout is None else timeout)

    def _collect(self, task_id: int | None, timeout: float) -> list:
        """Wait for one answer per rank; on failure or timeout raise `RankFailure`."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        open_pipes = list(self._result_pipes)
        while len(results) + len(failures) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(open_pipes, timeout=min(remaining, _POLL_INTERVAL))
            if not ready:
                for rank, process in enumerate(self._processes):
                    if not process.is_alive() and rank not in results and rank not in failures:
                        failures[rank] = f"worker process exited with code {process.exitcode}"
                        deadline = min(deadline, time.monotonic() + self.grace)
                continue
            for pipe in ready:
                try:
                    answer_task, rank, ok, value = pickle.loads(pipe.recv_bytes())
                except EOFError:  # the worker is gone; the dead-process check above reports it
                    open_pipes.remove(pipe)
                    continue
                if answer_task != task_id:
                    continue  # a stale answer from an earlier task
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value
                    deadline = min(deadline, time.monotonic() + self.grace)
        answered = sorted([*results, *failures])
        timed_out = [rank for rank in range(self.world_size) if rank not in answered]
        if timed_out or any(not process.is_alive() for process in self._processes):
            self._kill()  # the next run restarts the pool
        if failures or timed_out:
            raise RankFailure(failures, timed_out, answered)
        return [results[rank] for rank in range(self.world_size)]

    def _kill(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join()
        self._discard_pipes()

    def _discard_pipes(self) -> None:
        for pipe in [*self._task_pipes, *self._result_pipes]:
            pipe.close()
        self._processes, self._task_pipes, self._result_pipes = [], [], []
        self._ready = False

    def close(self, timeout: float = 5.0) -> list[int | None]:
        """Stop the workers (politely, then by force after `timeout` seconds); returns their exit codes."""
        for process, task_pipe in zip(self._processes, self._task_pipes):
            if process.is_alive():
                try:
                    task_pipe.send_bytes(_STOP)
                except OSError:  # it died since: joined below
                    pass
        for process in self._processes:
            process.join(timeout=timeout)
            if process.is_alive():
                process.kill()
                process.join()
        exit_codes = [process.exitcode for process in self._processes]
        self._discard_pipes()
        return exit_codes

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def spawn(function: Callable, nprocs: int, *args: Any, **kwargs: Any) -> list:
    """Run `function(*args, **kwargs)` on `nprocs` fresh local ranks and return their results."""
    with LocalWorkers(nprocs) as workers:
        return workers.run(function, *args, **kwargs)


def simulate(function: Callable, world_size: int, *args: Any, **kwargs: Any) -> list:
    """Run `function(*args, **kwargs)` on `world_size` ranks simulated in this process; return their results.

    What `spawn` returns (results in rank order, pickled and unpickled; `RankFailure` with each failed
    rank's traceback), without processes: every rank is a thread over an in-memory process group, one
    rank running at a time (`simulated_world`), so 64 ranks run on a laptop. Each rank gets its own copy
    of the arguments and starts from `torch.manual_seed(0)`, as in `spawn`. A collective that some rank
    never joins stops the simulation at once (RankFailure naming what each rank waits for); a rank that
    computes for longer than `SHARDTENSOR_TIMEOUT` seconds (300) is reported, not killed.

        >>> def body():
        ...     import torch.distributed as dist
        ...     return dist.get_rank()
        >>> simulate(body, 4)
        [0, 1, 2, 3]
    """
    import torch

    from .process_groups import forget_worlds, timeout_seconds
    from .simulated_world import Simulation, SimulationStopped, install_context, process_context

    if world_size < 1:
        raise ValueError(f"simulate needs world_size >= 1, got {world_size}")
    simulation = Simulation(world_size)
    outcomes: dict[int, tuple[str, Any]] = {}

    def rank_main(rank: int) -> None:
        def body():
            rank_args, rank_kwargs = copy.deepcopy((args, kwargs))
            return pickle.dumps(function(*rank_args, **rank_kwargs))

        try:
            outcomes[rank] = ("result", simulation.run_rank(rank, body))
        except SimulationStopped:
            outcomes[rank] = ("stopped", None)
        except BaseException:
            outcomes[rank] = ("failure", traceback.format_exc())

    caller, excepthook = process_context(), sys.excepthook  # each rank's init_process_group wraps the hook
    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"shardtensor-simulated-rank{rank}", daemon=True)
               for rank in range(world_size)]
    deadline = time.monotonic() + timeout_seconds()
    # c10d's registry of groups by name becomes one per thread, as torch's own threaded tests make it.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    with torch.autograd.set_multithreading_enabled(False):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            simulation.stop(f"ranks {stuck} still ran after {timeout_seconds():.0f} s (SHARDTENSOR_TIMEOUT)")
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    install_context(caller)
    sys.excepthook = excepthook
    forget_worlds()  # caches of the simulated worlds (plans, specs, peers) hold their meshes and groups
    failures = {rank: value for rank, (kind, value) in outcomes.items() if kind == "failure"}
    silent = sorted(set(range(world_size)) - set(outcomes) | {rank for rank, (kind, _) in outcomes.items() if kind == "stopped"})
    if failures or silent:
        raise RankFailure(failures, silent, sorted(set(range(world_size)) - set(silent)), simulation.stopped)
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
