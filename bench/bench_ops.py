"""Per-op eager overhead of shardtensor vs torch.distributed.tensor, same run, local gloo ranks.

    .venv/bin/python bench/bench_ops.py              # 4 ranks; prints the table for bench/README.md
    .venv/bin/python bench/bench_ops.py --ranks 1    # one rank: the least noisy on a busy machine

Small tensors, so the time is dispatch overhead, not compute. Each repeat times `ITERATIONS` calls
of ours and then of theirs back to back (so both see the same machine load), rank 0's CPU time
(`time.process_time`, gloo's threads included: on 2+ ranks an all_reduce in an MLP row costs
~110-200 us of CPU on the shared machine, its waiting partly hidden). Each
row: microseconds per op, min and median over the repeats, for both libraries, and the ratios
ours/theirs of the mins and of the medians (noise only adds time, so the min ratio is the steadier
one). The last column times ours again with `torch_function.fast_path_enabled = False` (every call
through `__torch_dispatch__`). Last rows: propagation on a cache miss (no processes:
`propagation.decide` on layouts of 1-D and 3-D meshes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ITERATIONS = 200
REPEATS = 15


def _time_per_call(function, iterations=ITERATIONS) -> float:
    """CPU time of this process per call: time the scheduler gives to other processes on a shared
    machine is left out (the cached path runs no collective, so a rank never waits for another)."""
    start = time.process_time()
    for _ in range(iterations):
        function()
    return (time.process_time() - start) / iterations * 1e6


def _workloads(library, mesh, shard, replicate):
    """name -> (function, ops per call), the same program for both libraries."""
    x = library.distribute_tensor(torch.randn(8, 8), mesh, [shard(0)])
    y = library.distribute_tensor(torch.randn(8, 8), mesh, [shard(0)])
    weight = library.distribute_tensor(torch.randn(8, 8), mesh, [replicate()])
    hidden = library.distribute_tensor(torch.randn(8, 16, requires_grad=True), mesh, [replicate()])
    output = library.distribute_tensor(torch.randn(16, 4, requires_grad=True), mesh, [replicate()])

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
        "relu": (lambda: x.relu(), 1),
        "sum": (lambda: x.sum(), 1),
        "mm": (lambda: x @ weight, 1),
        "view": (lambda: x.view(64), 1),
        "transpose": (lambda: x.t(), 1),
        "10-op chain": (chain, 10),
        "tiny MLP fwd+bwd": (mlp, 1),
        "tiny MLP step (zero_grad, fwd+bwd, SGD)": (mlp_step, 1),
    }


def _rank_body(repeats: int):
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor
    from shardtensor import torch_function

    torch.manual_seed(0)
    world = dist.get_world_size()
    ours = _workloads(shardtensor, shardtensor.init_device_mesh("cpu", (world,)), shardtensor.Shard, shardtensor.Replicate)
    theirs = _workloads(torch_tensor, torch_init_device_mesh("cpu", (world,)), torch_tensor.Shard, torch_tensor.Replicate)
    results = {}
    for name, (our_function, ops_per_call) in ours.items():
        their_function = theirs[name][0]
        for _ in range(3):  # warm: decisions cached, public functions learnt
            our_function(), their_function()
        our_samples, their_samples, normal_path_samples = [], [], []
        for _ in range(repeats):
            dist.barrier()
            our_samples.append(_time_per_call(our_function) / ops_per_call)
            their_samples.append(_time_per_call(their_function) / ops_per_call)
            torch_function.fast_path_enabled = False
            normal_path_samples.append(_time_per_call(our_function) / ops_per_call)
            torch_function.fast_path_enabled = True
        results[name] = (our_samples, their_samples, normal_path_samples)
    fallbacks = dict(shardtensor.dispatch.fallback_counts)
    return results, fallbacks


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
    options = parser.parse_args()
    torch.set_num_threads(1)
    results, fallbacks = spawn(_rank_body, options.ranks, options.repeats)[0]
    lines = [
        f"| op ({options.ranks} ranks, 8x8 float32, S(0)) | ours us/op min | median | torch DTensor us/op min "
        f"| median | ours/theirs (min) | ours/theirs (median) | ours without the function fast path, min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (our_samples, their_samples, normal_path_samples) in results.items():
        our_min, our_median = min(our_samples), statistics.median(our_samples)
        their_min, their_median = min(their_samples), statistics.median(their_samples)
        lines.append(
            f"| {name} | {our_min:.1f} | {our_median:.1f} | {their_min:.1f} | {their_median:.1f} "
            f"| {our_min / their_min:.2f} | {our_median / their_median:.2f} | {min(normal_path_samples):.1f} |"
        )
    for mesh_shape in [(4,), (2, 2, 2)]:
        shape_text = "x".join(map(str, mesh_shape))
        miss = _propagation_miss_us(mesh_shape)
        lines.append(f"| propagation cache miss, add S/S, mesh {shape_text} (median) | | {miss:.0f} | | | | | |")
    print("\n".join(lines))
    print(f"\nops through the replicate fallback (rank 0): {fallbacks or 'none'}")


if __name__ == "__main__":
    main()
