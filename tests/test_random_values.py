"""Random values are pinned: every box of every shape equals the documented global tensor, drawn
whole tile by tile by `helpers.documented_random` (not with the library's tile code).

The sha256 prefixes pin the numbers. Those of tensors of at most BLOCK_SIZE elements and of 1-D
tensors were captured before 2026-11-26, when the tiles were blocks of the flattened tensor, and
still hold: such a tensor is one block then and one tile now (1-D: tiles of exactly BLOCK_SIZE).
Those of larger tensors of 2 or more dims were re-pinned on 2026-11-26: with flat blocks a column
shard draws every block its rows cross (4x its size on 4 ranks), and CPU generators (mt19937) cannot
skip ahead to draw part of a block, so random generation in O(shard) needs tiles over every dim.
"""

import hashlib
import math
import random

import pytest
import torch
from helpers import documented_random, documented_tile_shape
from spmd import spmd

import shardtensor
from shardtensor import Replicate, Shard
from shardtensor.random import BLOCK_SIZE, random_shard, tile_shape


def _reference_shard(kind, shape, offset, local_shape, *, seed, counter, dtype, parameters=()):
    full = documented_random(kind, shape, seed=seed, counter=counter, dtype=dtype, parameters=parameters)
    return full[tuple(slice(start, start + length) for start, length in zip(offset, local_shape))]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()[:16]


