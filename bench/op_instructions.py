"""Instructions per cached op call (callgrind): the single-op rows of `bench_ops.py`, ours vs torch.

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.ours \\
        .venv/bin/python bench/op_instructions.py ours /tmp/cg.ours      # or: torch

The hot path's cost in a unit that does not depend on the machine's load: on one gloo rank, each
row of `bench_ops._workloads` runs with callgrind's instrumentation on around `SHORT` and then
`LONG` calls (the toggling of `optimizer_instructions.py`); the difference is per call.
"""

from __future__ import annotations

import itertools
import sys

import bench_ops
from optimizer_instructions import one_rank_world, per_call_instructions

ROWS = ("add", "mul", "relu", "sum", "mm", "view", "reshape", "transpose", "10-op chain")
SHORT, LONG = 20, 120


def main() -> None:
    import torch.distributed as dist

    library_name, out = sys.argv[1], sys.argv[2]
    library, mesh = one_rank_world(library_name)
    workloads = bench_ops._workloads(bench_ops._distributor(library, mesh))
    dumps = itertools.count(1)
    for name in ROWS:
        function, ops_per_call = workloads[name]
        per_op = per_call_instructions(function, SHORT, LONG, out, dumps) / ops_per_call
        print(f"{library_name} | {name} | {per_op / 1e3:.1f} K instructions per op")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
