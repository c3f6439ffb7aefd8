"""Instructions and CPU time per training step of the demo (fully_shard over "dp" x TP+SP over "tp", 2x2).

    .venv/bin/python bench/demo_step_instructions.py                 # CPU ms per step per rank (process, main thread)
    .venv/bin/python bench/demo_step_instructions.py --callgrind     # plus rank 0's instructions per step (main thread, all)

The demo's own model, plan, batch (64 x 64 split over "dp") and AdamW(foreach=True), four gloo ranks
started here as processes. Each rank reports the median over the measured steps of its process CPU time
(every thread: gloo's too) and its main thread's, and the collectives of one step. With `--callgrind`,
rank 0 runs under callgrind with instrumentation off except around `SHORT` and then `LONG` steps
(toggled by `callgrind_control`, as `optimizer_instructions.py` does); the difference is per step, for
rank 0's main thread (independent of the machine's load) and for all its threads (gloo's poll while they wait
for the other ranks: that part grows with the load). The kernel's time is not counted.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import subprocess
import sys
import time

WARM, SHORT, LONG = 3, 1, 3


def _rank_main(rank: int, port: int, steps: int, out: str | None) -> None:
    import torch
    import torch.distributed as dist

    from shardtensor import comm
    from shardtensor.demo.data import batch_for_step, load_corpus
    from shardtensor.demo.train import Options, _dp_slice, _optimizer, _step, build, forward_backward, mean_loss, shard_model
    from shardtensor.mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    options = Options()
    mesh = init_device_mesh("cpu", options.mesh, mesh_dim_names=("dp", "tp"))
    corpus = load_corpus(None, options.block_size)
    model = shard_model(build(options, corpus, torch.device("cpu")), mesh, "fsdp")
    optimizer = _optimizer(model, options)
    counter = itertools.count()

    def step() -> int:
        index = next(counter)
        tokens, targets = batch_for_step(corpus, index, options.batch_size, options.block_size, options.seed)
        with comm.observe() as records:
            loss = forward_backward(model, _dp_slice(tokens, mesh), _dp_slice(targets, mesh))
            mean_loss(loss, mesh)
        _step(optimizer)
        return len(records)

    if out is not None:  # rank 0 under callgrind: SHORT steps, then LONG steps, each phase dumped per thread
        from optimizer_instructions import per_call_instructions_by_thread

        main_thread, every_thread = per_call_instructions_by_thread(step, WARM, SHORT, LONG, out)
        print(f"instructions per step (rank 0): main thread {main_thread / 1e6:.1f} M, all threads "
              f"{every_thread / 1e6:.1f} M", flush=True)
    else:
        process, thread, collectives = [], [], 0
        for index in range(steps):
            began, began_thread = time.process_time(), time.thread_time()
            collectives = step()
            if index >= WARM:
                process.append(time.process_time() - began)
                thread.append(time.thread_time() - began_thread)
        print(f"rank {rank}: process {statistics.median(process) * 1e3:.1f} ms, main thread "
              f"{statistics.median(thread) * 1e3:.1f} ms per step (median of {len(process)}); "
              f"{collectives} collectives", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.rank is not None:
        _rank_main(arguments.rank, arguments.port, arguments.steps, arguments.out)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    steps = WARM + SHORT + LONG if arguments.callgrind else arguments.steps
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                                os.environ.get("PYTHONPATH", "")]))
    processes = []
    for rank in range(4):
        command = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--port", str(port), "--steps", str(steps)]
        if rank == 0 and arguments.callgrind:
            out = f"/tmp/demo_step.{os.getpid()}.cg"
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                       f"--callgrind-out-file={out}",
                       *command, "--out", out]
        processes.append(subprocess.Popen(command, env=environment,
                                          stderr=subprocess.DEVNULL if rank == 0 and arguments.callgrind else None))
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    main()
