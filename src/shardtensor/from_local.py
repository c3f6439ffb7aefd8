"""`from_local`'s layout: the global shape and exact shard sizes from every rank's local tensor.

Given a global `shape`, the shards follow `torch.chunk` (or explicit `shard_sizes`) and this rank's
shape is checked. Without one, a Shard placement makes every rank share its local shape once (one
fixed-size all_gather, `_exchange`), so uneven shards are exact; `shard_sizes="chunk"` assumes equal local shapes
as PyTorch does, and `shard_sizes={mesh_dim: sizes}` gives them. Every rank sees the same gathered
data, so a mismatch raises the same error on every rank.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

from . import comm
from .comm.c10d import tracing
from .layout import Layout
from .placement import Shard, check_partial_dtype

__all__ = ["from_local_layout", "shard_sizes_from_shapes"]


def _coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(size) for size in mesh_shape)))


def check_dense(tensor, function: str) -> None:
    """Refuse, before any collective, a tensor whose data a DTensor cannot hold as a strided shard."""
    if tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized:
        raise TypeError(_not_dense_error(tensor, function))


def _not_dense_error(tensor, function: str) -> str:
    kind = "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else f"layout {tensor.layout}"
    return (
        f"{function} takes a dense strided tensor, got a {kind} tensor of dtype {tensor.dtype}; "
        f"sparse, nested and quantized tensors cannot be sharded: convert it first (tensor.to_dense(), "
        f"tensor.dequantize(), or one DTensor per nested component)"
    )


def from_local_layout(local, mesh, placements, shape, shard_sizes, run_check: bool) -> Layout:
    """The layout of the DTensor made from this rank's `local` tensor (see `DTensor.from_local`)."""
    check_dense(local, "DTensor.from_local")
    check_partial_dtype(placements, local.dtype, "DTensor.from_local")
    mesh_shape = tuple(mesh.shape)
    if len(placements) != len(mesh_shape):
        # Layout.create raises the full message; do it before any collective so that every rank fails alike.
        Layout.create(mesh_shape, placements, local.shape)
    if mesh.get_coordinate() is None:
        return _outside_layout(local, mesh_shape, placements, shape, shard_sizes)
    coordinate = tuple(mesh.get_coordinate())
    gathered = None
    if run_check or (shape is None and shard_sizes in (None, "infer") and any(isinstance(p, Shard) for p in placements)):
        if tracing():
            return _assumed_and_checked_in_graph(local, mesh, placements, shape, shard_sizes, run_check)
        gathered = _exchange(local, mesh, placements)
    if gathered is not None:
        asked = "from_local(run_check=True)" if run_check else _INFERRING
        _check_gathered(gathered, mesh_shape, placements, asked)
    if shape is not None:
        mapping = None if shard_sizes in (None, "infer", "chunk") else shard_sizes
        layout = Layout.create(mesh_shape, placements, shape, shard_sizes=mapping)
        checked = gathered if gathered is not None else {coordinate: tuple(local.shape)}
        for where, entry in checked.items():
            local_shape = entry[0] if gathered is not None else entry
            if tuple(local_shape) != layout.local_shape(where):
                raise ValueError(
                    f"from_local: the local tensor at mesh coordinate {where} has shape {tuple(local_shape)}, "
                    f"but shape={tuple(shape)} with placements {placements!r} gives that coordinate "
                    f"{layout.local_shape(where)}; pass the global shape that the shards add up to, or "
                    f"omit shape to infer it from the local shapes"
                )
        return layout
    if shard_sizes == "chunk" or not any(isinstance(p, Shard) for p in placements):
        return _chunk_layout(local, mesh_shape, placements)
    if shard_sizes in (None, "infer"):
        return Layout.from_local_shapes(mesh_shape, placements, {where: entry[0] for where, entry in gathered.items()})
    return _explicit_layout(local, mesh_shape, placements, shard_sizes, coordinate)


