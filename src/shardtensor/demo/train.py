"""One rank's part of the demo: data parallel x tensor parallel training of the GPT with AdamW.

The model is laid out over the "tp" mesh dim by `model.parallelize`; data parallelism over "dp"
gives each dp rank its slice of the global batch. With `data_parallel="fsdp"` (the default) every
block and then the whole model are `fully_shard`ed over "dp": parameters are sharded there too,
gathered per block around its forward and backward, and gradients reduce-scattered per block.
With `"ddp"` the parameters are replicated over "dp" and gradients are averaged after backward with
one all_reduce of all of them. Either way backward has already summed the norm gradients that
sequence parallelism leaves Partial over "tp", in one all_reduce over "tp". With `compare`, rank 0
also trains the same model on the whole batch on one device, step for step.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.nn.functional as F

from .. import comm
from ..dtensor import DTensor
from ..fsdp import fully_shard
from ..mesh import DeviceMesh, init_device_mesh
from ..parallel import loss_parallel
from . import report
from .checkpoint import load_checkpoint, save_checkpoint
from .data import Corpus, batch_for_step, load_corpus
from .model import GPT, GPTConfig, parallelize
from .schedule import learning_rate_at, set_learning_rate

__all__ = ["Options", "DATA_PARALLEL_MODES", "average_gradients", "compile_blocks", "mean_loss", "shard_model",
           "forward_backward", "train", "whole_model"]

DATA_PARALLEL_MODES = ("fsdp", "ddp")


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything a run depends on (the command line's flags)."""

    mesh: tuple[int, int] = (2, 2)
    data_parallel: str = "fsdp"  # one of DATA_PARALLEL_MODES: how the "dp" mesh dim holds the parameters
    steps: int = 300
    batch_size: int = 64
    block_size: int = 64
    layers: int = 2
    heads: int = 4
    width: int = 128
    learning_rate: float = 7e-3  # the peak of the schedule (`schedule.learning_rate_at`)
    warmup_steps: int = 100  # a long warmup to a high peak: the loss leaves its plateau near 2.5 soonest
    final_learning_rate_fraction: float = 0.05
    seed: int = 0
    data: str | None = None
    checkpoint: str | None = None
    compare: bool = False
    sample_length: int = 320
    device_type: str = "cpu"
    compile: str | None = None  # a torch.compile backend: each block is compiled with it (`compile_blocks`)


def average_gradients(parameters: list[torch.nn.Parameter], mesh: DeviceMesh, loss: torch.Tensor) -> float:
    """Data-parallel gradient averaging over mesh dim "dp" (0), in place; returns the global mean loss.

    Each dp rank's loss is the mean over its equal share of the batch, so the global gradient is
    the average of theirs: one all_reduce of every gradient's local shard, the loss riding along in
    the same buffer. Backward already left each gradient in its parameter's layout over "tp" (the
    norm weights' Partial gradients are summed over "tp" in one all_reduce at its end), so "tp"
    needs nothing here.
    """
    misplaced = [index for index, parameter in enumerate(parameters) if parameter.grad.placements != parameter.placements]
    if misplaced:
        raise _gradient_layout_error(misplaced)
    locals_ = [parameter.grad.to_local() for parameter in parameters]
    local_loss = loss.to_local() if isinstance(loss, DTensor) else loss
    flat = torch.cat([local_loss.detach().reshape(1), *(local.reshape(-1) for local in locals_)])
    flat = comm.all_reduce(flat, mesh, 0, reduce_op="avg")
    for local, piece in zip(locals_, flat[1:].split([local.numel() for local in locals_])):
        local.copy_(piece.view_as(local))
    return flat[0].item()


