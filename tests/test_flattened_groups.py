"""A collective over several mesh dims at once (a flattened reduction) on a plane of the world mesh, after
ranks of that plane have been in different groups: its group must form on every member, not hang."""

import torch
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate
from shardtensor.debug import CommDebugMode
from shardtensor.mesh import DeviceMesh, init_device_mesh


@spmd(meshes=[(2, 2, 2)], timeout=300.0)
def test_flattened_reduction_after_asymmetric_groups(mesh):
    """Torch names a group its members make alone by hashing its ranks with the number of groups each
    member has been in; after a sub-mesh over ranks 0 and 3 (not a line of the 2x2x2 mesh), ranks 0 and 2
    of the plane {0, 2, 4, 6} disagree and such a group hung. The world mesh's planes are made by all."""
    DeviceMesh("cpu", [0, 3])  # every rank builds it; only ranks 0 and 3 are in its group
    world = init_device_mesh("cpu", (2, 2, 2))
    full = torch.arange(24.0).reshape(4, 6)
    partial = DTensor.from_local(full / 4, world, [Partial(), Partial(), Replicate()])  # four equal parts: exact
    with CommDebugMode() as comm_mode:
        reduced = partial.redistribute(world, [Replicate(), Replicate(), Replicate()])
    assert torch.equal(reduced.to_local(), full)
    assert comm_mode.get_comm_counts() == {"all_reduce": 1}  # over mesh dims 0 and 1 at once: 4 of the 8 ranks
