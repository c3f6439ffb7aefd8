"""`DTensor.from_local` of uneven Shard(0) shards without `shape`: ours learns the local shapes from every
rank (one fixed-size all_gather), torch assumes every shard has this rank's shape (no collective).

    .venv/bin/python bench/bench_from_local.py          # meshes 2 and 2x2; rows for bench/README.md

Each rank holds `coordinate + 1` rows of 16 floats (not torch.chunk's split, so torch's global shape
is wrong there: the row times what a user would pay for exact sizes). Both libraries run in the same
worker processes, alternating repeats after a barrier; per call: the slowest rank's min over repeats of
the wall time (the collective waits for the other ranks).
"""

from __future__ import annotations

import math
import time

import torch

CALLS = 100
REPEATS = 7


def _rank_body(shape: tuple[int, ...]) -> dict[str, float]:
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor

    libraries = {
        "ours": (shardtensor, shardtensor.init_device_mesh("cpu", shape)),
        "torch": (torch_tensor, torch_init_device_mesh("cpu", shape)),
    }
    local = torch.randn(libraries["ours"][1].get_coordinate()[0] + 1, 16)
    best = {name: math.inf for name in libraries}
    for _ in range(REPEATS):
        for name, (library, mesh) in libraries.items():
            placements = [library.Shard(0)] + [library.Replicate()] * (mesh.ndim - 1)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                library.DTensor.from_local(local, mesh, placements)
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS * 1e6)
    return best


def main() -> None:
    from shardtensor import launch

    print("| mesh | ours us/call (min, slowest rank) | torch DTensor us/call | ours/torch |")
    print("|---|---:|---:|---:|")
    for shape in [(2,), (2, 2)]:
        results = launch.spawn(_rank_body, math.prod(shape), shape)
        ours = max(result["ours"] for result in results)
        theirs = max(result["torch"] for result in results)
        print(f"| {'x'.join(map(str, shape))} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.1f} |")


if __name__ == "__main__":
    main()
