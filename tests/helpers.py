"""Test helpers shared by the test files: exact global tensors, one rank's piece of them, and Partial
DTensors with their single-device values, the exact records of index and value agreements, and random tensors
by the documented rule.

`local_piece` is computed with `torch.chunk` only (not with the library's `Layout`), and
`partial_and_value` and `partial_of` combine the ranks' operands with plain torch (not with the library's reduction),
and `documented_random` draws the global tensor by the rule `shardtensor.random` documents (not
with its `random_shard`), so a test that compares with them checks the library against an
independent expectation.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import math
import os

import torch

from shardtensor import DTensor, comm
from shardtensor.layout import Layout
from shardtensor.placement import Partial, Shard
from shardtensor.random import BLOCK_SIZE

# The installed torch's (major, minor): tests whose expectation follows a torch version compare with it.
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])

# How plain torch combines the operands of a Partial(reduce_op), stacked along dim 0.
_COMBINE = {
    "sum": lambda stacked: stacked.sum(0),
    "avg": lambda stacked: stacked.mean(0),
    "max": lambda stacked: stacked.amax(0),
    "min": lambda stacked: stacked.amin(0),
}


def exact_full(shape, seed: int = 0, *, dtype=torch.float64) -> torch.Tensor:
    """The same global tensor on every rank: small integers, so sums and products stay exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, tuple(shape), generator=generator).to(dtype)


