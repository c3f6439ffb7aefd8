"""Per-op eager overhead of shardtensor vs torch.distributed.tensor, same run, local gloo ranks.

    .venv/bin/python bench/bench_ops.py              # 4 ranks; prints the table for bench/README.md
    .venv/bin/python bench/bench_ops.py --ranks 1    # one rank: the least noisy on a busy machine
    .venv/bin/python bench/bench_ops.py --first-call # first call on fresh shapes, meshes 4, 2x2, 2x2x2

Small tensors, so the time is dispatch overhead, not compute. Each repeat times `ITERATIONS` calls
of ours and then of theirs back to back (so both see the same machine load), rank 0's CPU time
(`time.process_time`, gloo's threads included: on 2+ ranks an all_reduce in an MLP row costs
~110-200 us of CPU on the shared machine, its waiting partly hidden). Each
row: microseconds per op, min and median over the repeats, for both libraries, and the ratios
ours/theirs of the mins and of the medians (noise only adds time, so the min ratio is the steadier
one). Then ours again with `torch_function.fast_path_enabled = False` (every call through
`__torch_dispatch__`), and the same program on plain full-size tensors (one device, no DTensor) with
both libraries' ratios to it. Last rows: propagation on a cache miss (no processes:
`propagation.decide` on layouts of 1-D and 3-D meshes).

`--first-call` times each library's first call of six common ops on inputs in mixed placements,
a shape neither library has seen in every repetition (so every decision cache misses): rank 0's CPU
time and the slowest rank's wall time, ms per call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from timing import time_per_call

ITERATIONS = 200
REPEATS = 15


def _time_per_call(function, iterations=ITERATIONS) -> float:
    """CPU time of this process per call: time the scheduler gives to other processes on a shared
    machine is left out (the cached path runs no collective, so a rank never waits for another)."""
    return time_per_call(function, iterations) * 1e6


def _workloads(distribute):
    """name -> (function, ops per call), the same program for every library; `distribute(tensor,
    sharded)` lays a tensor out as `Shard(0)` or `Replicate()` (plain torch: the tensor itself)."""
    x = distribute(torch.randn(8, 8), True)
    y = distribute(torch.randn(8, 8), True)
    weight = distribute(torch.randn(8, 8), False)
    hidden = distribute(torch.randn(8, 16, requires_grad=True), False)
    output = distribute(torch.randn(16, 4, requires_grad=True), False)
    scale = torch.tensor(2.0)  # a plain 0-d tensor, read like a Python scalar by both libraries

    def chain():
        z = x + y
        z = z * 2
        z = z.relu()
        z = z - y
        z = z.exp()
        z = z / 3
        z = z.tanh()
        z = z + 1
        z = z.sigmoid()
        return z * y

    def mlp():
        ((x @ hidden).relu() @ output).sum().backward()

    # A training step: the optimizer reads the gradients, so the step holds the gradient
    # communication of both libraries (torch DTensor reduces a Partial gradient when SGD reads it,
    # ours at the end of backward); the fwd+bwd row accumulates gradients nobody reads.
    optimizer = torch.optim.SGD([hidden, output], lr=1e-3)

    def mlp_step():
        optimizer.zero_grad()
        ((x @ hidden).relu() @ output).sum().backward()
        optimizer.step()

    return {
        "add": (lambda: x + y, 1),
        "mul": (lambda: x * y, 1),
        "x * t (t = torch.tensor(2.0), 0-d plain)": (lambda: x * scale, 1),
        "x * torch.tensor(2.0)": (lambda: x * torch.tensor(2.0), 1),
        "relu": (lambda: x.relu(), 1),
        "sum": (lambda: x.sum(), 1),
        "mm": (lambda: x @ weight, 1),
        "view": (lambda: x.view(64), 1),
        "reshape": (lambda: x.reshape(64), 1),
        "transpose": (lambda: x.t(), 1),
        "10-op chain": (chain, 10),
        "tiny MLP fwd+bwd": (mlp, 1),
        "tiny MLP step (zero_grad, fwd+bwd, SGD)": (mlp_step, 1),
    }


def _distributor(library, mesh):
    """`distribute` for `_workloads` with one library's `distribute_tensor`, placements and mesh."""

    def distribute(tensor, sharded):
        placement = library.Shard(0) if sharded else library.Replicate()
        return library.distribute_tensor(tensor, mesh, [placement])

    return distribute


