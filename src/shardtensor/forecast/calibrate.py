"""`python -m shardtensor.forecast.calibrate [--runs N]`: measure this machine's gloo (all_reduce, all_gather,
reduce_scatter and all_to_all through `shardtensor.comm`, on 2 and 4 local ranks; each point the best of N
runs, for a shared machine) and store the fitted latency and bandwidth, with the date, in
`calibrated_gloo.json` (the "gloo-local" profile).

The fit is the planner's alpha-beta model: time = latency_us + bytes / bytes_per_us, where bytes are what
one rank receives (`CommRecord.bytes_received`), fitted robustly (`fit`): this machine is shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
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

__all__ = ["measure_here", "measure", "best_of", "fit", "main"]

SIZES = (1, 1024, 16 * 1024, 128 * 1024, 1024 * 1024)  # float32 elements per rank
REPEATS = 5
BURST = 5
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def measure_here(mesh, sizes=SIZES, repeats: int = REPEATS) -> list[tuple[str, int, int, float]]:
    """(kind, ranks, bytes received, seconds) per collective and size, on this rank: the time per call of
    `BURST` rounds in a row of one call along every mesh dim of `mesh` in turn, then over all of them
    flattened (as a step issues them: ranks drift apart and wait for each other across groups), the best of
    `repeats` bursts, each after a barrier. `ranks` is the mean group size. Every rank of the mesh calls it."""
    points = []
    for size in sizes:
        groups = list(range(mesh.ndim)) + ([tuple(range(mesh.ndim))] if mesh.ndim > 1 else [])
        calls = {kind: [_call(kind, mesh, mesh_dims, size) for mesh_dims in groups] for kind in KINDS}
        for kind, along_dims in calls.items():
            with comm.observe() as records:
                for call in along_dims:
                    call()  # warm up, and learn the bytes
            times = []
            for _ in range(repeats):
                torch.distributed.barrier()
                began = time.perf_counter()
                for _ in range(BURST):
                    for call in along_dims:
                        call()
                times.append((time.perf_counter() - began) / (BURST * len(along_dims)))
            received = sum(record.bytes_received for record in records) // max(len(records), 1)
            ranks = round(sum(record.group_size for record in records) / max(len(records), 1))
            points.append((kind, ranks, received, min(times)))
    return points


def _call(kind: str, mesh, mesh_dim, size: int):
    """One collective of `kind` along `mesh_dim` (or a tuple of them), `size` float32 elements per rank and piece."""
    ranks = math.prod(mesh.shape[dim] for dim in mesh_dim) if isinstance(mesh_dim, tuple) else mesh.size(mesh_dim)
    tensor, pieces = torch.ones(size, device=mesh.device_type), torch.ones(size * ranks, device=mesh.device_type)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(tensor, mesh, mesh_dim, reduce_op="sum")
    if kind == "all_gather":
        return lambda: comm.all_gather(tensor, mesh, mesh_dim, dim=0, sizes=[size] * ranks)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(pieces, mesh, mesh_dim, reduce_op="sum", dim=0, sizes=[size] * ranks)
    return lambda: comm.all_to_all(pieces, mesh, mesh_dim, split_dim=0, split_sizes=[size] * ranks,
                                   concat_dim=0, concat_sizes=[size] * ranks)


def _rank_main(sizes: tuple[int, ...], repeats: int) -> list[tuple[str, int, int, float]]:
    return measure_here(init_device_mesh("cpu", (torch.distributed.get_world_size(),)), sizes, repeats)


def measure(world_sizes=(2, 4), sizes=SIZES, repeats: int = REPEATS) -> list[tuple[str, int, int, float]]:
    """Every point, measured on rank 0 of a fresh local gloo world of each size."""
    points = []
    for world_size in world_sizes:
        points += spawn(_rank_main, world_size, tuple(sizes), repeats)[0]
    return points


def fit(points) -> tuple[dict[str, float], float]:
    """({kind: latency_us}, bytes_per_us) of time = latency(kind) + bytes / bandwidth: each kind's latency is
    its median time for messages up to 16 kB, the bandwidth the median over the larger messages of
    bytes / (time - latency of its kind)."""
    latencies = {}
    for kind in dict.fromkeys(kind for kind, *_ in points):
        small = [seconds * 1e6 for other, _, received, seconds in points if other == kind and received <= 16 * 1024]
        latencies[kind] = statistics.median(small)
    rates = [received / (seconds * 1e6 - latencies[kind]) for kind, _, received, seconds in points
             if received > 16 * 1024 and seconds * 1e6 > latencies[kind]]
    return latencies, statistics.median(rates) if rates else float("inf")


def best_of(runs: int) -> tuple[list[tuple[str, int, int, float]], list[float]]:
    """Every point of `measure`, the least time of `runs` runs (a shared machine's load only adds), and the
    one-minute load average as each run began."""
    best: dict[tuple[str, int, int], float] = {}
    loads = []
    for _ in range(runs):
        loads.append(os.getloadavg()[0])
        for kind, ranks, received, seconds in measure():
            best[kind, ranks, received] = min(seconds, best.get((kind, ranks, received), math.inf))
    return [(*key, seconds) for key, seconds in best.items()], loads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtensor.forecast.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="measure every point this many times, keep the best")
    arguments = parser.parse_args(argv)
    if arguments.runs < 1:
        parser.error(f"--runs must be at least 1, got {arguments.runs}")
    points, loads = best_of(arguments.runs)
    latencies, bytes_per_us = fit(points)
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, torch {torch.__version__}",
        "ranks": "2 and 4",
        "load_average": f"{_span(loads)} on {os.cpu_count()} cores",
        "ranks_per_node": 4,
        "latency_by_kind_us": {kind: round(latency, 1) for kind, latency in latencies.items()},
        "bytes_per_us": round(bytes_per_us, 1),
        "points": [{"kind": kind, "ranks": ranks, "bytes_received": received, "us": round(seconds * 1e6, 1)}
                   for kind, ranks, received, seconds in points],
    }
    CALIBRATION_FILE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"gloo on this machine: latencies {record['latency_by_kind_us']} us, {bytes_per_us:.0f} bytes/us; "
          f"written to {CALIBRATION_FILE}")
    return 0


def _span(loads: list[float]) -> str:
    least, most = f"{min(loads):.0f}", f"{max(loads):.0f}"
    return least if least == most else f"{least} to {most}"


if __name__ == "__main__":
    sys.exit(main())
