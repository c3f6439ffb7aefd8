"""FSDP benchmark: torch's `fully_shard` (torch DTensor) and ours on the same model, in the same run.

    .venv/bin/python bench/bench_fsdp.py            # 4 local gloo ranks, CPU
    .venv/bin/python bench/bench_fsdp.py --quick    # fewer steps
    .venv/bin/python bench/bench_fsdp.py --foreach  # AdamW(foreach=True) for both (default: the for-loop AdamW)
    .venv/bin/python bench/bench_fsdp.py --reshard-after-forward 2  # the blocks reshard to 2 ranks after forward

Model: an input projection, BLOCKS MLP blocks (width -> hidden -> width, residual) and a head, each
block one `fully_shard` unit and the root one more; AdamW (the same implementation for both); each rank trains on its slice of the
batch. `hidden` is chosen not to divide by the rank count, so torch pads every block's shards.

Reported per implementation: the time of forward + backward (where FSDP works: gathers,
reduce-scatters, overlap) and of the optimizer step (AdamW on the sharded DTensors; ours also waits
there for the last reduce-scatters, which it leaves in flight after backward), each the slowest
rank's median, memory held between steps (bytes of the storages of parameters, gradients and optimizer
state on one rank, padding included), the step's peak above that (the largest running sum of
allocations minus frees during one step, from the profiler's per-op memory on the training thread,
each op's own at its start), CPU time of a whole step (`time.process_time`: every thread of the rank,
gloo's included; the busiest rank's median: on a shared machine wall time mostly measures waiting
for the scheduler, CPU time what the step costs), and
bytes per step (what one rank receives in the collectives of forward and backward, ideal-algorithm count: ours
from `comm.observe()`, torch's computed from its padded shard sizes). Both runs start from the
same weights and data; the table says whether their parameters agree after the steps.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WIDTH, HIDDEN, BLOCKS, BATCH_PER_RANK = 256, 1030, 4, 16
FOREACH = "--foreach" in sys.argv
# The blocks' reshard_after_forward (the root keeps the default): True, or an int k (backward gathers over k ranks).
RESHARD_AFTER_FORWARD = int(sys.argv[sys.argv.index("--reshard-after-forward") + 1]) if "--reshard-after-forward" in sys.argv else True


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(64, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model() -> Model:
    torch.manual_seed(0)
    return Model()


def _shard(model: Model, fully_shard, mesh) -> Model:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD_AFTER_FORWARD)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH_PER_RANK, 64, generator=generator), torch.randn(BATCH_PER_RANK, 10, generator=generator)


def _train_step(model, optimizer, step: int, rank: int, around_passes=contextlib.nullcontext) -> tuple[float, float]:
    """One step; returns the seconds of forward + backward and of the optimizer step."""
    inputs, target = _batch(step, rank)
    start = time.perf_counter()
    with around_passes():
        loss = ((model(inputs) - target) ** 2).mean()
        loss.backward()
        for parameter in model.parameters():  # ours leaves reduce-scatters in flight: wait here, like torch
            _local(parameter.grad)
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return middle - start, time.perf_counter() - middle


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _held_bytes(model, optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients and optimizer state on this rank."""
    storages = {}
    tensors = []
    for parameter in model.parameters():
        tensors.append(parameter)
        if parameter.grad is not None:
            tensors.append(parameter.grad)
    for state in optimizer.state.values():
        tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _step_peak(run_step) -> int:
    """The largest sum of live allocations during one step, relative to its start (profiler memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run_step()
    events = sorted((event for event in profiler.events() if event.self_cpu_memory_usage), key=lambda event: event.time_range.start)
    current = peak = 0
    for event in events:  # each op's own allocations minus frees, at its start (children counted in their own events)
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def _torch_bytes_per_step(model, ranks: int) -> int:
    """What one rank receives per step in torch FSDP2: every unit's padded shards, all-gathered in forward
    and reduce-scattered once; the non-root units' gathered again in backward, over groups of k ranks (k =
    RESHARD_AFTER_FORWARD, all ranks for True), each rank sending its 1/k of the padded unit."""
    group = ranks if RESHARD_AFTER_FORWARD is True else RESHARD_AFTER_FORWARD
    total = 0
    units = [model, *model.blocks]
    for unit in units:
        owned = [parameter for name, parameter in unit.named_parameters() if unit is not model or not name.startswith("blocks.")]
        padded = sum(math.ceil(parameter.shape[0] / ranks) * parameter[0].numel() * parameter.element_size() for parameter in owned)
        total += 2 * (ranks - 1) * padded
        if unit is not model:
            total += (group - 1) * padded * ranks // group
    return total


def _measure_interleaved(models: dict, rank: int, steps: int, observe) -> dict:
    """Train every model the same steps, alternating step by step (so both see the same machine load)."""
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH) for name, model in models.items()}
    passes = {name: [] for name in models}
    updates = {name: [] for name in models}
    cpu = {name: [] for name in models}
    for step in range(3 + steps):  # the first 3 steps warm caches and create the optimizer state
        for name, model in models.items():
            dist.barrier()
            cpu_start = time.process_time()
            forward_backward, update = _train_step(model, optimizers[name], step, rank)
            if step >= 3:
                passes[name].append(forward_backward)
                updates[name].append(update)
                cpu[name].append(time.process_time() - cpu_start)
    results = {}
    for name, model in models.items():
        seen: list = []

        @contextlib.contextmanager
        def collect():
            with observe() as records:
                yield
            seen.extend(records)

        _train_step(model, optimizers[name], 3 + steps, rank, collect if name == "ours" else contextlib.nullcontext)
        peak = _step_peak(lambda: _train_step(model, optimizers[name], 4 + steps, rank))
        results[name] = {
            "passes_s": statistics.median(passes[name]), "updates_s": statistics.median(updates[name]),
            "cpu_s": statistics.median(cpu[name]),
            "held": _held_bytes(model, optimizers[name]), "peak": peak,
            "received": sum(record.bytes_received for record in seen) if name == "ours" else None,
            "full": [parameter.full_tensor().detach() for parameter in model.parameters()],
        }
    return results


def run_rank(steps: int, foreach: bool, reshard_after_forward: bool | int):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardtensor import comm
    from shardtensor.fsdp import fully_shard
    from shardtensor.mesh import init_device_mesh

    global FOREACH, RESHARD_AFTER_FORWARD
    FOREACH, RESHARD_AFTER_FORWARD = foreach, reshard_after_forward
    torch.set_num_threads(1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    models = {
        "theirs": _shard(_model(), torch_fully_shard, torch_mesh("cpu", (ranks,))),
        "ours": _shard(_model(), fully_shard, init_device_mesh("cpu", (ranks,))),
    }
    results = _measure_interleaved(models, rank, steps, comm.observe)
    results["theirs"]["received"] = _torch_bytes_per_step(_model(), ranks)
    ours, theirs = results["ours"], results["theirs"]
    agree = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ours.pop("full"), theirs.pop("full")))
    return {"ours": ours, "theirs": theirs, "agree": agree}


def _table(per_rank: list[dict], ranks: int, steps: int) -> list[str]:
    def worst(side: str, key: str):
        return max(result[side][key] for result in per_rank)

    megabytes = 1 / 2**20
    lines = [
        f"{ranks} gloo ranks, CPU, fp32; model: 64 -> {WIDTH}, {BLOCKS} blocks {WIDTH} -> {HIDDEN} -> {WIDTH}, head {WIDTH} -> 10 "
        f"({HIDDEN} rows over {ranks} ranks: torch pads to {math.ceil(HIDDEN / ranks)} per rank); {BATCH_PER_RANK} rows per rank; "
        f"median of {steps} steps (the two implementations alternate step by step); AdamW foreach={FOREACH}; blocks' "
        f"reshard_after_forward={RESHARD_AFTER_FORWARD}; parameters of the two runs agree after training: "
        f"{all(r['agree'] for r in per_rank)}",
        "",
        "| implementation | forward+backward (ms) | ratio to torch | optimizer step (ms) | whole step ratio | "
        "CPU per step (ms) | CPU ratio | held between steps (MB) | step peak above held (MB) | received per step (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side, label in (("theirs", "torch fully_shard"), ("ours", "shardtensor fully_shard")):
        passes, updates = worst(side, "passes_s"), worst(side, "updates_s")
        whole = (passes + updates) / (worst("theirs", "passes_s") + worst("theirs", "updates_s"))
        lines.append(
            f"| {label} | {passes * 1e3:.1f} | {passes / worst('theirs', 'passes_s'):.2f} | {updates * 1e3:.1f} | {whole:.2f} | "
            f"{worst(side, 'cpu_s') * 1e3:.1f} | {worst(side, 'cpu_s') / worst('theirs', 'cpu_s'):.2f} | "
            f"{worst(side, 'held') * megabytes:.4f} | {worst(side, 'peak') * megabytes:.3f} | {worst(side, 'received') * megabytes:.3f} |"
        )
    return lines


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_fsdp

    from shardtensor import launch

    ranks = 4
    steps = 5 if "--quick" in sys.argv else 15
    start = time.perf_counter()
    per_rank = launch.spawn(bench_fsdp.run_rank, ranks, steps, FOREACH, RESHARD_AFTER_FORWARD)
    print("\n".join(_table(per_rank, ranks, steps)))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
