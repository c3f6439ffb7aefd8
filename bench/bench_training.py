"""Whole training steps, shardtensor vs torch.distributed.tensor side by side in one run (local gloo ranks).

    .venv/bin/python bench/bench_training.py            # 2 ranks; prints the table for bench/README.md
    .venv/bin/python bench/bench_training.py --quick    # fewer repeats, smaller memory rows

Rows: the Megatron MLP block step (tests/training_programs.py: LayerNorm, W1 Shard(0), gelu,
W2 Shard(1), residual, MSE; forward, backward and SGD) at two hidden sizes; a transformer block step
with AdamW (attention written as softmax(q k^T) v, which both libraries run); AdamW's step alone,
foreach and not, on 24 parameters 64x64 mixed Shard(0)/Shard(1)/Replicate; the `randn` factory; and
`distribute_tensor`. For each library: the wall time of a step on rank 0 over the repeats, min
and median (each sample starts after a barrier; ours and torch's alternate, so both see the same
machine load; noise only adds time, so the ratio of the mins is the steadier one), the collectives one step issues (each library's own CommDebugMode), and the peak memory
a step adds on rank 0 (resident set sampled every 0.2 ms while it runs, minus the resident set
before it; the source tensor of `distribute_tensor` is created before).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed.tensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import training_programs as programs  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class _PeakMemory:
    """The most resident memory above the starting level while the block runs (sampled)."""

    def __enter__(self):
        self.start = self.peak = _resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _resident_bytes())
            time.sleep(0.0002)

    def __exit__(self, *exc_info):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _resident_bytes())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20


# ---- rows: library, mesh -> step function -----------------------------------------------------------


def _training_step(program, optimizer_class, **optimizer_options):
    def setup(library, mesh):
        parameters, inputs = programs.distribute(program, library, mesh, tp_mesh_dim=0, dtype=torch.float32)
        optimizer = optimizer_class(list(parameters.values()), **optimizer_options)

        def step():
            optimizer.zero_grad(set_to_none=True)
            programs.loss_of(program, parameters, inputs, library).backward()
            optimizer.step()

        return step

    return setup


def _optimizer_step(foreach: bool):
    def setup(library, mesh):
        generator = torch.Generator().manual_seed(0)
        kinds = [library.Shard(0), library.Shard(1), library.Replicate()]
        parameters = []
        for index in range(24):
            placements = [kinds[index % 3]]
            parameter = library.distribute_tensor(torch.randn(64, 64, generator=generator), mesh, placements)
            parameter.requires_grad_()
            parameter.grad = library.distribute_tensor(torch.randn(64, 64, generator=generator), mesh, placements)
            parameters.append(parameter)
        optimizer = torch.optim.AdamW(parameters, lr=1e-3, foreach=foreach)
        return optimizer.step

    return setup


def _randn(shard_mib: int):
    """Ours: the `randn` factory; torch's column: plain `torch.randn` of the local shard, because
    torch.distributed.tensor.randn raises a bare AssertionError on CPU meshes."""

    def setup(library, mesh):
        rows = shard_mib * 2**20 // 4 // 1024

        def step():
            if library is torch.distributed.tensor:
                return torch.randn(rows, 1024)
            return library.randn(rows * mesh.size(), 1024, device_mesh=mesh, placements=[library.Shard(0)])

        return step

    return setup


def _distribute(total_mib: int):
    source = torch.randn(total_mib * 2**20 // 4 // 1024, 1024)

    def setup(library, mesh):
        def step():
            return library.distribute_tensor(source, mesh, [library.Shard(0)])

        return step

    return setup


def _rows(quick: bool):
    mlp = programs.megatron_mlp
    transformer = programs.megatron_transformer(hidden=256, batch=1, sequence=256, heads=8, sdpa=False)
    return [
        ("Megatron MLP block fwd+bwd+SGD, h=256, batch 64", _training_step(mlp(hidden=256, batch=64), torch.optim.SGD, lr=0.1)),
        ("Megatron MLP block fwd+bwd+SGD, h=1024, batch 64", _training_step(mlp(hidden=1024, batch=64), torch.optim.SGD, lr=0.1)),
        ("transformer block fwd+bwd+AdamW, h=256, 1x256 tokens, 8 heads", _training_step(transformer, torch.optim.AdamW, lr=1e-3)),
        ("AdamW(foreach=True).step(), 24 params 64x64 S(0)/S(1)/R", _optimizer_step(True)),
        ("AdamW(foreach=False).step(), same params", _optimizer_step(False)),
        (f"randn factory, {4 if quick else 16} MiB shard per rank (torch: plain torch.randn of the shard)",
         _randn(4 if quick else 16)),
        (f"distribute_tensor of {16 if quick else 64} MiB, Shard(0)", _distribute(16 if quick else 64)),
    ]


def _rank_body(quick: bool, repeats: int):
    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    import shardtensor
    from shardtensor.debug import CommDebugMode

    world = dist.get_world_size()
    meshes = {"ours": shardtensor.init_device_mesh("cpu", (world,)), "torch": torch_init_device_mesh("cpu", (world,))}
    libraries = {"ours": shardtensor, "torch": torch_tensor}
    modes = {"ours": CommDebugMode, "torch": TorchCommDebugMode}
    results = []
    for name, setup in _rows(quick):
        steps = {which: setup(libraries[which], meshes[which]) for which in ("ours", "torch")}
        row = {}
        for which, step in steps.items():
            step()  # warm: decisions cached, kernels loaded
            with modes[which]() as mode:
                step()
            dist.barrier()
            with _PeakMemory() as memory:
                step()
            row[which] = {"collectives": mode.get_total_counts(), "memory": memory.added_mib, "times": []}
        for _ in range(repeats):
            for which, step in steps.items():
                dist.barrier()
                start = time.perf_counter()
                step()
                dist.barrier()
                row[which]["times"].append((time.perf_counter() - start) * 1e3)
        results.append((name, row))
        del steps
    return results


def main() -> None:
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (a 1-D mesh of them)")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per row and library")
    parser.add_argument("--quick", action="store_true", help="3 repeats and small memory rows")
    options = parser.parse_args()
    torch.set_num_threads(1)
    # Large blocks always mmapped and unmapped, so that the resident set follows allocations (glibc
    # otherwise raises its threshold after the first free and reuses freed memory unseen).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**16)
    repeats = 3 if options.quick else options.repeats
    results = spawn(_rank_body, options.ranks, options.quick, repeats)[0]
    lines = [
        f"| step ({options.ranks} gloo ranks) | ours ms (min) | torch ms (min) | ours / torch (min) "
        f"| ours / torch (median) | collectives ours | torch | peak MiB ours | torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in results:
        ours, theirs = row["ours"]["times"], row["torch"]["times"]
        median_ratio = statistics.median(ours) / statistics.median(theirs)
        lines.append(
            f"| {name} | {min(ours):.2f} | {min(theirs):.2f} | {min(ours) / min(theirs):.2f} | {median_ratio:.2f} "
            f"| {row['ours']['collectives']} | {row['torch']['collectives']} | {row['ours']['memory']:.0f} "
            f"| {row['torch']['memory']:.0f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
