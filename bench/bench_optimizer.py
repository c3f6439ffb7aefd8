"""Optimizer steps and gradient clipping on DTensor parameters: shardtensor vs torch.distributed.tensor.

    .venv/bin/python bench/bench_optimizer.py              # 2 ranks; prints the table for bench/README.md
    .venv/bin/python bench/bench_optimizer.py --ranks 4

24 parameters of 64x64 float32, placements cycling Shard(0), Shard(1), Replicate, gradients laid
out like their parameters (issue 8's setting). Each repeat times `ITERATIONS` calls of ours and then
of theirs back to back, as rank 0's CPU time (`time.process_time`, so time the shared machine gives
to other processes is left out); min and median over the repeats, and the ratios ours/theirs.
Collectives per call: ours from `comm.observe()`, torch's from `CommDebugMode`. The last column is
the same step on plain tensors of the local shard sizes' global size (no DTensor at all).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import time_per_call

ITERATIONS = 20
REPEATS = 7
PARAMETERS = 24
SIZE = 64


def _parameters(library, mesh, placements):
    generator = torch.Generator().manual_seed(0)
    parameters = []
    for index in range(PARAMETERS):
        layout = [placements[index % len(placements)]]
        full = torch.randn(SIZE, SIZE, generator=generator)
        grad = torch.randn(SIZE, SIZE, generator=generator)
        if library is None:
            parameter = full.requires_grad_()
            parameter.grad = grad
        else:
            parameter = library.distribute_tensor(full, mesh, layout).requires_grad_()
            parameter.grad = library.distribute_tensor(grad, mesh, layout)
        parameters.append(parameter)
    return parameters


def _workloads(library, mesh, placements) -> dict:
    """name -> function of one call, the same program for every library (None: plain tensors)."""

    def optimizer_step(optimizer_class, **options):
        optimizer = optimizer_class(_parameters(library, mesh, placements), **options)
        return optimizer.step

    def partial_gradient_step(**options):
        """Replicate parameters whose gradients arrive Partial (data parallel), fresh every step."""
        parameters = _parameters(library, mesh, placements[-1:])
        optimizer = torch.optim.AdamW(parameters, lr=1e-3, **options)
        shares = [torch.randn(SIZE, SIZE) for _ in parameters]

        def step():
            for parameter, share in zip(parameters, shares):
                parameter.grad = share if library is None else library.DTensor.from_local(
                    share, mesh, [library.Partial()], run_check=False)
            optimizer.step()

        return step

    def clip(foreach: bool):
        parameters = _parameters(library, mesh, placements)
        return lambda: torch.nn.utils.clip_grad_norm_(parameters, max_norm=1e9, foreach=foreach)

    return {
        "AdamW(foreach=True).step()": optimizer_step(torch.optim.AdamW, lr=1e-3, foreach=True),
        "AdamW(foreach=False).step()": optimizer_step(torch.optim.AdamW, lr=1e-3, foreach=False),
        "AdamW(fused=True).step()": optimizer_step(torch.optim.AdamW, lr=1e-3, fused=True),
        "Adam(foreach=True).step()": optimizer_step(torch.optim.Adam, lr=1e-3, foreach=True),
        "SGD(momentum=0.9, foreach=True).step()": optimizer_step(torch.optim.SGD, lr=1e-3, momentum=0.9, foreach=True),
        "AdamW(foreach=True).step(), Partial grads": partial_gradient_step(foreach=True),
        "clip_grad_norm_(foreach=True)": clip(True),
        "clip_grad_norm_(foreach=False)": clip(False),
    }


def _count(function, observe) -> int | None:
    try:
        with observe() as counter:
            function()
        return counter()
    except Exception:  # noqa: BLE001  (a row the library cannot run shows as n/a)
        return None


def _rank_body(repeats: int, iterations: int):
    import contextlib

    import torch.distributed as dist
    from torch.distributed import tensor as torch_tensor
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    import shardtensor
    from shardtensor import comm

    world = dist.get_world_size()
    ours = _workloads(shardtensor, shardtensor.init_device_mesh("cpu", (world,)),
                      [shardtensor.Shard(0), shardtensor.Shard(1), shardtensor.Replicate()])
    theirs = _workloads(torch_tensor, torch_init_device_mesh("cpu", (world,)),
                        [torch_tensor.Shard(0), torch_tensor.Shard(1), torch_tensor.Replicate()])
    plain = _workloads(None, None, [None])

    @contextlib.contextmanager
    def observe_ours():
        with comm.observe() as records:
            yield lambda: len(records)

    @contextlib.contextmanager
    def observe_theirs():
        with CommDebugMode() as mode:
            yield mode.get_total_counts

    results = {}
    for name, our_function in ours.items():
        their_function, plain_function = theirs[name], plain[name]
        runs_theirs = _count(their_function, observe_theirs) is not None
        for _ in range(3):  # warm: decisions cached
            our_function()
            if runs_theirs:
                their_function()
        counts = (_count(our_function, observe_ours), _count(their_function, observe_theirs) if runs_theirs else None)
        our_samples, their_samples, plain_samples = [], [], []
        for _ in range(repeats):
            dist.barrier()
            our_samples.append(time_per_call(our_function, iterations) * 1e3)
            if runs_theirs:
                their_samples.append(time_per_call(their_function, iterations) * 1e3)
            plain_samples.append(time_per_call(plain_function, iterations) * 1e3)
        results[name] = (our_samples, their_samples, plain_samples, counts)
    return results


def _format(samples: list[float]) -> tuple[str, str]:
    if not samples:
        return "n/a", "n/a"
    return f"{min(samples):.3f}", f"{statistics.median(samples):.3f}"


def _ratio(ours: list[float], theirs: list[float], pick) -> str:
    return f"{pick(ours) / pick(theirs):.2f}" if ours and theirs else "n/a"


def main() -> None:
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (a 1-D mesh of them)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    options = parser.parse_args()
    torch.set_num_threads(1)
    results = spawn(_rank_body, options.ranks, options.repeats, options.iterations)[0]
    lines = [
        f"| step ({options.ranks} ranks, {PARAMETERS} params {SIZE}x{SIZE} S(0)/S(1)/R) | ours ms min | median "
        f"| torch DTensor ms min | median | ours/torch (min) | ours/torch (median) | collectives ours / torch "
        f"| plain tensors ms min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (ours, theirs, plain, (our_count, their_count)) in results.items():
        our_min, our_median = _format(ours)
        their_min, their_median = _format(theirs)
        counts = f"{our_count} / {'n/a' if their_count is None else their_count}"
        lines.append(
            f"| {name} | {our_min} | {our_median} | {their_min} | {their_median} | {_ratio(ours, theirs, min)} "
            f"| {_ratio(ours, theirs, statistics.median)} | {counts} | {_format(plain)[0]} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
