"""Collectives of picklable Python objects, built on `all_gather` and `broadcast` (so they are recorded as such)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..mesh import DeviceMesh
from .collectives import all_gather, broadcast
from .peers import _peers

__all__ = ["all_gather_object", "broadcast_object"]


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
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(mesh.device_type)
        length.fill_(payload.numel())
    length = broadcast(length, mesh, mesh_dim, src=src)
    if payload is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=mesh.device_type)
    data = broadcast(payload, mesh, mesh_dim, src=src).cpu()
    return obj if peers.coordinate == src else pickle.loads(data.numpy().tobytes())
