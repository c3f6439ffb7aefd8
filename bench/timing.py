"""The timing loops the benchmarks share: the time of each call, and the mean time of calls run back to back."""

from __future__ import annotations

import time


def call_times(function, repeats: int, *, before=None) -> list[float]:
    """Wall seconds of each of `repeats` calls of `function`; `before()`, when given (a barrier that
    lines the ranks up), runs untimed ahead of each call."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def time_per_call(function, iterations: int, clock=time.process_time) -> float:
    """Mean seconds per call of `iterations` calls back to back, by `clock`: `time.process_time` (the
    default) is this process's CPU time, gloo's threads included, so time a shared machine gives to
    other processes is left out; `time.perf_counter` is wall time, waiting for other ranks included."""
    start = clock()
    for _ in range(iterations):
        function()
    return (clock() - start) / iterations
