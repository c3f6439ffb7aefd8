"""`python -m shardtensor.demo` / `shardtensor-demo`: parse the flags, then run `train.train` (with
`--pipeline`, `pipeline_train.train_pipeline`) on every rank: under `torchrun` on this process's rank
(nccl when CUDA is present), otherwise on local CPU ranks spawned here. The process group is torn down
before the interpreter exits."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ..launch import LocalWorkers, RankFailure
from .pipeline import SCHEDULES
from .pipeline_train import PipelineOptions, train_pipeline
from .train import DATA_PARALLEL_MODES, Options, train

__all__ = ["main", "parse_options"]

# Seconds the spawned ranks may take for the whole run: a demo on a busy machine is slow, not stuck
# (a rank stuck in a collective still fails after the process group's own timeout).
RUN_TIMEOUT = 3600.0


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--mesh takes DPxTP, e.g. 2x2 or 1x4 (PPxDPxTP with --pipeline, e.g. 2x2x2); got {text!r}")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
    return sizes


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
    parser.add_argument("--steps", type=int, default=None, help=f"training steps (default {defaults.steps}; {PipelineOptions.steps} with --pipeline)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"global batch, sequences per step (default {defaults.batch_size}; {PipelineOptions.batch_size} with --pipeline)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="characters per sequence")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--width", type=int, default=defaults.width)
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate, warmup then cosine decay (default {defaults.learning_rate}; "
                             f"{PipelineOptions.learning_rate}, constant, with --pipeline)")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="steps of linear learning-rate warmup")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--data", default=None, help="a text file to train on (default: the Python standard library's source)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="resume from DIR if it holds a checkpoint; save there at the end")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="compile each block with torch.compile (fullgraph, as torchtitan does) with BACKEND "
                             "(default inductor; aot_eager compiles fastest); not with --pipeline")
    parser.add_argument("--compare", action="store_true", help="train the same model on one process alongside and check the losses agree")
    parser.add_argument("--sample-length", type=int, default=defaults.sample_length, help="characters of text to generate at the end")
    parser.add_argument("--pipeline", action="store_true",
                        help="pipeline parallelism too: --mesh PPxDPxTP (default 2x2x2), the blocks cut into PP stages "
                             "run by torch.distributed.pipelining, each stage fully_shard on dp x tensor parallel on tp")
    parser.add_argument("--schedule", choices=SCHEDULES, default=PipelineOptions.schedule, help="the pipeline's schedule (with --pipeline)")
    parser.add_argument("--microbatches", type=int, default=PipelineOptions.microbatches,
                        help="microbatches each dp rank's batch is split into per step (with --pipeline)")
    parser.add_argument("--forecast", type=_forecast_shape, default=None, metavar="RxDPxTP",
                        help="print the forecast of one training step on a mesh of this shape (replicas x dp x tp, "
                             "or dp x tp) instead of training: one rank, shapes only, no data (docs/forecast.md)")
    return parser


def _pipeline_options(parser: argparse.ArgumentParser, arguments, world_size: int | None) -> tuple[PipelineOptions, int]:
    """The options of a --pipeline run (PPxDPxTP mesh), checked like the others."""
    mesh = arguments.mesh or (2, 2, 2)
    if len(mesh) != 3:
        parser.error(f"--pipeline takes --mesh PPxDPxTP (e.g. 2x2x2), got {'x'.join(map(str, mesh))}")
    pp, dp, tp = mesh
    batch_size = PipelineOptions.batch_size if arguments.batch_size is None else arguments.batch_size
    size = world_size or arguments.nproc or pp * dp * tp
    if pp * dp * tp != size:
        parser.error(f"--mesh {pp}x{dp}x{tp} needs {pp * dp * tp} ranks, but there are {size}")
    if arguments.heads % tp or arguments.width % arguments.heads:
        parser.error(f"--heads {arguments.heads} must divide --width {arguments.width} and be a multiple of the {tp} tensor-parallel ranks")
    if arguments.layers < pp:
        parser.error(f"--layers {arguments.layers}: each of the {pp} pipeline stages needs at least one block")
    if arguments.microbatches < 1 or batch_size % (dp * arguments.microbatches):
        parser.error(f"--batch-size {batch_size} must split into {dp} data-parallel shares of "
                     f"--microbatches {arguments.microbatches} equal microbatches")
    if arguments.data is not None and not os.path.isfile(arguments.data):
        parser.error(f"--data {arguments.data}: no such file")
    if arguments.compile is not None:
        parser.error("--compile compiles the blocks of the default and --mesh DPxTP runs; leave it out with --pipeline")
    if arguments.checkpoint is not None or arguments.data_parallel != "fsdp":
        parser.error("--pipeline runs fully_shard on dp and saves no checkpoint: leave out --checkpoint and --data-parallel")
    options = PipelineOptions(
        mesh=mesh, steps=PipelineOptions.steps if arguments.steps is None else arguments.steps, batch_size=batch_size, block_size=arguments.block_size,
        layers=arguments.layers, heads=arguments.heads, width=arguments.width,
        learning_rate=PipelineOptions.learning_rate if arguments.lr is None else arguments.lr,
        seed=arguments.seed, data=arguments.data, compare=arguments.compare, sample_length=arguments.sample_length,
        device_type="cuda" if world_size and torch.cuda.is_available() else "cpu",
        schedule=arguments.schedule, microbatches=arguments.microbatches,
    )
    return options, size


def _forecast_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(size) for size in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--forecast takes RxDPxTP or DPxTP positive sizes, e.g. 8x8x16; got {text!r}")
    return shape


def parse_options(argv=None, world_size: int | None = None) -> tuple[Options, int]:
    """The run's options and its number of ranks (`world_size` under a launcher, else --nproc/--mesh)."""
    parser = _parser()
    arguments = parser.parse_args(argv)
    if arguments.pipeline:
        return _pipeline_options(parser, arguments, world_size)
    if arguments.mesh is not None and len(arguments.mesh) != 2:
        parser.error("--mesh PPxDPxTP needs --pipeline; without it --mesh takes DPxTP")
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
    batch_size = Options.batch_size if arguments.batch_size is None else arguments.batch_size
    if batch_size % mesh[0]:
        parser.error(f"--batch-size {batch_size} must divide over the {mesh[0]} data-parallel ranks")
    options = Options(
        mesh=mesh, data_parallel=arguments.data_parallel, steps=Options.steps if arguments.steps is None else arguments.steps, batch_size=batch_size, block_size=arguments.block_size,
        layers=arguments.layers, heads=arguments.heads, width=arguments.width,
        learning_rate=Options.learning_rate if arguments.lr is None else arguments.lr, warmup_steps=arguments.warmup_steps,
        seed=arguments.seed, data=arguments.data, checkpoint=arguments.checkpoint, compare=arguments.compare,
        sample_length=arguments.sample_length,
        device_type="cuda" if world_size and torch.cuda.is_available() else "cpu", compile=arguments.compile,
    )
    return options, size


def _run_under_launcher(options: Options) -> None:
    """This process is one rank of a torchrun job: pick its GPU, train, tear the group down."""
    if options.device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if options.device_type == "cuda" else "gloo")
    try:
        _train_function(options)(options)
    finally:
        dist.destroy_process_group()


def _train_function(options: Options):
    return train_pipeline if isinstance(options, PipelineOptions) else train


def main(argv=None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.forecast:
        from .forecast import print_forecast
        return print_forecast(arguments)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    options, size = parse_options(argv, int(os.environ["WORLD_SIZE"]) if launched else None)
    if launched:
        _run_under_launcher(options)
        return 0
    try:
        with LocalWorkers(size) as workers:
            workers.run(_train_function(options), options, timeout=RUN_TIMEOUT)
    except RankFailure as failure:
        print(failure)
        return 1
    return 0
