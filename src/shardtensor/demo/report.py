"""What the demo shows on rank 0: a progress bar (loss, tokens/s, the one-device loss with
--compare) and the final loss (a mean over the last steps), then the collectives of one training step,
how one weight is laid out, and a sample of generated text (sampled on rank 0 from a one-device copy of
the trained weights)."""

from __future__ import annotations

import collections

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from ..debug import visualize_sharding
from .data import Corpus

__all__ = ["Progress", "generate", "print_loss_agreement", "LOSS_TOLERANCE"]

# Losses of the parallel and the one-device run differ only by float32 rounding (sums in another order).
LOSS_TOLERANCE = 1e-3
# The final loss shown is the mean of this many last steps' losses: one step's loss is one batch's, noisy.
FINAL_LOSS_STEPS = 20
TEMPERATURE = 0.5  # below 1: the likelier characters, so the sample reads more like the code it learnt


_DATA_PARALLEL_NAMES = {"fsdp": "fully_shard", "ddp": "replicated, gradients all-reduced"}


class ComparisonError(RuntimeError):
    """The parallel training's losses left the one-device training's by more than float rounding."""


def _mesh_dim_label(record) -> str:
    if record.mesh_dim_names is not None:
        return "+".join(record.mesh_dim_names)
    return "point to point" if record.mesh_dim is None else str(record.mesh_dim)


def communication_table(records) -> Table:
    """The collectives of one step on this rank, by kind and the mesh dims they ran over."""
    calls, sent = collections.Counter(), collections.Counter()
    for record in records:
        key = (record.kind, _mesh_dim_label(record))
        calls[key] += 1
        sent[key] += record.bytes_sent
    table = Table(title="collectives of one training step (rank 0)", title_justify="left")
    for column in ("collective", "mesh dim", "calls", "KiB sent"):
        table.add_column(column, justify="right" if column in ("calls", "KiB sent") else "left")
    for key in sorted(calls):
        table.add_row(key[0], key[1], str(calls[key]), f"{sent[key] / 1024:.1f}")
    table.add_row("total", "", str(sum(calls.values())), f"{sum(sent.values()) / 1024:.1f}", style="bold")
    return table


@torch.no_grad()
def generate(model, corpus: Corpus, options, device: torch.device) -> str:
    """Sample text from a one-device model (the trained weights gathered: `train.whole_model`), one
    plain forward per character; the seed fixes the text."""
    generator = torch.Generator().manual_seed(options.seed)
    prompt = corpus.encode("    def ") if options.data is None else corpus.tokens[:1]  # a method, as most of the corpus is
    tokens = prompt[None].to(device)
    for _ in range(options.sample_length):
        logits = model(tokens[:, -options.block_size :])[:, -1]
        probabilities = torch.softmax(logits.float().cpu() / TEMPERATURE, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probabilities, 1, generator=generator).to(device)], dim=1)
    return corpus.decode(tokens[0].tolist())


def _global_parameters(model) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


class Progress:
    """Rank 0's view of the run, from the header to the verdict."""

    def __init__(self, options, corpus: Corpus, start: int):
        self.console = Console()
        self.differences: list[float] = []
        self.losses: collections.deque[float] = collections.deque(maxlen=FINAL_LOSS_STEPS)
        self.options = options
        self.console.print(
            f"[bold]shardtensor demo[/bold]: a GPT trained on {corpus.tokens.numel():,} characters of "
            f"{corpus.name} (vocabulary {corpus.vocab_size}), mesh {options.mesh[0]}x{options.mesh[1]} "
            f"(dp x tp, {_DATA_PARALLEL_NAMES[options.data_parallel]} on dp)"
            f"{', checked against one device' if options.compare else ''}"
        )
        self.bar = RichProgress(
            TextColumn("[bold]train[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.bar.add_task("train", total=options.steps, completed=start, status="")
        self.bar.start()

    def update(self, step: int, loss: float, reference_loss: float | None, tokens_per_second: float) -> None:
        status = f"loss {loss:.4f}  {tokens_per_second:,.0f} tok/s"
        if reference_loss is not None:
            status += f"  one device {reference_loss:.4f}"
            self.differences.append(abs(loss - reference_loss))
        self.losses.append(loss)
        self.bar.update(self.task, advance=1, status=status)

    def finish(self, step_communication, model, sample: str) -> None:
        self.bar.stop()
        if self.losses:
            mean = sum(self.losses) / len(self.losses)
            self.console.print(f"final loss {mean:.4f} nats per character (the mean of the last {len(self.losses)} steps' losses)")
        self.console.print(f"model: {_global_parameters(model):,} parameters")
        if step_communication:
            self.console.print(communication_table(step_communication))
            if self.options.compile:
                self.console.print("(--compile: the collectives inside the compiled blocks' graphs are not counted here)")
        weight = model.blocks[0].mlp.fc.weight
        header = ("blocks.0.mlp.fc.weight over dp x tp (fully_shard splits each tp shard's rows over dp):"
                  if self.options.data_parallel == "fsdp" else
                  "blocks.0.mlp.fc.weight over tp (each dp row holds the same shards):")
        visualize_sharding(weight, header=header, use_rich=True)
        self.console.rule("sample")
        self.console.print(sample, markup=False, highlight=False, soft_wrap=True)  # code lines unbroken
        self.console.rule()
        print_loss_agreement(self.console, self.differences)


def print_loss_agreement(console, differences: list[float]) -> None:
    """Print that the losses agree with one device's (`--compare`), or raise if one step left them."""
    if not differences:
        return
    worst = max(differences)
    verdict = f"{len(differences)} steps, max |loss - one-device loss| = {worst:.2e}"
    if worst > LOSS_TOLERANCE:
        raise ComparisonError(f"the parallel losses left the one-device losses: {verdict} > {LOSS_TOLERANCE}")
    console.print(f"[green]ok[/green]: losses agree with one device ({verdict})")
