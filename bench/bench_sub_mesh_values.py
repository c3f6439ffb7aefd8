"""Ops that return Python values, on a mesh over the world and on a sub-mesh: ours vs torch DTensor.

    .venv/bin/python bench/bench_sub_mesh_values.py    # 4 ranks; prints the table for bench/README.md

A 8x8 float32 `x` sharded `Shard(0)` and a Replicate `y`, on the 4-rank world, on the sub-mesh of
ranks [1, 3] (rank 0 outside it, rank 1 inside) and on each rank's own row of a 2x2 mesh (`mesh["tp"]`:
every rank inside its own sub-mesh). Each row: wall-clock microseconds per
call (the calls synchronize the ranks, so CPU time would hide the waiting), min and median over the
repeats, and this rank's collectives per call; where torch does not give the single-device value,
what it gives instead (untimed).
"""

from __future__ import annotations

import statistics
import time

import torch

ITERATIONS = 100
REPEATS = 7


def _per_call_us(function) -> float:
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        function()
    return (time.perf_counter() - start) / ITERATIONS * 1e6


def _outcome(function, expected) -> str | None:
    """None when the call gives the single-device value (then it is timed); else what it gives."""
    try:
        value = function()
    except Exception as error:
        return f"raises {type(error).__name__}: {error}"
    if value is None or abs(value - expected) > 1e-4 * max(1.0, abs(expected)):
        return f"gives {value!r}, one device {expected!r}"
    return None


def _rank_body():
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor
    from shardtensor import comm

    full_x, full_y = torch.randn(8, 8), torch.randn(8, 8)
    ours_2d = shardtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    theirs_2d = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes_by_label = {
        "world": (shardtensor.DeviceMesh("cpu", [0, 1, 2, 3]), TorchDeviceMesh("cpu", [0, 1, 2, 3])),
        "sub-mesh [1, 3]": (shardtensor.DeviceMesh("cpu", [1, 3]), TorchDeviceMesh("cpu", [1, 3])),
        "own row of 2x2": (ours_2d["tp"], theirs_2d["tp"]),
    }
    rows = {}
    for mesh_label, (our_mesh, their_mesh) in meshes_by_label.items():
        for library_name, library, mesh in (("ours", shardtensor, our_mesh), ("torch", torch_tensor, their_mesh)):
            x = library.distribute_tensor(full_x, mesh, [library.Shard(0)])
            y = library.distribute_tensor(full_y, mesh, [library.Replicate()])
            calls = {
                "x.sum().item()": (lambda: x.sum().item(), full_x.sum().item()),
                "torch.equal(x, y)": (lambda: torch.equal(x, y), torch.equal(full_x, full_y)),
            }
            for op_name, (function, expected) in calls.items():
                outcome = _outcome(function, expected)
                samples = []
                collectives = None
                if outcome is None and library_name == "ours":
                    with comm.observe() as records:
                        function()
                    collectives = len(records)
                for _ in range(REPEATS):
                    dist.barrier()
                    if outcome is None:
                        samples.append(_per_call_us(function))
                rows[(mesh_label, op_name, library_name)] = (outcome, samples, collectives)
    return dist.get_rank(), rows


def main() -> None:
    from shardtensor.launch import spawn

    torch.set_num_threads(1)
    results = dict(spawn(_rank_body, 4))
    print("| mesh | op | rank | ours us/call min | median | ours collectives | torch us/call min | median | ours/torch (min) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for rank in (0, 1):
        rows = results[rank]
        for mesh_label, op_name, library_name in rows:
            if library_name != "ours":
                continue
            _, our_samples, collectives = rows[(mesh_label, op_name, "ours")]
            their_outcome, their_samples, _ = rows[(mesh_label, op_name, "torch")]
            where = "outside" if mesh_label == "sub-mesh [1, 3]" and rank == 0 else "inside"
            ours = f"{min(our_samples):.0f} | {statistics.median(our_samples):.0f} | {collectives}"
            if their_outcome is not None:
                theirs, ratio = f"{their_outcome} | | ", ""
            else:
                theirs = f"{min(their_samples):.0f} | {statistics.median(their_samples):.0f}"
                ratio = f"{min(our_samples) / min(their_samples):.2f}"
            print(f"| {mesh_label} | {op_name} | {rank} ({where}) | {ours} | {theirs} | {ratio} |")


if __name__ == "__main__":
    main()
