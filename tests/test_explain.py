"""explain_redistribute: prints and returns the plan that redistribute would run, without communicating."""

import io

import pytest
import torch
from spmd import spmd

from shardtensor import DeviceMesh, Partial, Replicate, Shard, comm, distribute_tensor
from shardtensor.debug.explain import explain_redistribute
from shardtensor.layout import Layout
from shardtensor.redistribute import plan

R = Replicate()


def test_explain_a_layout_prints_steps_totals_and_the_lower_bound():
    layout = Layout.create((2, 2), [Partial(), Partial()], (1024, 1024))
    output = io.StringIO()
    result = explain_redistribute(layout, [R, R], itemsize=4, file=output)
    assert result is plan(layout, layout.with_placements([R, R]), 4)
    text = output.getvalue()
    assert text == str(result) + "\n"
    assert "mesh dims (0, 1): [P(sum), P(sum)] -> [R, R]  all_reduce (group 4), 6291456 bytes/rank" in text
    assert "lower bound 6291456 bytes/rank (1.00x)" in text


def test_explain_a_sum_and_avg_mix_prints_one_reduction_and_its_divisor():
    """(P(sum), P(avg)) -> (R, R): one all_reduce over both mesh dims (sum, then / 2 for the avg mesh
    dim) at the lower bound, where one all_reduce per mesh dim moved 8388608 bytes/rank (1.33x)."""
    layout = Layout.create((2, 2), [Partial("sum"), Partial("avg")], (1024, 1024))
    output = io.StringIO()
    explain_redistribute(layout, [R, R], itemsize=4, file=output)
    text = output.getvalue()
    assert "mesh dims (0, 1): [P(sum), P(avg)] -> [R, R]  all_reduce (group 4, sum / 2), 6291456 bytes/rank" in text
    assert "lower bound 6291456 bytes/rank (1.00x)" in text and len(text.splitlines()) == 3


def test_explain_a_layout_needs_an_itemsize():
    layout = Layout.create((2,), [Shard(0)], (4,))
    with pytest.raises(ValueError, match="pass e.g. itemsize=4 for float32"):
        explain_redistribute(layout, [R])
    with pytest.raises(TypeError, match="takes a DTensor or a Layout"):
        explain_redistribute(torch.ones(2), [R], itemsize=4)


@spmd(meshes=[(4,)])
def test_explain_a_dtensor_uses_its_item_size_and_moves_nothing(mesh):
    dtensor = distribute_tensor(torch.ones(8, 8, dtype=torch.float16), mesh, [Shard(0)])
    output = io.StringIO()
    with comm.observe() as records:
        result = explain_redistribute(dtensor, [Shard(1)], file=output)
    assert records == [] and result.itemsize == 2 and "2-byte items" in output.getvalue()
    assert result.collectives == ("all_to_all",) and result.total_bytes == result.lower_bound_bytes == 3 * 4 * 2


@spmd(meshes=[(4,)])
def test_explain_a_cross_mesh_move(mesh):
    dtensor = distribute_tensor(torch.ones(8, 4), mesh, [Partial()])
    output = io.StringIO()
    reduction, moves = explain_redistribute(dtensor, [Shard(0)], device_mesh=DeviceMesh("cpu", [3, 1]), file=output)
    assert reduction.collectives == ("all_reduce",)
    assert moves.messages == 0  # after the all_reduce, ranks 3 and 1 already hold their rows
    assert "hand-off" in output.getvalue() and "all_reduce" in output.getvalue()
