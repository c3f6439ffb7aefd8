"""What a sub-mesh sends to the ranks of the world outside it: results that depend on the data.

Every rank of the world runs every op (SPMD). A rank outside a DTensor's mesh holds no data and
computes an op's outputs from global metadata alone (`dispatch`), except where they depend on the
data: the output shapes of `nonzero` or `x[x > 0]`, and the Python values of `item()`, `equal` or
`tolist()`. The mesh's ranks call `sent_to_world`, the ranks outside `received_from_mesh`, and the
mesh's first rank sends the result, or the error the op raised on the mesh (so that the ranks
outside raise it instead of waiting), to every rank with one `broadcast_object` (two broadcasts).
Only a sub-mesh sends: on a mesh over the whole world no rank is outside.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .comm import broadcast_object
from .mesh import DeviceMesh, world_mesh

__all__ = ["is_sub_mesh", "sent_to_world", "received_from_mesh"]


def is_sub_mesh(mesh: DeviceMesh) -> bool:
    """Whether some rank of the world is outside `mesh`."""
    return mesh.size() < dist.get_world_size()


def _unchanged(result: Any) -> Any:
    return result


def sent_to_world(mesh: DeviceMesh, compute: Callable[[], Any], shown: Callable[[Any], Any] = _unchanged):
    """On the ranks of a sub-mesh: `compute()`, and from its first rank `shown(result)` (what the ranks
    outside need of it: the outputs' metadata, or the values) or the error `compute` raised, to every
    rank of the world. The ranks outside call `received_from_mesh` at the same point."""
    try:
        result = compute()
    except Exception as error:
        _broadcast_from_first_rank(mesh, _FailedOnMesh(type(error).__name__, str(error)))
        raise
    _broadcast_from_first_rank(mesh, shown(result))
    return result


def received_from_mesh(mesh: DeviceMesh, op: object) -> Any:
    """On a rank outside the mesh: what the mesh's first rank sent (`sent_to_world`); if `op` failed
    on the mesh, its error (the same builtin type, or a RuntimeError) is raised here too."""
    received = _broadcast_from_first_rank(mesh, None)
    if isinstance(received, _FailedOnMesh):
        raise received.error(op, mesh)
    return received


@dataclasses.dataclass(frozen=True, slots=True)
class _FailedOnMesh:
    """What the mesh's first rank sends instead of a result when the op failed."""

    kind: str
    message: str

    def error(self, op, mesh) -> Exception:
        kind = getattr(builtins, self.kind, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
        return kind(f"{op} failed on the ranks of {mesh!r} (this rank is outside it): {self.kind}: {self.message}")


def _broadcast_from_first_rank(mesh: DeviceMesh, sent: Any) -> Any:
    """A collective over the world (every rank calls it alike): the mesh's first rank's `sent` everywhere."""
    world = world_mesh(mesh.device_type)
    first = int(mesh.mesh.flatten()[0])
    return broadcast_object(sent if world.get_rank() == first else None, world, 0, src=first)
