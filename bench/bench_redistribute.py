"""Redistribute benchmark: shardtensor against torch.distributed.tensor in the same run, on 4 local ranks.

    .venv/bin/python bench/bench_redistribute.py            # full table (~2-3 minutes on 2 cores)
    .venv/bin/python bench/bench_redistribute.py --quick    # 4 KB and 1 MB only

For every transition and size: median wall time of one redistribute (the slowest rank's median),
ours / theirs; bytes / lower bound for both, where bytes are the most bytes any one rank receives
summed over the collectives of the redistribute (an ideal algorithm's count: all_gather the other
pieces, all_reduce 2(n-1)/n of the tensor, reduce_scatter (n-1) pieces, all_to_all and
point-to-point what arrives); and first-call planning latency (ours: `plan` on an empty cache;
theirs: `_gen_transform_infos_non_cached`). Torch's bytes are read from its functional collectives
with a dispatch mode, padding included. Then first-call planning latency on a 2x2x2 mesh (ours).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from timing import call_times

SIZES = {"4 KB": (32, 32), "1 MB": (512, 512), "16 MB": (2048, 2048)}
ITERATIONS = {"4 KB": 30, "1 MB": 10, "16 MB": 3}
# (mesh shape, source placements, target placements); "S0" = Shard(0), "R", "P" = Partial(sum).
TRANSITIONS = [
    ((4,), ("S0",), ("R",)),
    ((4,), ("S0",), ("S1",)),
    ((4,), ("R",), ("S0",)),
    ((4,), ("P",), ("R",)),
    ((4,), ("P",), ("S0",)),
    ((2, 2), ("S0", "S1"), ("S1", "S0")),
    ((2, 2), ("S0", "S0"), ("R", "R")),
    ((2, 2), ("S0", "S0"), ("R", "S0")),
    ((2, 2), ("S0", "R"), ("R", "S0")),
    ((2, 2), ("P", "P"), ("R", "R")),
]
PLANNING_3D = [
    (("S0", "S1", "R"), ("R", "S0", "S1")),
    (("S0", "S0", "S0"), ("R", "R", "R")),
    (("S0", "S1", "S0"), ("S1", "S0", "R")),
    (("P", "P", "S0"), ("R", "R", "S1")),
    (("S0", "R", "S1"), ("S1", "S0", "R")),
    (("P", "P", "P"), ("R", "R", "R")),
]


def _placements(names, module):
    table = {"R": module.Replicate(), "P": module.Partial(), "S0": module.Shard(0), "S1": module.Shard(1)}
    return [table[name] for name in names]


class TorchBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes this rank receives in torch's functional collectives (ideal-algorithm count, padding included)."""

    def __init__(self):
        super().__init__()
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional":
            tensor = args[0]
            nbytes = tensor.numel() * tensor.element_size()
            if name == "all_gather_into_tensor":
                self.received += nbytes * (args[1] - 1)
            elif name == "reduce_scatter_tensor":
                self.received += nbytes * (args[2] - 1) // args[2]
            elif name == "all_reduce":
                size = dist.distributed_c10d._resolve_process_group(args[2]).size()
                self.received += 2 * (size - 1) * nbytes // size
            elif name == "all_to_all_single":
                group = dist.distributed_c10d._resolve_process_group(args[3])
                row = tensor.numel() // max(tensor.shape[0], 1) * tensor.element_size()
                outputs = args[1]
                self.received += (sum(outputs) - outputs[dist.get_rank(group)]) * row
            elif name != "wait_tensor" and not name.startswith("_"):  # _wrap_tensor_autograd moves nothing
                raise NotImplementedError(f"TorchBytes does not count {func}")
        return func(*args, **kwargs)


def _slowest_median(times: list[float]) -> float:
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def _most(value: int) -> int:
    most = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _time(function, iterations: int) -> float:
    function()  # warm-up: plans, process groups and caches
    return _slowest_median(call_times(function, iterations, before=dist.barrier))


def _first_call_ms(function, repeats: int = 5, setup=None) -> float:
    """Median time of `function`, `setup` (emptying caches) run before each call and not timed."""
    return statistics.median(call_times(function, repeats, before=setup)) * 1e3


