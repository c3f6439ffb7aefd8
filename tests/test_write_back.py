"""Views of moved copies (`write_back.CopySource`) read and write their base as views do on one device.

`y[:, 0]` of a tensor sharded along dim 1 is a view of a gathered copy of `y`: a write into it is
stored into `y` (`write_through`), and a read of it after `y` was written sees `y`'s new values
(`CopySource.refresh`), on every path an op takes (miss, cached plan, the public-function fast path,
multi-tensor plans, `to_local`, `full_tensor`, `redistribute`). Every test runs the same program on
a DTensor and on the full plain tensor and compares.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from helpers import exact_full
from spmd import spmd
from torch.testing import assert_close

from shardtensor import DTensor, Replicate, Shard, comm, distribute_tensor, explicit_communication, torch_function, write_back

# Placements of the base per mesh: the viewed dim (1) is sharded, so `y[:, 0]` moves it.
PLACEMENTS = {1: [[Shard(1)]], 2: [[Shard(1), Shard(1)], [Shard(0), Shard(1)]]}


def _bases(mesh, shape=(6, 8)):
    """(DTensor, plain) pairs of the same values, one per placement of `PLACEMENTS`."""
    full = exact_full(shape)
    return [(distribute_tensor(full, mesh, placements), full.clone()) for placements in PLACEMENTS[mesh.ndim]]


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _same(results, expected) -> None:
    assert len(results) == len(expected)
    for index, (result, value) in enumerate(zip(results, expected)):
        assert_close(_full(result), value, msg=lambda message, index=index: f"result {index}: {message}")


def _alternating_program(y, steps: int = 4) -> list:
    """Writes into the base, into its views and into a view of a view, each followed by reads."""
    column, rows_of_column, other = y[:, 0], y[:, 0][1:3], y.select(1, 2).unsqueeze(0)
    results = []
    for step in range(steps):
        y.add_(1.0)  # learnt on the first steps, then served by the fast path
        results += [column.sum(), rows_of_column * 2, other.exp(), column + rows_of_column.sum()]
        y.mul_(0.5)
        results.append(torch.add(column, other[0]))
        column.mul_(2.0)  # a view written: the base and the base's other copies see it
        results += [y.sum(0), other * 1, rows_of_column.clone()]
        rows_of_column.add_(float(step))  # a view of the view written
        results += [y.clone(), column.neg()]
    return results


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_reads_and_writes_of_views_alternating_with_writes_of_the_base(mesh):
    for dtensor, plain in _bases(mesh):
        _same(_alternating_program(dtensor), _alternating_program(plain))
        assert_close(dtensor.full_tensor(), plain)


@spmd(meshes=[(2,), (2, 2)])
def test_alternating_program_on_the_dispatcher_alone(mesh):
    """The same program with the public-function fast path off: cached aten plans serve every read.
    (A context, not pytest's `monkeypatch` fixture: a fixture passed to the worker ranks is never undone there.)"""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch_function, "fast_path_enabled", False)
        for dtensor, plain in _bases(mesh):
            _same(_alternating_program(dtensor), _alternating_program(plain))


@spmd(meshes=[(2,), (2, 2)])
def test_conversions_read_the_current_base(mesh):
    """`to_local()`, `full_tensor()` and `redistribute` of a view of a copy see the base's writes."""
    for dtensor, plain in _bases(mesh):
        column, expected = dtensor[:, 0], plain[:, 0]
        for step in range(3):
            dtensor.add_(float(step + 1))
            plain.add_(float(step + 1))
            assert_close(column.full_tensor(), expected)
            with torch.no_grad():
                assert_close(column.redistribute(placements=[Replicate()] * mesh.ndim).to_local(), expected)
            dtensor.mul_(3.0)
            plain.mul_(3.0)
            local = column.to_local()  # Replicate on the mesh dims that were gathered
            shard = column.redistribute(placements=[Shard(0)] * mesh.ndim).full_tensor()
            assert_close(shard, expected)
            assert_close(DTensor.from_local(local, mesh, column.placements, shape=tuple(column.shape)).full_tensor(),
                         expected)


@spmd(meshes=[(2,), (2, 2)])
def test_a_current_view_communicates_nothing_and_a_stale_one_once(mesh):
    """A read of a view whose base was not written runs no collective; after a write into the base,
    the first read refreshes the copy (the view op's own move, once), the next reads do not."""
    for dtensor, plain in _bases(mesh):
        column = dtensor[:, 0]
        column.sum()  # learnt
        with comm.observe() as records:
            column.sum()
            column * 2
        assert list(records) == []
        with comm.observe() as view_op_records:
            dtensor[:, 0]
        dtensor.add_(1.0)
        plain.add_(1.0)
        with comm.observe() as records:
            total = column.sum()
            doubled = column * 2
        assert list(records) == list(view_op_records) != []
        assert_close(total.full_tensor(), plain[:, 0].sum())
        assert_close(doubled.full_tensor(), plain[:, 0] * 2)


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_multi_tensor_ops_read_fresh_views_and_write_through_them(mesh):
    """`_foreach_*` reads a view of a copy after its base's write and stores its write into the base,
    on the miss, on the aten list plan and on the learnt public function."""
    for dtensor, plain in _bases(mesh):
        results = []
        for y, other in ((dtensor, distribute_tensor(exact_full((6,), seed=1), mesh, [Replicate()] * mesh.ndim)),
                         (plain, exact_full((6,), seed=1))):
            column, outputs = y[:, 0], []
            for step in range(4):
                y.add_(1.0)
                outputs += list(torch._foreach_mul([column, other], 2.0))
                torch._foreach_add_([column, other], float(step))
                outputs += [y.clone(), other.clone(), column.clone()]
            results.append(outputs)
        _same(*results)


@spmd(meshes=[(2,), (2, 2)])
def test_multi_tensor_writes_that_one_store_would_undo_raise(mesh):
    """Two copies of one base written by one call (or the base and a copy of it): storing the copies
    back would undo one write, so the call raises before writing and says to split it; two views of
    the same copy are written through together."""
    for dtensor, plain in _bases(mesh):
        for targets in ((dtensor[:, 0], dtensor[:, 1]), (dtensor, dtensor[:, 0])):
            with pytest.raises(RuntimeError, match="Write them in separate calls"):
                torch._foreach_add_(list(targets), 1.0)
        assert_close(dtensor.full_tensor(), plain)
        for y in (dtensor, plain):
            column = y[:, 3]
            torch._foreach_add_([column, column.unsqueeze(1), column], [1.0, 2.0, 3.0])
        assert_close(dtensor.full_tensor(), plain)


@spmd(meshes=[(2,), (2, 2)])
def test_views_follow_the_storage_when_the_base_gets_other_data(mesh):
    """After `y.data = z` a view of `y` keeps viewing `y`'s former storage, as on one device: it keeps
    its values, and its writes no longer reach `y`; a view whose base is freed still reads its values, and
    a deep copy of a view is a tensor of its own."""
    for dtensor, plain in _bases(mesh):
        results = []
        for y in (dtensor, plain):
            column = y[:, 0]
            y.add_(1.0)
            y.data = y.detach() * 10
            column.add_(1.0)
            results_of_y = [column.clone(), y.clone()]
            column.data = torch.zeros_like(column)  # and a view given other data no longer views `y`
            y.add_(1.0)
            column.add_(2.0)
            results.append(results_of_y + [column.clone(), y.clone()])
        _same(*results)
    full = exact_full((6, 8))
    for make in (lambda: distribute_tensor(full, mesh, PLACEMENTS[mesh.ndim][0]), full.clone):
        base = make()
        column = base[:, 1]
        copied = copy.deepcopy(column)  # an independent tensor of the column's values
        base.mul_(2.0)
        copied.add_(1.0)
        del base
        gc.collect()
        assert_close(_full(column), full[:, 1] * 2)
        assert_close(_full(copied), full[:, 1] + 1)


@spmd(meshes=[(2,), (2, 2)])
def test_gradients_through_a_refreshed_view(mesh):
    """`v = y[:, 0]; y.add_(b); v` reads the sum and its gradient reaches both `y`'s source and `b`."""
    for placements in PLACEMENTS[mesh.ndim]:
        full, addend = exact_full((6, 8)), exact_full((6, 8), seed=2)
        gradients = []
        for leaf, other in ((distribute_tensor(full, mesh, placements).requires_grad_(),
                             distribute_tensor(addend, mesh, placements).requires_grad_()),
                            (full.clone().requires_grad_(), addend.clone().requires_grad_())):
            y = leaf * 2.0
            column = y[:, 0]
            y.add_(other)
            loss = (column * column).sum()
            loss.backward()
            gradients.append([loss, leaf.grad, other.grad])
        _same(*gradients)


@spmd(meshes=[(2,), (2, 2)])
def test_in_place_views_of_a_view_keep_viewing_the_base(mesh):
    """`unsqueeze_` and `t_` of a view of a copy change its shape, not what it views."""
    for dtensor, plain in _bases(mesh):
        results = []
        for y in (dtensor, plain):
            column = y[:, 0]
            column.unsqueeze_(0)
            y.add_(1.0)
            outputs = [column.clone()]
            column.t_()
            column.mul_(2.0)
            y.sub_(0.5)
            results.append(outputs + [y.clone(), column.clone()])
        _same(*results)


@spmd(meshes=[(2,)])
def test_explicit_communication_refuses_the_refresh_a_read_needs(mesh):
    """Refreshing a stale view moves the base's shard: explicit-communication mode raises, naming it;
    a current view reads without communication there."""
    for dtensor, plain in _bases(mesh):
        column = dtensor[:, 0]
        with explicit_communication():
            assert_close(column.sum().full_tensor(), plain[:, 0].sum())
            dtensor.add_(1.0)
            with pytest.raises(RuntimeError, match="a read of a view of a redistributed copy would communicate"):
                column.sum()
        assert_close(column.sum().full_tensor(), plain[:, 0].sum() + 6)


@spmd(meshes=[(2,)])
def test_printing_a_stale_view_on_one_rank_communicates_nothing(mesh):
    """`if rank == 0: print(view)` must not start a refresh (a collective the other ranks never join)."""
    for dtensor, plain in _bases(mesh):
        column = dtensor[:, 0]
        dtensor.add_(1.0)
        plain.add_(1.0)
        with comm.observe() as records:
            text = repr(column) if mesh.get_rank() == 0 else ""
        assert list(records) == []
        assert mesh.get_rank() != 0 or "stale" in text
        assert_close(column.full_tensor(), plain[:, 0])  # every rank: refreshed by the next read
        assert "stale" not in repr(column)


@spmd(meshes=[(2,), (4,)])
def test_the_first_write_into_a_view_stores_its_copy_once(mesh):
    """On the miss path the plan built for the write stores the copy into the base; the miss path must
    not store it a second time."""
    stores = []
    store = write_back._store
    y = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    plain = torch.zeros(4, 6)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(write_back, "_store", lambda *args: (stores.append(args[0]), store(*args))[1])
        for view in (y[:, 0], plain[:, 0]):
            view.mul_(3.0)
            view.add_(1.0)
    assert len(stores) == 2, stores  # one per write
    assert torch.equal(y.full_tensor(), plain)
