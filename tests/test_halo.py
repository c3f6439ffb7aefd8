"""The halo exchange primitive: windows equal slices of the padded full tensor, and the adjoint
equals autograd of the single-device pad-and-slice, on 2 and 4 ranks and 2x2, with uneven and
thin shards and every edge mode. The oracle pads row indices with numpy (`np.pad`), independent of
the library's own row mapping."""

import dataclasses
import gc
from fractions import Fraction

import numpy as np
import pytest
import torch
from spmd import spmd
from torch.testing import assert_close

from shardtensor import comm, halo
from shardtensor.halo import (
    Exchange, SlidingWindow, differentiable_exchange, exchange, exchange_gradient, exchanged_bytes, output_bounds,
    window_exchange, window_gradient,
)

_NUMPY_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap", "none": "constant"}
EDGES = ("zeros", "reflect", "replicate", "circular", 2.5)  # 2.5: a constant fill


def _bounds(sizes):
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def _source_rows(size, window, edge):
    """The global row (or -1: a zero row) of each row of `window`, by np.pad of the row indices."""
    start, stop = window
    if stop == start:
        return np.zeros(0, dtype=np.int64)
    before, after = max(0, -start), max(0, stop - size)
    mode = _NUMPY_MODES.get(edge, "constant")
    kwargs = {"constant_values": -1} if mode == "constant" else {}
    padded = np.pad(np.arange(size), (before, after), mode=mode, **kwargs)
    return padded[start + before: stop + before]


def _padded_slice(full, dim, window, edge):
    """The window's rows of `full` padded by `edge` (differentiable: index_select, constant rows by where)."""
    rows = torch.as_tensor(_source_rows(full.size(dim), window, edge))
    picked = full.index_select(dim, rows.clamp(min=0))
    mask_shape = [1] * full.ndim
    mask_shape[dim] = -1
    fill = 0.0 if isinstance(edge, str) else edge
    return torch.where((rows >= 0).reshape(mask_shape), picked, fill)


