"""`python -m shardtensor.forecast.calibrate`: measure this machine's gloo (all_reduce and all_gather through
`shardtensor.comm`, on 2 and 4 local ranks) and store the fitted latency and bandwidth, with the date, in
`calibrated_gloo.json` (the "gloo-local" profile).

The fit is the planner's alpha-beta model: time = latency_us + bytes / bytes_per_us, where bytes are what
one rank receives (`CommRecord.bytes_received`), fitted robustly (`fit`): this machine is shared.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from .. import comm
from ..launch import spawn
from ..mesh import init_device_mesh
from .profiles import CALIBRATION_FILE

__all__ = ["measure_here", "measure", "fit", "main"]

SIZES = (1, 1024, 16 * 1024, 128 * 1024, 1024 * 1024)  # float32 elements per rank
REPEATS = 7


def measure_here(mesh, sizes=SIZES, repeats: int = REPEATS) -> list[tuple[str, int, int, float]]:
    """(kind, ranks, bytes received, seconds) per collective and size over `mesh`'s mesh dim 0, on this rank:
    the median over `repeats` calls, each after a barrier. Every rank of the mesh calls it."""
    ranks = mesh.size(0)
    points = []
    for size in sizes:
        tensor = torch.ones(size)
        calls = {
            "all_reduce": lambda: comm.all_reduce(tensor, mesh, 0, reduce_op="sum"),
            "all_gather": lambda: comm.all_gather(tensor, mesh, 0, dim=0, sizes=[size] * ranks),
        }
        for kind, call in calls.items():
            with comm.observe() as records:
                call()  # warm up, and learn the bytes
            times = []
            for _ in range(repeats):
                torch.distributed.barrier()
                began = time.perf_counter()
                call()
                times.append(time.perf_counter() - began)
            points.append((kind, ranks, records[0].bytes_received, statistics.median(times)))
    return points


def _rank_main(sizes: tuple[int, ...], repeats: int) -> list[tuple[str, int, int, float]]:
    return measure_here(init_device_mesh("cpu", (torch.distributed.get_world_size(),)), sizes, repeats)


def measure(world_sizes=(2, 4), sizes=SIZES, repeats: int = REPEATS) -> list[tuple[str, int, int, float]]:
    """Every point, measured on rank 0 of a fresh local gloo world of each size."""
    points = []
    for world_size in world_sizes:
        points += spawn(_rank_main, world_size, tuple(sizes), repeats)[0]
    return points


def fit(points) -> tuple[float, float]:
    """(latency_us, bytes_per_us) of time = latency + bytes / bandwidth, robust to a loaded machine: the
    latency is the median time of the messages up to 16 kB, the bandwidth the median over the larger ones
    of bytes / (time - latency)."""
    small = [seconds * 1e6 for _, _, received, seconds in points if received <= 16 * 1024]
    latency = statistics.median(small)
    rates = [received / (seconds * 1e6 - latency) for _, _, received, seconds in points
             if received > 16 * 1024 and seconds * 1e6 > latency]
    return latency, statistics.median(rates) if rates else float("inf")


def main(argv=None) -> int:
    points = measure()
    latency_us, bytes_per_us = fit(points)
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, torch {torch.__version__}",
        "ranks": "2 and 4",
        "load_average": f"{os.getloadavg()[0]:.0f} on {os.cpu_count()} cores",
        "ranks_per_node": 4,
        "latency_us": round(latency_us, 1),
        "exchange_latency_us": round(3 * latency_us, 1),
        "bytes_per_us": round(bytes_per_us, 1),
        "points": [{"kind": kind, "ranks": ranks, "bytes_received": received, "us": round(seconds * 1e6, 1)}
                   for kind, ranks, received, seconds in points],
    }
    CALIBRATION_FILE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gloo on this machine: latency {latency_us:.1f} us, {bytes_per_us:.0f} bytes/us; written to {CALIBRATION_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
