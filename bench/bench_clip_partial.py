"""clip_grad_norm_(foreach=False) of Partial(sum) gradients: ours vs torch.distributed.tensor, and
what ours would cost if each gradient's norm read it all_reduced (torch's collectives) instead of
reduce-scattered.

    .venv/bin/python bench/bench_clip_partial.py               # 2 ranks, a 1-D mesh
    .venv/bin/python bench/bench_clip_partial.py --mesh 2 2    # 2x2

Replicate parameters whose gradients are Partial(sum) (as data parallel leaves them), two sizes:
24 gradients of 64x64 and 8 of 512x512 float32. Rows:
- ours: `clip_grad_norm_` as is. Each norm reduce-scatters its gradient (one collective over the
  whole mesh, (G-1)/G of the gradient per rank), the norms stay a NormPartial, and the total is one
  all_reduce of a scalar: n + 1 collectives.
- ours, all_reduce reads: the same program with each norm computed on the gradient redistributed to
  Replicate (one all_reduce each, 2(G-1)/G of the gradient per rank; then the norms are Replicate
  and the total needs nothing): n collectives, what a rule choosing all_reduce would issue.
- torch DTensor: one all_reduce per gradient and mesh dim.
Time per call is wall time (`time.perf_counter`: the collectives' waiting counts) on rank 0, min
and median over the repeats; collectives and the bytes rank 0 receives per call are counted by
each library's own CommDebugMode.
"""

from __future__ import annotations

import statistics
import time

import torch
from mesh_options import run_on_mesh
from timing import time_per_call

REPEATS = 7
ITERATIONS = 10
WORKLOADS = {"24 x 64x64": (24, 64), "8 x 512x512": (8, 512)}


def _partial_parameters(library, mesh, count: int, size: int):
    """Replicate parameters whose gradients are Partial(sum): each rank holds its own share."""
    generator = torch.Generator().manual_seed(mesh.get_rank())
    parameters = []
    for _ in range(count):
        full = torch.ones(size, size)
        parameter = library.distribute_tensor(full, mesh, [library.Replicate()] * mesh.ndim).requires_grad_()
        share = torch.randn(size, size, generator=generator)
        parameter.grad = library.DTensor.from_local(share, mesh, [library.Partial()] * mesh.ndim, run_check=False)
        parameters.append(parameter)
    return parameters


def _clip_with_all_reduce_reads(parameters, library, mesh) -> torch.Tensor:
    """clip_grad_norm_(foreach=False)'s program with every gradient read all_reduced to Replicate."""
    replicate = [library.Replicate()] * mesh.ndim
    norms = [torch.linalg.vector_norm(parameter.grad.redistribute(mesh, replicate), 2.0) for parameter in parameters]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coefficient = torch.clamp(1e9 / (total + 1e-6), max=1.0)
    for parameter in parameters:
        parameter.grad.mul_(coefficient)
    return total


def _rank_body(mesh_shape: tuple[int, ...], repeats: int, iterations: int):
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    import shardtensor
    from shardtensor.debug import CommDebugMode

    our_mesh = shardtensor.init_device_mesh("cpu", mesh_shape)
    their_mesh = torch_init_device_mesh("cpu", mesh_shape)
    results = {}
    for workload, (count, size) in WORKLOADS.items():
        ours = _partial_parameters(shardtensor, our_mesh, count, size)
        ours_all_reduce = _partial_parameters(shardtensor, our_mesh, count, size)
        theirs = _partial_parameters(torch_tensor, their_mesh, count, size)
        rows = {
            "ours": (lambda: torch.nn.utils.clip_grad_norm_(ours, 1e9, foreach=False), CommDebugMode),
            "ours, all_reduce reads": (lambda: _clip_with_all_reduce_reads(ours_all_reduce, shardtensor, our_mesh),
                                       CommDebugMode),
            "torch DTensor": (lambda: torch.nn.utils.clip_grad_norm_(theirs, 1e9, foreach=False), TorchCommDebugMode),
        }
        for name, (function, mode_class) in rows.items():
            for _ in range(2):  # warm: decisions cached
                function()
            with mode_class() as mode:
                total = function()
            received = mode.get_total_bytes().received if mode_class is CommDebugMode else None
            samples = []
            for _ in range(repeats):
                dist.barrier()
                samples.append(time_per_call(function, iterations, clock=time.perf_counter) * 1e3)
            results[(workload, name)] = (samples, mode.get_total_counts(), received, float(total.full_tensor()))
    return results


def main() -> None:
    mesh_shape, results = run_on_mesh(_rank_body, __doc__.splitlines()[0], REPEATS, ITERATIONS)
    mesh_name = "x".join(map(str, mesh_shape))
    lines = [f"| mesh {mesh_name}: gradients | clip | ms min | median | collectives | bytes received (rank 0) | norm |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (workload, name), (samples, count, received, total) in results.items():
        bytes_text = "n/a" if received is None else str(received)
        lines.append(f"| {workload} | {name} | {min(samples):.3f} | {statistics.median(samples):.3f} | {count} "
                     f"| {bytes_text} | {total:.4f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
