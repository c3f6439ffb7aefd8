"""Random factories and distribute_tensor: time and peak memory per rank, shardtensor against
torch.distributed.tensor (and plain torch) in the same run, on 4 local gloo ranks.

    .venv/bin/python bench/bench_memory.py           # short: 16 MiB shards, 64 MiB distribute_tensor
    .venv/bin/python bench/bench_memory.py --full    # the issue's sizes: 64 MiB shards, 256 MiB

Every row runs in fresh processes (one world per library and row), because the peak resident set
(`resource.getrusage(...).ru_maxrss`) only grows: peak = maxrss after the first call - maxrss
before it (the source tensor of distribute_tensor included), the largest over ranks. tracemalloc
does not see torch's allocations. Time: the median of a few calls after the first, the slowest
rank's median. Float32, Shard(0) over a 1-D mesh of 4 ranks.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RANKS = 4
REPEATS = 3


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _measure(first, again) -> tuple[float, float]:
    """(peak MiB added by `first()`, median seconds of `again()`), timed after the peak is taken."""
    before = _maxrss_mib()
    result = first()
    peak = _maxrss_mib() - before
    del result
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        again()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def _library(name: str):
    """(module with randn/empty/distribute_tensor/Shard, mesh) for 'ours' or 'torch'."""
    if name == "ours":
        import shardtensor
        from shardtensor.mesh import init_device_mesh

        shardtensor.manual_seed(0)
        return shardtensor, init_device_mesh("cpu", (RANKS,))
    import torch.distributed.tensor as tensor_module
    from torch.distributed.device_mesh import init_device_mesh

    return tensor_module, init_device_mesh("cpu", (RANKS,))


def _maker(row: str, library: str, shape: tuple[int, int]):
    """(first, again): the call whose peak is measured (it makes the source tensor, for
    distribute_tensor) and the call that is timed."""
    local_shape = (shape[0] // RANKS, shape[1])
    if library == "plain":  # torch.randn / normal_ of the local shard size, no DTensor
        if row == "randn":
            return (lambda: torch.randn(local_shape)), (lambda: torch.randn(local_shape))
        return (lambda: torch.empty(local_shape).normal_()), (lambda: torch.empty(local_shape).normal_())
    module, mesh = _library(library)
    placements = [module.Shard(0)]
    if row == "randn":
        make = lambda: module.randn(shape, device_mesh=mesh, placements=placements)  # noqa: E731
        return make, make
    if row == "empty_normal":
        make = lambda: module.empty(shape, device_mesh=mesh, placements=placements).normal_()  # noqa: E731
        return make, make
    source_holder = []

    def first():
        source_holder.append(torch.ones(shape))  # the source's full tensor counts towards the peak
        return module.distribute_tensor(source_holder[0], mesh, placements)

    return first, lambda: module.distribute_tensor(source_holder[0], mesh, placements)


def run_rank(row: str, library: str, rows: int, columns: int) -> tuple[float, float]:
    """One rank's (peak MiB, seconds) for `row` with `library` ('ours', 'torch' or 'plain').

    A warm-up call on a small tensor first, so that one-time costs (imports, first dispatch)
    are not counted as the operation's memory.
    """
    torch.set_num_threads(1)
    warm_up, _ = _maker(row, library, (RANKS * 8, 8))
    warm_up()
    return _measure(*_maker(row, library, (rows, columns)))


ROWS = [
    ("randn factory", "randn", ("ours", "torch", "plain")),
    ("empty(...).normal_()", "empty_normal", ("ours", "torch", "plain")),
    ("distribute_tensor", "distribute_tensor", ("ours", "torch")),
]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_memory

    from shardtensor import launch

    full = "--full" in sys.argv
    shard_rows = 4096 if full else 1024  # 4096 x 4096 float32 = 64 MiB per shard
    distribute_rows = 16384 if full else 4096  # 16384 x 4096 float32 = 256 MiB in all
    print(f"{RANKS} ranks, float32, Shard(0); peak = maxrss increase (MiB, largest rank); time = median (ms, slowest rank)")
    print("| row | size | ours peak | torch DTensor peak | plain torch peak | ours ms | torch DTensor ms | plain torch ms | peak ours/torch | time ours/torch | time ours/plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for title, row, libraries in ROWS:
        rows = distribute_rows if row == "distribute_tensor" else shard_rows * RANKS
        size = f"{rows}x4096 ({rows * 4096 * 4 // 2**20} MiB global)"
        results = {}
        for library in libraries:
            try:
                per_rank = launch.spawn(bench_memory.run_rank, RANKS, row, library, rows, 4096)
            except launch.RankFailure as failure:  # torch's DTensor RNG needs an accelerator mesh
                print(f"  ({title}, {library}: failed: {str(failure).strip().splitlines()[-1]})")
                continue
            results[library] = (max(peak for peak, _ in per_rank), max(seconds for _, seconds in per_rank) * 1e3)
        names = ("ours", "torch", "plain")
        cells = [f"{results[name][0]:.0f}" if name in results else "n/a" for name in names]
        cells += [f"{results[name][1]:.1f}" if name in results else "n/a" for name in names]
        cells += [_ratio(results, "torch", 0), _ratio(results, "torch", 1), _ratio(results, "plain", 1)]
        print(f"| {title} | {size} | " + " | ".join(cells) + " |")


def _ratio(results: dict, other: str, column: int) -> str:
    if "ours" not in results or other not in results:
        return "n/a"
    return f"{results['ours'][column] / results[other][column]:.2f}"


if __name__ == "__main__":
    main()
