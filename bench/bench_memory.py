"""Random factories and distribute_tensor: time and peak memory per rank, shardtensor against
torch.distributed.tensor (and plain torch) in the same run, on 4 local gloo ranks.

    .venv/bin/python bench/bench_memory.py           # short: 16 MiB shards, 64 MiB distribute_tensor
    .venv/bin/python bench/bench_memory.py --full    # the issue's sizes: 64 MiB shards, 256 MiB
    .venv/bin/python bench/bench_memory.py --full --draw-only  # randn rows' boxes in one process

Every row runs in fresh processes (one world per library and row), because the peak resident set
(`resource.getrusage(...).ru_maxrss`) only grows: peak = maxrss after the first call - maxrss
before it (the source tensor of distribute_tensor included), the largest over ranks. tracemalloc
does not see torch's allocations. Time: the median of a few calls after the first, the slowest
rank's median. Float32, Shard(0) over a 1-D mesh of 4 ranks, except the randn rows of a column
shard (Shard(1)) and of a 2-D shard ([Shard(0), Shard(1)] on a 2x2 mesh), compared with plain
torch.randn of the same local shape only.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from timing import call_times

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
    return peak, statistics.median(call_times(again, REPEATS, before=dist.barrier))


# A row's mesh shape and the tensor dim each mesh dim shards (Shard(0) on 4 ranks unless listed).
_LAYOUTS = {"randn_columns": ((RANKS,), (1,)), "randn_columns_unaligned": ((RANKS,), (1,)), "randn_2d": ((2, RANKS // 2), (0, 1))}
# 4100 columns: shards of 1025 columns whose edges cut the random generator's tiles (128 columns wide).
_COLUMNS = {"randn_columns_unaligned": 4100}


def _library(name: str, mesh_shape: tuple[int, ...]):
    """(module with randn/empty/distribute_tensor/Shard, mesh) for 'ours' or 'torch'."""
    if name == "ours":
        import shardtensor
        from shardtensor.mesh import init_device_mesh

        shardtensor.manual_seed(0)
        return shardtensor, init_device_mesh("cpu", mesh_shape)
    import torch.distributed.tensor as tensor_module
    from torch.distributed.device_mesh import init_device_mesh

    return tensor_module, init_device_mesh("cpu", mesh_shape)


def _local_shape(row: str, shape: tuple[int, int]) -> list[int]:
    mesh_shape, dims = _LAYOUTS.get(row, ((RANKS,), (0,)))
    local_shape = list(shape)
    for size, dim in zip(mesh_shape, dims):
        local_shape[dim] //= size
    return local_shape


def _maker(row: str, library: str, shape: tuple[int, int]):
    """(first, again): the call whose peak is measured (it makes the source tensor, for
    distribute_tensor) and the call that is timed."""
    mesh_shape, dims = _LAYOUTS.get(row, ((RANKS,), (0,)))
    local_shape = _local_shape(row, shape)
    if library == "plain":  # torch.randn / normal_ of the local shard size, no DTensor
        if row.startswith("randn"):
            return (lambda: torch.randn(local_shape)), (lambda: torch.randn(local_shape))
        return (lambda: torch.empty(local_shape).normal_()), (lambda: torch.empty(local_shape).normal_())
    module, mesh = _library(library, mesh_shape)
    placements = [module.Shard(dim) for dim in dims]
    if row.startswith("randn"):
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


def _alternating_ratio(again, local_shape) -> float:
    """min time of `again()` / min time of plain `torch.randn(local_shape)`, the two called in turn
    by one rank at a time while the others wait (the randn factory issues no collective after
    `manual_seed`): a ratio that the other ranks and other processes on a shared machine skew little."""
    ours, plain = [], []
    for rank in range(dist.get_world_size()):
        dist.barrier()
        if rank != dist.get_rank():
            continue
        for _ in range(3 * REPEATS):
            for call, times in ((again, ours), (lambda: torch.randn(local_shape), plain)):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
    dist.barrier()
    return min(ours) / min(plain)


def run_rank(row: str, library: str, rows: int, columns: int) -> tuple[float, float, float | None]:
    """One rank's (peak MiB, seconds, alternating ratio or None) for `row` with `library` ('ours',
    'torch' or 'plain'); the ratio to plain torch.randn for our randn rows.

    A warm-up call on a small tensor first, so that one-time costs (imports, first dispatch)
    are not counted as the operation's memory.
    """
    torch.set_num_threads(1)
    warm_up, _ = _maker(row, library, (RANKS * 8, 8))
    warm_up()
    first, again = _maker(row, library, (rows, columns))
    peak, seconds = _measure(first, again)
    ratio = None
    if library == "ours" and row.startswith("randn"):
        ratio = _alternating_ratio(again, _local_shape(row, (rows, columns)))
    return peak, seconds, ratio


ROWS = [
    ("randn factory", "randn", ("ours", "torch", "plain")),
    ("randn factory, Shard(1)", "randn_columns", ("ours", "plain")),
    ("randn factory, Shard(1), 4100 columns", "randn_columns_unaligned", ("ours", "plain")),
    ("randn factory, [Shard(0), Shard(1)] on 2x2", "randn_2d", ("ours", "plain")),
    ("empty(...).normal_()", "empty_normal", ("ours", "torch", "plain")),
    ("distribute_tensor", "distribute_tensor", ("ours", "torch")),
]


def draw_only(shard_rows: int) -> None:
    """Every rank's box of the randn rows drawn by `random.random_shard` (what the factory runs on a
    rank) and plain torch.randn of the box's shape, called in turn in this one process; the sum over
    boxes of each one's min time. No other rank competes for the cores, so on a shared machine this
    ratio is the steadiest."""
    import itertools

    from shardtensor.random import random_shard

    torch.set_num_threads(1)
    print("one process, float32; ms = sum over the ranks' boxes of the min of 7 calls, ours and plain torch.randn in turn")
    print("| row | size | boxes | ours ms | plain torch.randn ms | ours/plain |")
    print("|---|---|---|---|---|---|")
    for title, row, _ in ROWS:
        if not row.startswith("randn"):
            continue
        shape = (shard_rows * RANKS, _COLUMNS.get(row, 4096))
        mesh_shape, dims = _LAYOUTS.get(row, ((RANKS,), (0,)))
        local_shape = _local_shape(row, shape)
        ours_total = plain_total = 0.0
        for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
            offset = [0, 0]
            for index, dim in zip(coordinate, dims):
                offset[dim] += index * local_shape[dim]
            ours, plain = [], []
            for _ in range(7):
                for call, times in ((lambda: random_shard("randn", shape, offset, local_shape, seed=0, counter=0, dtype=torch.float32, device="cpu"), ours),
                                    (lambda: torch.randn(local_shape), plain)):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
            ours_total, plain_total = ours_total + min(ours), plain_total + min(plain)
        boxes = f"{local_shape[0]}x{local_shape[1]}"
        print(f"| {title} | {shape[0]}x{shape[1]} | {boxes} | {ours_total * 1e3:.1f} | {plain_total * 1e3:.1f} | {ours_total / plain_total:.2f} |")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_memory

    from shardtensor import launch

    full = "--full" in sys.argv
    shard_rows = 4096 if full else 1024  # 4096 x 4096 float32 = 64 MiB per shard
    if "--draw-only" in sys.argv:
        return draw_only(shard_rows)
    distribute_rows = 16384 if full else 4096  # 16384 x 4096 float32 = 256 MiB in all
    print(f"{RANKS} ranks, float32, Shard(0) unless named; peak = maxrss increase (MiB, largest rank); time = median (ms, slowest rank); alternating = min ours / min plain torch.randn called in turn by one rank at a time (largest rank)")
    print("| row | size | ours peak | torch DTensor peak | plain torch peak | ours ms | torch DTensor ms | plain torch ms | peak ours/torch | time ours/torch | time ours/plain | time ours/plain alternating |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for title, row, libraries in ROWS:
        rows = distribute_rows if row == "distribute_tensor" else shard_rows * RANKS
        columns = _COLUMNS.get(row, 4096)
        size = f"{rows}x{columns} ({rows * columns * 4 // 2**20} MiB global)"
        results = {}
        for library in libraries:
            try:
                per_rank = launch.spawn(bench_memory.run_rank, RANKS, row, library, rows, columns)
            except launch.RankFailure as failure:  # torch's DTensor RNG needs an accelerator mesh
                print(f"  ({title}, {library}: failed: {str(failure).strip().splitlines()[-1]})")
                continue
            results[library] = (max(peak for peak, _, _ in per_rank), max(seconds for _, seconds, _ in per_rank) * 1e3)
            ratios = [ratio for _, _, ratio in per_rank if ratio is not None]
            if ratios:
                results["alternating"] = max(ratios)
        names = ("ours", "torch", "plain")
        cells = [f"{results[name][0]:.0f}" if name in results else "n/a" for name in names]
        cells += [f"{results[name][1]:.1f}" if name in results else "n/a" for name in names]
        cells += [_ratio(results, "torch", 0), _ratio(results, "torch", 1), _ratio(results, "plain", 1)]
        cells.append(f"{results['alternating']:.2f}" if "alternating" in results else "n/a")
        print(f"| {title} | {size} | " + " | ".join(cells) + " |")


def _ratio(results: dict, other: str, column: int) -> str:
    if "ours" not in results or other not in results:
        return "n/a"
    return f"{results['ours'][column] / results[other][column]:.2f}"


if __name__ == "__main__":
    main()
