"""fully_shard state dicts through torch.distributed.checkpoint: saved on 4 shards, loaded on 2 (HSDP), exact."""

import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from spmd import spmd
from test_fsdp import _assert_same_parameters, _batches, _local_batch, _loss, _model, _shard
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm
from shardtensor.mesh import DeviceMesh

LR = 0.01


def _optimizer_state(model, optimizer) -> dict:
    """AdamW's state keyed by parameter name (what DCP needs), holding the optimizer's own tensors."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return {names[id(parameter)]: state for parameter, state in optimizer.state.items()}


def _steps(model, optimizer, batches, rank, ranks):
    for inputs, target in batches:
        _loss(model(_local_batch(inputs, rank, ranks)), _local_batch(target, rank, ranks)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _fresh_optimizer_state(model) -> torch.optim.AdamW:
    """An AdamW whose state exists (zeros, step 0) so that DCP can load into it in place."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for parameter in model.parameters():
        optimizer.state[parameter] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(parameter),
                                      "exp_avg_sq": torch.zeros_like(parameter)}
    return optimizer


@spmd(meshes=[(2, 2)])
def test_save_on_four_shards_load_on_two_and_keep_training(mesh):
    batches = _batches(3)
    reference = _model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    _steps(reference, reference_optimizer, batches, 0, 1)

    four_shards = DeviceMesh("cpu", mesh.mesh.flatten())
    rank, ranks = mesh.get_rank(), mesh.size()
    directory = comm.all_gather_object(tempfile.mkdtemp(prefix="fsdp_dcp_") if rank == 0 else None, four_shards, 0)[0]
    try:
        saved = _shard(_model(), four_shards)
        optimizer = torch.optim.AdamW(saved.parameters(), lr=LR)
        _steps(saved, optimizer, batches[:2], rank, ranks)
        state = saved.state_dict()
        assert all(isinstance(value, DTensor) and value.placements == (Shard(0),) for value in state.values())
        dcp.save({"model": state, "optimizer": _optimizer_state(saved, optimizer)}, checkpoint_id=directory)

        loaded = _shard(_model(), mesh)  # HSDP: (Replicate, Shard(0)), two shards per parameter
        loaded_optimizer = _fresh_optimizer_state(loaded)
        target = {"model": loaded.state_dict(), "optimizer": _optimizer_state(loaded, loaded_optimizer)}
        assert target["model"]["head.weight"].placements == (Replicate(), Shard(0))
        dcp.load(target, checkpoint_id=directory)
        for name, parameter in saved.named_parameters():
            assert_close(loaded.get_parameter(name).full_tensor(), parameter.full_tensor(), rtol=0, atol=0)
            assert_close(target["optimizer"][name]["exp_avg_sq"].full_tensor(), optimizer.state[parameter]["exp_avg_sq"].full_tensor(),
                         rtol=0, atol=0)
        _steps(loaded, loaded_optimizer, batches[2:], rank, ranks)
        _assert_same_parameters(loaded, reference)
    finally:
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
