"""Pipeline x data x tensor parallelism (3-D) for the demo's GPT: the model is cut into stages along its
blocks, each stage laid out over "tp" and `fully_shard`ed over "dp" like the whole model in `train`, and
torch's `torch.distributed.pipelining` runs the stages over the mesh's "pp" process group.

A stage hands the next one its sequence-sharded residual stream as the plain local tensor (what
PipelineStage sends point to point); the next stage wraps it back into a DTensor over "tp". Each schedule
step splits this dp rank's batch into microbatches; the loss is the mean over a microbatch and the
schedule divides the summed gradients by the number of microbatches, so they are the gradients of the
mean over the dp rank's batch, which fully_shard averages over "dp".

    python -m shardtensor.demo --mesh 2x2x2 --pipeline     # 8 local ranks: pp x dp x tp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dtensor import DTensor
from ..fsdp import fully_shard
from ..mesh import DeviceMesh
from ..parallel import loss_parallel, parallelize_module
from ..placement import Shard
from .model import GPT, _heads_error, tensor_parallel_plan

__all__ = ["GPTStage", "MESH_DIM_NAMES", "SCHEDULES", "split_blocks", "shard_stage", "pipeline_schedule", "pipeline_loss"]

MESH_DIM_NAMES = ("pp", "dp", "tp")
SCHEDULES = ("1f1b", "gpipe")
_STAGE_ENDS = {"token_embedding": "first", "position_embedding": "first", "norm": "last", "head": "last"}


def split_blocks(layers: int, stages: int) -> list[range]:
    """The blocks of each stage: `layers` split into `stages` consecutive runs, the first ones longer by
    one when they do not divide evenly (every stage needs at least one block)."""
    if layers < stages:
        raise ValueError(f"a pipeline of {stages} stages needs at least {stages} blocks (one per stage); the model has {layers}")
    length, longer = divmod(layers, stages)
    starts = [stage * length + min(stage, longer) for stage in range(stages + 1)]
    return [range(start, end) for start, end in zip(starts, starts[1:])]


class GPTStage(nn.Module):
    """One pipeline stage of a `GPT`: its blocks `block_indices` (the first stage also the embeddings, the
    last also the final norm and the head). Parameter names are the whole model's (`blocks.3.mlp.fc.weight`),
    so the stage's state lines up with a single-device GPT's.

    Between stages the residual stream travels as a plain tensor: with tensor parallelism (`tp_mesh` set
    by `shard_stage`), this rank's sequence shard, wrapped back into a `Shard(1)` DTensor on arrival.
    """

    def __init__(self, model: GPT, block_indices: range, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.tp_mesh: DeviceMesh | None = None
        self.sequence_length = model.config.block_size
        if is_first:
            self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding
        self.blocks = nn.ModuleDict({str(index): model.blocks[index] for index in block_indices})
        if is_last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.token_embedding(x) + self.position_embedding(positions)
        elif self.tp_mesh is not None:
            shape = (x.shape[0], self.sequence_length, x.shape[2])
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], shape=shape, stride=(shape[1] * shape[2], shape[2], 1))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            return self.head(self.norm(x))
        return x.to_local() if isinstance(x, DTensor) else x


def _stage_plan(stage: GPTStage) -> dict:
    """The demo's tensor-parallel plan, less the entries of modules that live on other stages."""
    kept = {"first": stage.is_first, "last": stage.is_last}
    return {name: style for name, style in tensor_parallel_plan().items()
            if name.startswith("blocks.") or kept[_STAGE_ENDS[name.split(".")[0]]]}


def shard_stage(model: GPT, mesh: DeviceMesh) -> GPTStage:
    """This rank's stage of `model` on the ("pp", "dp", "tp") `mesh`: the blocks of its pp coordinate,
    laid out over "tp", each block and then the stage `fully_shard`ed over "dp"."""
    if mesh.mesh_dim_names != MESH_DIM_NAMES:
        raise ValueError(f"the pipeline mesh needs mesh dims named {MESH_DIM_NAMES}; got {mesh.mesh_dim_names}")
    if model.config.heads % mesh.size("tp") != 0:
        raise _heads_error(model.config, mesh.size("tp"))
    stages, stage_index = mesh.size("pp"), mesh.get_local_rank("pp")
    blocks = split_blocks(model.config.layers, stages)[stage_index]
    stage = GPTStage(model, blocks, is_first=stage_index == 0, is_last=stage_index == stages - 1)
    stage.tp_mesh = mesh["tp"]
    parallelize_module(stage, mesh["tp"], _stage_plan(stage), src_data_rank=None)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    return stage


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of one microbatch, vocab-parallel on the last stage's sharded logits."""
    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def pipeline_schedule(stage: GPTStage, mesh: DeviceMesh, microbatches: int, schedule: str = "1f1b"):
    """torch's PipelineStage over the mesh's "pp" process group and a GPipe or 1F1B schedule over it."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")
    device = next(stage.parameters()).device
    pipeline_stage = PipelineStage(stage, mesh.get_local_rank("pp"), mesh.size("pp"), device, group=mesh.get_group("pp"))
    schedule_class = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return schedule_class(pipeline_stage, n_microbatches=microbatches, loss_fn=pipeline_loss)