def mean_loss(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    """The global mean loss from each dp rank's mean over its equal share of the batch (one small
    all_reduce over "dp"; FSDP has already reduced the gradients)."""
    local_loss = loss.to_local() if isinstance(loss, DTensor) else loss
    return comm.all_reduce(local_loss.detach().reshape(1), mesh, 0, reduce_op="avg").item()


def _gradient_layout_error(indices: list[int]) -> ValueError:
    return ValueError(
        f"average_gradients averages each gradient's local shard over dp, so every gradient must be laid "
        f"out like its parameter (as backward leaves them); parameters at positions {indices} are not"
    )


def forward_backward(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a batch (vocab-parallel when the logits are sharded) and its gradients."""
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    loss.backward()
    return loss


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(options: Options, corpus: Corpus, device: torch.device) -> GPT:
    torch.manual_seed(options.seed)
    config = GPTConfig(corpus.vocab_size, options.block_size, options.layers, options.heads, options.width)
    return GPT(config).to(device)


def shard_model(model: GPT, mesh: DeviceMesh, data_parallel: str, compile_backend: str | None = None) -> GPT:
    """Tensor parallelism over "tp"; with "fsdp" also every block, then the rest of the model, sharded
    over "dp" (each block one unit: one all-gather forward, one reduce-scatter backward). With
    `compile_backend`, each block is compiled between the two (`compile_blocks`)."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel={data_parallel!r}: choose one of {DATA_PARALLEL_MODES}")
    parallelize(model, mesh["tp"])
    if compile_backend is not None:
        compile_blocks(model, compile_backend)
    if data_parallel == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def compile_blocks(model: GPT, backend: str) -> GPT:
    """Compile each block's forward in one graph (`fullgraph=True`), as torchtitan does: after tensor
    parallelism, before fully_shard, whose hooks then run eagerly around each compiled forward."""
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    return model


def whole_model(model: GPT, device: torch.device) -> GPT:
    """A one-device GPT with the trained weights, each parameter gathered once over the mesh (every rank
    calls it): rank 0 samples from it, one plain forward per character instead of a sharded forward and
    its collectives on every rank."""
    state = {name: parameter.full_tensor().detach() if isinstance(parameter, DTensor) else parameter.detach()
             for name, parameter in model.named_parameters()}
    trained = GPT(model.config).to(device)
    trained.load_state_dict(state)
    return trained


def _optimizer(model: GPT, options: Options) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=options.learning_rate, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)


def _dp_slice(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return tensor.tensor_split(mesh.size(0))[mesh.get_coordinate()[0]]


def train(options: Options) -> None:
    """The demo on this rank (every rank of the world runs it)."""
    mesh = init_device_mesh(options.device_type, options.mesh, mesh_dim_names=("dp", "tp"))
    device = torch.device(options.device_type, torch.cuda.current_device()) if options.device_type == "cuda" else torch.device("cpu")
    corpus = load_corpus(options.data, options.block_size)
    model = build(options, corpus, device)
    is_main = mesh.get_rank() == 0
    reference = copy.deepcopy(model) if options.compare and is_main else None
    shard_model(model, mesh, options.data_parallel, options.compile)
    fsdp = options.data_parallel == "fsdp"
    optimizer = _optimizer(model, options)
    reference_optimizer = _optimizer(reference, options) if reference is not None else None
    start = 0
    if options.checkpoint:
        start = load_checkpoint(options.checkpoint, model, optimizer, reference, reference_optimizer)
    progress = report.Progress(options, corpus, start) if is_main else None
    parameters = list(model.parameters())
    for step in range(start, options.steps):
        tokens, targets = batch_for_step(corpus, step, options.batch_size, options.block_size, options.seed)
        learning_rate = learning_rate_at(step, options.learning_rate, options.steps, options.warmup_steps,
                                         options.final_learning_rate_fraction)
        for each in (optimizer, reference_optimizer):
            if each is not None:
                set_learning_rate(each, learning_rate)
        began = time.perf_counter()
        with comm.observe() as model_records:
            loss = forward_backward(model, _dp_slice(tokens, mesh).to(device), _dp_slice(targets, mesh).to(device))
        with comm.observe() as gradient_records:
            loss_value = mean_loss(loss, mesh) if fsdp else average_gradients(parameters, mesh, loss)
        _step(optimizer)
        elapsed = time.perf_counter() - began
        reference_loss = None
        if reference is not None:
            reference_loss = forward_backward(reference, tokens.to(device), targets.to(device)).item()
            _step(reference_optimizer)
        if progress is not None:
            progress.update(step, loss_value, reference_loss, tokens.numel() / elapsed)
    step_communication = model_records + gradient_records if options.steps > start else []
    if options.checkpoint:
        save_checkpoint(options.checkpoint, model, optimizer, options.steps, reference, reference_optimizer)
    trained = whole_model(model, device)
    if progress is not None:
        progress.finish(step_communication, model, report.generate(trained, corpus, options, device))
