"""Random values that do not depend on the mesh: the global tensor is a function of seed and shape.

The flattened global tensor is cut into blocks of `BLOCK_SIZE` elements; block `k` of the random
call number `counter` comes from a `torch.Generator` seeded with a hash of (seed, counter, k).
A rank generates only the blocks that overlap its shard, one at a time, and copies the part of each
block that its shard holds (time and memory linear in the shard), so every mesh shape, placement and
rank count (one rank included) sees the same global tensor.

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

import contextlib
import hashlib
import itertools
import math
import threading
from collections.abc import Iterator, Sequence

import torch

from . import comm

__all__ = ["BLOCK_SIZE", "FILLS", "manual_seed", "random_shard", "next_random_call", "same_draws_on_every_rank"]

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


@contextlib.contextmanager
def same_draws_on_every_rank(mesh) -> Iterator[None]:
    """Inside the block, torch's default generators (CPU, and the current CUDA device on a CUDA mesh)
    are seeded with the hash of (seed, counter, -1) of the next random call, alike on every rank, and
    restored afterwards: a random op without a rule of its own (poisson, multinomial...), computed whole
    on every rank by the replicate fallback, then draws the same values everywhere, a function of the
    seed and the call number (the op's own `generator=` argument, when given, is used instead)."""
    seed, counter = next_random_call(mesh)
    devices = [torch.cuda.current_device()] if mesh.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_block_seed(seed, counter, -1))
        yield


def _block_seed(seed: int, counter: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{counter}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Blocks:
    """Draws of the flattened global tensor by flat index range, one block at a time.

    Only the most recent block is kept, so ranges that share a block (consecutive chunks of a box)
    draw it once, and memory stays at most two blocks whatever the box size.
    """

    def __init__(self, method: str, total: int, seed: int, counter: int, dtype: torch.dtype, parameters: tuple):
        self.method, self.total, self.seed, self.counter = method, total, seed, counter
        self.dtype, self.parameters = dtype, parameters
        self._last: tuple[int, torch.Tensor] | None = None

    def block(self, index: int) -> torch.Tensor:
        if self._last is None or self._last[0] != index:
            length = min(BLOCK_SIZE, self.total - index * BLOCK_SIZE)
            generator = torch.Generator().manual_seed(_block_seed(self.seed, self.counter, index))
            # Drawn on the CPU by a CPU generator whatever the data's device, so that every device
            # gets the same numbers; `_fill_box` copies them into the shard on its device.
            values = getattr(torch.empty(length, dtype=self.dtype, device="cpu"), self.method)(*self.parameters, generator=generator)
            self._last = (index, values)
        return self._last[1]

    def range(self, start: int, stop: int) -> torch.Tensor:
        """Global flat elements `start:stop` (a view of one block when the range lies in one)."""
        first, last = start // BLOCK_SIZE, (stop - 1) // BLOCK_SIZE
        parts = []
        for index in range(first, last + 1):
            low = max(start - index * BLOCK_SIZE, 0)
            high = min(stop - index * BLOCK_SIZE, BLOCK_SIZE)
            parts.append(self.block(index)[low:high])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fill_box(values: torch.Tensor, blocks: _Blocks, shape: Sequence[int], offset: Sequence[int],
              below: float | None = None) -> None:
    """Write the box `offset + values.shape` of the global tensor into `values`, in O(its size)
    (with `below`: whether each value is below it, chunk by chunk).

    The box is walked in chunks of consecutive indices of one `split` tensor dim (the outermost
    whose rows fit in a block). A chunk is as long as fits in the block where it starts, so most
    chunks are views of one block and only a row crossing a block edge is concatenated: the draws in
    flight never exceed two blocks, and only blocks holding elements of the box are drawn (within a
    chunk, gaps between the box's elements are shorter than a block).
    """
    ndim = len(shape)
    local_shape = tuple(values.shape)
    def write(destination: torch.Tensor, drawn: torch.Tensor) -> None:
        destination.copy_(drawn if below is None else drawn.lt(below))

    if ndim == 0:
        write(values, blocks.range(0, 1).reshape(()))
        return
    strides = _contiguous_strides(shape)
    split = 0
    while split < ndim - 1 and strides[split] > BLOCK_SIZE:
        split += 1
    row = strides[split]
    inner_shape, inner_strides = local_shape[split + 1 :], strides[split + 1 :]
    inner_start = sum(start * stride for start, stride in zip(offset[split + 1 :], inner_strides))
    inner_extent = sum((length - 1) * stride for length, stride in zip(inner_shape, inner_strides)) + 1
    for outer in itertools.product(*(range(length) for length in local_shape[:split])):
        base = sum((start + index) * stride for start, index, stride in zip(offset, outer, strides))
        destination = values[outer] if outer else values
        first = 0
        while first < local_shape[split]:
            start = base + (offset[split] + first) * row + inner_start
            room = (start // BLOCK_SIZE + 1) * BLOCK_SIZE - start
            count = min(local_shape[split] - first, max(1, (room - inner_extent) // row + 1))
            drawn = blocks.range(start, start + (count - 1) * row + inner_extent)
            box = drawn.as_strided((count, *inner_shape), (row, *inner_strides), drawn.storage_offset())
            write(destination[first : first + count], box)
            first += count


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
    out: torch.Tensor | None = None,
    below: float | None = None,
) -> torch.Tensor:
    """The box `offset + local_shape` of the global random tensor of `shape`.

    `kind` is "rand", "randn" or a name in `FILLS`, called with `parameters` on each block
    (`random_shard("uniform_", ..., parameters=(-1.0, 1.0))`). Time and memory are linear in the
    blocks the box touches (its size, for boxes of whole rows), never in the global size: blocks
    are drawn one at a time and copied into the result, or into `out` (a tensor of `local_shape`,
    written in place) so that filling an existing shard needs no second shard. With `below`, the
    result is the bool mask `values < below` (dropout's and bernoulli's keep masks), compared block
    by block: the values are drawn in `dtype` as always, but never held for the whole box.

    >>> full = random_shard("rand", (3, 4), (0, 0), (3, 4), seed=0, counter=0, dtype=torch.float32)
    >>> torch.equal(random_shard("rand", (3, 4), (1, 2), (2, 2), seed=0, counter=0,
    ...                          dtype=torch.float32), full[1:, 2:])
    True
    """
    method = _ALIASES.get(kind, kind)
    if method not in FILLS:
        raise ValueError(f"random_shard kind must be 'rand', 'randn' or one of {FILLS}, got {kind!r}")
    if out is None:
        out = torch.empty(tuple(local_shape), dtype=dtype if below is None else torch.bool, device=device)
    elif tuple(out.shape) != tuple(local_shape):
        raise ValueError(f"random_shard out= has shape {tuple(out.shape)}, but the box has shape {tuple(local_shape)}")
    # torch's own check of the parameters (uniform_(2, 1), exponential_(-1), ...) on an empty tensor: a rank
    # whose box is empty raises as the others do, instead of running on into their next collective.
    getattr(torch.empty(0, dtype=dtype, device=out.device), method)(*parameters)
    if out.numel():
        _fill_box(out, _Blocks(method, math.prod(shape), seed, counter, dtype, parameters), shape, offset, below)
    return out