def _full(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _windows(sizes, case):
    """Windows per coordinate: a sliding window's, or shard bounds widened by (before, after)."""
    bounds = _bounds(sizes)
    if isinstance(case, SlidingWindow):
        return case.input_windows(case.output_bounds(bounds, case.output_size(sum(sizes))))
    before, after = case
    return tuple((start - before, stop + after) for start, stop in bounds)


# (shard sizes along one mesh dim of 2 or 4 ranks, window case): even, uneven, empty and thin shards.
CASES = {
    2: [((4, 4), SlidingWindow(3, padding=1)), ((5, 2), (2, 3)), ((1, 6), (3, 2)), ((3, 3), SlidingWindow(4, 2, 1)),
        ((2, 5), SlidingWindow(3, dilation=3, padding=3))],
    4: [((2, 2, 2, 2), SlidingWindow(3, padding=1)), ((3, 1, 0, 4), (2, 2)), ((1, 1, 1, 5), (3, 4)),
        ((4, 1, 2, 1), SlidingWindow(5, 2, 2)), ((2, 3, 2, 1), SlidingWindow(3))],
}


def _mesh_dims(mesh):
    return 0 if mesh.ndim == 1 else (0, 1)  # a 2x2 mesh flattens its four ranks along one tensor dim


def _piece(mesh):
    coordinate = mesh.get_coordinate()
    return coordinate[0] if mesh.ndim == 1 else coordinate[0] * 2 + coordinate[1]


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_windows_equal_slices_of_the_padded_full_tensor(mesh):
    dim, me = 2, _piece(mesh)
    for sizes, case in CASES[mesh.size()]:
        bounds, windows = _bounds(sizes), _windows(sizes, case)
        full = _full((2, 3, sum(sizes)), seed=sum(sizes))
        local = full.narrow(dim, *_start_length(bounds[me]))
        for edge in EDGES:
            window = window_exchange(local, mesh, _mesh_dims(mesh), dim, bounds, windows, edge)
            assert_close(window, _padded_slice(full, dim, windows[me], edge), rtol=0, atol=0,
                         msg=lambda text: f"{sizes} {case} {edge}: {text}")


def _start_length(bounds):
    return bounds[0], bounds[1] - bounds[0]


@spmd(meshes=[(2,), (4,), (2, 2)])
def test_adjoint_equals_autograd_of_the_single_device_pad_and_slice(mesh):
    dim, me = 1, _piece(mesh)
    for sizes, case in CASES[mesh.size()]:
        bounds, windows = _bounds(sizes), _windows(sizes, case)
        for edge in EDGES:
            full = _full((3, sum(sizes)), seed=7).requires_grad_()
            grads = [_full((3, stop - start), seed=100 + c) for c, (start, stop) in enumerate(windows)]
            total = sum((_padded_slice(full, dim, window, edge) * grad).sum() for window, grad in zip(windows, grads))
            total.backward()
            local = full.detach().narrow(dim, *_start_length(bounds[me])).clone().requires_grad_()
            grad_local = window_gradient(grads[me], mesh, _mesh_dims(mesh), dim, bounds, windows, edge)
            assert_close(grad_local, full.grad.narrow(dim, *_start_length(bounds[me])),
                         msg=lambda text: f"{sizes} {case} {edge}: {text}")
            steps = (Exchange(_mesh_dims_tuple(mesh), dim, bounds, windows, edge),)
            differentiable_exchange(local, mesh, steps).backward(grads[me])
            assert_close(local.grad, grad_local, rtol=0, atol=0)


def _mesh_dims_tuple(mesh):
    dims = _mesh_dims(mesh)
    return dims if isinstance(dims, tuple) else (dims,)


@spmd(meshes=[(2, 2)])
def test_two_dims_on_two_mesh_dims_bring_the_corners(mesh):
    """H on mesh dim 0, W on mesh dim 1, uneven and thin: the second exchange runs on the widened tensor."""
    heights, widths = (3, 1), (1, 4)
    rows, columns = mesh.get_coordinate()
    for edge in EDGES:
        full = _full((2, sum(heights), sum(widths)), seed=3).requires_grad_()
        steps = (
            Exchange((0,), 1, _bounds(heights), _windows(heights, (2, 1)), edge),
            Exchange((1,), 2, _bounds(widths), _windows(widths, SlidingWindow(3, padding=1)), edge),
        )
        my_windows = [step.window(mesh.shape, mesh.get_coordinate()) for step in steps]
        expected = _padded_slice(_padded_slice(full, 1, my_windows[0], edge), 2, my_windows[1], edge)
        local = full.detach()[:, slice(*_bounds(heights)[rows]), slice(*_bounds(widths)[columns])].clone()
        local.requires_grad_()
        window = differentiable_exchange(local, mesh, steps)
        assert_close(window, expected.detach(), rtol=0, atol=0)
        grad = _full(window.shape, seed=11 + 2 * rows + columns)
        window.backward(grad)
        # The single-device reference: every coordinate's window dotted with its gradient.
        total = 0
        for row_coordinate in range(2):
            for column_coordinate in range(2):
                coordinate = (row_coordinate, column_coordinate)
                windows = [step.window(mesh.shape, coordinate) for step in steps]
                padded = _padded_slice(_padded_slice(full, 1, windows[0], edge), 2, windows[1], edge)
                total = total + (padded * _full(padded.shape, seed=11 + 2 * row_coordinate + column_coordinate)).sum()
        total.backward()
        assert_close(local.grad, full.grad[:, slice(*_bounds(heights)[rows]), slice(*_bounds(widths)[columns])])


@spmd(meshes=[(2,), (4,)])
def test_exchange_moves_exactly_the_halo_rows_point_to_point(mesh):
    """A 3-row 'same' window on even shards: one batch_p2p; each rank sends and receives one row per
    neighbour (edge ranks: one neighbour, or the wrapped one with circular)."""
    dim = 1
    sizes = (3,) * mesh.size()
    bounds, windows = _bounds(sizes), _windows(sizes, SlidingWindow(3, padding=1))
    local = _full((2, 3), seed=mesh.get_rank())
    row_bytes = 2 * 8
    me = mesh.get_local_rank(0)
    for edge in EDGES:
        neighbours = 2 if edge == "circular" or 0 < me < mesh.size() - 1 else 1
        with comm.observe() as records:
            window = window_exchange(local, mesh, 0, dim, bounds, windows, edge)
            exchange_gradient(window, mesh, (Exchange((0,), dim, bounds, windows, edge),))
        assert [record.kind for record in records] == ["batch_p2p", "batch_p2p"]
        for record in records:
            assert (record.bytes_sent, record.bytes_received) == (neighbours * row_bytes, neighbours * row_bytes)
        assert exchanged_bytes(bounds, windows, edge, me, row_bytes) == (neighbours * row_bytes,) * 2
    with comm.observe() as records:  # windows inside the shards: nothing moves
        assert_close(window_exchange(local, mesh, 0, dim, bounds, bounds, "none"), local, rtol=0, atol=0)
    assert records == []


@spmd(meshes=[(2,), (2, 2)])
def test_kept_halo_rebuilds_the_window_without_communicating(mesh):
    """`exchange(keep=True)` then `exchange(reuse=True)` of the same shard and exchanges: the same
    window, no collective; other exchanges, or the shard written in place, exchange again; a shard
    never kept exchanges; the kept rows go with the shard."""
    heights, widths = (3, 1), (1, 4)
    steps = (Exchange((0,), 1, _bounds(heights), _windows(heights, (2, 1)), "reflect"),)
    if mesh.ndim == 2:
        steps += (Exchange((1,), 2, _bounds(widths), _windows(widths, SlidingWindow(3, padding=1)), "zeros"),)
    shape = [2, heights[mesh.get_coordinate()[0]], widths[mesh.get_coordinate()[1]] if mesh.ndim == 2 else 3]
    local = _full(shape, seed=mesh.get_rank())
    with comm.observe() as records:
        window = exchange(local, mesh, steps, keep=True)
    assert len(records) == len(steps)
    with comm.observe() as records:
        assert_close(exchange(local, mesh, steps, reuse=True), window, rtol=0, atol=0)
    assert records == []
    other_steps = (dataclasses.replace(steps[0], edge="zeros"),) + steps[1:]
    with comm.observe() as records:
        exchange(local, mesh, other_steps, reuse=True)
        exchange(local.clone(), mesh, steps, reuse=True)
    assert len(records) == 2 * len(steps)
    local.mul_(2)  # a new version: the kept rows are stale
    with comm.observe() as records:
        assert_close(exchange(local, mesh, steps, reuse=True), exchange(local, mesh, steps), rtol=0, atol=0)
    assert len(records) == 2 * len(steps)
    kept = len(halo._kept_halos)
    del local
    gc.collect()
    assert len(halo._kept_halos) == kept - 1


@spmd(meshes=[(2,)])
def test_a_replicated_edge_row_travels_once(mesh):
    """Coordinate 1 holds one row; coordinate 0's window reaches 3 rows past the end: 'replicate'
    fills them with that row, which moves once."""
    bounds, windows = ((0, 3), (3, 4)), ((0, 7), (3, 4))
    local = _full((3 if mesh.get_local_rank(0) == 0 else 1, 2), seed=0)
    with comm.observe() as records:
        window = window_exchange(local, mesh, 0, 0, bounds, windows, "replicate")
    expected_rows = 7 if mesh.get_local_rank(0) == 0 else 1
    assert window.shape == (expected_rows, 2)
    row_bytes = 2 * 8
    sent, received = (0, row_bytes) if mesh.get_local_rank(0) == 0 else (row_bytes, 0)
    assert [(record.bytes_sent, record.bytes_received) for record in records] == [(sent, received)]


@spmd(meshes=[(2,)])
def test_bad_geometry_raises_the_same_clear_error_on_every_rank(mesh):
    local = torch.zeros(2, 3)
    bounds = ((0, 2), (2, 4))
    with pytest.raises(ValueError, match="edge is 'none'"):
        window_exchange(local, mesh, 0, 0, bounds, ((-1, 3), (1, 5)), "none")
    with pytest.raises(ValueError, match="edge mode 'mirror' is unknown"):
        window_exchange(local, mesh, 0, 0, bounds, bounds, "mirror")
    with pytest.raises(ValueError, match="not contiguous"):
        window_exchange(local, mesh, 0, 0, ((0, 2), (3, 5)), bounds, "zeros")
    with pytest.raises(ValueError, match="has 3 rows on dim 1"):
        window_exchange(local, mesh, 0, 1, bounds, bounds, "zeros")


def test_output_bounds_follow_the_owner_of_each_output_rows_input_row():
    # stride 1, offset 0: the input's shards.
    assert output_bounds(((0, 3), (3, 3), (3, 7)), 7) == ((0, 3), (3, 3), (3, 7))
    # A 'same' convolution keeps uneven shard sizes; a valid one takes a row from each side.
    same = SlidingWindow(3, padding=1)
    assert same.output_bounds(((0, 5), (5, 6), (6, 9)), 9) == ((0, 5), (5, 6), (6, 9))
    valid = SlidingWindow(3)
    assert valid.output_size(9) == 7
    assert valid.output_bounds(((0, 5), (5, 6), (6, 9)), 7) == ((0, 4), (4, 5), (5, 7))
    assert valid.input_windows(((0, 4), (4, 5), (5, 7))) == ((0, 6), (4, 7), (5, 9))
    # Stride 2 halves even shards; an upsampling by 2 (stride 1/2) doubles them.
    assert SlidingWindow(2, 2).output_bounds(((0, 4), (4, 8)), 4) == ((0, 2), (2, 4))
    assert output_bounds(((0, 3), (3, 5)), 10, Fraction(1, 2)) == ((0, 6), (6, 10))
