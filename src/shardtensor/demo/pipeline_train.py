"""One rank's part of the demo with `--pipeline`: the GPT cut into pipeline stages over "pp", each stage
tensor parallel over "tp" and `fully_shard`ed over "dp" (`pipeline.shard_stage`), trained with AdamW
through a GPipe or 1F1B schedule (`pipeline.pipeline_schedule`).

The last stage holds the loss; one small all_reduce over ("pp", "dp") gives rank 0 the global mean to
print. With `compare`, rank 0 also trains the whole model on one device, step for step. At the end every
stage gathers its parameters and the stages share them over "pp", so that rank 0 samples text from the
trained model on one device.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from .. import comm
from ..dtensor import DTensor
from ..mesh import init_device_mesh
from . import report
from .data import batch_for_step, load_corpus
from .model import GPT, GPTConfig
from .pipeline import MESH_DIM_NAMES, SCHEDULES, pipeline_schedule, shard_stage
from .train import Options, build, forward_backward

__all__ = ["PipelineOptions", "train_pipeline"]


@dataclasses.dataclass(frozen=True)
class PipelineOptions(Options):
    """The demo's options with a ("pp", "dp", "tp") mesh and the schedule's settings."""

    mesh: tuple[int, int, int] = (2, 2, 2)
    schedule: str = "1f1b"  # one of pipeline.SCHEDULES
    microbatches: int = 2  # per dp rank's batch and step
    steps: int = 80  # a short run: eight processes share the cores of a small machine
    batch_size: int = 32
    learning_rate: float = 2e-3  # constant: this loop has no warmup or decay (the 2-D loop's peak is higher)


def _adamw(module: torch.nn.Module, options: Options) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=options.learning_rate, weight_decay=0.01, foreach=True)


def _update(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step_loss(microbatch_losses: list, is_last: bool, mesh, device: torch.device) -> float:
    """The step's mean loss over the whole batch on every rank: the last stage's microbatch means, averaged
    over microbatches, then over dp (one all_reduce over ("pp", "dp"); the other stages add 0)."""
    if is_last:
        local = torch.stack([loss.to_local() if isinstance(loss, DTensor) else loss for loss in microbatch_losses])
        local = local.detach().mean().reshape(1) / mesh.size("dp")
    else:
        local = torch.zeros(1, device=device)
    return comm.all_reduce(local, mesh, ("pp", "dp"), reduce_op="sum").item()


def _whole_model(stage, mesh, config: GPTConfig, device: torch.device) -> GPT:
    """A one-device GPT with the trained weights: each stage gathers its parameters (a collective over the
    stage's dp x tp ranks), then the stages exchange them over "pp"."""
    pieces = {name: parameter.full_tensor().detach().cpu() for name, parameter in stage.named_parameters()}
    state = {}
    for stage_pieces in comm.all_gather_object(pieces, mesh, "pp"):
        state.update(stage_pieces)
    model = GPT(config).to(device)
    model.load_state_dict(state)
    return model


class _PipelineProgress:
    """Rank 0's progress bar (loss, tokens/s, the one-device loss with --compare) and verdict."""

    def __init__(self, options: PipelineOptions, corpus, blocks_per_stage: list[int]):
        self.console = Console()
        self.differences: list[float] = []
        pp, dp, tp = options.mesh
        self.console.print(
            f"[bold]shardtensor demo[/bold]: a GPT trained on {corpus.tokens.numel():,} characters of {corpus.name} "
            f"(vocabulary {corpus.vocab_size}), mesh {pp}x{dp}x{tp} (pp x dp x tp: {pp} pipeline stages holding "
            f"{blocks_per_stage} blocks, {options.schedule} over {options.microbatches} microbatches, fully_shard on dp)"
            f"{', checked against one device' if options.compare else ''}"
        )
        self.bar = RichProgress(TextColumn("[bold]train[/bold]"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=self.console)
        self.task = self.bar.add_task("train", total=options.steps, status="")
        self.bar.start()

    def update(self, loss: float, reference_loss: float | None, tokens_per_second: float) -> None:
        status = f"loss {loss:.4f}  {tokens_per_second:,.0f} tok/s"
        if reference_loss is not None:
            status += f"  one device {reference_loss:.4f}"
            self.differences.append(abs(loss - reference_loss))
        self.bar.update(self.task, advance=1, status=status)

    def finish(self, step_communication, sample: str) -> None:
        self.bar.stop()
        if step_communication:
            self.console.print(report.communication_table(step_communication))
        self.console.rule("sample")
        self.console.print(sample, markup=False, highlight=False, soft_wrap=True)  # code lines unbroken
        self.console.rule()
        report.print_loss_agreement(self.console, self.differences)


def train_pipeline(options: PipelineOptions) -> None:
    """The pipelined demo on this rank (every rank of the world runs it)."""
    if options.schedule not in SCHEDULES:
        raise ValueError(f"schedule={options.schedule!r}: choose one of {SCHEDULES}")
    mesh = init_device_mesh(options.device_type, options.mesh, mesh_dim_names=MESH_DIM_NAMES)
    device = torch.device(options.device_type, torch.cuda.current_device()) if options.device_type == "cuda" else torch.device("cpu")
    corpus = load_corpus(options.data, options.block_size)
    model = build(options, corpus, device)
    is_main = mesh.get_rank() == 0
    reference = copy.deepcopy(model) if options.compare and is_main else None
    reference_optimizer = _adamw(reference, options) if reference is not None else None
    stage = shard_stage(model, mesh)
    schedule = pipeline_schedule(stage, mesh, options.microbatches, options.schedule)
    optimizer = _adamw(stage, options)
    blocks = comm.all_gather_object(len(stage.blocks), mesh, "pp")
    progress = _PipelineProgress(options, corpus, blocks) if is_main else None
    dp, dp_size = mesh.get_local_rank("dp"), mesh.size("dp")
    step_communication = []
    for step in range(options.steps):
        tokens, targets = batch_for_step(corpus, step, options.batch_size, options.block_size, options.seed)
        began = time.perf_counter()
        microbatch_losses: list = []
        with comm.observe() as records:
            if stage.is_first:
                schedule.step(tokens.tensor_split(dp_size)[dp].to(device))
            elif stage.is_last:
                schedule.step(target=targets.tensor_split(dp_size)[dp].to(device), losses=microbatch_losses)
            else:
                schedule.step()
        _update(optimizer)
        step_communication = records
        loss = _step_loss(microbatch_losses, stage.is_last, mesh, device)
        elapsed = time.perf_counter() - began
        reference_loss = None
        if reference is not None:
            reference_loss = forward_backward(reference, tokens.to(device), targets.to(device)).item()
            _update(reference_optimizer)
        if progress is not None:
            progress.update(loss, reference_loss, tokens.numel() / elapsed)
    trained = _whole_model(stage, mesh, model.config, device)
    if progress is not None:
        progress.finish(step_communication, report.generate(trained, corpus, options, device))
