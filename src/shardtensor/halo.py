"""Halo exchange: each rank gets the global rows of a sharded dim that its local computation needs.

Every rank knows every coordinate's shard bounds along a sharded dim (the layout holds exact shard
sizes) and every op's geometry is global, so every rank can compute every coordinate's *window*:
the global rows `[start, stop)` it needs, which may start below 0 or end past the dim's size N and
may span several shards (a shard thinner than the halo takes rows from a neighbour's neighbour).
Rows outside `[0, N)` are filled by the `edge` mode: "zeros", "reflect" (mirror without repeating
the edge row, as `F.pad`), "replicate" (the edge row), "circular" (wrapping across the first and
last shard) or "none" (such rows are an error); a number fills them with that constant (zeros is
0.0; max pooling's padding is `float("-inf")`).

`window_exchange` moves exactly the rows each pair needs with one batched point-to-point
(`comm.batch_p2p`), only between pairs with rows to move; a rank's own rows never travel. Each
owner sends the distinct rows a peer needs once (a replicated edge row used three times travels
once). `window_gradient` is its adjoint: the same pairs reversed, each owner adding the gradients
of its rows (a reflected, replicated or wrapped row lands on the row it came from; zero-filled
rows are dropped). `Exchange` bundles one dim's geometry; `exchange`/`exchange_gradient` run several
in sequence (two spatial dims on two mesh dims: the second on the widened tensor, so corners come
for free; the adjoint in reverse order); `differentiable_exchange` is the autograd Function.

An op whose backward reads the same window (a convolution's) exchanges with `keep=True`: the rows
received are remembered with the shard (weakly: they go when it goes; the halo only, not the
window), and the backward's `exchange(..., reuse=True)` rebuilds the window from the unchanged
shard and those rows without communicating. Reuse depends only on the shard's lifetime and version
counter, which SPMD programs change alike on every rank, so the ranks agree on it (a shard written
through `to_local()` on some ranks only between forward and backward would not).

Output ownership, shared by every spatially sharded op (`output_bounds`): output row o belongs to
the coordinate that owns input row `clamp(o * stride + offset, 0, N - 1)`. A sliding window
(`SlidingWindow`: convolution, pooling) uses the centre of its receptive field,
`offset = dilation * (kernel_size - 1) // 2 - padding`: a stride-1 'same' convolution keeps the
input's shard sizes (uneven in, uneven out), and a valid one takes its halo from both sides.

A rule's local op evaluated on meta tensors (mesh None: the engine learning output shard sizes)
must not communicate: it builds its window with `exchange_shape` instead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .layout import Layout
from .mesh import DeviceMesh

__all__ = [
    "EDGE_MODES", "Edge", "Bounds", "output_bounds", "shard_bounds", "SlidingWindow", "Exchange",
    "window_exchange", "window_gradient", "exchange", "exchange_gradient", "differentiable_exchange",
    "exchange_shape", "WindowExchange", "exchanged_bytes",
]

EDGE_MODES = ("zeros", "reflect", "replicate", "circular", "none")

# (start, stop) of global rows per coordinate along the exchanging mesh dims, in coordinate order.
Bounds = tuple[tuple[int, int], ...]
# How rows outside [0, N) are filled: a name of EDGE_MODES, or a number (a constant).
Edge = str | float
# One mesh dim, or a tuple of them: the flattened peers, row-major in the order given (a tensor
# dim's shard order: its piece index).
MeshDims = int | str | tuple[int | str, ...]


def _halo_error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"halo exchange: {problem}; {allowed}")


# ---- geometry ---------------------------------------------------------------------------------------


def shard_bounds(layout: Layout, dim: int) -> Bounds:
    """The global rows `(start, stop)` of each piece of tensor dim `dim`, in piece order: the piece
    index is the flattened coordinate over `layout.shard_order[dim]` (its exchange's mesh dims)."""
    bounds, start = [], 0
    for size in layout.pieces[dim]:
        bounds.append((start, start + size))
        start += size
    return tuple(bounds)


def output_bounds(shard_bounds: Bounds, output_size: int, stride: int | Fraction = 1, offset: int = 0) -> Bounds:
    """The output rows `(start, stop)` each coordinate owns: output row o belongs to the coordinate
    that owns input row `clamp(o * stride + offset, 0, N - 1)`.

    `stride` may be a `fractions.Fraction` (an upsampling op maps output row o to input row
    `o * in / out`). Owners are monotone in o, so each coordinate gets a contiguous run, empty for
    an empty shard; with `stride=1, offset=0` the output rows equal the input rows.

    >>> output_bounds(((0, 3), (3, 5)), 5)  # stride 1: the output keeps the input's shards
    ((0, 3), (3, 5))
    """
    stride = Fraction(stride)
    if stride <= 0:
        raise _halo_error(f"output_bounds got stride {stride}", "give a positive stride")
    input_size = max((stop for _, stop in shard_bounds), default=0)

    def outputs_below(row: int) -> int:  # how many output rows map to input rows < `row`
        if row <= 0:
            return 0
        if row >= input_size:
            return output_size
        return min(output_size, max(0, math.ceil((row - offset) / stride)))

    return tuple((outputs_below(start), outputs_below(stop)) for start, stop in shard_bounds)


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """The geometry of a sliding window along one dim (a convolution's or a pooling's kernel):
    output row o reads input rows `o * stride - padding + dilation * j` for j in range(kernel_size)."""

    kernel_size: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    @property
    def span(self) -> int:
        """Input rows one output row reads, first to last."""
        return self.dilation * (self.kernel_size - 1) + 1

    @property
    def offset(self) -> int:
        """Output row o belongs to the owner of input row `o * stride + offset`: its window's centre."""
        return self.dilation * (self.kernel_size - 1) // 2 - self.padding

    def output_size(self, input_size: int, padding_after: int | None = None) -> int:
        """Output rows for `input_size` input rows (`padding_after`: the padding past the end, default `padding`)."""
        after = self.padding if padding_after is None else padding_after
        return max(0, (input_size + self.padding + after - self.span) // self.stride + 1)

    def output_bounds(self, shard_bounds: Bounds, output_size: int) -> Bounds:
        return output_bounds(shard_bounds, output_size, self.stride, self.offset)

    def input_windows(self, output_bounds: Bounds) -> Bounds:
        """The input rows each coordinate needs for its output rows (empty for no output rows)."""
        windows = []
        for start, stop in output_bounds:
            first = start * self.stride - self.padding
            last = first + (stop - 1 - start) * self.stride + self.span if stop > start else first
            windows.append((first, last))
        return tuple(windows)


# ---- the exchange plan ------------------------------------------------------------------------------


def _is_constant(edge) -> bool:
    """Rows outside are a constant: "zeros" or a number."""
    return edge == "zeros" or (isinstance(edge, (int, float)) and not isinstance(edge, bool))


def _fill_value(edge) -> float:
    return 0.0 if edge == "zeros" else float(edge)


def _source_row(row: int, size: int, edge: Edge) -> int | None:
    """The global row that fills window row `row` of a dim of `size` rows (None: a constant row)."""
    if 0 <= row < size:
        return row
    if _is_constant(edge):
        return None
    if edge == "replicate":
        return min(max(row, 0), size - 1)
    if edge == "circular":
        return row % size
    period = 2 * (size - 1)  # reflect: ... 2 1 [0 1 2 ... N-1] N-2 ...
    if period == 0:
        return 0
    folded = row % period
    return folded if folded < size else period - folded


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive window rows taken from one source: `source` -1 is the constant, 0 the local shard,
    i > 0 the i-th received buffer; rows `start, start + step, ...` (`step` 1, -1 or 0)."""

    source: int
    start: int
    length: int
    step: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one coordinate does in an exchange: the local rows it sends to each peer (sorted,
    distinct), the rows it receives from each peer, and how its window is assembled."""

    sends: tuple[tuple[int, tuple[int, ...]], ...]
    receives: tuple[tuple[int, int], ...]
    runs: tuple[_Run, ...]
    window_rows: int
    local_rows: int


def _runs(references: Sequence[tuple[int, int]]) -> tuple[_Run, ...]:
    """Run-length encode (source, position) references into runs of step 1, -1 or 0."""
    runs: list[_Run] = []
    for source, position in references:
        if runs:
            last = runs[-1]
            step = position - (last.start + (last.length - 1) * last.step)
            continues = source == -1 or (last.length == 1 and step in (1, -1, 0)) or step == last.step
            if last.source == source and continues:
                runs[-1] = _Run(source, last.start, last.length + 1, step if last.length == 1 else last.step)
                continue
        runs.append(_Run(source, position, 1, 1))
    return tuple(runs)


def _owner(row: int, bounds: Bounds) -> int:
    for coordinate, (start, stop) in enumerate(bounds):
        if start <= row < stop:
            return coordinate
    raise AssertionError(f"row {row} lies in no shard of {bounds}")  # bounds are checked to cover [0, N)


def _check_geometry(bounds: Bounds, windows: Bounds, edge: Edge, peers: int) -> int:
    """Validate the exchange's description (the same on every rank, so every rank raises alike); returns N."""
    if edge not in EDGE_MODES and not _is_constant(edge):
        raise _halo_error(f"edge mode {edge!r} is unknown", f"use one of {EDGE_MODES} or a number (a constant fill)")
    if len(bounds) != peers or len(windows) != peers:
        raise _halo_error(
            f"{len(bounds)} shard bounds and {len(windows)} windows for {peers} coordinates",
            "give one (start, stop) of each per coordinate along the exchanging mesh dims",
        )
    expected = 0
    for start, stop in bounds:
        if start != expected or stop < start:
            raise _halo_error(f"shard bounds {list(bounds)} are not contiguous from row 0",
                              "give each coordinate's (start, stop) in coordinate order, each from the last's stop")
        expected = stop
    size = expected
    for coordinate, (start, stop) in enumerate(windows):
        if stop < start:
            raise _halo_error(f"coordinate {coordinate}'s window ({start}, {stop}) ends before it starts",
                              "give windows with stop >= start")
        if stop == start:
            continue
        if edge == "none" and (start < 0 or stop > size):
            raise _halo_error(
                f"coordinate {coordinate}'s window ({start}, {stop}) leaves the dim's {size} rows and edge is 'none'",
                "use an edge mode (zeros, reflect, replicate, circular) or windows inside [0, size)",
            )
        if size == 0 and not _is_constant(edge):
            raise _halo_error(f"coordinate {coordinate}'s window ({start}, {stop}) needs rows of an empty dim",
                              "only a constant edge (zeros or a number) can fill a window of a dim without rows")
    return size


@functools.lru_cache(maxsize=1024)
def _plan(bounds: Bounds, windows: Bounds, edge: Edge, me: int) -> _Plan:
    size = _check_geometry(bounds, windows, edge, len(bounds))

    def sources(coordinate: int) -> list[int | None]:
        start, stop = windows[coordinate]
        return [_source_row(row, size, edge) for row in range(start, stop)]

    my_start, my_stop = bounds[me]
    needed: dict[int, set[int]] = {}
    for row in sources(me):
        if row is not None and not my_start <= row < my_stop:
            needed.setdefault(_owner(row, bounds), set()).add(row)
    received = {peer: sorted(rows) for peer, rows in sorted(needed.items())}
    buffer_of = {peer: index + 1 for index, peer in enumerate(received)}
    position_in_buffer = {row: position for rows in received.values() for position, row in enumerate(rows)}
    references = []
    for row in sources(me):
        if row is None:
            references.append((-1, 0))
        elif my_start <= row < my_stop:
            references.append((0, row - my_start))
        else:
            references.append((buffer_of[_owner(row, bounds)], position_in_buffer[row]))
    sends = []
    for peer in range(len(bounds)):
        if peer == me:
            continue
        rows = sorted({row for row in sources(peer) if row is not None and my_start <= row < my_stop})
        if rows:
            sends.append((peer, tuple(row - my_start for row in rows)))
    return _Plan(
        tuple(sends), tuple((peer, len(rows)) for peer, rows in received.items()), _runs(references),
        windows[me][1] - windows[me][0], my_stop - my_start,
    )


@functools.lru_cache(maxsize=256)
def _peer_ranks(mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Global ranks of the flattened peers along `mesh_dims` (row-major), and this rank's position."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not in {mesh!r}; only its ranks may exchange halos")
    ranks = []
    for flat in range(math.prod(mesh.shape[mesh_dim] for mesh_dim in mesh_dims)):
        peer = list(coordinate)
        for mesh_dim in reversed(mesh_dims):
            flat, peer[mesh_dim] = divmod(flat, mesh.shape[mesh_dim])
        ranks.append(int(mesh.mesh[tuple(peer)]))
    return tuple(ranks), ranks.index(mesh.get_rank())


def _mesh_dims(mesh: DeviceMesh, mesh_dim: MeshDims) -> tuple[int, ...]:
    names = mesh_dim if isinstance(mesh_dim, tuple) else (mesh_dim,)
    indices = tuple(mesh._mesh_dim_index(name) for name in names)
    if len(set(indices)) != len(indices):
        raise _halo_error(f"mesh dims {mesh_dim!r} repeat a mesh dim", "flatten each mesh dim once")
    return indices


def _contiguous_ranges(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct positions as (start, length) ranges."""
    ranges: list[tuple[int, int]] = []
    for position in positions:
        if ranges and ranges[-1][0] + ranges[-1][1] == position:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + 1)
        else:
            ranges.append((position, 1))
    return ranges


def _gather_rows(tensor: torch.Tensor, dim: int, positions: Sequence[int]) -> torch.Tensor:
    return torch.cat([tensor.narrow(dim, start, length) for start, length in _contiguous_ranges(positions)], dim)


def _add_rows(target: torch.Tensor, dim: int, positions: Sequence[int], rows: torch.Tensor) -> None:
    offset = 0
    for start, length in _contiguous_ranges(positions):
        target.narrow(dim, start, length).add_(rows.narrow(dim, offset, length))
        offset += length


def _swap(sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[int, int]], like: torch.Tensor,
          dim: int, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> list[torch.Tensor]:
    """One `comm.batch_p2p` between peers along `mesh_dims` (its record names them): each (tensor, global
    rank) of `sends` sent, and for each (rows, global rank) of `receives` a tensor shaped like `like` with
    that many rows on `dim` received (in order)."""
    operations = [comm.PointToPoint("send", tensor, rank) for tensor, rank in sends]
    operations += [
        comm.PointToPoint("recv", like.new_empty(_with_rows(like.shape, dim, rows)), rank) for rows, rank in receives
    ]
    return comm.batch_p2p(operations, mesh=mesh, mesh_dim=mesh_dims)


def _with_rows(shape: Sequence[int], dim: int, rows: int) -> list[int]:
    shape = list(shape)
    shape[dim] = rows
    return shape


# ---- one dim ----------------------------------------------------------------------------------------


def _prepare(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, dim: int, bounds, windows, edge: Edge,
             rows_expected: str):
    dim = dim % tensor.ndim if tensor.ndim else 0
    mesh_dims = _mesh_dims(mesh, mesh_dim)
    ranks, me = _peer_ranks(mesh, mesh_dims)
    bounds = tuple((int(start), int(stop)) for start, stop in bounds)
    windows = tuple((int(start), int(stop)) for start, stop in windows)
    plan = _plan(bounds, windows, edge, me)
    expected = plan.local_rows if rows_expected == "local" else plan.window_rows
    if tensor.size(dim) != expected:
        raise _halo_error(
            f"the tensor has {tensor.size(dim)} rows on dim {dim} but coordinate {me}'s "
            f"{'shard' if rows_expected == 'local' else 'window'} holds {expected} "
            f"(shard bounds {list(bounds)}, windows {list(windows)})",
            "pass this rank's shard (window_exchange) or its window's gradient (window_gradient)",
        )
    return dim, mesh_dims, ranks, plan


def window_exchange(local: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, dim: int,
                    shard_bounds: Bounds, windows: Bounds, edge: Edge = "zeros") -> torch.Tensor:
    """This rank's window: global rows `windows[c]` of tensor dim `dim` for its coordinate c along
    `mesh_dim`, assembled from its own shard (`local`, rows `shard_bounds[c]`), the rows its peers
    send and the edge mode's rows. One `comm.batch_p2p` (none when no pair has rows to move).

    >>> window = window_exchange(local, mesh, 0, 2, ((0, 4), (4, 8)), ((-1, 5), (3, 9)))  # doctest: +SKIP
    """
    return _exchange_step(local, mesh, Exchange(_mesh_dims(mesh, mesh_dim), dim, shard_bounds, windows, edge))[0]


def _exchange_step(local: torch.Tensor, mesh: DeviceMesh, step: Exchange,
                   received: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`window_exchange` along `step`: the window and the rows received from the peers (given as
    `received`, the rows a former exchange of the same shard received: no communication)."""
    dim, mesh_dims, ranks, plan = _prepare(local, mesh, step.mesh_dims, step.dim, step.shard_bounds, step.windows,
                                           step.edge, "local")
    if received is None:
        sends = [(_gather_rows(local, dim, positions), ranks[peer]) for peer, positions in plan.sends]
        receives = [(rows, ranks[peer]) for peer, rows in plan.receives]
        received = _swap(sends, receives, local, dim, mesh, mesh_dims)
    return _assemble(local, list(received), plan, dim, step.edge), list(received)


def _assemble(local: torch.Tensor, received: list[torch.Tensor], plan: _Plan, dim: int, edge: Edge) -> torch.Tensor:
    """The window from the local shard, the rows received (in the plan's order) and the edge's rows."""
    buffers = [local, *received]
    pieces = []
    for run in plan.runs:
        if run.source == -1:
            pieces.append(local.new_full(_with_rows(local.shape, dim, run.length), _fill_value(edge)))
        elif run.step == 1:
            pieces.append(buffers[run.source].narrow(dim, run.start, run.length))
        elif run.step == -1:
            pieces.append(buffers[run.source].narrow(dim, run.start - run.length + 1, run.length).flip(dim))
        else:
            row = buffers[run.source].narrow(dim, run.start, 1)
            pieces.append(row.expand(_with_rows(row.shape, dim, run.length)))
    if not pieces:
        return local.new_empty(_with_rows(local.shape, dim, 0))
    return torch.cat(pieces, dim)


def window_gradient(grad_window: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, dim: int,
                    shard_bounds: Bounds, windows: Bounds, edge: Edge = "zeros") -> torch.Tensor:
    """The adjoint of `window_exchange`: the gradient of this rank's shard from its window's
    gradient and its peers' (each window row's gradient is added to the row it came from, on the
    rank that owns it; zero-filled rows are dropped). One `comm.batch_p2p`, the pairs reversed."""
    dim, mesh_dims, ranks, plan = _prepare(grad_window, mesh, mesh_dim, dim, shard_bounds, windows, edge, "window")
    grad_local = grad_window.new_zeros(_with_rows(grad_window.shape, dim, plan.local_rows))
    # The gradients of the rows that came from each peer, sent back to it.
    targets = [grad_local]
    targets += [grad_window.new_zeros(_with_rows(grad_window.shape, dim, rows)) for _, rows in plan.receives]
    row = 0
    for run in plan.runs:
        if run.source != -1:
            gradient = grad_window.narrow(dim, row, run.length)
            if run.step == 1:
                targets[run.source].narrow(dim, run.start, run.length).add_(gradient)
            elif run.step == -1:
                targets[run.source].narrow(dim, run.start - run.length + 1, run.length).add_(gradient.flip(dim))
            else:
                targets[run.source].narrow(dim, run.start, 1).add_(gradient.sum(dim, keepdim=True))
        row += run.length
    sends = [(target, ranks[peer]) for target, (peer, _) in zip(targets[1:], plan.receives)]
    receives = [(len(positions), ranks[peer]) for peer, positions in plan.sends]
    received = _swap(sends, receives, grad_window, dim, mesh, mesh_dims)
    for rows, (_, positions) in zip(received, plan.sends):
        _add_rows(grad_local, dim, positions, rows)
    return grad_local


def exchanged_bytes(bounds: Bounds, windows: Bounds, edge: Edge, coordinate: int, row_bytes: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by `coordinate` in `window_exchange`, for `row_bytes` bytes per
    row: what `comm` records (the adjoint moves the same bytes the other way)."""
    plan = _plan(tuple(map(tuple, bounds)), tuple(map(tuple, windows)), edge, coordinate)
    sent = sum(len(positions) for _, positions in plan.sends)
    received = sum(rows for _, rows in plan.receives)
    return sent * row_bytes, received * row_bytes


# ---- several dims -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exchange:
    """One dim's exchange: tensor dim `dim` sharded over `mesh_dims` (its shard order) with
    `shard_bounds`, each coordinate needing its `windows` rows, `edge` filling rows outside."""

    mesh_dims: tuple[int, ...]
    dim: int
    shard_bounds: Bounds
    windows: Bounds
    edge: Edge = "zeros"

    @classmethod
    def of_layout(cls, layout: Layout, dim: int, windows: Bounds, edge: Edge = "zeros") -> Exchange:
        """The exchange of `layout`'s tensor dim `dim` (sharded over its shard order)."""
        return cls(layout.shard_order[dim], dim, shard_bounds(layout, dim), tuple(windows), edge)

    def piece(self, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> int:
        """The piece index (flattened coordinate over `mesh_dims`) of a mesh coordinate."""
        index = 0
        for mesh_dim in self.mesh_dims:
            index = index * mesh_shape[mesh_dim] + coordinate[mesh_dim]
        return index

    def window(self, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple[int, int]:
        return self.windows[self.piece(mesh_shape, coordinate)]


# The rows an exchange with `keep` received, for a later `reuse`: shard -> {exchanges: (the shard's
# version counter then, the rows received per step)}. Weak keys: an entry lives as long as its shard.
_kept_halos: WeakIdKeyDictionary = WeakIdKeyDictionary()


def exchange(local: torch.Tensor, mesh: DeviceMesh, exchanges: Sequence[Exchange], *, keep: bool = False,
             reuse: bool = False) -> torch.Tensor:
    """`window_exchange` along each exchange in order, each on the tensor the last one widened (the
    corners of two sharded dims come with the second).

    `keep`: remember the rows received with `local`; `reuse`: if rows were kept for this shard, still
    unchanged (version counter), and these exchanges, build the window from them without
    communicating (the module says when ranks agree on that)."""
    exchanges = tuple(exchanges)
    kept = _kept_halos.get(local, {}).get(exchanges) if reuse else None
    kept_rows = kept[1] if kept is not None and kept[0] == local._version else (None,) * len(exchanges)
    window, received_rows = local, []
    for step, rows in zip(exchanges, kept_rows):
        window, received = _exchange_step(window, mesh, step, rows)
        received_rows.append(received)
    if keep:
        _kept_halos.setdefault(local, {})[exchanges] = (local._version, tuple(received_rows))
    return window


def exchange_shape(local_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                   exchanges: Sequence[Exchange]) -> list[int]:
    """The shape of the window `exchange` gives the rank at `coordinate` (no communication)."""
    shape = list(local_shape)
    for step in exchanges:
        start, stop = step.window(mesh_shape, coordinate)
        shape[step.dim] = stop - start
    return shape


def exchange_gradient(grad_window: torch.Tensor, mesh: DeviceMesh, exchanges: Sequence[Exchange]) -> torch.Tensor:
    """The adjoint of `exchange`: `window_gradient` along each exchange in reverse order."""
    for step in reversed(exchanges):
        grad_window = window_gradient(grad_window, mesh, step.mesh_dims, step.dim, step.shard_bounds, step.windows,
                                      step.edge)
    return grad_window


class WindowExchange(torch.autograd.Function):
    """`exchange` as an autograd Function: the window's gradient goes back to the rows' owners."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, exchanges: tuple[Exchange, ...]) -> torch.Tensor:
        ctx.mesh, ctx.exchanges = mesh, exchanges
        return exchange(local, mesh, exchanges)

    @staticmethod
    def backward(ctx, grad_window: torch.Tensor):
        return exchange_gradient(grad_window, ctx.mesh, ctx.exchanges), None, None


def differentiable_exchange(local: torch.Tensor, mesh: DeviceMesh, exchanges: Sequence[Exchange]) -> torch.Tensor:
    """`exchange`, differentiable: the window of `local` along `exchanges`, gradients to their owners."""
    return WindowExchange.apply(local, mesh, tuple(exchanges))