def _clear_planner_caches() -> None:
    """Empty every cache of the planner (plans, per-layout geometry, bounds): a true first call."""
    from shardtensor.redistribute import bounds, planner

    for module in (planner, bounds):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def _row(mesh_shape, source_names, target_names, shape, iterations, meshes):
    import shardtensor
    import torch.distributed.tensor as their
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as TheirSpec
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached, clear_redistribute_planner_cache

    from shardtensor import comm
    from shardtensor.redistribute import bounds, planner

    our_mesh, their_mesh = meshes[mesh_shape]
    full = torch.randn(shape)
    partial = "P" in source_names
    if partial:
        ours = shardtensor.DTensor.from_local(full.clone(), our_mesh, _placements(source_names, shardtensor))
        theirs = their.DTensor.from_local(full.clone(), their_mesh, _placements(source_names, their))
    else:
        ours = shardtensor.distribute_tensor(full, our_mesh, _placements(source_names, shardtensor))
        theirs = their.distribute_tensor(full, their_mesh, _placements(source_names, their))
    our_target = _placements(target_names, shardtensor)
    their_target = _placements(target_names, their)

    def run_ours():
        return ours.redistribute(our_mesh, our_target).to_local()

    def run_theirs():
        local = theirs.redistribute(their_mesh, their_target).to_local()
        return local.wait() if hasattr(local, "wait") else local

    our_time = _time(run_ours, iterations)
    their_time = _time(run_theirs, iterations)
    with comm.observe() as records:
        run_ours()
    our_bytes = _most(sum(record.bytes_received for record in records))
    with TorchBytes() as counter:
        run_theirs()
    their_bytes = _most(counter.received)
    source, target = ours.sharding, ours.sharding.with_placements(our_target)
    bound = bounds.lower_bound_bytes(source, target, 4)
    our_plan = planner.plan(source, target, 4)

    def plan_ours():
        planner.plan(source, target, 4)

    their_target_spec = TheirSpec(their_mesh, tuple(their_target), tensor_meta=theirs._spec.tensor_meta)

    def plan_theirs():
        _gen_transform_infos_non_cached(theirs._spec, their_target_spec)

    return {
        "ours_ms": our_time * 1e3, "theirs_ms": their_time * 1e3, "ours_bytes": our_bytes, "theirs_bytes": their_bytes,
        "bound": bound, "plan_ours_ms": _first_call_ms(plan_ours, setup=_clear_planner_caches),
        "plan_theirs_ms": _first_call_ms(plan_theirs, setup=clear_redistribute_planner_cache),
        "collectives": "+".join(our_plan.collectives) or "local",
    }


def run_rank(size_names: list[str]) -> list[dict]:
    """One rank's part: every row, in the same order on every rank."""
    import torch.distributed.device_mesh as their_device_mesh

    import shardtensor

    torch.set_num_threads(1)
    meshes = {
        shape: (shardtensor.init_device_mesh("cpu", shape), their_device_mesh.init_device_mesh("cpu", shape))
        for shape in [(4,), (2, 2)]
    }
    rows = []
    for size_name in size_names:
        for uneven in (False, True):
            rows_cols = SIZES[size_name]
            shape = (rows_cols[0] - 1, rows_cols[1] + 1) if uneven else rows_cols
            for mesh_shape, source, target in TRANSITIONS:
                result = _row(mesh_shape, source, target, shape, ITERATIONS[size_name], meshes)
                result.update(size=size_name, shape=shape, mesh=mesh_shape, source=source, target=target)
                rows.append(result)
    return rows


def _planning_3d() -> list[str]:
    from shardtensor import placement
    from shardtensor.layout import Layout
    from shardtensor.redistribute import planner

    lines = ["| 2x2x2 transition, shape (1000, 1001) | first-call plan (ms) | collectives | bytes / bound |", "|---|---|---|---|"]
    for source_names, target_names in PLANNING_3D:
        source = Layout.create((2, 2, 2), _placements(source_names, placement), (1000, 1001))
        target = source.with_placements(_placements(target_names, placement))

        def plan_once():
            return planner.plan(source, target, 4)

        elapsed = _first_call_ms(plan_once, repeats=7, setup=_clear_planner_caches)
        _clear_planner_caches()
        result = plan_once()
        ratio = result.total_bytes / result.lower_bound_bytes if result.lower_bound_bytes else 1.0
        lines.append(f"| ({','.join(source_names)})->({','.join(target_names)}) | {elapsed:.2f} | "
                     f"{'+'.join(result.collectives)} | {ratio:.2f} |")
    return lines


def _table(rows: list[dict]) -> list[str]:
    lines = [
        "| transition | mesh | shape | ours (ms) | torch (ms) | time ratio | ours bytes/bound | torch bytes/bound "
        "| plan ours (ms) | plan torch (ms) | our collectives |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        bound = row["bound"]

        def ratio(value):
            return f"{value / bound:.2f}" if bound else ("1.00" if value == 0 else "inf")

        transition = f"({','.join(row['source'])})->({','.join(row['target'])})"
        mesh = "x".join(map(str, row["mesh"]))
        lines.append(
            f"| {transition} | {mesh} | {row['shape'][0]}x{row['shape'][1]} ({row['size']}) | {row['ours_ms']:.3f} | "
            f"{row['theirs_ms']:.3f} | {row['ours_ms'] / row['theirs_ms']:.2f} | {ratio(row['ours_bytes'])} | "
            f"{ratio(row['theirs_bytes'])} | {row['plan_ours_ms']:.3f} | {row['plan_theirs_ms']:.3f} | {row['collectives']} |"
        )
    return lines


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_redistribute

    from shardtensor import launch

    size_names = ["4 KB", "1 MB"] if "--quick" in sys.argv else list(SIZES)
    start = time.perf_counter()
    rows = launch.spawn(bench_redistribute.run_rank, 4, size_names)[0]
    print("\n".join(_table(rows)))
    print()
    print("\n".join(_planning_3d()))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
