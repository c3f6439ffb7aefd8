"""The text table and JSON tree of a CommDebugMode recording: modules, their collectives, ops and plans.

Noise levels as in PyTorch: 0 collectives per module (with bytes, ours), 1 also module types,
parameter placements and the DTensor ops, 2 also the ops on plain and local tensors, 3 also
trivial ops and the redistribute plans that ran (ours). Plain text, no terminal colour codes, so
that a table can be compared, logged and diffed.
"""

from __future__ import annotations

import collections
import dataclasses
import json

from ..dtensor import DTensor
from .direct_collectives import DirectRecord
from .module_tracker import BACKWARD, FORWARD, GLOBAL

__all__ = ["table", "write_json", "TRIVIAL_OPS", "C10D_NAMES"]

PHASES = (FORWARD, BACKWARD)
# Our collective kinds and their c10d counterparts (see `CommDebugMode`).
C10D_NAMES = {
    "all_gather": "all_gather_into_tensor",
    "all_to_all": "all_to_all_single",
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter_tensor",
    "broadcast": "broadcast",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "batch_p2p": "batch_isend_irecv",
    "gather": "gather",  # gather and reduce: only collectives called directly through torch.distributed
    "reduce": "reduce",
}
# Ops that only relabel or view data; shown from noise level 3 (PyTorch's list).
TRIVIAL_OPS = frozenset({
    "aten.detach.default", "aten.t.default", "aten.view.default", "aten._to_copy.default",
    "aten.as_strided.default", "aten.transpose.int",
})


@dataclasses.dataclass(frozen=True, slots=True)
class _Noise:
    module_data: bool  # module types, parameter placements, DTensor ops, totals by mesh dim
    all_ops: bool  # ops on plain and local tensors too
    trivial: bool  # trivial ops and redistribute plans

    @classmethod
    def of(cls, noise_level) -> _Noise:
        if not isinstance(noise_level, int) or not 0 <= noise_level <= 3:
            raise ValueError(f"noise_level must be an int from 0 to 3, got {noise_level!r}: 0 collectives per "
                             f"module, 1 + DTensor ops and module data, 2 + all ops, 3 + trivial ops and plans")
        return cls(noise_level >= 1, noise_level >= 2, noise_level >= 3)

    def shows(self, operation) -> bool:
        if operation.name in TRIVIAL_OPS and not self.trivial:
            return False
        return self.all_ops or (self.module_data and operation.kind == "dtensor")


class _Recording:
    """What the table and the JSON read from a mode, grouped by (module, phase) once."""

    def __init__(self, mode, noise: _Noise):
        self.modules = mode.get_modules()
        self.counts = mode.get_comm_module_counts()
        self.bytes = mode.get_comm_module_bytes()
        self.records = mode.records
        self.operations: dict[tuple[str, str], list] = collections.defaultdict(list)
        for operation in mode.operations:
            if noise.shows(operation):
                self.operations[operation.module, operation.phase].append(operation)
        self.plans: dict[tuple[str, str], list] = collections.defaultdict(list)
        if noise.trivial:
            for module, phase, plan in mode.get_redistribute_plans():
                self.plans[module, phase].append(plan)

    def dtensor_parameters(self, module: str) -> list[tuple[str, str]]:
        return [(name, _placements_text(parameter.placements))
                for name, parameter in self.modules[module].parameters if isinstance(parameter, DTensor)]

    def operation_collectives(self, operation) -> str:
        counts = collections.Counter(self.records[index].kind for index in operation.records)
        return ", ".join(f"{kind} x{count}" for kind, count in sorted(counts.items()))


def _placements_text(placements) -> str:
    return "[" + ", ".join(map(str, placements)) + "]"


def _bytes_text(amount) -> str:
    return f"sent {amount.sent} B, received {amount.received} B"


