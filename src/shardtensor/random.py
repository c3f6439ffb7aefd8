"""Random values that do not depend on the mesh: the global tensor is a function of seed and shape.

The flattened global tensor is cut into blocks of `BLOCK_SIZE` elements; block `k` of the random
call number `counter` comes from a `torch.Generator` seeded with a hash of (seed, counter, k).
A rank generates only the blocks that overlap its shard and keeps the elements it holds, so every
mesh shape, placement and rank count (one rank included) sees the same global tensor.

Semantics: `manual_seed(seed)` sets the seed and resets the counter to 0. Every random call on
DTensors (the `rand`/`randn` factories and random ops such as `uniform_`, `rand_like`,
`bernoulli_`, dropout) takes the next counter value, on every rank (SPMD programs call in the
same order), so call number `counter` after `manual_seed(seed)` always gives the same global
tensor for a given global shape, dtype and distribution. Random ops on plain tensors use torch's
own generator and neither read nor advance this counter.

Thread policy: the seed and the counter are process-wide and a lock makes each random call take a
distinct counter value. Calls from several threads take values in the order they reach the lock, so
a program that draws random DTensors from several threads must order those calls alike on every rank.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Sequence

import torch

from . import comm

__all__ = ["BLOCK_SIZE", "FILLS", "manual_seed", "random_shard", "next_random_call"]

BLOCK_SIZE = 2**16

# The distributions `random_shard` draws: a kind is the name of torch's in-place random method that
# fills a block (its `parameters` are that method's arguments); "rand" and "randn" are the
# standard uniform and normal.
FILLS = ("uniform_", "normal_", "exponential_", "random_", "log_normal_", "cauchy_", "geometric_")
_ALIASES = {"rand": "uniform_", "randn": "normal_"}

_seed: int | None = None
_counter = 0
_lock = threading.Lock()  # guards _seed and _counter


def manual_seed(seed: int) -> None:
    """Seed shardtensor's random factories; every rank must pass the same value.

    >>> shardtensor.manual_seed(0)  # doctest: +SKIP
    >>> a = shardtensor.rand(4, 4, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    global _seed, _counter
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"manual_seed takes an int, got {seed!r} ({type(seed).__name__})")
    with _lock:
        _seed, _counter = seed, 0


def next_random_call(mesh) -> tuple[int, int]:
    """(seed, counter) for the next random call, advancing the counter.

    Without `manual_seed`, the seed is drawn from torch's default generator on mesh coordinate 0
    and shared with every rank of the mesh once.
    """
    global _seed, _counter
    with _lock:
        if _seed is None:
            candidate = int(torch.randint(0, 2**62, ()).item())
            _seed = comm.all_gather_object(candidate, mesh, None)[0]
        call = (_seed, _counter)
        _counter += 1
    return call


def _block_seed(seed: int, counter: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{counter}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _flat_indices(shape: Sequence[int], offset: Sequence[int], local_shape: Sequence[int]) -> torch.Tensor:
    """Row-major global indices of the elements of the box `offset + local_shape`, in local order."""
    index = torch.zeros((), dtype=torch.int64)
    step = math.prod(shape)
    for size, start, length in zip(shape, offset, local_shape):
        step //= max(size, 1)
        index = index.unsqueeze(-1) + torch.arange(start, start + length, dtype=torch.int64) * step
    return index.reshape(-1)


def random_shard(
    kind: str,
    shape: Sequence[int],
    offset: Sequence[int],
    local_shape: Sequence[int],
    *,
    seed: int,
    counter: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    parameters: tuple = (),
) -> torch.Tensor:
    """The box `offset + local_shape` of the global random tensor of `shape`.

    `kind` is "rand", "randn" or a name in `FILLS`, called with `parameters` on each block
    (`random_shard("uniform_", ..., parameters=(-1.0, 1.0))`).

    >>> full = random_shard("rand", (3, 4), (0, 0), (3, 4), seed=0, counter=0, dtype=torch.float32)
    >>> torch.equal(random_shard("rand", (3, 4), (1, 2), (2, 2), seed=0, counter=0,
    ...                          dtype=torch.float32), full[1:, 2:])
    True
    """
    method = _ALIASES.get(kind, kind)
    if method not in FILLS:
        raise ValueError(f"random_shard kind must be 'rand', 'randn' or one of {FILLS}, got {kind!r}")
    total = math.prod(shape)
    index = _flat_indices(shape, offset, local_shape)
    values = torch.empty(index.numel(), dtype=dtype)
    if index.numel():
        blocks = index // BLOCK_SIZE
        for block in torch.unique(blocks).tolist():
            length = min(BLOCK_SIZE, total - block * BLOCK_SIZE)
            generator = torch.Generator().manual_seed(_block_seed(seed, counter, block))
            generated = getattr(torch.empty(length, dtype=dtype), method)(*parameters, generator=generator)
            mask = blocks == block
            values[mask] = generated[index[mask] - block * BLOCK_SIZE]
    return values.reshape(tuple(local_shape)).to(device)
