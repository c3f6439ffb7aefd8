"""Every collective shardtensor issues, in mesh-coordinate order, with exact uneven sizes.

Each function works along one mesh dim: the peers are the ranks that share this rank's coordinate
on the other mesh dims, and pieces are indexed by the peer's coordinate along `mesh_dim` (c10d
orders a group by global rank, which may differ; this module hides that). Sizes are lists in
coordinate order; uneven and empty pieces move exactly, with no padding bytes. `mesh_dim` may
also be a tuple of mesh dims: the peers are then the flattened sub-mesh through this rank,
row-major in the order given (one collective instead of one per mesh dim; its group is created by
its members alone on first use, so ranks outside it need not call).

Observability: every call with more than one rank adds 1 to `call_counts[kind]` and appends a
`CommRecord` to every list yielded by an active `observe()`. Bytes are this rank's, for an ideal
algorithm (see `CommRecord`). A one-rank group makes no c10d call and no record, and every function
returns its input as is (collectives over one rank are identities).

    >>> with observe() as records:  # doctest: +SKIP
    ...     total = all_reduce(local, mesh, 0, reduce_op="sum")
    >>> records[0].bytes_sent  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collective_check
from .mesh import DeviceMesh, local_group, on_new_world

__all__ = [
    "CommRecord", "CommHandle", "PointToPoint", "observe", "call_counts",
    "all_gather", "all_gather_into", "all_to_all", "all_reduce", "reduce_scatter", "broadcast", "scatter",
    "all_gather_object", "send", "recv", "batch_p2p",
]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
# Bools reduce as uint8: "sum" and "max" are any (logical or), "product" and "min" are all.
_BOOL_REDUCE_OPS = {"sum": "max", "max": "max", "min": "min", "product": "min"}
# A mesh dim (index or name), or a tuple of them: the flattened sub-mesh, row-major in the order given.
MeshDims = int | str | tuple[int | str, ...]
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- observability --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class CommRecord:
    """One collective as seen by this rank, with the bytes an ideal algorithm moves.

    all_gather: sent = local bytes * (n-1), received = the other pieces. all_to_all: the pieces
    sent to / received from other coordinates. all_reduce: ring, sent = received =
    2 * (n-1) / n * bytes. reduce_scatter: sent = input bytes minus this rank's piece, received =
    (n-1) * this rank's piece. broadcast and scatter: the source sends each peer its bytes
    directly, the others receive theirs. send / recv / batch_p2p: the tensors' bytes, group_size 2.
    """

    kind: str
    mesh_dim: int | tuple[int, ...] | None
    group_size: int
    bytes_sent: int
    bytes_received: int


_observers: list[list[CommRecord]] = []
call_counts: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def observe():
    """Collect the `CommRecord`s of the calls made inside the block (nestable)."""
    records: list[CommRecord] = []
    _observers.append(records)
    try:
        yield records
    finally:
        for index in range(len(_observers) - 1, -1, -1):
            if _observers[index] is records:
                del _observers[index]
                break


def _record(kind: str, mesh_dim: int | tuple[int, ...] | None, group_size: int, bytes_sent: int, bytes_received: int) -> None:
    call_counts[kind] += 1
    if _observers:
        record = CommRecord(kind, mesh_dim, group_size, bytes_sent, bytes_received)
        for records in _observers:
            records.append(record)


# --- async handles ----------------------------------------------------------------------------------
class CommHandle:
    """What `async_op=True` returns: `wait()` waits for the c10d work and returns the result."""

    __slots__ = ("_works", "_finish", "_result", "_done")

    def __init__(self, works: list, finish: Callable[[], Any]):
        self._works = works
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._done = True
            self._works = self._finish = None
        return self._result


def _complete(work, finish: Callable[[], Any], async_op: bool):
    """Return `finish()` now, or a handle that runs it after the c10d `work` when async."""
    if not async_op:
        return finish()
    works = work if isinstance(work, list) else [] if work is None else [work]
    return CommHandle(works, finish)


def _identity(result, async_op: bool):
    return CommHandle([], lambda: result) if async_op else result


# --- peers: coordinate order versus c10d group order -------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Peers:
    mesh_dim: int | tuple[int, ...]
    size: int
    coordinate: int
    ranks: tuple[int, ...]  # global ranks in coordinate order
    group_order: tuple[int, ...]  # coordinates in c10d group-rank order (sorted by global rank)
    group_rank: tuple[int, ...]  # coordinate -> c10d group rank
    group: Any

    @property
    def in_coordinate_order(self) -> bool:
        return self.group_order == tuple(range(self.size))


_peers_cache: dict[tuple[DeviceMesh, MeshDims], _Peers] = {}
on_new_world(_peers_cache.clear)  # peers hold the groups of the world they were made in


def _peers(mesh: DeviceMesh, mesh_dim: MeshDims, *tensors: torch.Tensor) -> _Peers:
    mesh.check_world("a collective")
    for tensor in tensors:  # the collective's tensors must be on the mesh's device (gloo: cpu, nccl: cuda)
        if tensor.device.type != mesh.device_type:
            raise _device_error(tensor, mesh)
    key = (mesh, mesh_dim)
    peers = _peers_cache.get(key)
    if peers is None:
        if isinstance(mesh_dim, tuple) and len(mesh_dim) > 1:
            peers = _flattened_peers(mesh, mesh_dim)
        else:
            index = mesh._mesh_dim_index(mesh_dim[0] if isinstance(mesh_dim, tuple) else mesh_dim)
            ranks = mesh.group_ranks(index)
            group = mesh.get_group(index) if len(ranks) > 1 else None
            peers = _make_peers(index, ranks, mesh.get_local_rank(index), group)
        _peers_cache[key] = peers
    return peers


def _make_peers(mesh_dim, ranks: tuple[int, ...], coordinate: int, group) -> _Peers:
    group_order = tuple(sorted(range(len(ranks)), key=lambda position: ranks[position]))
    group_rank = tuple(group_order.index(position) for position in range(len(ranks)))
    return _Peers(mesh_dim, len(ranks), coordinate, ranks, group_order, group_rank, group)


def _flattened_peers(mesh: DeviceMesh, mesh_dims: tuple) -> _Peers:
    """The ranks sharing this rank's coordinate off `mesh_dims`, row-major over `mesh_dims` as given."""
    indices = tuple(mesh._mesh_dim_index(mesh_dim) for mesh_dim in mesh_dims)
    if len(set(indices)) != len(indices):
        raise ValueError(f"mesh dims {mesh_dims} repeat a mesh dim; flatten each mesh dim of {mesh!r} once")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError(f"rank {mesh.get_rank()} is not in {mesh!r}; only its ranks may run its collectives")
    index = tuple(slice(None) if mesh_dim in indices else coordinate[mesh_dim] for mesh_dim in range(mesh.ndim))
    kept = sorted(indices)
    sub_mesh = mesh.mesh[index].permute([kept.index(mesh_dim) for mesh_dim in indices])
    ranks = tuple(sub_mesh.flatten().tolist())
    group = None
    if len(ranks) > 1:
        group = dist.group.WORLD if len(ranks) == dist.get_world_size() else local_group(ranks)
    return _make_peers(indices, ranks, ranks.index(mesh.get_rank()), group)