def shard_sizes_from_shapes(sharding_shapes, local, mesh, placements, check_local: bool):
    """PhysicsNeMo's `sharding_shapes` as our `shard_sizes`: "infer" and "chunk" as they are, and
    `{mesh_dim: [local shape of each coordinate along mesh_dim]}` as `{mesh_dim: [sizes]}`.

    The shapes must agree with each other off the dim `mesh_dim` shards (an argument check, alike on
    every rank given alike arguments). `check_local` also compares them with this rank's local tensor
    here, before any collective could be waiting for this rank; `from_local(run_check=True)` passes
    False, as its exchange checks every rank's shape (`_explicit_layout`) after gathering them.
    """
    if sharding_shapes in ("infer", "chunk"):
        return sharding_shapes
    if not isinstance(sharding_shapes, Mapping):
        raise ValueError(_shapes_error(sharding_shapes, "is neither 'infer', 'chunk' nor a mapping"))
    coordinate = mesh.get_coordinate()
    counts = Counter(p.dim % max(local.ndim, 1) for p in placements if isinstance(p, Shard))
    sizes_by_mesh_dim = {}
    for mesh_dim, shapes in sharding_shapes.items():
        placement = placements[mesh_dim] if isinstance(mesh_dim, int) and 0 <= mesh_dim < len(placements) else None
        if not isinstance(placement, Shard):
            raise ValueError(_shapes_error(
                sharding_shapes, f"has key {mesh_dim!r}, which is not a mesh dim with a Shard placement "
                f"(placements {tuple(placements)!r})"))
        if not -local.ndim <= placement.dim < local.ndim:
            Layout.create(mesh.shape, placements, local.shape)  # raises the out-of-range message
        dim = placement.dim % local.ndim
        if counts[dim] > 1:
            raise ValueError(_shapes_error(
                sharding_shapes, f"gives shapes for mesh dim {mesh_dim}, but tensor dim {dim} is sharded by "
                f"several mesh dims; explicit shapes need a tensor dim sharded by one mesh dim: pass "
                f"sharding_shapes='infer' for nested uneven shards"))
        shapes = [tuple(int(size) for size in shape) for shape in shapes]
        if len(shapes) != mesh.shape[mesh_dim] or any(len(shape) != local.ndim for shape in shapes):
            raise ValueError(_shapes_error(
                sharding_shapes, f"gives {len(shapes)} shapes for mesh dim {mesh_dim}; expected "
                f"{mesh.shape[mesh_dim]} shapes (one per coordinate along it) of {local.ndim} sizes each"))
        reference = list(local.shape) if check_local else list(shapes[0])
        for position, shape in enumerate(shapes):
            mine = check_local and coordinate is not None and position == coordinate[mesh_dim]
            expected = list(reference)
            if not mine:  # a peer along mesh_dim: the same sizes except on the dim mesh_dim shards
                expected[dim] = shape[dim]
            if list(shape) != expected or min(shape, default=0) < 0:
                whose = f"this rank's local shape {tuple(local.shape)}" if check_local else f"the shape {shapes[0]}"
                why = "this rank's local shape" if mine else f"{whose} except on dim {dim}"
                raise ValueError(_shapes_error(
                    sharding_shapes, f"gives coordinate {position} of mesh dim {mesh_dim} the shape {shape}; "
                    f"expected {tuple(expected)} ({why}) with non-negative sizes"))
        sizes_by_mesh_dim[mesh_dim] = [shape[dim] for shape in shapes]
    return sizes_by_mesh_dim


def _shapes_error(sharding_shapes, problem: str) -> str:
    return (
        f"from_local: sharding_shapes={sharding_shapes!r} {problem}. Allowed: 'infer' (gather every rank's "
        f"local shape), 'chunk' (torch.chunk shapes), or {{mesh_dim: [local shape of each coordinate along "
        f"mesh_dim]}} for mesh dims with a Shard placement"
    )


# The fixed size of a rank's record in the exchange: its number of dims, a digest of its dtype and
# placements, then its local shape padded to _RECORD_DIMS sizes.
_RECORD_DIMS = 8


def _digest(local, placements) -> int:
    """A number that differs (but for a 2**-64 chance) when the dtype or placements differ, alike on every rank."""
    described = repr((str(local.dtype), tuple(placements))).encode()
    return int.from_bytes(hashlib.blake2b(described, digest_size=8).digest(), "little", signed=True)


def _exchange(local, mesh, placements) -> dict:
    """{mesh coordinate: (local shape, dtype, placements)} of every rank, the same on every rank.

    One all_gather of fixed-size records (`comm.all_gather_over_mesh`). Only when the ranks' digests
    differ (another dtype or placements somewhere: the message names them) or a tensor has more than
    _RECORD_DIMS dims, every rank, having seen the same records, exchanges the whole entries as objects.
    """
    digest = _digest(local, placements)
    record = torch.tensor(_record(local.shape[:_RECORD_DIMS], local.ndim, digest, 2 + _RECORD_DIMS), device=mesh.device_type)
    rows = comm.all_gather_over_mesh(record, mesh).tolist()
    coordinates = _coordinates(mesh.shape)
    if all(row[0] <= _RECORD_DIMS and row[1] == digest for row in rows):
        return {where: (tuple(row[2:2 + row[0]]), local.dtype, placements) for where, row in zip(coordinates, rows)}
    mine = (tuple(local.shape), local.dtype, placements)
    return dict(zip(coordinates, comm.all_gather_object(mine, mesh, None)))


def _record(local_shape, ndim: int, digest: int, length: int) -> list[int]:
    return [ndim, digest, *local_shape] + [0] * (length - 2 - len(local_shape))


