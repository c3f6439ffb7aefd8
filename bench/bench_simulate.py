"""`launch.simulate` against `spawn` and a warm `LocalWorkers` pool: one program, 4 and 8 ranks.

    .venv/bin/python bench/bench_simulate.py [--world-sizes 4 8] [--repeats 3]

The program (tests/test_simulate.py `_program`): collectives, a redistribute, random factories and
two tensor-parallel SGD steps of a small MLP, on a (n/2, 2) mesh. `spawn` starts fresh processes
(import, rendezvous) every call; a warm pool (what the test suite uses) only runs the task;
`simulate` runs every rank as a thread of this process. Wall time, min and median over the repeats.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import test_simulate  # noqa: E402  (the program, registered so that workers find it)

from shardtensor import launch  # noqa: E402


def _timed(function, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    print("world | how | min s | median s")
    for world_size in options.world_sizes:
        mesh_shape = (world_size // 2, 2)
        rows = {
            "simulate": _timed(lambda: launch.simulate(test_simulate._program, world_size, mesh_shape), options.repeats),
            "spawn (fresh processes)": _timed(lambda: launch.spawn(test_simulate.PROGRAM, world_size, mesh_shape),
                                              options.repeats),
        }
        with launch.LocalWorkers(world_size) as workers:
            workers.run(test_simulate.PROGRAM, mesh_shape)  # start-up and first call, not timed
            rows["warm pool"] = _timed(lambda: workers.run(test_simulate.PROGRAM, mesh_shape), options.repeats)
        for how, times in rows.items():
            print(f"{world_size} | {how} | {min(times):.2f} | {statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