def _rank_body(repeats: int):
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor
    from shardtensor import torch_function

    torch.manual_seed(0)
    world = dist.get_world_size()
    ours = _workloads(_distributor(shardtensor, shardtensor.init_device_mesh("cpu", (world,))))
    theirs = _workloads(_distributor(torch_tensor, torch_init_device_mesh("cpu", (world,))))
    plain = _workloads(lambda tensor, sharded: tensor)  # the single-device program: full 8x8 tensors
    results = {}
    for name, (our_function, ops_per_call) in ours.items():
        their_function, plain_function = theirs[name][0], plain[name][0]
        for _ in range(3):  # warm: decisions cached, public functions learnt
            our_function(), their_function(), plain_function()
        our_samples, their_samples, normal_path_samples, plain_samples = [], [], [], []
        for _ in range(repeats):
            dist.barrier()
            our_samples.append(_time_per_call(our_function) / ops_per_call)
            their_samples.append(_time_per_call(their_function) / ops_per_call)
            torch_function.fast_path_enabled = False
            normal_path_samples.append(_time_per_call(our_function) / ops_per_call)
            torch_function.fast_path_enabled = True
            plain_samples.append(_time_per_call(plain_function) / ops_per_call)
        results[name] = (our_samples, their_samples, normal_path_samples, plain_samples)
    fallbacks = dict(shardtensor.dispatch.fallback_counts)
    return results, fallbacks


FIRST_CALL_MESHES = [(4,), (2, 2), (2, 2, 2)]
FIRST_CALL_REPEATS = 5


def _first_call_programs(library, mesh, rows: int, columns: int):
    """name -> a function that lays out fresh (rows, columns) inputs in mixed placements and
    returns the op call: per mesh dim, x is S(0), S(1), R and y is S(1), R, S(0), so most calls
    move an input before computing (as in `_propagation_miss_us`)."""
    import torch.nn.functional as F

    first = [library.Shard(0), library.Shard(1), library.Replicate()][: mesh.ndim]
    second = [library.Shard(1), library.Replicate(), library.Shard(0)][: mesh.ndim]

    def laid_out(shape, placements):
        return library.distribute_tensor(torch.randn(shape), mesh, placements)

    def binary(operation, second_shape):
        def prepare():
            x, y = laid_out((rows, columns), first), laid_out(second_shape, second)
            return lambda: operation(x, y)
        return prepare

    def unary(operation):
        def prepare():
            x = laid_out((rows, columns), first)
            return lambda: operation(x)
        return prepare

    return {
        "add": binary(torch.add, (rows, columns)),
        "mm": binary(torch.mm, (columns, rows)),
        "sum(dim=1)": unary(lambda x: x.sum(dim=1)),
        "softmax(dim=1)": unary(lambda x: torch.softmax(x, dim=1)),
        "layer_norm": unary(lambda x: F.layer_norm(x, (columns,))),
        "reshape(-1)": unary(lambda x: x.reshape(-1)),
    }


def _finished(result):
    """The local result, waited for (torch DTensor may return an AsyncCollectiveTensor)."""
    local = result.to_local()
    return local.wait() if hasattr(local, "wait") else local


def _first_call_body(mesh_shape, repeats: int):
    """Per op and library: (CPU seconds of this rank, wall seconds) of each first call on a fresh
    shape; call 0 is the op's first call in this process (fresh ranks per mesh)."""
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor

    torch.manual_seed(0)
    meshes = {
        "ours": (shardtensor, shardtensor.init_device_mesh("cpu", mesh_shape)),
        "torch": (torch_tensor, torch_init_device_mesh("cpu", mesh_shape)),
    }
    names = list(_first_call_programs(shardtensor, meshes["ours"][1], 16, 16))
    samples = {(name, key): [] for name in names for key in meshes}
    for repeat in range(repeats + 1):
        for index, name in enumerate(names):
            # A shape neither library has seen (rows per repeat, columns per op), small enough
            # (at most 56x56) that the local op and the bytes moved cost little next to dispatch.
            rows, columns = 8 * (2 + repeat), 8 * (2 + index)
            for key, (library, mesh) in meshes.items():
                call = _first_call_programs(library, mesh, rows, columns)[name]()
                dist.barrier()
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                _finished(call())
                samples[name, key].append((time.process_time() - cpu_start, time.perf_counter() - wall_start))
    return samples


