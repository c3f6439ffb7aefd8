"""Pipeline parallelism (torch.distributed.pipelining's PipelineStage with ScheduleGPipe and Schedule1F1B over
the mesh's "pp" process group) composed with fully_shard over "dp" and tensor parallelism over "tp", on the
demo's GPT cut into stages by `shardtensor.demo.pipeline`: 2x1x2 (pp x tp) on 4 ranks and 2x2x2 on 8.

Every run trains a few SGD steps and compares, against the same GPT trained on one device on the whole batch,
the loss of every step (the mean of the last stage's microbatch losses, averaged over dp) and every parameter
afterwards (float64; SGD, unlike Adam, shows a gradient off by a constant factor such as the 1/microbatches
scaling). Three blocks on two stages: the first stage holds two, the second one.
"""

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spmd import spmd

from shardtensor import DeviceMesh, DTensor, Partial, comm
from shardtensor.demo.model import GPT, GPTConfig
from shardtensor.demo.cli import parse_options
from shardtensor.demo.pipeline import GPTStage, pipeline_schedule, shard_stage, split_blocks
from shardtensor.demo.pipeline_train import PipelineOptions, train_pipeline

CONFIG = GPTConfig(vocab_size=11, block_size=8, layers=3, heads=2, width=8)
BATCH, MICROBATCHES, STEPS, LEARNING_RATE = 8, 2, 2, 0.5
TOLERANCE = 1e-10
SLOW_MACHINE_TIMEOUT = 300.0  # eight processes on a two-core machine: a no-hang bound, not a time budget


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=generator) for _ in range(2))
            for _ in range(STEPS)]


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).double()


def _one_device(batches):
    """Losses per step and parameters after the steps of the whole GPT on the whole batch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for tokens, targets in batches:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, dict(model.named_parameters())


def _train_and_compare(mesh: DeviceMesh, schedule_name: str, expected_losses, expected_parameters, batches):
    stage = shard_stage(_model(), mesh)
    schedule = pipeline_schedule(stage, mesh, MICROBATCHES, schedule_name)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LEARNING_RATE)
    dp, dp_size = mesh.get_local_rank("dp"), mesh.size("dp")
    for step, (tokens, targets) in enumerate(batches):
        tokens, targets = tokens.tensor_split(dp_size)[dp], targets.tensor_split(dp_size)[dp]
        microbatch_losses = []
        with comm.observe() as records:
            if stage.is_first:
                schedule.step(tokens)
            else:
                schedule.step(target=targets, losses=microbatch_losses)
        if dp_size > 1 and step > 0:  # the first step also runs PipelineStage's shape inference
            _check_data_parallel_collectives(records, len(stage.blocks))
        optimizer.step()
        optimizer.zero_grad()
        if stage.is_last:
            assert len(microbatch_losses) == MICROBATCHES
            assert all(isinstance(loss, DTensor) for loss in microbatch_losses)  # vocab-parallel loss on "tp"
            loss = torch.stack([loss.full_tensor() for loss in microbatch_losses]).mean()
            loss = DTensor.from_local(loss, mesh["dp"], [Partial("avg")]).full_tensor()
            torch.testing.assert_close(loss, expected_losses[step], rtol=0, atol=TOLERANCE,
                                       msg=lambda text: f"{schedule_name}, loss of step {step}: {text}")
    names = [name for name, _ in stage.named_parameters()]
    expected_blocks = split_blocks(CONFIG.layers, mesh.size("pp"))[mesh.get_local_rank("pp")]
    assert {name.split(".")[1] for name in names if name.startswith("blocks.")} == {str(index) for index in expected_blocks}
    for name, parameter in stage.named_parameters():
        assert parameter.placements[0].is_shard(), (name, parameter.placements)  # fully_shard over "dp"
        torch.testing.assert_close(parameter.full_tensor(), expected_parameters[name].detach(), rtol=0, atol=TOLERANCE,
                                   msg=lambda text: f"{schedule_name}, parameter {name}: {text}")


def _check_data_parallel_collectives(records, blocks: int):
    """fully_shard knows nothing of the schedule: every microbatch gathers each block in forward and again in
    backward and reduce-scatters every unit (the blocks and the stage's root); the root, kept gathered after
    its forward, is gathered once per microbatch too, as the end of each microbatch's backward reshards it."""
    kinds = collections.Counter(record.kind for record in records if record.mesh_dim_names == ("dp",))
    assert kinds == {"all_gather": MICROBATCHES * (2 * blocks + 1), "reduce_scatter": MICROBATCHES * (blocks + 1)}, kinds


def _named_world(shape) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(dist.get_world_size()).reshape(shape), mesh_dim_names=("pp", "dp", "tp"))


