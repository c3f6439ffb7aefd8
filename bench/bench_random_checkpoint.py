"""Cost of replaying random draws under activation checkpointing, ours vs torch.distributed.tensor.

    .venv/bin/python bench/bench_random_checkpoint.py              # 2 local gloo ranks
    .venv/bin/python bench/bench_random_checkpoint.py --ranks 1

Rows, each timing A then B in turn: the backward check every random call on DTensors now makes
(`torch._C._current_graph_task_id`) and `random.next_random_call` whole (A only); a block without random
ops (`(x * w).tanh()`, 64x64 float32, Shard(0), ours) forward and backward, checkpointed by
`shardtensor.random.checkpoint` (A) and by `torch.utils.checkpoint.checkpoint` (B): the wrapper's own
cost; a dropout block (`dropout(x * w).tanh() * rand_like`), ours (A) and torch's DTensor (B), without
checkpointing and checkpointed (ours by `shardtensor.random.checkpoint`, torch's by
`torch.utils.checkpoint.checkpoint`: on a CPU mesh torch's random ops run without its RNG tracker, so
its masks are not replayed; a timing reference only), all `use_reentrant=False`; the same two blocks
under torch's composable `checkpoint(module)` applied once: the block without random ops with
`context_fn=shardtensor.random.checkpoint_contexts` (A) and without (B), the dropout block ours with it (A)
and torch's DTensor without (B). Rank 0's CPU time per call (`bench_ops._time_per_call`), min and median
over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F
from bench_ops import _time_per_call

REPEATS = 15


def _block(x, w):
    return F.dropout(x * w, 0.5).tanh() * torch.rand_like(x)


def _deterministic_block(x, w):
    return (x * w).tanh()


def _step(library, checkpoint_function, block=_block):
    """A forward and backward of `block` on 64x64 Shard(0) DTensors of `library`, checkpointed or not."""
    mesh = library.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = library.distribute_tensor(torch.randn(64, 64), mesh, [library.Shard(0)]).requires_grad_()
    w = library.distribute_tensor(torch.randn(64, 64), mesh, [library.Shard(0)]).requires_grad_()

    def step():
        output = block(x, w) if checkpoint_function is None else checkpoint_function(block, x, w, use_reentrant=False)
        output.sum().backward()

    return step


class _Module(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return self.block(*args)


def _composable(block, **kwargs):
    """A checkpoint function, as `_step` calls it, running `block` as a module under torch's composable
    `checkpoint(module, **kwargs)`, applied once."""
    from torch.distributed._composable import checkpoint

    module = checkpoint(_Module(block), **kwargs)
    return lambda block, *args, use_reentrant: module(*args)


def _rank_body(repeats: int):
    from torch.distributed import tensor as torch_tensor
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    import shardtensor
    from shardtensor.random import checkpoint, checkpoint_contexts, next_random_call

    warnings.simplefilter("ignore")  # torch's DTensor warns that its random ops are incomplete on CPU
    torch.manual_seed(0)
    shardtensor.manual_seed(0)
    mesh = shardtensor.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    rows = {
        "backward check (graph task id)": (lambda: torch._C._current_graph_task_id(), None),
        "next_random_call": (lambda: next_random_call(mesh), None),
        "block without random ops fwd+bwd, checkpointed: random.checkpoint (A) vs torch's checkpoint (B), ours": (
            _step(shardtensor, checkpoint, _deterministic_block),
            _step(shardtensor, torch_checkpoint, _deterministic_block),
        ),
        "dropout block fwd+bwd: ours (A) vs torch DTensor (B)": (_step(shardtensor, None), _step(torch_tensor, None)),
        "dropout block fwd+bwd, checkpointed: ours (A) vs torch DTensor (B)": (
            _step(shardtensor, checkpoint), _step(torch_tensor, torch_checkpoint),
        ),
        "block without random ops fwd+bwd, composable checkpoint(module): context_fn=checkpoint_contexts (A) vs none (B), ours": (
            _step(shardtensor, _composable(_deterministic_block, context_fn=checkpoint_contexts), _deterministic_block),
            _step(shardtensor, _composable(_deterministic_block), _deterministic_block),
        ),
        "dropout block fwd+bwd, composable checkpoint(module): ours with checkpoint_contexts (A) vs torch DTensor (B)": (
            _step(shardtensor, _composable(_block, context_fn=checkpoint_contexts)),
            _step(torch_tensor, _composable(_block)),
        ),
    }
    results = {}
    for name, (first, second) in rows.items():
        functions = [function for function in (first, second) if function is not None]
        for _ in range(3):  # warm: decisions cached
            for function in functions:
                function()
        samples = [[] for _ in functions]
        for _ in range(repeats):
            torch.distributed.barrier()
            for function, function_samples in zip(functions, samples):
                function_samples.append(_time_per_call(function))
        results[name] = samples
    return results


def main() -> None:
    from shardtensor.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (a 1-D mesh of them)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed repeats per row and library")
    options = parser.parse_args()
    torch.set_num_threads(1)
    results = spawn(_rank_body, options.ranks, options.repeats)[0]
    lines = [
        f"| row ({options.ranks} ranks) | A us min | median | B us min | median | A/B (min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, samples in results.items():
        cells = [f"{min(times):.2f} | {statistics.median(times):.2f}" for times in samples]
        ratio = f"{min(samples[0]) / min(samples[1]):.2f}" if len(samples) == 2 else "n/a"
        if len(samples) == 1:
            cells.append("n/a | n/a")
        lines.append(f"| {name} | {' | '.join(cells)} | {ratio} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