# --- helpers ---------------------------------------------------------------------------------------
def _device_error(tensor: torch.Tensor, mesh: DeviceMesh) -> ValueError:
    return ValueError(
        f"a collective over {mesh!r} got a tensor on device {tensor.device} (shape {tuple(tensor.shape)}); "
        f"the mesh's collectives take tensors on its device type {mesh.device_type!r}: move the tensor "
        f"with .to({mesh.device_type!r}), or build the mesh for device type {tensor.device.type!r}"
    )


def _sizes_error(function: str, what: str, given, peers: _Peers, expected: str) -> ValueError:
    return ValueError(
        f"{function}: {what} {given!r} does not fit mesh dim {peers.mesh_dim} with {peers.size} ranks "
        f"(this rank is coordinate {peers.coordinate}); expected {expected}"
    )


def _check_sizes(function: str, name: str, sizes: Sequence[int], peers: _Peers) -> list[int]:
    sizes = [int(size) for size in sizes]
    if len(sizes) != peers.size or any(size < 0 for size in sizes):
        raise _sizes_error(function, name, sizes, peers, f"{peers.size} non-negative sizes in coordinate order")
    return sizes


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as c10d moves it: bools travel as uint8 (same bytes); a conjugate or negative view
    (`x.conj()`) is resolved first, since c10d sends the memory and would drop the view's meaning."""
    tensor = tensor.resolve_conj().resolve_neg()
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _unwire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.view(torch.bool) if dtype == torch.bool else tensor


