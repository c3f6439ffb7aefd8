"""Start-up cost in a fresh process: import, mesh, first op, shardtensor vs torch.distributed.tensor.

    .venv/bin/python bench/bench_startup.py              # 5 fresh processes per library
    .venv/bin/python bench/bench_startup.py --demo       # also the demo's wall time (--steps 1)

Each sample is a new Python process on one gloo rank (a 1-D mesh of 1) that times its phases: torch
and the process group (the same for every library), importing the library, `init_device_mesh`,
`distribute_tensor` of an 8x8 tensor as Shard(0), the first op (`x + x`, its local result waited),
then a second op on a new shape (`x * x`, 16x16) and the construction of an `AdamW` optimizer, as a
training program would. "plain" runs the same program on plain tensors (no DTensor). Wall and CPU
time (`time.process_time`) per phase, min and median over the samples (libraries interleaved, so
both see the same load), and the phase in which `torch._dynamo` was first imported (~0.5 s of CPU:
torch's meta kernels of elementwise ops and `Optimizer.add_param_group` are wrapped by
`torch._disable_dynamo`, which imports it on first use). Sources compile to a private bytecode cache
first (one discarded run per library), as an installed package's would.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

LIBRARIES = ("ours", "torch", "plain")
PHASES = ("torch + process group", "import library", "init mesh", "distribute_tensor", "first op (x + x)",
          "second op, new shape", "AdamW(...)")

_CHILD = r"""
import json, os, sys, time
phases, dynamo_phase = [], None
def mark(name):
    global dynamo_phase, wall, cpu
    now_wall, now_cpu = time.perf_counter(), time.process_time()
    phases.append((name, now_wall - wall, now_cpu - cpu))
    if dynamo_phase is None and "torch._dynamo" in sys.modules:
        dynamo_phase = name
    wall, cpu = time.perf_counter(), time.process_time()
wall, cpu = time.perf_counter(), time.process_time()
library = sys.argv[1]
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
mark("torch + process group")
if library == "ours":
    import shardtensor as api
    from shardtensor import init_device_mesh
elif library == "torch":
    import torch.distributed.tensor as api
    from torch.distributed.device_mesh import init_device_mesh
mark("import library")
if library == "plain":
    mark("init mesh")
    x = torch.randn(8, 8)
    mark("distribute_tensor")
    (x + x)
    mark("first op (x + x)")
    y = torch.randn(16, 16)
    (y * y)
    mark("second op, new shape")
    parameter = torch.nn.Parameter(torch.randn(8, 8))
else:
    mesh = init_device_mesh("cpu", (1,))
    mark("init mesh")
    x = api.distribute_tensor(torch.randn(8, 8), mesh, [api.Shard(0)])
    mark("distribute_tensor")
    local = (x + x).to_local()
    local = local.wait() if hasattr(local, "wait") else local
    mark("first op (x + x)")
    y = api.distribute_tensor(torch.randn(16, 16), mesh, [api.Shard(0)])
    local = (y * y).to_local()
    local = local.wait() if hasattr(local, "wait") else local
    mark("second op, new shape")
    parameter = torch.nn.Parameter(api.distribute_tensor(torch.randn(8, 8), mesh, [api.Shard(0)]))
torch.optim.AdamW([parameter], lr=1e-3)
mark("AdamW(...)")
dist.destroy_process_group()
print(json.dumps({"phases": phases, "dynamo": dynamo_phase}))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _environment(cache: str) -> dict:
    """This environment with bytecode written to `cache` (this machine sets PYTHONDONTWRITEBYTECODE,
    which would compile every source on every import) and one thread, as the other benches use."""
    environment = dict(os.environ, PYTHONPYCACHEPREFIX=cache, OMP_NUM_THREADS="1")
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    return environment


def _sample(library: str, environment: dict) -> dict:
    wall_start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", _CHILD, library, str(_free_port())], env=environment,
                               capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    result["process wall"] = time.perf_counter() - wall_start
    return result


def _demo_seconds(environment: dict) -> float:
    """Wall time of `python -m shardtensor.demo --steps 1` (4 spawned ranks, then a sample of text)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "shardtensor.demo", "--steps", "1", "--sample-length", "20"],
                   env=environment, capture_output=True, timeout=1200, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5, help="fresh processes per library")
    parser.add_argument("--demo", action="store_true", help="also time the demo with --steps 1 (one run)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        environment = _environment(cache)
        for library in LIBRARIES:  # fills the bytecode cache
            _sample(library, environment)
        samples = {library: [] for library in LIBRARIES}
        for _ in range(options.samples):
            for library in LIBRARIES:
                samples[library].append(_sample(library, environment))
        demo = [_demo_seconds(environment)] if options.demo else []
    print(f"{options.samples} fresh processes per library, load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| phase | ours wall ms min | median | ours CPU ms min | median | torch wall ms min | median "
          "| torch CPU ms min | median | ours/torch CPU (min) | plain CPU ms min |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cells(library, index):
        walls = [sample["phases"][index][1] * 1e3 for sample in samples[library]]
        cpus = [sample["phases"][index][2] * 1e3 for sample in samples[library]]
        return min(walls), statistics.median(walls), min(cpus), statistics.median(cpus)

    def totals(library, count):
        walls = [sum(phase[1] for phase in sample["phases"][1:count]) * 1e3 for sample in samples[library]]
        cpus = [sum(phase[2] for phase in sample["phases"][1:count]) * 1e3 for sample in samples[library]]
        return min(walls), statistics.median(walls), min(cpus), statistics.median(cpus)

    rows = [(name, lambda library, index=index: cells(library, index)) for index, name in enumerate(PHASES)]
    rows.append(("import + mesh + distribute + first op", lambda library: totals(library, 5)))
    rows.append(("... + second op + AdamW", lambda library: totals(library, 7)))
    for name, measure in rows:
        ours, theirs, plain = measure("ours"), measure("torch"), measure("plain")
        print(f"| {name} | {ours[0]:.0f} | {ours[1]:.0f} | {ours[2]:.0f} | {ours[3]:.0f} | {theirs[0]:.0f} "
              f"| {theirs[1]:.0f} | {theirs[2]:.0f} | {theirs[3]:.0f} | {ours[2] / max(theirs[2], 1e-9):.2f} "
              f"| {plain[2]:.0f} |")
    for library in LIBRARIES:
        where = sorted({sample["dynamo"] for sample in samples[library]}, key=str)
        process = [sample["process wall"] for sample in samples[library]]
        print(f"\n{library}: torch._dynamo first imported in {where}; whole process wall s min "
              f"{min(process):.2f}, median {statistics.median(process):.2f}")
    if demo:
        print(f"\ndemo --steps 1 wall s: {', '.join(f'{seconds:.1f}' for seconds in demo)}")


if __name__ == "__main__":
    main()