def _first_call_table(repeats: int) -> list[str]:
    """One row per op and mesh: ms per first call on a fresh shape, ours and torch DTensor's."""
    from shardtensor.launch import spawn

    lines = [
        "| mesh | op | ours first-ever ms | ours ms min | median | torch first-ever ms | torch ms min | median "
        "| ours/torch (min) | ours/torch (median) | ours wall ms median | torch wall ms median |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mesh_shape in FIRST_CALL_MESHES:
        per_rank = spawn(_first_call_body, math.prod(mesh_shape), mesh_shape, repeats)
        shape_text = "x".join(map(str, mesh_shape))
        for name in dict.fromkeys(name for name, _ in per_rank[0]):
            cells = {}
            for key in ("ours", "torch"):
                cpu = [cpu_seconds * 1e3 for cpu_seconds, _ in per_rank[0][name, key]]
                wall = [max(rank[name, key][call][1] for rank in per_rank) * 1e3 for call in range(len(cpu))]
                cells[key] = (cpu[0], min(cpu[1:]), statistics.median(cpu[1:]), statistics.median(wall[1:]))
            ours, theirs = cells["ours"], cells["torch"]
            lines.append(
                f"| {shape_text} | {name} | {ours[0]:.1f} | {ours[1]:.2f} | {ours[2]:.2f} | {theirs[0]:.1f} "
                f"| {theirs[1]:.1f} | {theirs[2]:.1f} | {ours[1] / theirs[1]:.3f} | {ours[2] / theirs[2]:.3f} "
                f"| {ours[3]:.2f} | {theirs[3]:.1f} |"
            )
    return lines


def _propagation_miss_us(mesh_shape) -> float:
    """One cache miss of `decide` for `add` of two differently sharded inputs (planner included)."""
    from shardtensor.layout import Layout
    from shardtensor.ops.registry import RULES
    from shardtensor.placement import Replicate, Shard
    from shardtensor.propagation import clear_cache, decide
    from shardtensor.redistribute.planner import _cached_plan
    from shardtensor.rules import OpCall, TensorMeta

    shape = (16, 16, 16)
    first = [Shard(0), Shard(1), Replicate()][: len(mesh_shape)]
    second = [Shard(1), Replicate(), Shard(0)][: len(mesh_shape)]
    layouts = [Layout.create(mesh_shape, first, shape), Layout.create(mesh_shape, second, shape)]
    meta = TensorMeta(shape, (256, 16, 1), torch.float32)
    call = OpCall(torch.ops.aten.add.Tensor, (meta, meta), (meta, meta), ())
    rule = RULES[torch.ops.aten.add.Tensor]
    samples = []
    for _ in range(REPEATS):
        clear_cache()
        _cached_plan.cache_clear()
        start = time.perf_counter()
        decide(call, layouts, rule, (0,) * len(mesh_shape), None)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="local gloo ranks (a 1-D mesh of them)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed repeats per row and library")
    parser.add_argument("--first-call", action="store_true",
                        help="instead: first call of common ops on fresh shapes, meshes 4, 2x2, 2x2x2")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.first_call:
        print("\n".join(_first_call_table(min(options.repeats, FIRST_CALL_REPEATS))))
        return
    results, fallbacks = spawn(_rank_body, options.ranks, options.repeats)[0]
    lines = [
        f"| op ({options.ranks} ranks, 8x8 float32, S(0)) | ours us/op min | median | torch DTensor us/op min "
        f"| median | ours/theirs (min) | ours/theirs (median) | ours without the function fast path, min "
        f"| plain torch us/op min | ours/plain (min) | torch DTensor/plain (min) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (our_samples, their_samples, normal_path_samples, plain_samples) in results.items():
        our_min, our_median = min(our_samples), statistics.median(our_samples)
        their_min, their_median = min(their_samples), statistics.median(their_samples)
        plain_min = min(plain_samples)
        lines.append(
            f"| {name} | {our_min:.1f} | {our_median:.1f} | {their_min:.1f} | {their_median:.1f} "
            f"| {our_min / their_min:.2f} | {our_median / their_median:.2f} | {min(normal_path_samples):.1f} "
            f"| {plain_min:.1f} | {our_min / plain_min:.1f} | {their_min / plain_min:.1f} |"
        )
    for mesh_shape in [(4,), (2, 2, 2)]:
        shape_text = "x".join(map(str, mesh_shape))
        miss = _propagation_miss_us(mesh_shape)
        lines.append(f"| propagation cache miss, add S/S, mesh {shape_text} (median) | | {miss:.0f} | | | | | | | | |")
    print("\n".join(lines))
    print(f"\nops through the replicate fallback (rank 0): {fallbacks or 'none'}")


if __name__ == "__main__":
    main()
