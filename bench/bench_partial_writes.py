"""In-place writes into a Partial: ours vs torch.distributed.tensor, per call.

    .venv/bin/python bench/bench_partial_writes.py               # 2 ranks, a 1-D mesh
    .venv/bin/python bench/bench_partial_writes.py --mesh 2 2    # 2x2

`P(sum).add_(1.0)`, `P(max).mul_(-1.0)` and `P(sum).add_(torch.tensor(0.5))` on an 8x8 float32 Partial
DTensor, the same tensor written again on every call. Ours adds a scalar to one operand of a P(sum) (no
collective), and reduces a P(max) scaled by a negative (one all_reduce), writing the result back as
Partial operands, from a cached plan after the first call. Torch DTensor refuses the first two
("in-place operations that require placement changes"). Time per call is rank 0's CPU time
(`time.process_time`, gloo's threads included: the machine is shared), min and median over the repeats.
"""

from __future__ import annotations

import statistics

import torch
from mesh_options import run_on_mesh
from timing import time_per_call

REPEATS = 9
ITERATIONS = 200
CALLS = {
    "P(sum).add_(1.0)": ("sum", lambda partial: partial.add_(1.0)),
    "P(max).mul_(-1.0)": ("max", lambda partial: partial.mul_(-1.0)),
    "P(sum).add_(torch.tensor(0.5))": ("sum", lambda partial, scalar=torch.tensor(0.5): partial.add_(scalar)),
}


def _rank_body(mesh_shape: tuple[int, ...], repeats: int, iterations: int):
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    import shardtensor

    meshes = {"ours": (shardtensor, shardtensor.init_device_mesh("cpu", mesh_shape)),
              "torch DTensor": (torch_tensor, torch_init_device_mesh("cpu", mesh_shape))}
    local = torch.randn(8, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = {}
    for name, (reduce_op, call) in CALLS.items():
        for library_name, (library, mesh) in meshes.items():
            partial = library.DTensor.from_local(local.clone(), mesh, [library.Partial(reduce_op)] * mesh.ndim)
            try:
                call(partial)  # warm: the decision is made
            except RuntimeError as error:
                results[(name, library_name)] = str(error).split(";")[0][:90]
                continue
            samples = []
            for _ in range(repeats):
                dist.barrier()
                samples.append(time_per_call(lambda: call(partial), iterations) * 1e6)
            results[(name, library_name)] = samples
    return results


def main() -> None:
    mesh_shape, results = run_on_mesh(_rank_body, __doc__.splitlines()[0], REPEATS, ITERATIONS)
    lines = [f"| mesh {'x'.join(map(str, mesh_shape))}: call | library | us min | median |", "|---|---|---:|---:|"]
    for (name, library_name), samples in results.items():
        if isinstance(samples, str):
            lines.append(f"| `{name}` | {library_name} | refused: {samples} | |")
        else:
            lines.append(f"| `{name}` | {library_name} | {min(samples):.1f} | {statistics.median(samples):.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
