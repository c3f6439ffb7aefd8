"""An op's input moved to the layout its rule needs, a Partial input reduced only once.

Autograd saves the inputs of an op for its backward, so a Partial input that the forward had to
reduce (`(y - target) ** 2` with `y` Partial) would be reduced again when the backward formula
reads it (`pow`'s gradient uses `self`): one more collective per step than the hand-written
program. A DTensor holding Partial values therefore keeps the result of its last implicit move
(one entry: target layout, and the shard it was computed from with both version counters, so an
in-place write into either invalidates it; inputs an op writes to are never kept), and the next op that needs the same layout reuses it. Moves from layouts
without a Partial are not kept: recomputing them (an all_gather of a saved shard) is the memory
saving the program chose by sharding.
"""

from __future__ import annotations

import torch

from .layout import Layout
from .redistribute import redistribute_local_tensor

__all__ = ["moved_local"]


def moved_local(dtensor, target: Layout, mesh) -> torch.Tensor:
    """`dtensor`'s shard redistributed to `target` (which differs from its layout); not for an input
    the op writes to."""
    source = dtensor._spec.layout
    local = dtensor._local_tensor
    if not source.partial_mesh_dims():
        return redistribute_local_tensor(local, source, target, mesh)
    kept = dtensor.__dict__.get("_moved")
    if kept is not None:
        kept_target, kept_source, versions, kept_result = kept
        if kept_target == target and kept_source is local and versions == (local._version, kept_result._version):
            return kept_result
    result = redistribute_local_tensor(local, source, target, mesh)
    dtensor._moved = (target, local, (local._version, result._version), result)
    return result
