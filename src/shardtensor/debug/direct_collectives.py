"""Collectives a program calls directly through `torch.distributed` or torch's functional collectives,
as `CommDebugMode` sees them: which torch ops count, under which key, and whether `shardtensor.comm`
issued the call (it records its own collectives, so those must not count twice), eagerly or in a
compiled graph (whose collectives of ours each come with the op that records them: `comm.records`).

The table is the one torch's CommDebugMode counts (its `c10d_collective_ops` and functional
collectives), with the same keys: a c10d op under its own name (`dist.all_reduce` ->
"c10d.allreduce_"), a functional collective under its legacy `c10d_functional` name
(`funcol.all_reduce` -> "c10d_functional.all_reduce"). Like torch, barrier, send and recv do not count.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch.distributed import distributed_c10d

from .. import comm
from ..comm import CommRecord

__all__ = ["DirectRecord", "TORCH_KEY_KINDS", "KIND_TORCH_KEYS", "torch_key", "direct_record", "in_compiled_graph"]

# torch's CommDebugMode key of each collective op it counts -> our collective kind.
TORCH_KEY_KINDS = {
    "c10d._allgather_base_": "all_gather",
    "c10d.allgather_": "all_gather",
    "c10d.allgather_coalesced_": "all_gather",
    "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d.allreduce_": "all_reduce",
    "c10d.allreduce_coalesced_": "all_reduce",
    "c10d.alltoall_": "all_to_all",
    "c10d.alltoall_base_": "all_to_all",
    "c10d.broadcast_": "broadcast",
    "c10d.gather_": "gather",
    "c10d.scatter_": "scatter",
    "c10d.reduce_": "reduce",
    "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d_functional.all_gather_into_tensor": "all_gather",
    "c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "c10d_functional.all_reduce": "all_reduce",
    "c10d_functional.all_reduce_coalesced": "all_reduce",
    "c10d_functional.all_to_all_single": "all_to_all",
    "c10d_functional.broadcast": "broadcast",
    "c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
}
# The key torch counts a torch DTensor's collective of each of our kinds under, which our DTensor's
# collectives answer: redistributes use functional collectives, distribute_tensor broadcasts and
# scatters through c10d. torch counts no point-to-point, so send, recv and batch_p2p have no key.
KIND_TORCH_KEYS = {
    "all_gather": "c10d_functional.all_gather_into_tensor",
    "all_to_all": "c10d_functional.all_to_all_single",
    "all_reduce": "c10d_functional.all_reduce",
    "reduce_scatter": "c10d_functional.reduce_scatter_tensor",
    "broadcast": "c10d.broadcast_",
    "scatter": "c10d.scatter_",
}
# Namespaces whose ops torch counts under another one: native functional collectives under the legacy
# names (only those torch maps: the autograd namespace's all_to_all_single alone).
_NAMESPACE_ALIASES = {"_c10d_functional": "c10d_functional", "_c10d_functional_autograd": "c10d_functional"}
_AUTOGRAD_COUNTED = {"_c10d_functional_autograd.all_to_all_single"}
_COLLECTIVE_NAMESPACES = {"c10d", "c10d_functional", *_NAMESPACE_ALIASES}


@dataclasses.dataclass(frozen=True, slots=True)
class DirectRecord(CommRecord):
    """A collective the program called through torch.distributed or torch's functional collectives,
    not through `shardtensor.comm`: `torch_key` is torch's CommDebugMode key ("c10d.allreduce_").
    Its bytes are not measured (0) and it has no `mesh_dim` (None)."""

    torch_key: str = ""


def torch_key(op) -> str | None:
    """torch's CommDebugMode key of a collective op (an op, its overload or that key as text), None for
    any other op: `torch.ops._c10d_functional.all_reduce.default` -> "c10d_functional.all_reduce"."""
    if isinstance(op, str):
        return op if op in TORCH_KEY_KINDS else None
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if not isinstance(op, torch._ops.OpOverloadPacket):
        return None
    namespace, _, name = op._qualified_op_name.partition("::")
    if namespace == "_c10d_functional_autograd" and f"{namespace}.{name}" not in _AUTOGRAD_COUNTED:
        return None
    key = f"{_NAMESPACE_ALIASES.get(namespace, namespace)}.{name}"
    return key if key in TORCH_KEY_KINDS else None


def direct_record(func, args, kwargs) -> DirectRecord | None:
    """The record of op `func` if it is a collective the program called directly, None otherwise (not a
    collective, or issued by `shardtensor.comm`, which records its own)."""
    if func.namespace not in _COLLECTIVE_NAMESPACES:
        return None
    key = torch_key(func)
    if key is None or _issued_by_comm() or in_compiled_graph():
        return None
    return DirectRecord(TORCH_KEY_KINDS[key], None, _group_size(func, args, kwargs), 0, 0, torch_key=key)


def _issued_by_comm() -> bool:
    """Whether the running c10d call was made inside `shardtensor.comm` (a frame of its modules is on the
    stack); read only under CommDebugMode, for collective ops, so that nothing else pays for it."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == comm.__name__ or module.startswith(comm.__name__ + "."):
            return True
        frame = frame.f_back
    return False


# The package whose runtime wrappers call every compiled graph (forward and backward, any backend that
# compiles through AOTAutograd: aot_eager, inductor).
_COMPILED_GRAPH_RUNNER = "torch._functorch._aot_autograd."


def in_compiled_graph() -> bool:
    """Whether a torch.compile graph is running (a frame of AOTAutograd's runtime is on the stack): its
    collectives of ours record themselves, and a collective op it issues is one of them (a direct
    collective call compiled into a graph is not told apart, and not counted). Read only under
    CommDebugMode, for collective ops and fx graph modules, so that nothing else pays for it."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_COMPILED_GRAPH_RUNNER):
            return True
        frame = frame.f_back
    return False


def _group_size(func, args, kwargs) -> int:
    """The size of the process group a c10d op (`process_group`) or functional collective (`group_name`,
    a name or a group) runs over."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name in ("process_group", "group_name"):
            group = args[position] if position < len(args) else kwargs[argument.name]
            if isinstance(group, str):
                group = distributed_c10d._resolve_process_group(group)
            elif isinstance(group, torch.ScriptObject):  # how c10d ops receive their group
                group = distributed_c10d.ProcessGroup.unbox(group)
            return group.size()
    raise ValueError(f"{func} has no process_group or group_name argument (schema {func._schema})")