def _assumed_and_checked_in_graph(local, mesh, placements, shape, shard_sizes, run_check: bool) -> Layout:
    """The layout from_local assumes while torch.compile traces, checked inside the graph.

    A graph cannot read other ranks' local shapes to build its layout (that read decides the shapes it
    was traced for), so it assumes them: from `shape` and `shard_sizes` when given, else every rank
    holding this rank's local shape (equal shards, as PyTorch assumes). Every run of the graph then
    exchanges the real local shapes (the one all_gather eager mode makes) and asserts they are the
    assumed ones, so uneven shards the graph did not assume raise on every rank instead of computing
    with wrong sizes.
    """
    sizes = "chunk" if shape is None else shard_sizes
    layout = from_local_layout(local, mesh, placements, shape, sizes, run_check=False)
    digest = _digest(local, placements)
    length = 2 + max(local.ndim, _RECORD_DIMS)
    record = torch.tensor(_record(local.shape, local.ndim, digest, length), device=local.device)
    expected = torch.tensor([_record(layout.local_shape(where), local.ndim, digest, length) for where in _coordinates(mesh.shape)],
                            device=local.device)
    received = comm.all_gather_over_mesh(record, mesh)
    torch._assert_async((received == expected).all(), _assumed_shapes_error(layout, run_check))
    return layout


def _assumed_shapes_error(layout: Layout, run_check: bool) -> str:
    asked = "from_local(run_check=True)" if run_check else "from_local without shape="
    return (
        f"{asked} inside a torch.compile graph: the graph was traced for the local shapes of {layout} "
        f"(every rank's shard as this rank's, or as shape= and shard_sizes= give them), but some rank's "
        f"local tensor has another shape or dtype or other placements. Pass shape= (and shard_sizes= for "
        f"uneven shards) to from_local; between parallel styles, keep the activations DTensors "
        f"(use_local_output=False), so their exact layout travels with them"
    )


def _outside_layout(local, mesh_shape, placements, shape, shard_sizes) -> Layout:
    """The layout on a rank outside the mesh, which cannot ask the mesh's ranks for their shapes."""
    mapping = None if shard_sizes in (None, "infer", "chunk") else shard_sizes
    if shape is not None:
        return Layout.create(mesh_shape, placements, shape, shard_sizes=mapping)
    if mapping is not None:
        return _explicit_layout(local, mesh_shape, placements, mapping, None)
    return _chunk_layout(local, mesh_shape, placements)


# What exchanged the local shapes when run_check was not asked for (a message names it).
_INFERRING = "from_local (inferring the global shape from every rank's local shape: a Shard placement and no shape=)"


def _check_gathered(gathered, mesh_shape, placements, asked: str) -> None:
    """Compare what every rank sent; all ranks see the same data, so all raise the same error, naming
    what exchanged it (`asked`: run_check, or the inference of the global shape)."""
    first_coordinate, (first_shape, first_dtype, first_placements) = next(iter(gathered.items()))
    for where, (local_shape, dtype, their_placements) in gathered.items():
        if dtype != first_dtype or their_placements != first_placements or len(local_shape) != len(first_shape):
            raise ValueError(
                f"{asked}: ranks disagree: mesh coordinate {first_coordinate} has a local tensor "
                f"of shape {first_shape}, dtype {first_dtype}, placements {first_placements!r}, and mesh "
                f"coordinate {where} has shape {local_shape}, dtype {dtype}, placements {their_placements!r}; "
                f"every rank must pass the same dtype, number of dims and placements"
            )
    Layout.from_local_shapes(
        mesh_shape,
        placements,
        {where: entry[0] for where, entry in gathered.items()},
    )


def _chunk_layout(local, mesh_shape, placements) -> Layout:
    """PyTorch's assumption: every shard has this rank's local shape."""
    shape = list(local.shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            if not -local.ndim <= placement.dim < local.ndim:
                Layout.create(mesh_shape, placements, local.shape)  # raises the out-of-range message
            shape[placement.dim % local.ndim] *= mesh_shape[mesh_dim]
    return Layout.create(mesh_shape, placements, shape)


def _explicit_layout(local, mesh_shape, placements, shard_sizes, coordinate) -> Layout:
    if isinstance(shard_sizes, str) or not isinstance(shard_sizes, Mapping):
        raise ValueError(
            f"from_local: shard_sizes={shard_sizes!r} is not understood; use 'infer' (default), 'chunk', "
            f"or a mapping {{mesh_dim: sizes}}"
        )
    shape = list(_chunk_layout(local, mesh_shape, placements).shape)
    for mesh_dim, sizes in shard_sizes.items():
        placement = placements[mesh_dim] if isinstance(mesh_dim, int) and 0 <= mesh_dim < len(placements) else None
        if isinstance(placement, Shard):
            shape[placement.dim % local.ndim] = sum(sizes)
    layout = Layout.create(mesh_shape, placements, shape, shard_sizes=shard_sizes)
    if coordinate is not None and layout.local_shape(coordinate) != tuple(local.shape):
        raise ValueError(
            f"from_local: shard_sizes={dict(shard_sizes)!r} gives mesh coordinate {coordinate} a shard of shape "
            f"{layout.local_shape(coordinate)}, but its local tensor has shape {tuple(local.shape)}"
        )
    return layout
