"""`python -m shardtensor.demo` / `shardtensor-demo`: parse the flags, then run `train.train` on every
rank: under `torchrun` on this process's rank (nccl when CUDA is present), otherwise on local CPU
ranks spawned here. The process group is torn down before the interpreter exits."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ..launch import LocalWorkers, RankFailure
from .train import DATA_PARALLEL_MODES, Options, train

__all__ = ["main", "parse_options"]

# Seconds the spawned ranks may take for the whole run: a demo on a busy machine is slow, not stuck
# (a rank stuck in a collective still fails after the process group's own timeout).
RUN_TIMEOUT = 3600.0


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        dp, tp = (int(size) for size in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes DPxTP, e.g. 2x2 or 1x4; got {text!r}") from None
    if dp < 1 or tp < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
    return dp, tp


def _default_mesh(world_size: int) -> tuple[int, int]:
    """Two tensor-parallel ranks per data-parallel row when the world size allows it."""
    return (world_size // 2, 2) if world_size % 2 == 0 else (1, world_size)


def _parser() -> argparse.ArgumentParser:
    defaults = Options()
    parser = argparse.ArgumentParser(
        prog="shardtensor-demo",
        description="Train a small GPT character by character with data (fully_shard or replicated) x tensor parallelism on shardtensor.",
    )
    parser.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (default: the mesh's size, 4)")
    parser.add_argument("--mesh", type=_mesh_shape, default=None, help="data-parallel x tensor-parallel sizes (default 2x2)")
    parser.add_argument("--data-parallel", choices=DATA_PARALLEL_MODES, default=defaults.data_parallel,
                        help="how the dp mesh dim holds the parameters: fsdp shards them (fully_shard, the default), "
                             "ddp replicates them and all-reduces the gradients")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global batch (sequences per step)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="characters per sequence")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--lr", type=float, default=defaults.learning_rate, help="peak learning rate (warmup, then cosine decay)")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="steps of linear learning-rate warmup")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--data", default=None, help="a text file to train on (default: the Python standard library's source)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="resume from DIR if it holds a checkpoint; save there at the end")
    parser.add_argument("--compare", action="store_true", help="train the same model on one process alongside and check the losses agree")
    parser.add_argument("--sample-length", type=int, default=defaults.sample_length, help="characters of text to generate at the end")
    return parser


def parse_options(argv=None, world_size: int | None = None) -> tuple[Options, int]:
    """The run's options and its number of ranks (`world_size` under a launcher, else --nproc/--mesh)."""
    parser = _parser()
    arguments = parser.parse_args(argv)
    size = world_size or arguments.nproc or (arguments.mesh[0] * arguments.mesh[1] if arguments.mesh else 4)
    mesh = arguments.mesh or _default_mesh(size)
    if mesh[0] * mesh[1] != size:
        parser.error(f"--mesh {mesh[0]}x{mesh[1]} needs {mesh[0] * mesh[1]} ranks, but there are {size}")
    if arguments.heads % mesh[1] or arguments.width % arguments.heads:
        parser.error(
            f"--heads {arguments.heads} must divide --width {arguments.width} and be a multiple of the "
            f"{mesh[1]} tensor-parallel ranks (attention is split by heads)"
        )
    if arguments.warmup_steps < 0:
        parser.error(f"--warmup-steps must be 0 or more, got {arguments.warmup_steps}")
    if arguments.data is not None and not os.path.isfile(arguments.data):
        parser.error(f"--data {arguments.data}: no such file")
    if arguments.batch_size % mesh[0]:
        parser.error(f"--batch-size {arguments.batch_size} must divide over the {mesh[0]} data-parallel ranks")
    options = Options(
        mesh=mesh, data_parallel=arguments.data_parallel, steps=arguments.steps, batch_size=arguments.batch_size, block_size=arguments.block_size,
        layers=arguments.layers, heads=arguments.heads, width=arguments.width, learning_rate=arguments.lr,
        warmup_steps=arguments.warmup_steps,
        seed=arguments.seed, data=arguments.data, checkpoint=arguments.checkpoint, compare=arguments.compare,
        sample_length=arguments.sample_length,
        device_type="cuda" if world_size and torch.cuda.is_available() else "cpu",
    )
    return options, size


def _run_under_launcher(options: Options) -> None:
    """This process is one rank of a torchrun job: pick its GPU, train, tear the group down."""
    if options.device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if options.device_type == "cuda" else "gloo")
    try:
        train(options)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    options, size = parse_options(argv, int(os.environ["WORLD_SIZE"]) if launched else None)
    if launched:
        _run_under_launcher(options)
        return 0
    try:
        with LocalWorkers(size) as workers:
            workers.run(train, options, timeout=RUN_TIMEOUT)
    except RankFailure as failure:
        print(failure)
        return 1
    return 0