def _module_lines(recording: _Recording, module: str, noise: _Noise) -> list[str]:
    depth = recording.modules[module].depth
    indent, collective_indent, detail_indent = "  " * (2 * depth), "  " * (2 * depth + 2), "  " * (2 * depth + 3)
    lines = [f"{indent}{module}"]
    if noise.module_data and module != GLOBAL:
        lines.append(f"{indent}*module type: {recording.modules[module].module_type}")
        parameters = recording.dtensor_parameters(module)
        if parameters:
            lines.append(f"{indent}*Parameter List")
            lines += [f"{indent} *{name}: {placements}" for name, placements in parameters]
    for phase in PHASES:
        counts = recording.counts.get(module, {}).get(phase, {})
        operations, plans = recording.operations[module, phase], recording.plans[module, phase]
        if not (counts or operations or plans):
            continue
        lines.append(f"{indent}  {phase.upper()} PASS")
        for kind, count in sorted(counts.items()):
            lines.append(f"{collective_indent}*{kind}: {count} ({_bytes_text(recording.bytes[module][phase][kind])})")
        for operation in operations:
            lines.append(f"{collective_indent}**{operation.name}{' (local)' if operation.kind == 'local' else ''}")
            if operation.kind == "dtensor":
                lines.append(f"{detail_indent}shape: {[list(shape) for shape in operation.input_shapes]}")
                lines.append(f"{detail_indent}sharding: {list(operation.input_placements)}")
                lines.append(f"{detail_indent}device mesh: {operation.device_mesh}")
            if operation.records:
                lines.append(f"{detail_indent}collectives: {recording.operation_collectives(operation)}")
        for plan in plans:
            lines.append(f"{collective_indent}**redistribute plan")
            lines += [f"{detail_indent}{line}" for line in str(plan).splitlines()]
    return lines


def _summary_lines(mode) -> list[str]:
    """Totals by kind (with c10d names), by mesh dim, and the replicate fallbacks."""
    lines = [f"Totals: {mode.get_total_counts()} collectives, {_bytes_text(mode.get_total_bytes())}"]
    for kind, count in sorted(mode.get_comm_counts().items()):
        lines.append(f"  {kind} (c10d {C10D_NAMES.get(kind, kind)}): {count}, {_bytes_text(mode.get_comm_bytes()[kind])}")
    ours = [record for record in mode.records if not isinstance(record, DirectRecord)]
    by_mesh_dim = collections.Counter((record.kind, record.mesh_dim) for record in ours)
    if by_mesh_dim:
        lines.append("By mesh dim:")
        lines += [f"  {kind} on mesh dim {mesh_dim}: {count}" for (kind, mesh_dim), count in sorted(by_mesh_dim.items(), key=str)]
    direct = collections.Counter(record.torch_key for record in mode.records if isinstance(record, DirectRecord))
    if direct:
        lines.append("Called directly through torch.distributed (bytes not measured):")
        lines += [f"  {key}: {count}" for key, count in sorted(direct.items())]
    fallbacks = mode.get_fallback_counts()
    if fallbacks:
        lines.append("Replicate fallback (no sharding rule):")
        lines += [f"  {name}: {count}" for name, count in sorted(fallbacks.items())]
    return lines


def table(mode, noise_level: int) -> str:
    """See `CommDebugMode.generate_comm_debug_tracing_table`."""
    noise = _Noise.of(noise_level)
    recording = _Recording(mode, noise)
    lines = [line for module in recording.modules for line in _module_lines(recording, module, noise)]
    if noise.module_data:
        lines += _summary_lines(mode)
    return "\n".join(lines)


def _json_module(recording: _Recording, module: str, noise: _Noise, children: dict[str, list[str]]) -> dict:
    info = recording.modules[module]
    entry = {
        "fqn": module,
        "module_type": info.module_type if noise.module_data else "",
        "parameters": recording.dtensor_parameters(module) if noise.module_data else [],
        "children": [_json_module(recording, child, noise, children) for child in children[module]],
    }
    for phase in PHASES:
        counts = recording.counts.get(module, {}).get(phase, {})
        entry[f"collectives_{phase}"] = sorted(counts.items())
        entry[f"bytes_{phase}"] = {kind: dataclasses.asdict(recording.bytes[module][phase][kind]) for kind in sorted(counts)}
        entry[f"operations_{phase}"] = [
            {"name": operation.name, "kind": operation.kind, "input_shape": [list(s) for s in operation.input_shapes],
             "input_sharding": list(operation.input_placements), "device_mesh": operation.device_mesh,
             "collectives": recording.operation_collectives(operation)}
            for operation in recording.operations[module, phase]
        ]
        entry[f"plans_{phase}"] = [str(plan) for plan in recording.plans[module, phase]]
    return entry


def write_json(mode, file_name: str, noise_level: int) -> None:
    """See `CommDebugMode.generate_json_dump`: the module tree, children nested, as JSON."""
    noise = _Noise.of(noise_level)
    recording = _Recording(mode, noise)
    children: dict[str, list[str]] = collections.defaultdict(list)
    for module, info in recording.modules.items():
        if info.parents:
            children[info.parents[-1]].append(module)
    with open(file_name, "w") as json_file:
        json.dump(_json_module(recording, GLOBAL, noise, children), json_file, indent=2)