@pytest.mark.parametrize(
    "kind, shape, offset, local_shape, dtype, parameters, digest",
    [
        # at most BLOCK_SIZE elements, or 1-D: the numbers of the flat blocks, captured before tiles
        ("randn", (3, 5000), (0, 0), (3, 5000), torch.float64, (), "8c9bf8039ab87e4c"),
        ("rand", (256, 256), (0, 100), (256, 50), torch.float32, (), "9ca066b7e210809c"),
        ("random_", (7, 9, 11), (1, 2, 3), (5, 6, 7), torch.int64, (0, 1000), "492dbaded9396631"),
        ("normal_", (BLOCK_SIZE,), (10,), (BLOCK_SIZE - 20,), torch.float32, (1.0, 2.0), "c820c2e836170f04"),
        ("uniform_", (), (), (), torch.float64, (-2.0, 3.0), "a1438fe972148050"),
        ("normal_", (BLOCK_SIZE * 3 + 17,), (BLOCK_SIZE - 5,), (BLOCK_SIZE * 2,), torch.float32, (1.0, 2.0), "dfefd0d9a65fccf9"),
        # more than BLOCK_SIZE elements over 2 or more dims: re-pinned with tiles on 2026-11-26
        ("randn", (3, BLOCK_SIZE // 2 + 5), (0, 0), (3, BLOCK_SIZE // 2 + 5), torch.float64, (), "4c080113ff7d6287"),
        ("rand", (700, 300), (0, 150), (700, 150), torch.float32, (), "511422ceb2d0dc50"),
        ("uniform_", (5, 7, 4000), (2, 3, 100), (3, 4, 2000), torch.float64, (-2.0, 3.0), "295012d3a1939ea4"),
        ("random_", (40, 5000), (10, 0), (20, 5000), torch.int64, (0, 1000), "8883bf4d67f4087e"),
    ],
)
def test_values_are_pinned(kind, shape, offset, local_shape, dtype, parameters, digest):
    values = random_shard(kind, shape, offset, local_shape, seed=1234, counter=7, dtype=dtype, device="cpu", parameters=parameters)
    assert _digest(values) == digest, (kind, shape, offset, local_shape)


@pytest.mark.parametrize(
    "shape, tile",
    [
        ((), ()), ((7,), (7,)), ((256, 256), (256, 256)), ((3, 5000), (3, 5000)),
        ((BLOCK_SIZE * 3 + 17,), (BLOCK_SIZE,)), ((16384, 4096), (512, 128)), ((4096, 4096), (256, 256)),
        ((700, 300), (256, 256)), ((3, 50000), (2, 32768)), ((8, 1024, 1024), (1, 256, 256)),
        ((5, 7, 4000), (4, 4, 4000)), ((1, 2 * BLOCK_SIZE + 1), (1, BLOCK_SIZE)), ((4 * BLOCK_SIZE, 2), (BLOCK_SIZE, 1)),
    ],
    ids=str,
)
def test_tiles_are_the_documented_boxes(shape, tile):
    assert tile_shape(shape) == documented_tile_shape(shape) == tile


_SHAPES = [
    (3, BLOCK_SIZE // 2 + 5), (700, 300), (5, 7, 4000), (BLOCK_SIZE * 3 + 17,), (2, 3, BLOCK_SIZE + 3),
    (1, 2 * BLOCK_SIZE + 1), (3, 2, 2, BLOCK_SIZE // 3), (), (0, 5), (7,), (2 * BLOCK_SIZE,), (1000, 999),
]


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
def test_every_box_equals_the_documented_tensor(shape):
    chooser = random.Random(sum(shape) + len(shape))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(3):
        offset = tuple(chooser.randrange(size) if size else 0 for size in shape)
        boxes.append((offset, tuple(chooser.randrange(size - start + 1) if size else 0 for size, start in zip(shape, offset))))
    for offset, local_shape in boxes:
        for kind, dtype, parameters in [("randn", torch.float32, ()), ("rand", torch.float64, ()),
                                        ("random_", torch.int64, (0, 100)), ("normal_", torch.bfloat16, (1.0, 2.0))]:
            expected = _reference_shard(kind, shape, offset, local_shape, seed=3, counter=1, dtype=dtype, parameters=parameters)
            values = random_shard(kind, shape, offset, local_shape, seed=3, counter=1, dtype=dtype, device="cpu", parameters=parameters)
            assert torch.equal(values, expected), f"{kind} {dtype}: shape {shape}, box offset {offset} size {local_shape}"


def test_out_is_written_in_place_even_when_not_contiguous():
    shape = (6, BLOCK_SIZE // 4)
    expected = _reference_shard("randn", shape, (0, 0), shape, seed=9, counter=0, dtype=torch.float32)
    out = torch.empty(shape[::-1]).t()
    assert random_shard("randn", shape, (0, 0), shape, seed=9, counter=0, dtype=torch.float32, out=out) is out
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="out= has shape"):
        random_shard("randn", shape, (0, 0), shape, seed=9, counter=0, dtype=torch.float32, out=torch.empty(3))
    with pytest.raises(TypeError, match="needs device="):  # a shard is made on the device its caller names
        random_shard("randn", shape, (0, 0), shape, seed=9, counter=0, dtype=torch.float32)


def _layouts(mesh):
    if mesh.ndim == 1:
        return [[Shard(0)], [Shard(1)], [Replicate()]]
    return [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)]]


@spmd(meshes=[(1,), (2,), (4,), (2, 2)])
def test_factories_and_in_place_fills_give_the_documented_tensor_on_every_layout(mesh):
    shape = (9, BLOCK_SIZE // 8 + 3)  # tiles of 8 x 4096: every layout cuts some
    for placements in _layouts(mesh):
        for counter, (make, kind, parameters) in enumerate([
            (lambda: shardtensor.randn(*shape, device_mesh=mesh, placements=placements), "randn", ()),
            (lambda: shardtensor.rand(*shape, device_mesh=mesh, placements=placements), "rand", ()),
            (lambda: shardtensor.empty(*shape, device_mesh=mesh, placements=placements).normal_(2.0, 3.0), "normal_", (2.0, 3.0)),
            (lambda: shardtensor.empty(*shape, device_mesh=mesh, placements=placements).uniform_(-1.0, 1.0), "uniform_", (-1.0, 1.0)),
        ]):
            shardtensor.manual_seed(21)
            shardtensor.random._counter = counter
            expected = documented_random(kind, shape, seed=21, counter=counter, dtype=torch.float32, parameters=parameters)
            assert torch.equal(make().full_tensor(), expected), f"{kind} on mesh {tuple(mesh.shape)} {placements}"


@pytest.mark.parametrize(
    "offset, local_shape, tiles",
    [
        ((256, 0), (256, 1024), [4, 5, 6, 7]),  # rows 256:512, a row shard of 4 ranks
        ((0, 300), (1024, 200), [1, 5, 9, 13]),  # columns 300:500 lie in tile column 1
        ((0, 256), (1024, 256), [1, 5, 9, 13]),  # a column shard of 4 ranks
        ((100, 300), (200, 300), [1, 2, 5, 6]),  # rows 100:300 and columns 300:600
    ],
)
def test_a_box_draws_each_tile_it_overlaps_once_and_no_other(monkeypatch, offset, local_shape, tiles):
    """Work is linear in the box: it draws exactly the tiles (256 x 256, a grid of 4 x 4 on a
    1024 x 1024 tensor) that hold its elements, each once, whatever dims it cuts."""
    from shardtensor import random as random_module

    drawn = []
    original = random_module._tile_seed
    monkeypatch.setattr(random_module, "_tile_seed", lambda seed, counter, tile: drawn.append(tile) or original(seed, counter, tile))
    random_shard("randn", (1024, 1024), offset, local_shape, seed=0, counter=0, dtype=torch.float32, device="cpu")
    assert drawn == tiles


def _peak_allocated_bytes(function) -> int:
    """Peak bytes `function()` holds allocated at once beyond what was live before, on this thread's
    CPU allocator: the running total of torch's profiler allocation events (not the resident set, which
    counts only the pages written)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    stack, allocations = list(profiler.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    if not allocations:
        return 0
    allocations.sort()
    before = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - before


def test_filling_a_shard_in_place_holds_at_most_one_tile_more():
    """A whole tile lying contiguous in the shard is drawn straight into it (a 1-D shard of whole
    tiles, a tensor of one tile): no memory beyond the shard. Tiles cut by the box or strided in it go
    through one tile's buffer: the shard plus one tile at most (random numbers as pinned above)."""
    tile_bytes = BLOCK_SIZE * 4
    cases = [  # (shape, offset, local shape, extra bytes allowed)
        ((4 * BLOCK_SIZE,), (BLOCK_SIZE,), (2 * BLOCK_SIZE,), 0),  # two whole tiles
        ((100, 300), (0, 0), (100, 300), 0),  # one tile: a replicated small tensor
        ((1024, 1024), (256, 0), (256, 1024), tile_bytes),  # tiles of 256 x 256, strided in the rows
        ((4 * BLOCK_SIZE,), (BLOCK_SIZE - 5,), (2 * BLOCK_SIZE,), tile_bytes),  # edges cut two tiles
    ]
    for shape, offset, local_shape, allowed in cases:
        out = torch.empty(local_shape)
        peak = _peak_allocated_bytes(lambda: random_shard("normal_", shape, offset, local_shape, seed=5, counter=2,
                                                          dtype=torch.float32, out=out, parameters=(0.0, 1.0)))
        assert peak <= allowed, (shape, offset, local_shape, peak)
        expected = _reference_shard("normal_", shape, offset, local_shape, seed=5, counter=2, dtype=torch.float32,
                                    parameters=(0.0, 1.0))
        assert torch.equal(out, expected), (shape, offset, local_shape)


@spmd(meshes=[(4,), (2, 2)])
def test_empty_normal_on_a_sharded_dtensor_peaks_at_its_shard(mesh):
    """`empty(...).normal_()`: the shard and nothing else when its tiles lie whole in it (a 1-D
    tensor of one tile per rank), like torch's own normal_ of the shard; the shard plus one tile else
    (256 KiB: 1.25x a 1 MiB shard), on a 2-D mesh too (rows and columns sharded)."""
    cases = {
        1: [((4 * BLOCK_SIZE,), [Shard(0)], 1.0), ((1024, 1024), [Shard(0)], 1.25)],
        2: [((4 * BLOCK_SIZE,), [Shard(0), Shard(0)], 1.0), ((1024, 1024), [Shard(0), Shard(1)], 1.25)],
    }
    for shape, placements, ratio in cases[mesh.ndim]:
        shardtensor.empty(*shape, device_mesh=mesh, placements=placements).normal_()  # decided and cached
        shard_bytes = math.prod(shape) // 4 * 4
        peak = _peak_allocated_bytes(lambda: shardtensor.empty(*shape, device_mesh=mesh, placements=placements).normal_())
        assert peak <= ratio * shard_bytes * 1.01, (shape, peak / shard_bytes)
