"""`python -m shardtensor.demo --forecast RxDPxTP`: the demo's training step forecast at a scale this
machine cannot run (one rank of the world, shapes only; see `shardtensor.forecast`).

The mesh is (replicate, dp, tp): tensor parallelism over "tp", `fully_shard` over "dp", and the "replicate"
dim holds data-parallel replicas of the sharded model (HSDP: gradients reduce-scattered over "dp", then
all-reduced over "replicate"). A 2-D mesh DPxTP is the demo's own layout. `make_step` is the step that
`train.train` runs (forward, backward, the mean loss over the data ranks, AdamW), on any of these meshes,
real or fake: the forecast's tests run it on real gloo ranks too.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import comm
from ..dtensor import DTensor
from ..forecast import forecast
from ..fsdp import fully_shard
from ..mesh import DeviceMesh
from .model import GPT, GPTConfig, parallelize
from .train import Options, forward_backward

__all__ = ["make_step", "fit_options", "VOCAB_SIZE", "forecast_demo", "print_forecast"]

# The default corpus's vocabulary (`data.standard_library_text` on Python 3.11): printable ASCII, the
# newline and the tab that stands for one level of indentation.
VOCAB_SIZE = 97


def _data_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    return ("replicate", "dp") if mesh.ndim == 3 else ("dp",)


def make_step(mesh: DeviceMesh, options: Options, vocab_size: int = VOCAB_SIZE):
    """Build the demo's sharded model, optimizer and this rank's batch on `mesh` (named ("dp", "tp") or
    ("replicate", "dp", "tp")); return its training step, which returns the global mean loss."""
    torch.manual_seed(options.seed)
    config = GPTConfig(vocab_size, options.block_size, options.layers, options.heads, options.width)
    model = GPT(config)
    parallelize(model, mesh["tp"])
    data_dims = _data_dims(mesh)
    data_mesh = mesh[data_dims]
    for block in model.blocks:
        fully_shard(block, mesh=data_mesh)
    fully_shard(model, mesh=data_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.learning_rate, weight_decay=0.01, foreach=True)
    data_ranks = data_mesh.size()
    data_rank = _flat(data_mesh)
    generator = torch.Generator().manual_seed(options.seed)
    windows = torch.randint(0, vocab_size, (options.batch_size, options.block_size + 1), generator=generator)
    mine = windows.tensor_split(data_ranks)[data_rank]
    tokens, targets = mine[:, :-1], mine[:, 1:]
    mesh_dims = tuple(range(len(data_dims)))

    def step() -> float:
        loss = forward_backward(model, tokens, targets)
        local = loss.to_local() if isinstance(loss, DTensor) else loss
        mean = comm.all_reduce(local.detach().reshape(1), mesh, mesh_dims if len(mesh_dims) > 1 else 0, reduce_op="avg")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mean.item()

    return step


def _flat(mesh: DeviceMesh) -> int:
    """This rank's row-major position in `mesh`."""
    position = 0
    for size, coordinate in zip(mesh.shape, mesh.get_coordinate()):
        position = position * size + coordinate
    return position


def fit_options(options: Options, mesh_shape: tuple[int, ...]) -> Options:
    """The demo's options grown to fit the mesh: heads a multiple of the tp size (keeping each head's
    width) and the global batch at least one sequence per data rank."""
    tp, data_ranks = mesh_shape[-1], math.prod(mesh_shape[:-1])
    head_width = options.width // options.heads
    heads = math.ceil(options.heads / tp) * tp
    batch = math.ceil(options.batch_size / data_ranks) * data_ranks
    return dataclasses.replace(options, heads=heads, width=heads * head_width, batch_size=batch)


def forecast_demo(options: Options, mesh_shape: tuple[int, ...], *, profile: str = "dgx-h100", rank: int = 0):
    """The demo step's `Forecast` on `mesh_shape` (DPxTP or RxDPxTP)."""
    names = ("replicate", "dp", "tp") if len(mesh_shape) == 3 else ("dp", "tp")
    return forecast(make_step, mesh_shape, options, mesh_dim_names=names, profile=profile, rank=rank)


def print_forecast(arguments) -> int:
    """`--forecast`: the demo's model from the flags, grown to fit the mesh, forecast and printed."""
    if arguments.data_parallel != "fsdp":
        raise SystemExit("--forecast models the demo with --data-parallel fsdp (the default)")
    batch_size = Options.batch_size if arguments.batch_size is None else arguments.batch_size
    flags = Options(batch_size=batch_size, block_size=arguments.block_size, layers=arguments.layers,
                    heads=arguments.heads, width=arguments.width, seed=arguments.seed)
    options = fit_options(flags, arguments.forecast)
    print(f"demo GPT: {options.layers} layers, {options.heads} heads, width {options.width}, "
          f"{options.block_size} characters per sequence, global batch {options.batch_size}")
    print(forecast_demo(options, arguments.forecast))
    return 0
