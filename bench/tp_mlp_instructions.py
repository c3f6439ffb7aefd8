"""Instructions per eager forward and backward of a TP MLP (callgrind), 2 gloo ranks.

    valgrind is started here for rank 0:
    .venv/bin/python bench/tp_mlp_instructions.py

`bench_compile.py`'s TP MLP (Linear 64 -> 256, ReLU, Linear 256 -> 64, batch 32) laid out by
`parallelize_module` with ColwiseParallel / RowwiseParallel on 2 ranks, run eagerly: the input requires
grad, so forward and backward each hold one all_reduce, and every call crosses the styles' boundaries
(a local output tagged with its layout, local inputs read back as DTensors). Rank 0 runs under callgrind
with instrumentation on around `SHORT` and then `LONG` calls (`optimizer_instructions.py`'s toggling); the
difference is per call, for rank 0's main thread (independent of the machine's load) and all its threads.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SHORT, LONG = 10, 40


def _rank_main(rank: int, port: int, out: str | None) -> None:
    import torch
    import torch.distributed as dist

    from bench_compile import BATCH, MLP, WIDTH
    from shardtensor.mesh import init_device_mesh
    from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = parallelize_module(MLP(), init_device_mesh("cpu", (2,)), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(BATCH, WIDTH, requires_grad=True)

    def forward_backward() -> None:
        model(x).sum().backward()

    if out is not None:
        from optimizer_instructions import per_call_instructions_by_thread

        main_thread, every_thread = per_call_instructions_by_thread(forward_backward, 3, SHORT, LONG, out)
        print(f"TP MLP forward+backward, 2 ranks (rank 0), K instructions per call: main thread {main_thread / 1e3:.1f}, "
              f"all threads {every_thread / 1e3:.1f}", flush=True)
    else:
        for _ in range(3 + SHORT + LONG):
            forward_backward()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1:
        rank, port = int(sys.argv[1]), int(sys.argv[2])
        _rank_main(rank, port, sys.argv[3] if len(sys.argv) > 3 else None)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bench = os.path.dirname(os.path.abspath(__file__))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([bench, os.environ.get("PYTHONPATH", "")]))
    out = f"/tmp/tp_mlp.{os.getpid()}.cg"
    commands = [
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", f"--callgrind-out-file={out}",
         sys.executable, os.path.abspath(__file__), "0", str(port), out],
        [sys.executable, os.path.abspath(__file__), "1", str(port)],
    ]
    processes = [subprocess.Popen(command, env=environment, stderr=subprocess.DEVNULL if index == 0 else None)
                 for index, command in enumerate(commands)]
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