@spmd(meshes=[(4,)], timeout=SLOW_MACHINE_TIMEOUT)
def test_pipeline_by_tensor_parallel_trains_as_one_device(mesh):
    """2 stages x 2 tensor-parallel ranks (dp of size 1), GPipe and 1F1B."""
    batches = _batches()
    expected_losses, expected_parameters = _one_device(batches)
    world = _named_world((2, 1, 2))
    for schedule_name in ("gpipe", "1f1b"):
        _train_and_compare(world, schedule_name, expected_losses, expected_parameters, batches)


@spmd(meshes=[(8,)], timeout=SLOW_MACHINE_TIMEOUT)
def test_pipeline_by_fully_shard_by_tensor_parallel_trains_as_one_device(mesh):
    """3-D: 2 stages x 2 fully_shard ranks x 2 tensor-parallel ranks, 1F1B and GPipe."""
    batches = _batches()
    expected_losses, expected_parameters = _one_device(batches)
    world = _named_world((2, 2, 2))
    for schedule_name in ("1f1b", "gpipe"):
        _train_and_compare(world, schedule_name, expected_losses, expected_parameters, batches)


def test_stages_split_the_blocks_and_hold_the_whole_models_parameters():
    """One device: the stages' parameters are the GPT's, each once, under the GPT's names."""
    model = GPT(CONFIG)
    ranges = split_blocks(CONFIG.layers, 2)
    assert ranges == [range(0, 2), range(2, 3)]
    stages = [GPTStage(model, blocks, is_first=index == 0, is_last=index == 1) for index, blocks in enumerate(ranges)]
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least 4 blocks"):
        split_blocks(3, 4)


def test_pipeline_options_check_the_mesh_the_stages_and_the_microbatches():
    options, size = parse_options(["--pipeline"])
    assert isinstance(options, PipelineOptions) and size == 8
    assert options.mesh == (2, 2, 2) and options.steps == PipelineOptions.steps and options.schedule == "1f1b"
    options, size = parse_options(["--pipeline", "--mesh", "2x1x2", "--schedule", "gpipe", "--microbatches", "4", "--steps", "3"])
    assert (options.mesh, size, options.schedule, options.microbatches, options.steps) == ((2, 1, 2), 4, "gpipe", 4, 3)
    assert not isinstance(parse_options([])[0], PipelineOptions)
    for wrong in (["--pipeline", "--mesh", "2x2"], ["--mesh", "2x2x2"], ["--pipeline", "--mesh", "4x1x1", "--layers", "2"],
                  ["--pipeline", "--batch-size", "6"], ["--pipeline", "--microbatches", "3"],
                  ["--pipeline", "--nproc", "4"], ["--pipeline", "--checkpoint", "run"], ["--pipeline", "--data-parallel", "ddp"]):
        with pytest.raises(SystemExit):
            parse_options(wrong)


@spmd(meshes=[(8,)], timeout=SLOW_MACHINE_TIMEOUT)
def test_the_pipelined_demo_trains_like_one_device(mesh):
    """The demo's --pipeline loop on 2x2x2 with --compare: rank 0 raises ComparisonError unless every step's
    loss is the one-device loss."""
    train_pipeline(PipelineOptions(steps=2, layers=2, heads=2, width=16, batch_size=8, block_size=16, sample_length=4,
                                   compare=True))