def _with_size(shape: Sequence[int], dim: int, size: int) -> list[int]:
    shape = list(shape)
    shape[dim] = size
    return shape


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _reduce_op(function: str, reduce_op: str, dtype: torch.dtype) -> str:
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"{function}: reduce_op {reduce_op!r} is not one of {sorted(_REDUCE_OPS)}")
    if dtype == torch.bool:
        if reduce_op not in _BOOL_REDUCE_OPS:
            raise ValueError(f"{function}: reduce_op {reduce_op!r} has no meaning for bool tensors; "
                             f"use one of {sorted(_BOOL_REDUCE_OPS)} (sum/max = any, product/min = all)")
        return _BOOL_REDUCE_OPS[reduce_op]
    return reduce_op


def _exchange(send: Sequence[torch.Tensor | None], receive_shapes: Sequence[Sequence[int] | None],
              template: torch.Tensor, peers: _Peers, async_op: bool):
    """One `all_to_all_single`: send[c] goes to coordinate c, a tensor of receive_shapes[c] comes back.

    None entries move nothing. Returns (c10d work, function giving the received tensors in
    coordinate order, bytes sent, bytes received).
    """
    input_splits = [0 if send[c] is None else send[c].numel() for c in peers.group_order]
    output_splits = [0 if receive_shapes[c] is None else math.prod(receive_shapes[c]) for c in peers.group_order]
    flat = [send[c].reshape(-1) for c in peers.group_order if send[c] is not None]
    send_buffer = torch.cat(flat) if flat else template.new_empty(0)
    receive_buffer = template.new_empty(sum(output_splits))
    work = dist.all_to_all_single(receive_buffer, send_buffer, output_splits, input_splits,
                                  group=peers.group, async_op=async_op)

    def received() -> list[torch.Tensor | None]:
        by_group_rank = receive_buffer.split(output_splits)
        return [None if receive_shapes[c] is None else by_group_rank[peers.group_rank[c]].view(receive_shapes[c])
                for c in range(peers.size)]

    element_size = template.element_size()
    return work, received, sum(input_splits) * element_size, sum(output_splits) * element_size


