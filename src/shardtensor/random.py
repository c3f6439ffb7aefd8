"""Random values that do not depend on the mesh: the global tensor is a function of seed and shape.

The flattened global tensor is cut into blocks of `BLOCK_SIZE` elements; block `k` of the random
call number `counter` comes from a `torch.Generator` seeded with a hash of (seed, counter, k).
A rank generates only the blocks that overlap its shard and keeps the elements it holds, so every
mesh shape, placement and rank count (one rank included) sees the same global tensor.
The counter advances by one per call on every rank (SPMD programs call in the same order).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from . import comm

__all__ = ["BLOCK_SIZE", "manual_seed", "random_shard", "next_random_call"]

BLOCK_SIZE = 2**16

_seed: int | None = None
_counter = 0


def manual_seed(seed: int) -> None:
    """Seed shardtensor's random factories; every rank must pass the same value.

    >>> shardtensor.manual_seed(0)  # doctest: +SKIP
    >>> a = shardtensor.rand(4, 4, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    """
    global _seed, _counter
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"manual_seed takes an int, got {seed!r} ({type(seed).__name__})")
    _seed, _counter = seed, 0


def next_random_call(mesh) -> tuple[int, int]:
    """(seed, counter) for the next random call, advancing the counter.

    Without `manual_seed`, the seed is drawn from torch's default generator on mesh coordinate 0
    and shared with every rank of the mesh once.
    """
    global _seed, _counter
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
) -> torch.Tensor:
    """The box `offset + local_shape` of the global random tensor of `shape` ("rand" or "randn").

    >>> full = random_shard("rand", (3, 4), (0, 0), (3, 4), seed=0, counter=0, dtype=torch.float32)
    >>> torch.equal(random_shard("rand", (3, 4), (1, 2), (2, 2), seed=0, counter=0,
    ...                          dtype=torch.float32), full[1:, 2:])
    True
    """
    if kind not in ("rand", "randn"):
        raise ValueError(f"random_shard kind must be 'rand' or 'randn', got {kind!r}")
    generate = torch.rand if kind == "rand" else torch.randn
    total = math.prod(shape)
    index = _flat_indices(shape, offset, local_shape)
    values = torch.empty(index.numel(), dtype=dtype)
    if index.numel():
        blocks = index // BLOCK_SIZE
        for block in torch.unique(blocks).tolist():
            length = min(BLOCK_SIZE, total - block * BLOCK_SIZE)
            generator = torch.Generator().manual_seed(_block_seed(seed, counter, block))
            generated = generate(length, generator=generator, dtype=dtype)
            mask = blocks == block
            values[mask] = generated[index[mask] - block * BLOCK_SIZE]
    return values.reshape(tuple(local_shape)).to(device)