def local_piece(full: torch.Tensor, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The piece of `full` a rank at `coordinate` holds under `placements` (default shard order).

    A tensor dim sharded over several mesh dims is chunked by the lowest mesh dim first, then each
    piece by the next one (nested shards), as `torch.chunk` does; missing chunks are empty.
    """
    piece = full
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % full.ndim
        chunks = torch.chunk(piece, mesh_shape[mesh_dim], dim) if piece.size(dim) else ()
        index = coordinate[mesh_dim]
        piece = chunks[index] if index < len(chunks) else piece.narrow(dim, piece.size(dim), 0)
    return piece


def layout_box(full: torch.Tensor, layout, coordinate) -> torch.Tensor:
    """The box of `full` that `layout` (a shardtensor Layout, any shard sizes) gives `coordinate`:
    a view narrowed to the layout's offset and local shape."""
    local = full
    for dim, (start, length) in enumerate(zip(layout.local_offset(coordinate), layout.local_shape(coordinate))):
        local = local.narrow(dim, start, length)
    return local


def seeded_randn(shape, seed: int) -> torch.Tensor:
    """A float64 tensor of standard normal values from its own seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def sharded_leaf(full: torch.Tensor, mesh, placements, shard_sizes=None):
    """A DTensor of `full` with exact (possibly uneven) shard sizes `{mesh_dim: sizes}`, differentiable
    back to a per-rank leaf and keeping its own gradient (`retain_grad`)."""
    layout = Layout.create(mesh.shape, placements, full.shape, shard_sizes=shard_sizes)
    local = layout_box(full, layout, mesh.get_coordinate()).clone().requires_grad_()
    dtensor = DTensor.from_local(local, mesh, placements, shape=full.shape, shard_sizes=shard_sizes)
    dtensor.retain_grad()
    return dtensor


def partial_and_value(mesh, shape, reduce_op: str | tuple[str, ...] = "sum", *, seed: int = 0, dtype=torch.float64):
    """A DTensor Partial(reduce_op) on every mesh dim (or one reduce op per mesh dim), rank r holding
    `randn(shape)` seeded `seed + r`, and its single-device value: every rank's operand combined by
    plain torch, not by the library, mesh dim by mesh dim from the last."""
    reduce_ops = (reduce_op,) * mesh.ndim if isinstance(reduce_op, str) else tuple(reduce_op)
    ranks = mesh.mesh.flatten().tolist()
    operands = [torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed + rank), dtype=dtype)
                for rank in ranks]
    value = torch.stack(operands).reshape(*mesh.mesh.shape, *shape)
    for mesh_dim in reversed(range(mesh.ndim)):
        value = _COMBINE[reduce_ops[mesh_dim]](value.movedim(mesh_dim, 0))
    local = operands[ranks.index(mesh.get_rank())]
    return DTensor.from_local(local, mesh, [Partial(op) for op in reduce_ops]), value


def partial_of(full: torch.Tensor, mesh, *, seed: int = 0):
    """A DTensor Partial(sum) on every mesh dim whose single-device value is `full`: every rank of `mesh`
    but the first holds random noise, the first holds `full` minus the others' noise (plain torch), so
    the operands differ on every rank and a wrong reduction shows."""
    ranks = mesh.mesh.flatten().tolist()
    noise = {rank: torch.randn(full.shape, generator=torch.Generator().manual_seed(seed + rank), dtype=full.dtype)
             for rank in ranks[1:]}
    rank = mesh.get_rank()
    local = noise[rank] if rank in noise else full - sum(noise.values(), torch.zeros_like(full))
    return DTensor.from_local(local, mesh, [Partial()] * mesh.ndim)

_torch_meshes: dict = {}


def counting_dispatch(monkeypatch) -> list:
    """The aten ops that reach `DTensor.__torch_dispatch__` while `monkeypatch` holds (the function fast
    path of `torch_function` skips it): a list that fills as they come."""
    calls = []
    original = DTensor.__torch_dispatch__

    def counting(cls, op, types, args=(), kwargs=None):
        calls.append(op)
        return original(op, types, args, kwargs)

    monkeypatch.setattr(DTensor, "__torch_dispatch__", classmethod(counting))
    return calls


def torch_mesh(mesh):
    """torch's own DeviceMesh over the ranks of `mesh` (made once per worker and mesh), for tests that
    run the same program on torch DTensor as an oracle of values and collective counts."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    key = tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())
    if key not in _torch_meshes:
        _torch_meshes[key] = TorchDeviceMesh("cpu", mesh.mesh)
    return _torch_meshes[key]


def torch_collectives(function):
    """(function(), how many collectives torch DTensor issued in it, by its own CommDebugMode)."""
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    with TorchCommDebugMode() as mode:
        result = function()
    return result, mode.get_total_counts()


def collective_kinds(mode) -> dict[str, int]:
    """The collectives either library's CommDebugMode counted, by our kind (`all_reduce`, `all_gather`,
    `all_to_all`, ...): torch's keys are its functional ops, read by their c10d names."""
    from shardtensor.debug.tracing_table import C10D_NAMES

    kind_of_c10d = {c10d: kind for kind, c10d in C10D_NAMES.items()}
    kinds: dict[str, int] = {}
    for key, count in mode.get_comm_counts().items():
        if count:
            kind = key if isinstance(key, str) else kind_of_c10d[str(key).split(".")[-1].rstrip("_")]
            kinds[kind] = kinds.get(kind, 0) + count
    return kinds


def all_reduce_records(mesh, nbytes: int, mesh_dims=None) -> list:
    """The record of one ring all_reduce of `nbytes` bytes over `mesh_dims` (default: every mesh dim, in
    one collective), or nothing on a one-rank group."""
    mesh_dims = tuple(range(mesh.ndim)) if mesh_dims is None else tuple(mesh_dims)
    group_size = math.prod(mesh.shape[mesh_dim] for mesh_dim in mesh_dims)
    if group_size == 1:
        return []
    traffic = 2 * (group_size - 1) * nbytes // group_size
    mesh_dim = mesh_dims if len(mesh_dims) > 1 else mesh_dims[0]
    return [comm.CommRecord("all_reduce", mesh_dim, group_size, traffic, traffic)]


def _agreement(mesh, mesh_dims, int64s: int) -> list:
    """The record of one all_reduce(max) of `int64s` int64 values over `mesh_dims` (default: every mesh dim)."""
    return all_reduce_records(mesh, 8 * int64s, mesh_dims)


def index_agreement(mesh, mesh_dims=None, *, index_tensors: int = 1) -> list:
    """The records of one index agreement (ops/index_checks.py) over `mesh_dims` (default: every mesh dim):
    one all_reduce(max) of two int64 per index tensor. Tests that claim "no data moved" compare the
    records with this exactly, so any other collective shows."""
    return _agreement(mesh, mesh_dims, 2 * index_tensors)


def value_agreement(mesh, mesh_dims=None, *, checked: int = 1) -> list:
    """The records of one value agreement (ops/value_checks.py): one all_reduce(max) of one int64 flag
    per checked argument over `mesh_dims` (default: every mesh dim)."""
    return _agreement(mesh, mesh_dims, checked)


_RANDOM_METHODS = {"rand": "uniform_", "randn": "normal_"}


def documented_tile_shape(shape) -> tuple[int, ...]:
    """The tile extents `shardtensor.random` documents: the whole shape up to BLOCK_SIZE elements;
    above, the extent of the dim with the fewest tiles (outermost on a tie) is halved, first to the
    largest power of two below the dim's size, until a tile holds at most BLOCK_SIZE elements."""
    tile = [max(size, 1) for size in shape]
    while math.prod(tile) > BLOCK_SIZE:
        counts = [math.ceil(size / extent) if extent > 1 else math.inf for size, extent in zip(shape, tile)]
        dim = counts.index(min(counts))
        power = 1
        while power * 2 < tile[dim]:
            power *= 2
        tile[dim] = power
    return tuple(tile)


def documented_random(kind: str, shape, *, seed: int, counter: int, dtype=torch.float64, parameters=()) -> torch.Tensor:
    """The global tensor of random call `counter` after `manual_seed(seed)`, as `shardtensor.random`
    documents it, drawn whole tile by tile: tile k (row-major in the grid of tiles of
    `documented_tile_shape`, clipped at the edges) filled in row-major order by torch's `kind`
    method (rand/randn: uniform_/normal_) from a generator seeded with the first 8 bytes
    (little-endian, 63 bits) of blake2b("seed:counter:k")."""
    full = torch.empty(tuple(shape), dtype=dtype)
    tile = documented_tile_shape(shape)
    grid = [range(0, size, extent) for size, extent in zip(shape, tile)]
    for index, starts in enumerate(itertools.product(*grid)):
        box = tuple(slice(start, min(start + extent, size)) for start, extent, size in zip(starts, tile, shape))
        digest = hashlib.blake2b(f"{seed}:{counter}:{index}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        method = _RANDOM_METHODS.get(kind, kind)
        values = getattr(torch.empty(full[box].numel(), dtype=dtype), method)(*parameters, generator=generator)
        full[box] = values.reshape(full[box].shape)
    return full


def with_fallback_draws(function, *, seed: int, counter: int):
    """`function()` on one device with torch's generator seeded as the replicate fallback seeds it for
    random call `counter` after `manual_seed(seed)` (`random.same_draws_on_every_rank` documents it:
    blake2b("seed:counter:-1"), 63 bits), then restored."""
    digest = hashlib.blake2b(f"{seed}:{counter}:-1".encode(), digest_size=8).digest()
    generator_state = torch.get_rng_state()
    torch.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    try:
        return function()
    finally:
        torch.set_rng_state(generator_state)


# Flags of a demo run that takes a few seconds (with --data of a small text).
SMALL_DEMO_FLAGS = ["--steps", "3", "--layers", "1", "--width", "16", "--heads", "2", "--batch-size", "4",
                    "--block-size", "16", "--sample-length", "8"]


def gloo_worker_threads() -> int:
    """How many gloo worker threads this process runs (c10d names them `pt_gloo_runloop`; Linux only).

    Each live gloo process group has its own; c10d's destroy_process_group does not stop them, only
    freeing the group does. One still running while Python finalizes can abort the process.
    """
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as name:
                count += name.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def exit_3_if_gloo_workers_outlive_the_library() -> None:
    """In a program run by a test: at exit, after the library's exit handler, exit with code 3 when a
    gloo worker thread is still running (the cause of the abort at finalization, checked without its race).

    Call it before the library registers its handler (before building a mesh): atexit runs handlers
    last-in first-out, so this check runs after `process_groups.release_process_groups`.
    """

    def check() -> None:
        left = gloo_worker_threads()
        if left:
            print(f"rank {os.environ.get('RANK')}: {left} gloo worker threads outlived the library's exit handler", flush=True)
            os._exit(3)

    atexit.register(check)
