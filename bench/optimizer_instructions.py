"""Instructions per optimizer step (callgrind): shardtensor vs torch.distributed.tensor vs plain tensors.

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.ours \\
        .venv/bin/python bench/optimizer_instructions.py ours /tmp/cg.ours      # or: torch, plain

The timings of `bench_optimizer.py` swing by +-0.1 of the ratio on the shared machine; instruction
counts do not. On one gloo rank, the workloads of `bench_optimizer.py` (same parameters, same
placements) run with callgrind's instrumentation switched on around 5 and then 25 steps (through
`callgrind_control`, which dumps each phase to `OUT.N`); the difference over 20 steps is one
step's count, without the toggling's own cost. Instructions are not time (memory stalls are left
out), but they show where a Python-level overhead goes and do not depend on the load.
"""

from __future__ import annotations

import glob
import itertools
import os
import subprocess
import sys

import torch

WORKLOADS = (
    "AdamW(foreach=True).step()", "AdamW(foreach=False).step()", "Adam(foreach=True).step()",
    "SGD(momentum=0.9, foreach=True).step()",
)
SHORT, LONG = 5, 25


def _control(*options: str) -> None:
    command = ["callgrind_control", *options, str(os.getpid())]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _instructions(dump: str) -> int:
    with open(dump) as file:
        return next(int(line.split()[1]) for line in file if line.startswith("totals:"))


def per_call_instructions(function, short: int, long: int, out: str, dumps) -> float:
    """Instructions per call of `function` (after 3 warm calls): callgrind on around `short`, then `long`
    calls, each phase dumped to `OUT.N` (N from the counter `dumps`), the difference divided by the calls."""
    for _ in range(3):  # warm: decisions cached, public functions learnt
        function()
    counts = []
    for calls in (short, long):
        _control("--instr=on")
        for _ in range(calls):
            function()
        _control("--instr=off")
        _control("--dump")
        counts.append(_instructions(f"{out}.{next(dumps)}"))
    return (counts[1] - counts[0]) / (long - short)


def per_call_instructions_by_thread(function, warm: int, short: int, long: int, out: str) -> tuple[float, float]:
    """Instructions per call of `function` by the main thread and by all threads, for a process run under
    callgrind with `--separate-threads=yes` (dumps `OUT.N-TT`, thread 01 the main one): gloo's threads wait
    for the other ranks, and how long they poll depends on the machine's load, so the main thread's count
    is the one that load does not move."""
    for _ in range(warm):
        function()
    counts = []
    for dump, calls in enumerate((short, long), start=1):
        _control("--instr=on")
        for _ in range(calls):
            function()
        _control("--instr=off")
        _control("--dump")
        per_thread = {path.rsplit("-", 1)[1]: _instructions(path) for path in glob.glob(f"{out}.{dump}-*")}
        counts.append((per_thread["01"], sum(per_thread.values())))
    (main_short, all_short), (main_long, all_long) = counts
    return (main_long - main_short) / (long - short), (all_long - all_short) / (long - short)


def one_rank_world(library_name: str):
    """A one-rank gloo world and (the library, a 1-D mesh) for "ours" or "torch"; (None, None) for "plain"."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 500))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    if library_name == "ours":
        import shardtensor as library

        return library, library.init_device_mesh("cpu", (1,))
    if library_name == "torch":
        from torch.distributed import tensor as library
        from torch.distributed.device_mesh import init_device_mesh

        return library, init_device_mesh("cpu", (1,))
    return None, None


def main() -> None:
    import torch.distributed as dist

    import bench_optimizer

    library_name, out = sys.argv[1], sys.argv[2]
    library, mesh = one_rank_world(library_name)
    placements = [None] if library is None else [library.Shard(0), library.Shard(1), library.Replicate()]
    workloads = bench_optimizer._workloads(library, mesh, placements)
    dumps = itertools.count(1)
    for name in WORKLOADS:
        per_step = per_call_instructions(workloads[name], SHORT, LONG, out, dumps)
        print(f"{library_name} | {name} | {per_step / 1e6:.2f} M instructions per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