# --- collectives along one mesh dim --------------------------------------------------------------------
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
    if collective_check.enabled:
        collective_check.agree("all_gather", peers, tensor, (dim, tuple(sizes), tuple(_with_size(tensor.shape, dim, 0))))
    local = _wire(tensor).contiguous()
    others = [c for c in range(peers.size) if c != peers.coordinate]
    row = math.prod(_with_size(local.shape, dim, 1))
    _record("all_gather", peers.mesh_dim, peers.size, _nbytes(local) * len(others),
            sum(sizes[c] for c in others) * row * local.element_size())
    if len(set(sizes)) == 1:
        output = local.new_empty(peers.size * local.numel())
        work = _all_gather_single(output, local.reshape(-1), group=peers.group, async_op=async_op)

        def finish_even() -> torch.Tensor:
            by_group_rank = output.view(peers.size, *local.shape)
            if dim == 0 and peers.in_coordinate_order:
                return _unwire(by_group_rank.flatten(0, 1), tensor.dtype)
            pieces = [by_group_rank[peers.group_rank[c]] for c in range(peers.size)]
            return _unwire(torch.cat(pieces, dim), tensor.dtype)

        return _complete(work, finish_even, async_op)
    send = [None if c == peers.coordinate else local for c in range(peers.size)]
    shapes = [None if c == peers.coordinate else _with_size(local.shape, dim, sizes[c]) for c in range(peers.size)]
    work, received, _, _ = _exchange(send, shapes, local, peers, async_op)

    def finish_uneven() -> torch.Tensor:
        pieces = received()
        pieces[peers.coordinate] = local
        return _unwire(torch.cat(pieces, dim), tensor.dtype)

    return _complete(work, finish_uneven, async_op)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: MeshDims, *,
                    sizes: Sequence[int], async_op: bool = False):
    """Write every peer's flat `tensor` (peer c's has sizes[c] elements) into the flat `output`, in
    coordinate order, and return `output`: the buffer of a sharded-data-parallel unit.

    Even sizes use one all_gather; uneven sizes one batch of point-to-point sends and receives
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
    _record("all_gather", peers.mesh_dim, peers.size, _nbytes(local) * (peers.size - 1),
            (sum(sizes) - sizes[peers.coordinate]) * local.element_size())
    target = wire_output if peers.in_coordinate_order else torch.empty_like(wire_output)
    group_sizes = [sizes[c] for c in peers.group_order]
    if len(set(sizes)) == 1:
        work = _all_gather_single(target, local, group=peers.group, async_op=async_op)
    else:
        # Point-to-point: this piece goes to every peer as it is and each peer's piece lands in its place
        # of the output, so no send buffer repeats the piece (an all_to_all_single would need one).
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
    if collective_check.enabled:
        others = _with_size(_with_size(tensor.shape, split_dim, 0), concat_dim, 0)
        collective_check.agree("all_to_all", peers, tensor, (split_dim, concat_dim, tuple(others)))
    local = _wire(tensor)
    pieces = list(local.split(split_sizes, split_dim))
    kept = pieces[me]
    receive_shape = _with_size(local.shape, split_dim, split_sizes[me])
    send = [None if c == me else pieces[c] for c in range(peers.size)]
    shapes = [None if c == me else _with_size(receive_shape, concat_dim, concat_sizes[c]) for c in range(peers.size)]
    work, received, sent_bytes, received_bytes = _exchange(send, shapes, local, peers, async_op)
    _record("all_to_all", peers.mesh_dim, peers.size, sent_bytes, received_bytes)

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
    if collective_check.enabled:
        collective_check.agree("all_reduce", peers, tensor, (tuple(tensor.shape), op))
    if tensor.dtype == torch.bool:
        buffer = tensor.to(torch.uint8, memory_format=torch.contiguous_format)
    else:
        buffer = tensor.clone(memory_format=torch.contiguous_format)
    traffic = 2 * (peers.size - 1) * _nbytes(buffer) // peers.size
    _record("all_reduce", peers.mesh_dim, peers.size, traffic, traffic)
    work = dist.all_reduce(buffer, op=_REDUCE_OPS[op], group=peers.group, async_op=async_op)
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
    if collective_check.enabled:
        collective_check.agree("reduce_scatter", peers, tensor, (dim, tuple(sizes), tuple(tensor.shape), op))
    local = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    pieces = local.split(sizes, dim)
    me = peers.coordinate
    output = torch.empty(pieces[me].shape, dtype=local.dtype, device=local.device)
    _record("reduce_scatter", peers.mesh_dim, peers.size, _nbytes(local) - _nbytes(output),
            (peers.size - 1) * _nbytes(output))
    if len(set(sizes)) == 1:
        if dim == 0 and peers.in_coordinate_order:
            stacked = local.contiguous()
        else:
            stacked = torch.stack([pieces[c] for c in peers.group_order])
        work = _reduce_scatter_single(output.view(-1), stacked.reshape(-1), op=_REDUCE_OPS[op], group=peers.group, async_op=async_op)
    else:
        return _reduce_scatter_uneven(tensor, pieces, op, peers, async_op)
    return _complete(work, lambda: output.to(torch.bool) if tensor.dtype == torch.bool else output, async_op)


_LOCAL_REDUCTIONS = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}


def _reduce_scatter_uneven(tensor: torch.Tensor, pieces: Sequence[torch.Tensor], op: str, peers: _Peers, async_op: bool):
    """Unequal pieces: one all_to_all sends piece c to coordinate c, then this rank reduces what arrived.

    Moves exactly the ideal bytes ((n-1) pieces of this rank's size) and is several times faster
    on gloo than its list reduce_scatter, which reduces piece by piece with a collective each.
    """
    me = peers.coordinate
    own = pieces[me]
    send = [None if c == me else pieces[c] for c in range(peers.size)]
    shapes = [None if c == me else own.shape for c in range(peers.size)]
    work, received, _, _ = _exchange(send, shapes, own, peers, async_op)
    combine = _LOCAL_REDUCTIONS[op]

    def finish() -> torch.Tensor:
        arrived = received()
        output = own.clone(memory_format=torch.contiguous_format)
        for c in range(peers.size):
            if c != me:
                combine(output, arrived[c], out=output)
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
    if collective_check.enabled:
        collective_check.agree("broadcast", peers, tensor, (tuple(tensor.shape), src))
    if peers.coordinate == src:
        buffer = tensor.clone(memory_format=torch.contiguous_format)
        _record("broadcast", peers.mesh_dim, peers.size, _nbytes(buffer) * (peers.size - 1), 0)
    else:
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        _record("broadcast", peers.mesh_dim, peers.size, 0, _nbytes(buffer))
    work = dist.broadcast(_wire(buffer), src=peers.ranks[src], group=peers.group, async_op=async_op)
    return _complete(work, lambda: buffer, async_op)


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
    if me != src:
        buffer = torch.empty(shape, dtype=dtype, device=mesh.device_type)
        _record("scatter", peers.mesh_dim, peers.size, 0, _nbytes(buffer))
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
    _record("scatter", peers.mesh_dim, peers.size, sent_bytes, 0)
    return _complete(works, lambda: pieces[me], async_op)


def all_gather_object(obj: Any, mesh: DeviceMesh, mesh_dim: int | str | None = None) -> list:
    """Every peer's picklable `obj`, in coordinate order; mesh_dim None gathers over the whole mesh.

    For the whole mesh the list is row-major over mesh coordinates (gathered one mesh dim at a
    time, last first, so no group over the whole mesh is needed). Each mesh dim costs two
    all_gathers (lengths, then the pickled bytes), recorded as such.
    """
    if mesh_dim is not None:
        return _gather_objects(obj, mesh, mesh_dim)
    gathered = [obj]
    for index in reversed(range(mesh.ndim)):
        nested = _gather_objects(gathered, mesh, index)
        gathered = [item for items in nested for item in items]
    return gathered


def _gather_objects(obj: Any, mesh: DeviceMesh, mesh_dim: int | str) -> list:
    peers = _peers(mesh, mesh_dim)
    if peers.size == 1:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(mesh.device_type)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=mesh.device_type)
    lengths = all_gather(length, mesh, mesh_dim, dim=0, sizes=[1] * peers.size).tolist()
    data = all_gather(payload, mesh, mesh_dim, dim=0, sizes=lengths).cpu()
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in data.split(lengths)]


# --- point to point (global ranks) ----------------------------------------------------------------------
def send(tensor: torch.Tensor, dst_global_rank: int) -> None:
    """Send `tensor` to global rank `dst_global_rank` (blocking)."""
    buffer = _wire(tensor.contiguous())
    _record("send", None, 2, _nbytes(buffer), 0)
    dist.send(buffer, dst=dst_global_rank)


def recv(shape: Sequence[int], dtype: torch.dtype, src_global_rank: int, *, device: str | torch.device = "cpu") -> torch.Tensor:
    """Receive a tensor of `shape` and `dtype` from global rank `src_global_rank` (blocking)."""
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    _record("recv", None, 2, 0, _nbytes(buffer))
    dist.recv(_wire(buffer), src=src_global_rank)
    return buffer


@dataclasses.dataclass(frozen=True, slots=True)
class PointToPoint:
    """One operation for `batch_p2p`: kind "send" or "recv", the tensor (a buffer for recv), the global peer."""

    kind: str
    tensor: torch.Tensor
    peer: int

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"PointToPoint kind must be 'send' or 'recv', got {self.kind!r}")


def batch_p2p(operations: Sequence[PointToPoint], *, async_op: bool = False):
    """Run sends and receives together (no ordering deadlocks); returns the received tensors in order."""
    if not operations:
        return _identity([], async_op)
    operations = [
        dataclasses.replace(operation, tensor=operation.tensor.contiguous()) if operation.kind == "send" else operation
        for operation in operations
    ]
    for operation in operations:
        if operation.kind == "recv" and not operation.tensor.is_contiguous():
            raise ValueError("batch_p2p: a recv buffer must be contiguous; allocate it with torch.empty(shape)")
    c10d_operations = [
        dist.P2POp(dist.isend if operation.kind == "send" else dist.irecv, _wire(operation.tensor), operation.peer)
        for operation in operations
    ]
    sent = sum(_nbytes(operation.tensor) for operation in operations if operation.kind == "send")
    received = sum(_nbytes(operation.tensor) for operation in operations if operation.kind == "recv")
    _record("batch_p2p", None, 2, sent, received)
    works = dist.batch_isend_irecv(c10d_operations)
    results = [operation.tensor for operation in operations if operation.kind == "recv"]
    if async_op:
        return CommHandle(works, lambda: results)
    for work in works:
        work.wait()
    return results
