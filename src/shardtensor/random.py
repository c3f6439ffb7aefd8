"""Random values that do not depend on the mesh: the global tensor is a function of seed and shape.

The global tensor is cut into tiles, boxes of at most `BLOCK_SIZE` elements over every dim
(`tile_shape`); tile `k` (row-major in the grid of tiles) of the random call number `counter` is
filled in row-major order from a `torch.Generator` seeded with a hash of (seed, counter, k). A rank
draws only the tiles its shard overlaps, one at a time, and copies the overlapping part of each into
its shard, so time is linear in the shard whatever dims are sharded (rows, columns, both, uneven)
and memory is the shard plus at most one tile; every mesh shape, placement and rank count (one rank included)
sees the same global tensor. A tensor of at most `BLOCK_SIZE` elements is one tile, and so is drawn
as one `randn(numel)` (or `uniform_`...) of the generator of tile 0, reshaped.

Until 2026-11-26 the tiles were blocks of the flattened tensor: a column shard then drew every block
its rows cross (4x its size on 4 ranks), and CPU generators (mt19937) cannot skip ahead to draw only
part of a block, so tiles over every dim replaced them. Tensors of at most `BLOCK_SIZE` elements
(one tile, one block) and 1-D tensors (tiles of exactly `BLOCK_SIZE`) kept their numbers; larger
tensors of 2 or more dims got new ones.

Semantics: `manual_seed(seed)` sets the seed and resets the counter to 0. Every random call on
DTensors (the `rand`/`randn` factories and random ops such as `uniform_`, `rand_like`,
`bernoulli_`, dropout) takes the next counter value, on every rank of the world (SPMD programs call in
the same order), so call number `counter` after `manual_seed(seed)` always gives the same global
tensor for a given global shape, dtype and distribution. That includes ranks outside the call's mesh:
they reach the op too (it gives them an empty shard) and take its number without drawing
(`skip_random_calls`), so that after dropout on a sub-mesh the next call on any mesh gives every
rank the same numbers. (A counter per mesh would not do: calls on two meshes would repeat each
other's numbers.) A program that calls a random op only on the ranks of its mesh (under
`if mesh.get_coordinate() is not None:`) is not SPMD and leaves the counter out of step. Random ops on
plain tensors use torch's own generator and neither read nor advance this counter.

Activation checkpointing: torch's checkpoints make their recomputation draw what the forward drew by
restoring torch's generators, which hold no part of this counter, so a plain checkpoint would
recompute dropout with another mask and give wrong gradients. Torch's non-reentrant checkpoints (the
composable `checkpoint(module)`, `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`,
`checkpoint_wrapper`) run the forward and each recomputation inside the pair of contexts their documented
`context_fn` argument returns: `context_fn=checkpoint_contexts` replays the counter there. `checkpoint`
(and `checkpoint_sequential`) here take torch's arguments, either `use_reentrant` mode, and replay the
counter with the same contexts. A random call during backward anywhere else raises (`next_random_call`)
instead of drawing numbers the forward did not draw: torch's recomputation is not recognised without
our contexts, since nothing it exposes but private closures tells which region it recomputes. Keeping
the counter where torch's checkpoint would restore it is not sound: on a CPU mesh that is only torch's default
CPU generator, whose mt19937 state has no field to spare, so each call would have to draw from it
(changing the numbers of plain random ops) and look the draw up in a table of past calls that grows
without bound and that `torch.manual_seed` on some ranks and not others would send out of step.

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
import torch.utils.checkpoint

from . import comm
from .mesh import DeviceMesh, world_mesh
from .rank_state import per_rank

__all__ = [
    "BLOCK_SIZE", "FILLS", "checkpoint", "checkpoint_contexts", "checkpoint_sequential", "draws_in_backward",
    "manual_seed", "random_shard", "next_random_call", "same_draws_on_every_rank", "skip_random_calls", "tile_shape",
]

BLOCK_SIZE = 2**16

# The distributions `random_shard` draws: a kind is the name of torch's in-place random method that
# fills a tile (its `parameters` are that method's arguments); "rand" and "randn" are the
# standard uniform and normal.
FILLS = ("uniform_", "normal_", "exponential_", "random_", "log_normal_", "cauchy_", "geometric_")
_ALIASES = {"rand": "uniform_", "randn": "normal_"}

_seed: int | None = None
_counter = 0
_replays = 0  # `checkpoint_contexts` recomputations and `draws_in_backward` blocks running (may draw in backward)
_lock = threading.Lock()  # guards _seed, _counter and _replays


def _restore_rank_state(state: tuple) -> None:
    global _seed, _counter, _replays
    _seed, _counter, _replays = state


per_rank("random", lambda: (_seed, _counter, _replays), _restore_rank_state, lambda: (None, 0, 0))


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


def next_random_call(mesh: DeviceMesh) -> tuple[int, int]:
    """(seed, counter) for the next random call on `mesh`, advancing the counter.

    Without `manual_seed`, the seed is drawn from torch's default generator on global rank 0 and
    shared with every rank of the world at the first random call, which every rank reaches (ranks
    outside `mesh` too): the counter is world-wide, so the seed must be as well. During backward
    (autograd's graph task), only a recomputation replayed by `checkpoint_contexts` may draw: anything
    else is most likely a plain torch checkpoint recomputing, which would draw numbers the forward did not.
    """
    global _seed, _counter
    if not _replays and torch._C._current_graph_task_id() != -1:  # the test FSDP2 uses for "in backward"
        raise _random_in_backward_error()
    if _seed is None:  # a collective, so not under the lock (`launch.simulate`'s ranks share the lock)
        candidate = int(torch.randint(0, 2**62, (), device="cpu").item())  # torch's default CPU generator
        agreed = comm.all_gather_object(candidate, world_mesh(mesh.device_type), None)[0]
        with _lock:
            _seed = agreed if _seed is None else _seed
    with _lock:
        call = (_seed, _counter)
        _counter += 1
    return call


def _random_in_backward_error() -> RuntimeError:
    return RuntimeError(
        "A random op on DTensors (dropout, rand_like, bernoulli_...) ran during backward. This is most "
        "likely the recomputation of an activation checkpoint of torch (torch.distributed._composable."
        "checkpoint(module), torch.utils.checkpoint.checkpoint, checkpoint_wrapper or checkpoint_sequential): it "
        "restores torch's generators but not shardtensor's random counter, so the recomputed forward would "
        "draw other numbers (another dropout mask) than the forward did, and the gradients would be wrong. "
        "Pass context_fn=shardtensor.random.checkpoint_contexts to checkpoint(module, ...), to "
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False) or to checkpoint_wrapper (with a "
        "context_fn of your own: functools.partial(shardtensor.random.checkpoint_contexts, your_context_fn)); "
        "or checkpoint with shardtensor.random.checkpoint(function, *args, use_reentrant=..., ...), which "
        "takes torch's arguments in either use_reentrant mode (with checkpoint_wrapper: "
        "checkpoint_fn=shardtensor.random.checkpoint; for checkpoint_sequential: "
        "shardtensor.random.checkpoint_sequential). "
        "If the draw belongs in backward (noise added to a gradient in a hook), run it inside "
        "shardtensor.random.draws_in_backward()."
    )


class _RegionForward:
    """The forward of one checkpointed region, as a context: notes in `start` the seed and the counter
    the region starts from (the seed its first random call drew, if none was set)."""

    def __init__(self):
        self.start = None

    def __enter__(self):
        with _lock:
            self._entered = (_seed, _counter)

    def __exit__(self, *exception):
        seed, counter = self._entered
        self.start = (_seed if seed is None else seed, counter)


class _RegionRecompute:
    """A recomputation of that region, as a context: runs from the seed and counter its forward started
    from and leaves them as it found them, as `torch.random.fork_rng` does for torch's generators.
    Re-enterable: torch recomputes once per backward through the region."""

    def __init__(self, forward: _RegionForward):
        self.forward = forward

    def __enter__(self):
        global _seed, _counter, _replays
        with _lock:
            self._outer = (_seed, _counter)
            (_seed, _counter), _replays = self.forward.start, _replays + 1

    def __exit__(self, *exception):
        global _seed, _counter, _replays
        with _lock:
            (_seed, _counter), _replays = self._outer, _replays - 1


class _Contexts:
    """Several contexts entered in order as one, re-enterable (a user's `context_fn` pair with ours)."""

    def __init__(self, *contexts):
        self.contexts = contexts

    def __enter__(self):
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self._stack = stack.pop_all()

    def __exit__(self, *exception):
        return self._stack.__exit__(*exception)


def checkpoint_contexts(context_fn=None) -> tuple:
    """A `context_fn` for torch's non-reentrant checkpoints: the (forward, recomputation) contexts that make
    the recomputation draw the random DTensors (dropout masks...) the forward drew. For torch's composable
    `checkpoint(module)` (the one FSDP2 and torchtitan apply per block), `torch.utils.checkpoint.checkpoint`
    with `use_reentrant=False` and `checkpoint_wrapper`, whose recomputation otherwise raises. To keep a
    `context_fn` of your own (selective checkpointing), pass it: its contexts are entered inside ours. A
    selective policy must not save a random op: the recomputation would skip its draw and shift those after
    it, as torch's own selective checkpointing shifts its generators' draws for plain tensors.

    >>> checkpoint(block, context_fn=shardtensor.random.checkpoint_contexts)  # doctest: +SKIP
    >>> selective = functools.partial(create_selective_checkpoint_contexts, policy)  # doctest: +SKIP
    >>> contexts = functools.partial(shardtensor.random.checkpoint_contexts, selective)  # doctest: +SKIP
    >>> checkpoint(block, context_fn=contexts)  # doctest: +SKIP
    """
    forward = _RegionForward()
    recompute = _RegionRecompute(forward)
    if context_fn is None:
        return forward, recompute
    their_forward, their_recompute = context_fn()
    return _Contexts(forward, their_forward), _Contexts(recompute, their_recompute)


class _Replayed:
    """`function` as `checkpoint` hands it to torch: its first call (the forward) runs in the forward
    context of `checkpoint_contexts`, every later call (a recomputation) in the recomputation context."""

    def __init__(self, function):
        self.function, self.ran = function, False
        self.forward, self.recompute = checkpoint_contexts()

    def __call__(self, *args, **kwargs):
        context = self.recompute if self.ran else self.forward
        self.ran = True
        with context:
            return self.function(*args, **kwargs)


@contextlib.contextmanager
def draws_in_backward() -> Iterator[None]:
    """Allow random calls on DTensors during backward in this block: for code that draws there on
    purpose (noise added to gradients in a hook, a custom autograd backward), which `next_random_call`
    otherwise refuses as a likely torch-checkpoint recomputation. The draws take counter values like
    any other random call."""
    global _replays
    with _lock:
        _replays += 1
    try:
        yield
    finally:
        with _lock:
            _replays -= 1


def checkpoint(function, *args, **kwargs):
    """`torch.utils.checkpoint.checkpoint(function, *args, **kwargs)` whose recomputation draws the
    random DTensors (dropout masks...) the forward drew, in either `use_reentrant` mode; the
    recomputation leaves shardtensor's random counter where it was.

    >>> y = shardtensor.random.checkpoint(lambda x: F.dropout(x, 0.1), x, use_reentrant=False)  # doctest: +SKIP
    """
    return torch.utils.checkpoint.checkpoint(_Replayed(function), *args, **kwargs)


def checkpoint_sequential(functions, segments: int, input, use_reentrant: bool | None = None, **kwargs):
    """`torch.utils.checkpoint.checkpoint_sequential` with `checkpoint` above for each segment, so that
    recomputations draw the random DTensors the forward drew. The functions (a `Sequential`'s children,
    or a list of callables) are cut as torch cuts them: `segments - 1` runs of `len // segments`
    functions, each checkpointed, then the rest, run normally (its activations are needed at once)."""
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    if not 1 <= segments <= len(functions):
        raise ValueError(f"checkpoint_sequential: segments must be between 1 and the number of functions "
                         f"({len(functions)}), got {segments}")
    size = len(functions) // segments

    def run(part):
        def forward(value):
            for function in part:
                value = function(value)
            return value
        return forward

    for start in range(0, size * (segments - 1), size):
        input = checkpoint(run(functions[start:start + size]), input, use_reentrant=use_reentrant, **kwargs)
    return run(functions[size * (segments - 1):])(input)


def skip_random_calls(mesh: DeviceMesh, count: int) -> None:
    """On a rank outside `mesh`: take the numbers of the `count` random calls its ranks make for one op,
    drawing nothing, so that the counter stays the same on every rank of the world."""
    for _ in range(count):
        next_random_call(mesh)


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
        torch.manual_seed(_tile_seed(seed, counter, -1))
        yield


def _tile_seed(seed: int, counter: int, tile: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{counter}:{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def tile_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The extent along each dim of the tiles that cut the global tensor of `shape`.

    The whole shape when it has at most `BLOCK_SIZE` elements; else, starting from the whole shape,
    the extent of the dim cut into the fewest tiles (the outermost on a tie) is halved, its first
    cut at the largest power of two below its size, until a tile holds at most `BLOCK_SIZE`
    elements. Every dim is thus cut into about as many tiles as the others, so shards along any dim
    (rows, columns, both) draw little more than themselves; a 1-D tensor gets tiles of exactly
    `BLOCK_SIZE`.

    >>> tile_shape((16384, 4096)), tile_shape((100, 100)), tile_shape((3, 50000))
    ((512, 128), (100, 100), (2, 32768))
    """
    tile = [max(size, 1) for size in shape]
    while math.prod(tile) > BLOCK_SIZE:
        counts = {dim: math.ceil(shape[dim] / tile[dim]) for dim in range(len(tile)) if tile[dim] > 1}
        dim = min(counts, key=counts.get)  # the first (outermost) of the fewest
        tile[dim] = 1 << ((tile[dim] - 1).bit_length() - 1)  # the largest power of two below it
    return tuple(tile)


class _Tiles:
    """The tiles of one random call: tile `index` (row-major in the grid of tiles) is a box of the
    global tensor, filled in row-major order by torch's `method` from a generator seeded with a hash
    of (seed, counter, index)."""

    def __init__(self, method: str, shape: Sequence[int], seed: int, counter: int, dtype: torch.dtype, parameters: tuple):
        self.method, self.shape, self.seed, self.counter = method, tuple(shape), seed, counter
        self.dtype, self.parameters = dtype, parameters
        self.tile = tile_shape(shape)
        self.grid = [math.ceil(size / extent) for size, extent in zip(self.shape, self.tile)]
        # One buffer for every tile, made at the first tile that needs it: an allocation (and its page
        # faults) per tile costs time, and allocators that mmap large blocks would fault a fresh one in
        # each time.
        self._buffer: torch.Tensor | None = None

    def extents(self, position: Sequence[int]) -> list[int]:
        """The extent along each dim of the tile at grid `position`, clipped to the tensor's edges."""
        return [min(extent, size - index * extent) for index, extent, size in zip(position, self.tile, self.shape)]

    def draw(self, position: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """The tile at grid `position`, clipped to the tensor's edges: drawn into `into` (a contiguous
        CPU tensor of the tile's shape) when given, else into the shared buffer (valid until the next draw)."""
        extents = self.extents(position)
        index = 0
        for coordinate, count in zip(position, self.grid):
            index = index * count + coordinate
        generator = torch.Generator().manual_seed(_tile_seed(self.seed, self.counter, index))
        # Drawn on the CPU by a CPU generator whatever the data's device, so that every device gets
        # the same numbers; `_fill_box` copies them into the shard on its device. Always into a 1-D
        # contiguous tensor: torch's CPU kernels draw other numbers into a strided one.
        if into is not None:
            values = into.view(-1)
        else:
            if self._buffer is None:
                self._buffer = torch.empty(math.prod(self.tile), dtype=self.dtype, device="cpu")
            values = self._buffer[: math.prod(extents)]
        return getattr(values, self.method)(*self.parameters, generator=generator).view(extents)


def _fill_box(values: torch.Tensor, tiles: _Tiles, offset: Sequence[int], below: float | None = None) -> None:
    """Write the box `offset + values.shape` of the global tensor into `values` (with `below`: whether
    each value is below it): every tile the box overlaps is drawn once and its overlapping part
    copied into place, so the work is the box plus the tiles cut by its edges. A whole tile that lies
    contiguous in `values` (a CPU shard of a 1-D tensor, a tensor of one tile) is drawn straight into
    it; the others go through one buffer of a tile, so the memory is at most the box plus one tile.
    """
    ranges = []
    for start, length, extent in zip(offset, values.shape, tiles.tile):
        ranges.append(range(start // extent, (start + length - 1) // extent + 1))
    for position in itertools.product(*ranges):
        source, destination = [], []
        for index, extent, start, length in zip(position, tiles.tile, offset, values.shape):
            low, high = max(start, index * extent), min(start + length, (index + 1) * extent)
            source.append(slice(low - index * extent, high - index * extent))
            destination.append(slice(low - start, high - start))
        target = values[tuple(destination)]
        if below is None and _holds_whole_tile(target, tiles.extents(position), tiles.dtype):
            tiles.draw(position, into=target)
            continue
        part = tiles.draw(position)[tuple(source)]
        target.copy_(part if below is None else part.lt(below))


def _holds_whole_tile(target: torch.Tensor, extents: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a tile of `extents` can be drawn straight into `target`: all of it lands there, and
    `target` is contiguous CPU memory of the tile's dtype (as the buffer would be)."""
    return (list(target.shape) == list(extents) and target.dtype == dtype and target.is_contiguous()
            and target.device.type == "cpu")


def random_shard(
    kind: str,
    shape: Sequence[int],
    offset: Sequence[int],
    local_shape: Sequence[int],
    *,
    seed: int,
    counter: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    parameters: tuple = (),
    out: torch.Tensor | None = None,
    below: float | None = None,
) -> torch.Tensor:
    """The box `offset + local_shape` of the global random tensor of `shape`.

    `kind` is "rand", "randn" or a name in `FILLS`, called with `parameters` on each tile
    (`random_shard("uniform_", ..., parameters=(-1.0, 1.0))`). Time is linear in the tiles the box
    overlaps (its size plus the tiles cut by its edges), never in the global size: tiles are drawn
    one at a time and copied into the result, made on `device` (the shard's), or into `out` (a tensor
    of `local_shape`, written in place) so that filling an existing shard needs no second shard. With
    `below`, the result is the bool mask `values < below` (dropout's and bernoulli's keep masks),
    compared tile by tile: the values are drawn in `dtype` as always, but never held for the whole box.

    >>> full = random_shard("rand", (3, 4), (0, 0), (3, 4), seed=0, counter=0, dtype=torch.float32, device="cpu")
    >>> torch.equal(random_shard("rand", (3, 4), (1, 2), (2, 2), seed=0, counter=0,
    ...                          dtype=torch.float32, device="cpu"), full[1:, 2:])
    True
    """
    method = _ALIASES.get(kind, kind)
    if method not in FILLS:
        raise ValueError(f"random_shard kind must be 'rand', 'randn' or one of {FILLS}, got {kind!r}")
    if out is None and device is None:
        raise TypeError("random_shard needs device= (the device of the shard it makes) or out= (a shard to fill)")
    if out is None:
        out = torch.empty(tuple(local_shape), dtype=dtype if below is None else torch.bool, device=device)
    elif tuple(out.shape) != tuple(local_shape):
        raise ValueError(f"random_shard out= has shape {tuple(out.shape)}, but the box has shape {tuple(local_shape)}")
    # torch's own check of the parameters (uniform_(2, 1), exponential_(-1), ...) on an empty tensor: a rank
    # whose box is empty raises as the others do, instead of running on into their next collective.
    getattr(torch.empty(0, dtype=dtype, device=out.device), method)(*parameters)
    if out.numel():
        _fill_box(out, _Tiles(method, shape, seed, counter, dtype, parameters), offset, below)
    return out
