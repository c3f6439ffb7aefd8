"""Who a collective along a mesh dim talks to: its peers in coordinate order, mapped to c10d's group order.

c10d orders a group by global rank, which may differ from coordinate order along the mesh dim; a
`_Peers` value holds both orders so the collectives can hide the difference. Peers along several mesh
dims at once run over a group of the flattened ranks when one exists (made by every rank: on a mesh over
the whole world, or by `DeviceMesh._flatten`); on a slice without one they hold no group but the peers of
each mesh dim (`parts`), and the collectives run one per mesh dim, as torch's DTensor does on a slice.
Also the size checks every collective makes against its peers, with their error messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import DeviceMesh
from ..process_groups import has_group, named_group, on_new_world

__all__ = ["MeshDims"]

# A mesh dim (index or name), or a tuple of them: the flattened sub-mesh, row-major in the order given.
MeshDims = int | str | tuple[int | str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Peers:
    mesh_dim: int | tuple[int, ...]
    size: int
    coordinate: int
    ranks: tuple[int, ...]  # global ranks in coordinate order
    group_order: tuple[int, ...]  # coordinates in c10d group-rank order
    group_rank: tuple[int, ...]  # coordinate -> c10d group rank
    group: Any  # None for one rank, and for `parts`
    mesh_dim_names: tuple[str, ...] | None  # the names of `mesh_dim` on the mesh, for the records
    # Several mesh dims without a group over their flattened ranks: the peers of each mesh dim, in the
    # order given (coordinate = parts[0].coordinate * parts[1].size * ... + parts[-1].coordinate).
    parts: tuple[_Peers, ...] = ()
    # gloo's even reduce_scatter reduces the whole tensor (twice the ideal bytes, and more CPU in its threads
    # than an all_to_all of the pieces and a local reduction, measured in bench/README.md "The demo's step"):
    # the collectives reduce by exchange on gloo groups.
    reduces_by_exchange: bool = False

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
    # peers without a flattened group use one made since (`_flatten`) from then on
    if peers is None or peers.parts and has_group(tuple(sorted(peers.ranks))):
        if isinstance(mesh_dim, tuple) and len(mesh_dim) > 1:
            peers = _flattened_peers(mesh, mesh_dim)
        else:
            index = mesh._mesh_dim_index(mesh_dim[0] if isinstance(mesh_dim, tuple) else mesh_dim)
            ranks = mesh.group_ranks(index)
            group = mesh.get_group(index) if len(ranks) > 1 else None
            peers = _make_peers(index, ranks, mesh.get_local_rank(index), group, _names(mesh, (index,)))
        _peers_cache[key] = peers
    return peers


def _make_peers(mesh_dim, ranks: tuple[int, ...], coordinate: int, group, names) -> _Peers:
    """Peers in coordinate order; c10d's rank of each in `group` is asked (a user's group from
    `DeviceMesh.from_group` may order its ranks other than by global rank)."""
    if group is None:
        group_rank = tuple(range(len(ranks)))
    else:
        group_rank = tuple(dist.get_group_rank(group, rank) for rank in ranks)
    group_order = tuple(sorted(range(len(ranks)), key=lambda position: group_rank[position]))
    reduces_by_exchange = group is not None and dist.get_backend(group) == "gloo"
    return _Peers(mesh_dim, len(ranks), coordinate, ranks, group_order, group_rank, group, names, (), reduces_by_exchange)


def _names(mesh: DeviceMesh, indices: tuple[int, ...]) -> tuple[str, ...] | None:
    return None if mesh.mesh_dim_names is None else tuple(mesh.mesh_dim_names[index] for index in indices)


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
    key, names, coordinate = tuple(sorted(ranks)), _names(mesh, indices), ranks.index(mesh.get_rank())
    if len(ranks) > 1 and mesh._spans_world:
        # Every rank holds this mesh and runs its collectives (on its own plane): they make every such
        # group together (a no-op for groups that exist, e.g. the world's).
        mesh._create_flattened_groups(indices)
    if len(ranks) == 1 or has_group(key):
        group = None if len(ranks) == 1 else named_group(key, None)
        return _make_peers(indices, ranks, coordinate, group, names)
    # A slice (other slices may run other ops: pipeline stages) with no flattened group (`_flatten` makes
    # one): its members alone cannot make one (torch names such a group by hashing its ranks with the
    # number of groups each member has been in, so members that were in different groups would hang).
    parts = tuple(_peers(mesh, index) for index in indices)
    return dataclasses.replace(_make_peers(indices, ranks, coordinate, None, names), parts=parts)


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
    """The sizes as ints, SymInts (torch.compile's dynamic shapes) as they are, checked against the peers."""
    sizes = [size if isinstance(size, torch.SymInt) else int(size) for size in sizes]
    if len(sizes) != peers.size or any(isinstance(size, int) and size < 0 for size in sizes):
        raise _sizes_error(function, name, sizes, peers, f"{peers.size} non-negative sizes in coordinate order")
    return sizes
