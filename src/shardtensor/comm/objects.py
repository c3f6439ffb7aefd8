"""Collectives of picklable Python objects, and the gather of a small fixed-size tensor over a whole mesh,
built on `all_gather`, `broadcast` and `all_reduce` (so they are recorded as such)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..mesh import DeviceMesh
from .collectives import all_gather, all_reduce, broadcast
from .peers import _peers

__all__ = ["all_gather_object", "all_gather_over_mesh", "broadcast_object", "share_object"]


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


def all_gather_over_mesh(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's `tensor` (one shape on every rank), stacked in row-major mesh-coordinate order:
    shape `(mesh.size(), *tensor.shape)`. One all_gather over the flattened mesh when the mesh spans
    the world (its group is the world's: none is made), else one per mesh dim of more than one rank.

    >>> all_gather_over_mesh(torch.tensor([rank], device=mesh.device_type), mesh).flatten().tolist()  # doctest: +SKIP
    [0, 1, 2, 3]
    """
    stacked = tensor.unsqueeze(0)
    if mesh.ndim > 1 and mesh._spans_world:
        steps = [tuple(range(mesh.ndim))]
    else:  # the last mesh dim first, so that the rows end up row-major
        steps = list(reversed(range(mesh.ndim)))
    for mesh_dim in steps:
        peers = mesh.size() if isinstance(mesh_dim, tuple) else mesh.size(mesh_dim)
        stacked = all_gather(stacked, mesh, mesh_dim, dim=0, sizes=[stacked.shape[0]] * peers)
    return stacked


def _gather_objects(obj: Any, mesh: DeviceMesh, mesh_dim: int | str) -> list:
    peers = _peers(mesh, mesh_dim)
    if peers.size == 1:
        return [obj]
    payload = _pickled(obj, mesh.device_type)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=mesh.device_type)
    lengths = all_gather(length, mesh, mesh_dim, dim=0, sizes=[1] * peers.size).tolist()
    data = all_gather(payload, mesh, mesh_dim, dim=0, sizes=lengths).cpu()
    return [_unpickled(chunk) for chunk in data.split(lengths)]


def broadcast_object(obj: Any, mesh: DeviceMesh, mesh_dim: int | str, *, src: int = 0) -> Any:
    """Coordinate `src`'s picklable `obj` on every peer along `mesh_dim` (others pass None).

    Two broadcasts, recorded as such: the payload's length (other peers cannot know it), then the
    pickled bytes.
    """
    peers = _peers(mesh, mesh_dim)
    if peers.size == 1:
        return obj
    payload = None
    length = torch.zeros(1, dtype=torch.int64, device=mesh.device_type)
    if peers.coordinate == src:
        payload = _pickled(obj, mesh.device_type)
        length.fill_(payload.numel())
    length = broadcast(length, mesh, mesh_dim, src=src)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=mesh.device_type)
    data = broadcast(payload, mesh, mesh_dim, src=src).cpu()
    return obj if peers.coordinate == src else _unpickled(data)


def share_object(obj: Any, mesh: DeviceMesh, mesh_dim: int | str) -> tuple[int, Any]:
    """(how many peers along `mesh_dim` passed an object, the object) on every peer, where the others
    pass None; the object is None unless exactly one peer passed one.

    Unlike `broadcast_object`, no peer needs to know which one sends, so peers that are each the sender
    of their own sub-mesh (every row of a 2-D mesh at once) call it alike: an all_reduce (sum) of three
    int64s (the number of senders, the sender's coordinate, the pickle's length), then, when exactly one
    peer sent, a broadcast of the pickle from it. (The pickle could ride in the all_reduce, but gloo's
    all_reduce of 1 KiB takes about five times as long as a broadcast of it.)
    """
    peers = _peers(mesh, mesh_dim)
    if peers.size == 1:
        return int(obj is not None), obj
    payload = None if obj is None else _pickled(obj, mesh.device_type)
    header = [0, 0, 0] if payload is None else [1, peers.coordinate, payload.numel()]
    header = torch.tensor(header, dtype=torch.int64, device=mesh.device_type)
    senders, source, length = all_reduce(header, mesh, mesh_dim, reduce_op="sum").tolist()
    if senders != 1:
        return senders, None
    if payload is None:
        payload = torch.empty(length, dtype=torch.uint8, device=mesh.device_type)
    data = broadcast(payload, mesh, mesh_dim, src=source).cpu()
    return 1, obj if obj is not None else _unpickled(data)


def _pickled(obj: Any, device_type: str) -> torch.Tensor:
    """`obj` pickled into a uint8 tensor on the mesh's device (what the collectives send)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device_type)


def _unpickled(data: torch.Tensor) -> Any:
    """The object a received uint8 tensor (on the CPU) holds."""
    return pickle.loads(data.numpy().tobytes())
