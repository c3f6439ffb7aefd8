"""Explicit-communication mode: an op that would redistribute implicitly raises, naming the plan."""

import os

import pytest
import torch
from spmd import spmd

import shardtensor
from shardtensor import Partial, Replicate, Shard, comm, distribute_tensor, modes


@torch.library.custom_op("explicit_comm_test::running_total", mutates_args=())
def _running_total(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0)


@spmd(meshes=[(2,), (2, 2)])
def test_local_ops_run_and_moving_ops_raise_with_the_plan(mesh):
    rows = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)] * mesh.ndim)
    columns = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(1)] * mesh.ndim)
    with shardtensor.explicit_communication():
        with comm.observe() as records:
            local = (rows * 2 + rows).relu()  # every rule computes in place
        assert list(records) == [] and local.placements == rows.placements
        for attempt in range(2):  # the second call takes the cached plan: it must raise as well
            with pytest.raises(RuntimeError) as raised:
                rows + columns
            message = str(raised.value)
            assert "aten.add.Tensor" in message and "explicit-communication" in message
            assert "S(1)" in message and "redistribute" in message and "bytes" in message
        with pytest.raises(RuntimeError, match="replicate fallback"):
            torch.ops.explicit_comm_test.running_total(rows)
        moved = rows + columns.redistribute(mesh, rows.placements)  # asked for explicitly: fine
    assert torch.equal(moved.full_tensor(), torch.arange(16.0).reshape(4, 4) * 2)


@spmd(meshes=[(2,)])
def test_environment_variable_turns_it_on(mesh):
    partial = shardtensor.DTensor.from_local(torch.ones(3), mesh, [Partial()])
    os.environ["SHARDTENSOR_EXPLICIT_COMM"] = "1"
    try:
        modes.read_environment()
        with pytest.raises(RuntimeError, match="all_reduce|reduce_scatter"):
            partial.exp()  # exp of a P(sum) must reduce first
        assert torch.equal((partial * 3).full_tensor(), torch.full((3,), 6.0))  # stays Partial: no move
        assert torch.equal((partial + 1).full_tensor(), torch.full((3,), 3.0))  # added on one operand: no move
    finally:
        del os.environ["SHARDTENSOR_EXPLICIT_COMM"]
        modes.read_environment()
    assert torch.equal((partial + 1).full_tensor(), torch.full((3,), 3.0))
    replicated = distribute_tensor(torch.ones(3), mesh, [Replicate()])
    with shardtensor.explicit_communication():
        assert torch.equal(torch.ops.explicit_comm_test.running_total(replicated).full_tensor(), torch.arange(1.0, 4.0))
