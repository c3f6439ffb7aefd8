"""The collectives along one mesh dim (or a tuple of mesh dims): all_gather, all_gather_into,
all_to_all, all_reduce, reduce_scatter, broadcast and scatter, each with exact uneven sizes.

Over a tuple of mesh dims with no group over their flattened ranks (a slice of the world: see `peers`),
a collective runs as one collective per mesh dim (`_..._per_mesh_dim`) with the same result, returned
as a finished handle under `async_op`; scatter and an uneven all_gather_into are point to point
already and run as they are.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import collective_check
from ..mesh import DeviceMesh
from . import c10d
from .handles import _complete, _identity
from .peers import MeshDims, _Peers, _check_sizes, _peers, _sizes_error
from .wire import _exchange, _nbytes, _record_on, _reduce_op, _unwire, _wire, _with_size

__all__ = ["all_gather", "all_gather_into", "all_to_all", "all_reduce", "reduce_scatter", "broadcast", "scatter"]

def _equal(sizes: list) -> bool:
    """Whether every peer's size is the same int. Symbolic sizes (torch.compile's dynamic shapes) count as
    unequal: the uneven form is right for every size, and asking would guard the graph on the sizes."""
    return not any(isinstance(size, torch.SymInt) for size in sizes) and len(set(sizes)) == 1


def all_gather(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *, dim: int,
               sizes: Sequence[int], async_op: bool = False):
    """Concatenate along `dim` every peer's tensor (peer c's has size sizes[c] on `dim`).

    Even sizes use one all_gather; uneven sizes use an all_to_all that sends this piece to every
    peer, so no padding moves.
    """
    peers = _peers(mesh, mesh_dim, tensor)
    sizes = _check_sizes("all_gather", "sizes", sizes, peers)
    dim = dim % tensor.ndim
    if tensor.shape[dim] != sizes[peers.coordinate]:
        raise _sizes_error("all_gather", "local shape", tuple(tensor.shape), peers,
                           f"size sizes[{peers.coordinate}] = {sizes[peers.coordinate]} on dim {dim} (sizes {sizes})")
    if peers.size == 1:
        return _identity(tensor, async_op)
    if peers.parts:
        return _identity(_all_gather_per_mesh_dim(tensor, mesh, peers, dim, sizes), async_op)
    if collective_check.enabled:
        collective_check.agree("all_gather", peers, tensor, (dim, tuple(sizes), tuple(_with_size(tensor.shape, dim, 0))))
    local = _wire(tensor).contiguous()
    traced = c10d.tracing()
    if _equal(sizes):
        others = peers.size - 1
        record = _record_on("all_gather", peers, _nbytes(local) * others, _nbytes(local) * others, traced)
        output, work = c10d.all_gather_single(local.new_empty(peers.size * local.numel()), local.reshape(-1),
                                              peers.group, peers.size, async_op, record)

        def finish_even() -> torch.Tensor:
            by_group_rank = output.view(peers.size, *local.shape)
            if dim == 0 and peers.in_coordinate_order:
                return _unwire(by_group_rank.flatten(0, 1), tensor.dtype)
            pieces = [by_group_rank[peers.group_rank[c]] for c in range(peers.size)]
            return _unwire(torch.cat(pieces, dim), tensor.dtype)

        return _complete(work, finish_even, async_op)
    send = [None if c == peers.coordinate else local for c in range(peers.size)]
    shapes = [None if c == peers.coordinate else _with_size(local.shape, dim, sizes[c]) for c in range(peers.size)]
    work, received = _exchange(send, shapes, local, peers, async_op, "all_gather", traced)

    def finish_uneven() -> torch.Tensor:
        pieces = received()
        pieces[peers.coordinate] = local
        return _unwire(torch.cat(pieces, dim), tensor.dtype)

    return _complete(work, finish_uneven, async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *,
                    sizes: Sequence[int], async_op: bool = False):
    """Write every peer's flat `tensor` (peer c's has sizes[c] elements) into the flat `output`, in
    coordinate order, and return `output`: the buffer of a sharded-data-parallel unit.

    Even sizes use one all_gather; uneven sizes (and mesh dims without a flattened group, over the
    default group, which needs no new group) one batch of point-to-point sends and receives
    (one grouped call: this piece to every peer, each peer's piece straight into its place), so
    nothing is padded, no send buffer repeats the piece (as an all_to_all's would) and nothing is
    copied after the collective (when c10d's group order is coordinate order; else one reordering
    copy). Recorded as one "all_gather".
    """
    peers = _peers(mesh, mesh_dim, output, tensor)
    sizes = _check_sizes("all_gather_into", "sizes", sizes, peers)
    if tensor.ndim != 1 or output.ndim != 1 or not output.is_contiguous() or output.numel() != sum(sizes) \
            or tensor.numel() != sizes[peers.coordinate] or output.dtype != tensor.dtype:
        raise _sizes_error("all_gather_into", "(output, tensor) shapes",
                           (tuple(output.shape), tuple(tensor.shape), output.dtype, tensor.dtype), peers,
                           f"a flat contiguous output of sum(sizes) = {sum(sizes)} elements and a flat tensor of "
                           f"sizes[{peers.coordinate}] = {sizes[peers.coordinate]} elements, of one dtype")
    if peers.size == 1:
        output.copy_(tensor)
        return _identity(output, async_op)
    local = _wire(tensor).contiguous()
    wire_output = _wire(output)
    record = _record_on("all_gather", peers, _nbytes(local) * (peers.size - 1),
                        (sum(sizes) - sizes[peers.coordinate]) * local.element_size(), c10d.tracing())
    target = wire_output if peers.in_coordinate_order else torch.empty_like(wire_output)
    group_sizes = [sizes[c] for c in peers.group_order]
    if len(set(sizes)) == 1 and not peers.parts:
        gathered, work = c10d.all_gather_single(target, local, peers.group, peers.size, async_op, record)
        if gathered is not target:  # traced: a new tensor (`c10d`), written into the output as eager mode does
            target.copy_(gathered)
    else:
        # Point-to-point: this piece goes to every peer as it is and each peer's piece lands in its place
        # of the output, so no send buffer repeats the piece (an all_to_all_single would need one).
        c10d.refuse_point_to_point("all_gather_into with uneven sizes")
        pieces = target.split(group_sizes)
        operations = []
        for c in range(peers.size):
            if c != peers.coordinate:
                peer = peers.ranks[c]
                operations.append(dist.P2POp(dist.isend, local, peer, group=peers.group))
                operations.append(dist.P2POp(dist.irecv, pieces[peers.group_rank[c]], peer, group=peers.group))
        pieces[peers.group_rank[peers.coordinate]].copy_(local)
        work = dist.batch_isend_irecv(operations)
        if not async_op:
            for item in work:
                item.wait()

    def finish() -> torch.Tensor:
        if target is not wire_output:
            by_group_rank = target.split(group_sizes)
            torch.cat([by_group_rank[peers.group_rank[c]] for c in range(peers.size)], out=wire_output)
        return output

    return _complete(work, finish, async_op)


def all_to_all(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *, split_dim: int,
               split_sizes: Sequence[int], concat_dim: int, concat_sizes: Sequence[int], async_op: bool = False):
    """Split along `split_dim` (piece c to coordinate c), concatenate what arrives along `concat_dim`.

    From coordinate c arrives a piece of size concat_sizes[c] on `concat_dim` and
    split_sizes[this coordinate] on `split_dim` (Shard(concat_dim) -> Shard(split_dim)). With
    split_dim == concat_dim this re-splits one dim from one set of piece sizes to another.
    """
    peers = _peers(mesh, mesh_dim, tensor)
    split_sizes = _check_sizes("all_to_all", "split_sizes", split_sizes, peers)
    concat_sizes = _check_sizes("all_to_all", "concat_sizes", concat_sizes, peers)
    split_dim, concat_dim = split_dim % tensor.ndim, concat_dim % tensor.ndim
    me = peers.coordinate
    if tensor.shape[split_dim] != sum(split_sizes):
        raise _sizes_error("all_to_all", "local shape", tuple(tensor.shape), peers,
                           f"size sum(split_sizes) = {sum(split_sizes)} on split_dim {split_dim}")
    own_concat_size = split_sizes[me] if split_dim == concat_dim else tensor.shape[concat_dim]
    if own_concat_size != concat_sizes[me]:
        raise _sizes_error("all_to_all", "concat_sizes", concat_sizes, peers,
                           f"concat_sizes[{me}] = {own_concat_size}, the size of the piece this rank keeps")
    if peers.size == 1:
        return _identity(tensor, async_op)
    if peers.parts:
        routed = _all_to_all_per_mesh_dim(tensor, mesh, peers, split_dim, split_sizes, concat_dim, concat_sizes)
        return _identity(routed, async_op)
    if collective_check.enabled:
        others = _with_size(_with_size(tensor.shape, split_dim, 0), concat_dim, 0)
        collective_check.agree("all_to_all", peers, tensor, (split_dim, concat_dim, tuple(others)))
    local = _wire(tensor)
    pieces = list(local.split(split_sizes, split_dim))
    kept = pieces[me]
    receive_shape = _with_size(local.shape, split_dim, split_sizes[me])
    send = [None if c == me else pieces[c] for c in range(peers.size)]
    shapes = [None if c == me else _with_size(receive_shape, concat_dim, concat_sizes[c]) for c in range(peers.size)]
    work, received = _exchange(send, shapes, local, peers, async_op, "all_to_all", c10d.tracing())

    def finish() -> torch.Tensor:
        arrived = received()
        arrived[me] = kept
        return _unwire(torch.cat(arrived, concat_dim), tensor.dtype)

    return _complete(work, finish, async_op)


def all_reduce(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *, reduce_op: str, async_op: bool = False):
    """Reduce over the peers; returns a new tensor (the input is never written)."""
    peers = _peers(mesh, mesh_dim, tensor)
    op = _reduce_op("all_reduce", reduce_op, tensor.dtype)
    if peers.size == 1:
        return _identity(tensor, async_op)
    if peers.parts:  # one mesh dim after another: each reduces what the previous ones reduced
        for part in peers.parts:
            tensor = all_reduce(tensor, mesh, part.mesh_dim, reduce_op=reduce_op)
        return _identity(tensor, async_op)
    if collective_check.enabled:
        collective_check.agree("all_reduce", peers, tensor, (tuple(tensor.shape), op))
    traced = c10d.tracing()
    if tensor.dtype == torch.bool:
        buffer = tensor.to(torch.uint8, memory_format=torch.contiguous_format)
    elif traced:  # a functional all_reduce writes no buffer: no copy to protect the input
        buffer = tensor.contiguous()
    else:
        buffer = tensor.clone(memory_format=torch.contiguous_format)
    traffic = 2 * (peers.size - 1) * _nbytes(buffer) // peers.size
    record = _record_on("all_reduce", peers, traffic, traffic, traced)
    buffer, work = c10d.all_reduce(buffer, op, peers.group, async_op, record)
    return _complete(work, lambda: buffer.to(torch.bool) if tensor.dtype == torch.bool else buffer, async_op)


def reduce_scatter(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *, reduce_op: str, dim: int,
                   sizes: Sequence[int], async_op: bool = False):
    """This coordinate's piece (size sizes[coordinate] on `dim`) of the tensor reduced over the peers."""
    peers = _peers(mesh, mesh_dim, tensor)
    sizes = _check_sizes("reduce_scatter", "sizes", sizes, peers)
    op = _reduce_op("reduce_scatter", reduce_op, tensor.dtype)
    dim = dim % tensor.ndim
    if tensor.shape[dim] != sum(sizes):
        raise _sizes_error("reduce_scatter", "local shape", tuple(tensor.shape), peers,
                           f"size sum(sizes) = {sum(sizes)} on dim {dim}")
    if peers.size == 1:
        return _identity(tensor, async_op)
    if peers.parts:
        return _identity(_reduce_scatter_per_mesh_dim(tensor, mesh, peers, reduce_op, dim, sizes), async_op)
    if collective_check.enabled:
        collective_check.agree("reduce_scatter", peers, tensor, (dim, tuple(sizes), tuple(tensor.shape), op))
    local = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    pieces = local.split(sizes, dim)
    me = peers.coordinate
    traced = c10d.tracing()
    if _equal(sizes) and (traced or not peers.reduces_by_exchange):
        output = torch.empty(pieces[me].shape, dtype=local.dtype, device=local.device)
        record = _record_on("reduce_scatter", peers, _nbytes(local) - _nbytes(output),
                            (peers.size - 1) * _nbytes(output), traced)
        if dim == 0 and peers.in_coordinate_order:
            stacked = local.contiguous()
        else:
            stacked = torch.stack([pieces[c] for c in peers.group_order])
        reduced, work = c10d.reduce_scatter_single(output.view(-1), stacked.reshape(-1), op, peers.group, peers.size,
                                                   async_op, record)
        output = reduced.view(output.shape)
    else:
        return _reduce_scatter_uneven(tensor, pieces, op, peers, async_op, traced)
    return _complete(work, lambda: output.to(torch.bool) if tensor.dtype == torch.bool else output, async_op)


_LOCAL_REDUCTIONS = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}


def _reduce_scatter_uneven(tensor: torch.Tensor, pieces: Sequence[torch.Tensor], op: str, peers: _Peers, async_op: bool,
                           traced: bool):
    """Unequal pieces (and even ones on gloo): one all_to_all sends piece c to coordinate c, then this rank
    reduces what arrived, in coordinate order after its own piece.

    Moves exactly the ideal bytes ((n-1) pieces of this rank's size) and is several times faster
    on gloo than its list reduce_scatter, which reduces piece by piece with a collective each.
    """
    me = peers.coordinate
    own = pieces[me]
    send = [None if c == me else pieces[c] for c in range(peers.size)]
    shapes = [None if c == me else own.shape for c in range(peers.size)]
    work, received = _exchange(send, shapes, own, peers, async_op, "reduce_scatter", traced)
    combine = _LOCAL_REDUCTIONS[op]

    def finish() -> torch.Tensor:
        arrived = received()
        output = None
        for c in range(peers.size):
            if c != me:  # the first combination makes the output (no copy of this rank's piece first)
                output = combine(own, arrived[c]) if output is None else combine(output, arrived[c], out=output)
        output = output.contiguous()
        if op == "avg":
            output.div_(peers.size)
        return output.to(torch.bool) if tensor.dtype == torch.bool else output

    return _complete(work, finish, async_op)


def broadcast(tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *, src: int = 0, async_op: bool = False):
    """Coordinate `src`'s tensor on every peer, as a new tensor; other ranks pass a tensor of the same shape."""
    peers = _peers(mesh, mesh_dim, tensor)
    if not 0 <= src < peers.size:
        raise _sizes_error("broadcast", "src", src, peers, f"a coordinate in [0, {peers.size})")
    if peers.size == 1:
        return _identity(tensor, async_op)
    if peers.parts:
        return _identity(_broadcast_per_mesh_dim(tensor, mesh, peers, src), async_op)
    if collective_check.enabled:
        collective_check.agree("broadcast", peers, tensor, (tuple(tensor.shape), src))
    traced = c10d.tracing()
    if peers.coordinate == src:
        buffer = tensor.clone(memory_format=torch.contiguous_format)
        record = _record_on("broadcast", peers, _nbytes(buffer) * (peers.size - 1), 0, traced)
    else:
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        record = _record_on("broadcast", peers, 0, _nbytes(buffer), traced)
    wired, work = c10d.broadcast(_wire(buffer), peers.ranks[src], peers.group, async_op, record)
    return _complete(work, lambda: _unwire(wired, tensor.dtype), async_op)


def scatter(pieces: Sequence[torch.Tensor] | None, mesh: DeviceMesh, mesh_dim: MeshDims, *, src: int = 0,
            shape: Sequence[int], dtype: torch.dtype, async_op: bool = False):
    """Coordinate `src` sends pieces[c] to coordinate c (sizes may differ); returns this coordinate's piece.

    Only `src` passes `pieces` (in coordinate order); every rank passes the `shape` and `dtype` of
    its own piece. Point-to-point sends move exact bytes (empty pieces move nothing); `src` gets its
    own piece back as is. Pieces may be views of one tensor: each is made contiguous only when sent.
    """
    peers = _peers(mesh, mesh_dim, *(pieces or ()))
    if not 0 <= src < peers.size:
        raise _sizes_error("scatter", "src", src, peers, f"a coordinate in [0, {peers.size})")
    me = peers.coordinate
    shape = [int(size) for size in shape]
    if me == src:
        if pieces is None or len(pieces) != peers.size:
            count = None if pieces is None else len(pieces)
            raise _sizes_error("scatter", "number of pieces", count, peers, f"{peers.size} pieces on the source rank")
        if list(pieces[me].shape) != shape or pieces[me].dtype != dtype:
            raise _sizes_error("scatter", "own piece", (tuple(pieces[me].shape), pieces[me].dtype), peers,
                               f"shape {tuple(shape)} and dtype {dtype}")
    if peers.size == 1:
        return _identity(pieces[0], async_op)
    if collective_check.enabled:
        template = _wire(pieces[me] if me == src else torch.empty(0, dtype=dtype, device=mesh.device_type))
        collective_check.agree("scatter", peers, template, (src,))
    c10d.refuse_point_to_point("scatter")
    if me != src:
        buffer = torch.empty(shape, dtype=dtype, device=mesh.device_type)
        _record_on("scatter", peers, 0, _nbytes(buffer), False)  # not traced: refused above
        work = dist.irecv(_wire(buffer), src=peers.ranks[src], group=peers.group) if buffer.numel() else None
        if work is not None and not async_op:
            work.wait()
        return _complete(work, lambda: buffer, async_op)
    # The source sends each piece straight from the caller's tensor: no send buffer holding all pieces
    # (an all_to_all would concatenate them). Synchronously, one piece is in flight at a time, so a
    # piece that must be made contiguous is freed before the next one is made.
    works, sent_bytes = [], 0
    for coordinate in range(peers.size):
        if coordinate == me or pieces[coordinate].numel() == 0:
            continue
        piece = _wire(pieces[coordinate].contiguous())
        sent_bytes += _nbytes(piece)
        work = dist.isend(piece, dst=peers.ranks[coordinate], group=peers.group)
        if async_op:
            works.append(work)
        else:
            work.wait()
    _record_on("scatter", peers, sent_bytes, 0, False)
    return _complete(works, lambda: pieces[me], async_op)


# --- several mesh dims without a flattened group: one collective per mesh dim ----------------------
# The flattened coordinate is row-major over `peers.parts`: the first part's is the outermost.


def _coordinates(peers: _Peers, flat: int) -> tuple[int, ...]:
    """The coordinate along each of `peers.parts` of the flattened coordinate `flat`."""
    coordinates = []
    for part in reversed(peers.parts):
        flat, coordinate = divmod(flat, part.size)
        coordinates.append(coordinate)
    return tuple(reversed(coordinates))


def _reduce_scatter_per_mesh_dim(tensor, mesh, peers: _Peers, reduce_op: str, dim: int, sizes: list[int]):
    """Outermost mesh dim first: each reduce_scatter keeps this coordinate's run of flattened pieces."""
    for part in peers.parts:
        run = len(sizes) // part.size  # flattened pieces per coordinate along `part`
        runs = [sizes[start:start + run] for start in range(0, len(sizes), run)]
        tensor = reduce_scatter(tensor, mesh, part.mesh_dim, reduce_op=reduce_op, dim=dim, sizes=list(map(sum, runs)))
        sizes = runs[part.coordinate]
    return tensor


def _all_gather_per_mesh_dim(tensor, mesh, peers: _Peers, dim: int, sizes: list[int]):
    """Innermost mesh dim first: each all_gather joins runs of flattened pieces that are adjacent."""
    run = 1  # flattened pieces this rank holds, from `start`
    for part in reversed(peers.parts):
        start = peers.coordinate - peers.coordinate % (run * part.size)
        runs = [sum(sizes[start + position * run:start + (position + 1) * run]) for position in range(part.size)]
        tensor = all_gather(tensor, mesh, part.mesh_dim, dim=dim, sizes=runs)
        run *= part.size
    return tensor


def _broadcast_per_mesh_dim(tensor, mesh, peers: _Peers, src: int):
    """Outermost mesh dim first, each from `src`'s coordinate along it, among the ranks that share
    `src`'s coordinates on the inner mesh dims (after it, those hold `src`'s tensor)."""
    source, mine = _coordinates(peers, src), _coordinates(peers, peers.coordinate)
    for index, part in enumerate(peers.parts):
        if mine[index + 1:] == source[index + 1:]:
            tensor = broadcast(tensor, mesh, part.mesh_dim, src=source[index])
    return tensor


def _all_to_all_per_mesh_dim(tensor, mesh, peers: _Peers, split_dim: int, split_sizes: list[int], concat_dim: int,
                             concat_sizes: list[int]):
    """Route each piece along one mesh dim at a time (outermost first), as one uneven all_to_all per mesh
    dim: before the step along part i, a rank holds the pieces (from r, to s) with s sharing its
    coordinates on the parts before i and r on the parts from i on; it sends each to the peer sharing s's
    coordinate on part i. Every rank must know every piece's size: from the size lists, which agree on
    every peer when split_dim != concat_dim; a re-split (split_dim == concat_dim) first gathers each
    peer's split sizes (one all_gather per mesh dim)."""
    rest = math.prod(_with_size(_with_size(tensor.shape, split_dim, 1), concat_dim, 1))
    if split_dim == concat_dim:
        own_sizes = torch.tensor(split_sizes, dtype=torch.int64, device=tensor.device)
        matrix = all_gather(own_sizes, mesh, peers.mesh_dim, dim=0, sizes=[peers.size] * peers.size).view(peers.size, -1)
        numel = matrix.mul(rest).tolist()
    else:
        numel = [[rest * split_sizes[target] * concat_sizes[source] for target in range(peers.size)]
                 for source in range(peers.size)]
    me = peers.coordinate
    local = _wire(tensor)
    held = {(me, target): piece.reshape(-1) for target, piece in enumerate(local.split(split_sizes, split_dim))}
    coordinates = [_coordinates(peers, flat) for flat in range(peers.size)]
    mine = coordinates[me]
    for index, part in enumerate(peers.parts):
        if part.size == 1:
            continue
        send, receive, expected = [None] * part.size, [None] * part.size, [None] * part.size
        for position in range(part.size):
            if position == part.coordinate:
                continue
            outgoing = sorted(key for key in held if coordinates[key[1]][index] == position)
            send[position] = torch.cat([held.pop(key) for key in outgoing]) if outgoing else local.new_empty(0)
            expected[position] = [
                (source, target) for source, target in itertools.product(range(peers.size), repeat=2)
                if coordinates[source][index] == position and coordinates[source][index + 1:] == mine[index + 1:]
                and coordinates[target][:index + 1] == mine[:index + 1]
            ]
            receive[position] = [sum(numel[source][target] for source, target in expected[position])]
        if collective_check.enabled:
            others = _with_size(_with_size(tensor.shape, split_dim, 0), concat_dim, 0)
            collective_check.agree("all_to_all", part, local, (split_dim, concat_dim, tuple(others)))
        _, received = _exchange(send, receive, local, part, False, "all_to_all", c10d.tracing())
        for position, message in enumerate(received()):
            if message is not None:
                pieces = message.split([numel[source][target] for source, target in expected[position]])
                held.update(zip(expected[position], pieces))
    shape = _with_size(local.shape, split_dim, split_sizes[me])
    arrived = [held[source, me].view(_with_size(shape, concat_dim, concat_sizes[source]))
               for source in range(peers.size)]
    return _unwire(torch.cat(arrived, concat_dim), tensor.dtype)
