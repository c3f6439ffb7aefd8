"""The divergence detector: ranks that disagree on a collective raise on every rank, naming each
rank's fingerprint; agreeing ranks get the same values and counts as without the check."""

import pytest
import torch
import torch.distributed as dist

from shardtensor import Replicate, Shard, collective_check, comm, distribute_tensor
from shardtensor.debug import CollectiveMismatch, check_collectives
from spmd import spmd


def _mismatch(call) -> str:
    with check_collectives(), pytest.raises(CollectiveMismatch) as raised:
        call()
    return str(raised.value)


@spmd(meshes=[(2,), (2, 2)])
def test_different_collectives_raise_on_every_rank(mesh):
    rank = mesh.get_local_rank(0)
    local = torch.ones(3)
    if rank == 0:
        message = _mismatch(lambda: comm.all_reduce(local, mesh, 0, reduce_op="sum"))
    else:
        message = _mismatch(lambda: comm.broadcast(local, mesh, 0, src=0))
    assert "all_reduce over mesh dim 0" in message and "broadcast over mesh dim 0" in message, message
    for peer in mesh.group_ranks(0):
        assert f"rank {peer}:" in message, message
    assert "test_collective_check.py" in message, message  # the calling line of each rank


@spmd(meshes=[(2,), (4,)])
def test_different_shapes_and_dtypes_raise_on_every_rank(mesh):
    rank = mesh.get_local_rank()
    shape_message = _mismatch(lambda: comm.all_reduce(torch.ones(2 + rank), mesh, 0, reduce_op="sum"))
    assert "local shape (2,)" in shape_message and "local shape (3,)" in shape_message, shape_message
    dtype = torch.float64 if rank == 0 else torch.float32
    dtype_message = _mismatch(lambda: comm.all_gather(torch.ones(2, dtype=dtype), mesh, 0, dim=0, sizes=[2] * mesh.size()))
    assert "dtype torch.float64" in dtype_message and "dtype torch.float32" in dtype_message, dtype_message
    sizes = [1] * mesh.size() if rank == 0 else [2] + [1] * (mesh.size() - 1)  # ranks disagree on piece 0
    sizes_message = _mismatch(lambda: comm.all_gather(torch.ones(1), mesh, 0, dim=0, sizes=sizes))
    assert f"arguments (0, {tuple(sizes)}" in sizes_message, sizes_message


@spmd(meshes=[(2,), (2, 2)])
def test_agreeing_ranks_run_as_without_the_check(mesh):
    full = torch.arange(24.0).reshape(4, 6)
    x = distribute_tensor(full, mesh, [Shard(0)] * mesh.ndim)
    with comm.observe() as unchecked:
        expected = x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    with check_collectives(), comm.observe() as checked:
        result = x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    assert torch.equal(result, full) and torch.equal(expected, full)
    assert checked == unchecked  # the fingerprint exchange is not counted
    assert collective_check.enabled is False  # the block restores the previous setting
    assert dist.is_initialized()
