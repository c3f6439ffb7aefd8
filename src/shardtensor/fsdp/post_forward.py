"""`reshard_after_forward=k` (an int): after forward a unit keeps what a sub-group of k ranks needs to
re-gather its parameters, so that backward all-gathers within that sub-group (intra-node, say) instead
of over the whole shard mesh dim, at the cost of memory between forward and backward (FSDP2's
post-forward mesh).

The n ranks along the shard mesh dim split into n/k sub-groups of k consecutive coordinates (PyTorch's
`mesh.view(-1, k)`). A unit's gathered buffer is coordinate-major, so the segments of coordinates
[p*n/k, (p+1)*n/k) are one contiguous block of it: the sub-group's member p keeps block p, and one
all_gather_into over the sub-group writes the gathered buffer exactly as the full gather does (uneven
and empty pieces included, no padding), which the unit then copies out as usual.

A kept block serves the backward (and activation checkpointing's recomputation) of the step that kept
it, nothing else: the root's next forward, an explicit `unshard()` and the end of backward drop it. So
no gather ever sends values older than the sharded parameters, whatever changed them in between (an
optimizer step after a forward without backward); version counters cannot tell, as optimizers may
update a unit's parameters through its flat buffer.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from .. import comm
from ..mesh import DeviceMesh
from .slots import ParameterSlot

__all__ = ["PostForwardShard", "reshard_after_forward_choice"]


def _choice_error(kind: type[Exception], caller: str, value, size: int) -> Exception:
    divisors = [divisor for divisor in range(2, size + 1) if size % divisor == 0]
    ints = f"an int in {divisors}" if divisors else "no int larger than 1 (the shard mesh dim has one rank)"
    return kind(
        f"{caller}: reshard_after_forward={value!r} does not fit the shard mesh dim of {size} ranks; pass True, "
        f"False, None (True except for the root module) or {ints}: the number of ranks to reshard to after "
        f"forward, which must divide {size} (1 means False, {size} means True)"
    )


def reshard_after_forward_choice(value, size: int, caller: str) -> bool | int | None:
    """`value` checked against a shard mesh dim of `size` ranks: None, True or False as given, an int k
    with 1 < k < size as is; the int 1 is False (with a warning, as in PyTorch) and `size` is True."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise _choice_error(TypeError, caller, value, size)
    if value < 1 or size % value != 0:
        raise _choice_error(ValueError, caller, value, size)
    if value == 1:
        warnings.warn(f"{caller}: reshard_after_forward=1 keeps the whole unsharded parameters after forward, "
                      f"as reshard_after_forward=False does (pass False to say so)", UserWarning, stacklevel=3)
        return False
    return True if value == size else value


def sub_group_mesh(mesh: DeviceMesh, shard_mesh_dim: int, group_size: int) -> DeviceMesh:
    """The 1-D mesh over this rank's sub-group: `group_size` consecutive coordinates along `shard_mesh_dim`.

    Its process group is made with every sub-group of the world at once, by every rank in the same order
    (collective, like building a mesh; later units find them made). Groups made by their members alone
    (`new_group(use_local_synchronization=True)`) take torch's hashed names, which count the groups each
    member has seen: members that saw different numbers (a sub-mesh one of them is in) hang."""
    mesh._create_split_groups(shard_mesh_dim, (mesh.size(shard_mesh_dim) // group_size, group_size))
    line = mesh.group_ranks(shard_mesh_dim)
    first = mesh.get_local_rank(shard_mesh_dim) // group_size * group_size
    return DeviceMesh(mesh.device_type, list(line[first : first + group_size]), _groups_exist=True)


class PostForwardShard:
    """A unit's block of its gathered buffer, kept from the end of forward until backward re-gathers it
    over the sub-group (`mesh`, whose member p keeps block p)."""

    def __init__(self, group_size: int, mesh: DeviceMesh, shard_mesh_dim: int, segment_sizes: Sequence[int]):
        self.mesh = sub_group_mesh(mesh, shard_mesh_dim, group_size)
        per_member = len(segment_sizes) // group_size
        self.block_sizes = tuple(sum(segment_sizes[p * per_member : (p + 1) * per_member]) for p in range(group_size))
        self._member = self.mesh.get_local_rank()
        self._coordinates = range(self._member * per_member, (self._member + 1) * per_member)
        self._block_start = sum(self.block_sizes[: self._member])
        self._kept: torch.Tensor | None = None
        self._targets: list[torch.Tensor] = []
        self._sources: list[torch.Tensor] = []

    def bind(self, slots: Sequence[ParameterSlot], unsharded: torch.Tensor) -> None:
        """Views from the unit's (new) flat unsharded buffer to the kept block: each piece of this block's coordinates."""
        self._kept = unsharded.new_empty(self.block_sizes[self._member])
        self._targets, self._sources = [], []
        for slot in slots:
            whole = unsharded[slot.unsharded_offset : slot.unsharded_offset + slot.numel].view(slot.unsharded_shape)
            for c in self._coordinates:
                numel = slot.piece_numel(c)
                if numel:
                    start = slot.gathered_offsets[c] - self._block_start
                    self._targets.append(self._kept[start : start + numel].view(slot.piece_shape(c)))
                    self._sources.append(whole.narrow(slot.dim, slot.piece_start(c), slot.piece_sizes[c]))
        self.drop()

    def keep(self) -> None:
        """Copy this block out of the gathered parameters, before they are freed."""
        storage = self._kept.untyped_storage()
        storage.resize_(self._kept.numel() * self._kept.element_size())
        if self._targets:
            torch._foreach_copy_(self._targets, self._sources)

    def gather_into(self, gathered: torch.Tensor):
        """Start the sub-group's all-gather of the kept blocks into the unit's whole gathered buffer."""
        return comm.all_gather_into(gathered, self._kept, self.mesh, 0, sizes=self.block_sizes, async_op=True)

    def drop(self) -> None:
        """Free the kept block (after its gather finished, or when the unit reshards fully)."""
        if self._kept is not None:
            self._kept.untyped_storage().resize_(0)
