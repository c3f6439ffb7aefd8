"""What a sub-mesh sends to the ranks of the world outside it: results that depend on the data.

Every rank of the world runs every op (SPMD). A rank outside a DTensor's mesh holds no data and
computes an op's outputs from global metadata alone (`dispatch`), except where they depend on the
data: the output shapes of `nonzero` or `x[x > 0]`, and the Python values of `item()`, `equal` or
`tolist()`. The mesh's ranks call `sent_to_world`, the ranks outside `received_from_mesh`, and the
mesh's first rank sends the result, or the error the op raised on the mesh (so that the ranks
outside raise it instead of waiting), to every rank with `comm.share_object` over the world (an
all_reduce of three numbers, then a broadcast).

Only a mesh that may have ranks outside it sends (`has_ranks_outside`). Not a mesh over the whole
world; not one sliced from it (`mesh["tp"]` of a 2-D mesh): every rank is in it or in a sibling it
sliced for itself, where it runs the same ops. Any other sub-mesh (`DeviceMesh("cpu", [1, 3])`,
`from_group`) may have ranks outside running the op on it, or ranks running it on a sibling (each
rank on its own row, built by every rank): its ranks cannot tell, so every rank takes part, and a
collective in which any number of first ranks send (one per sibling) keeps the world in step. A
program whose ranks run different ops on such meshes (pipeline stages each running their own layers)
would wait here: slice the stages' meshes from one mesh over the world instead.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable
from typing import Any


from .comm import share_object
from .mesh import DeviceMesh, world_mesh

__all__ = ["has_ranks_outside", "sent_to_world", "received_from_mesh"]


def has_ranks_outside(mesh: DeviceMesh) -> bool:
    """Whether ranks of the world may run ops on `mesh` from outside it: a sub-mesh not sliced from a
    mesh over the whole world."""
    return not mesh._spans_world and not mesh._sliced_from_world


def _unchanged(result: Any) -> Any:
    return result


def sent_to_world(mesh: DeviceMesh, compute: Callable[[], Any], shown: Callable[[Any], Any] = _unchanged):
    """On the ranks of a sub-mesh: `compute()`, and from its first rank `shown(result)` (what the ranks
    outside need of it: the outputs' metadata, or the values) or the error `compute` raised, to every
    rank of the world. The ranks outside call `received_from_mesh` at the same point."""
    try:
        result = compute()
    except Exception as error:
        _share_with_world(mesh, _FailedOnMesh(type(error).__name__, str(error)))
        raise
    _share_with_world(mesh, shown(result))
    return result


def received_from_mesh(mesh: DeviceMesh, op: object) -> Any:
    """On a rank outside the mesh: what the mesh's first rank sent (`sent_to_world`); if `op` failed
    on the mesh, its error (the same builtin type, or a RuntimeError) is raised here too."""
    senders, received = _share_with_world(mesh, None)
    if senders != 1:
        raise RuntimeError(
            f"{op} on a DTensor of {mesh!r}, which this rank is outside: it waits for the one result the mesh's "
            f"first rank sends, but {senders} ranks sent one (several sub-meshes ran an op at this point, each "
            f"its own); every rank of the world must run the same ops on the same DTensors (SPMD)"
        )
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


def _share_with_world(mesh: DeviceMesh, sent: Any) -> tuple[int, Any]:
    """A collective over the world (every rank calls it alike): `sent` from the mesh's first rank."""
    world = world_mesh(mesh.device_type)
    first = int(mesh.mesh.flatten()[0])
    return share_object(sent if world.get_rank() == first else None, world, 0)
