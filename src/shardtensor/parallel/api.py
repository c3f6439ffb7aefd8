"""`parallelize_module`: apply a plan of parallel styles to a module's submodules by name.

A plan is a dict from fully qualified submodule names to styles (or to nested plans); a name's
parts may be `fnmatch` patterns, so `"layers.*.attention.wq"` names that projection in every layer.
Tied parameters (one Parameter held by two modules, as a language model's embedding and output
head) stay tied: both modules end up holding the same distributed parameter.

    >>> plan = {
    ...     "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    ...     "layers.*.mlp.fc": ColwiseParallel(),
    ...     "layers.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    ... }
    >>> parallelize_module(model, mesh["tp"], plan)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from ..dtensor import DTensor
from ..mesh import DeviceMesh, current_mesh
from .layouts import check_tp_mesh
from .style import ParallelStyle, UnsupportedModuleError

__all__ = ["parallelize_module"]

Plan = ParallelStyle | Mapping[str, "Plan"]


def _no_match_error(path: str, prefix: str, module: nn.Module) -> KeyError:
    children = [name for name, _ in module.named_children()]
    where = f"under {prefix!r}" if prefix else "at the top of the module"
    return KeyError(
        f"parallelize_plan entry {path!r} matches no submodule: {where} the children are {children}; "
        f"name submodules by their fully qualified names (print(model) shows them), '*' matching one part"
    )


def _plan_error(value, path: str) -> TypeError:
    return TypeError(
        f"parallelize_plan[{path!r}] is a {type(value).__name__}; each entry must be a ParallelStyle "
        f"(ColwiseParallel(), ...) or a nested dict plan"
    )


def _with_source(style: ParallelStyle, src_data_rank: int | None) -> ParallelStyle:
    if style.src_data_rank == src_data_rank:
        return style
    return dataclasses.replace(style, src_data_rank=src_data_rank)


def _apply_style(style: ParallelStyle, module: nn.Module, mesh: DeviceMesh, path: str, src_data_rank) -> None:
    try:
        _with_source(style, src_data_rank)._apply(module, mesh)
    except UnsupportedModuleError as error:
        raise UnsupportedModuleError(f"parallelize_plan[{path!r}]: {error}") from None


def _apply_plan(module: nn.Module, mesh: DeviceMesh, plan: Plan, prefix: str, src_data_rank) -> None:
    if isinstance(plan, ParallelStyle):
        _apply_style(plan, module, mesh, prefix, src_data_rank)
        return
    if not isinstance(plan, Mapping):
        raise _plan_error(plan, prefix)
    for path, entry in plan.items():
        full_path = f"{prefix}.{path}" if prefix else path
        if not isinstance(entry, (ParallelStyle, Mapping)):
            raise _plan_error(entry, full_path)
        if path == "":  # the module itself, as torch reads the empty key
            _apply_plan(module, mesh, entry, prefix, src_data_rank)
            continue
        first, _, rest = path.partition(".")
        matched = [(name, child) for name, child in module.named_children() if fnmatchcase(name, first)]
        if not matched:
            raise _no_match_error(full_path, prefix, module)
        for name, child in matched:
            child_prefix = f"{prefix}.{name}" if prefix else name
            _apply_plan(child, mesh, {rest: entry} if rest else entry, child_prefix, src_data_rank)


# Where a tied parameter lives: (qualified name of its owner module, the owner, the parameter's name there).
Location = tuple[str, nn.Module, str]


def _tied_parameters(module: nn.Module) -> list[list[Location]]:
    """The locations of every parameter held by more than one module (or under two names)."""
    locations: dict[int, list[Location]] = {}
    for owner_name, owner in module.named_modules():
        for name, parameter in owner._parameters.items():
            if parameter is not None:
                locations.setdefault(id(parameter), []).append((owner_name, owner, name))
    return [group for group in locations.values() if len(group) > 1]


def _layout_of(parameter) -> tuple:
    if isinstance(parameter, DTensor):
        return parameter.device_mesh, parameter.placements
    return None, "a plain tensor (no style laid it out)"


def _untied_error(group: list[Location], held: list) -> ValueError:
    where = "; ".join(
        f"{owner_name + '.' if owner_name else ''}{name}: {_layout_of(parameter)[1]}"
        for (owner_name, _, name), parameter in zip(group, held)
    )
    return ValueError(
        f"parallelize_module: a tied parameter would be laid out differently where it is shared ({where}); "
        f"give every module that holds it a style with the same placement of it (an Embedding under "
        f"RowwiseParallel and a Linear under ColwiseParallel both take Shard(0)), or untie it first"
    )


def _retie(groups: list[list[Location]]) -> None:
    """Point every location of a tied parameter at one distributed parameter again.

    Each style distributed its own module's copy; the copies hold the same values, so the first one
    serves all locations, provided they were laid out alike.
    """
    for group in groups:
        held = [getattr(owner, name) for _, owner, name in group]
        if all(parameter is held[0] for parameter in held):
            continue
        if any(_layout_of(parameter) != _layout_of(held[0]) for parameter in held):
            raise _untied_error(group, held)
        for _, owner, name in group[1:]:
            owner.register_parameter(name, held[0])


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: Plan | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Lay out `module` over a 1-D mesh by a plan; returns the module, changed in place.

    `parallelize_plan` is a style (applied to `module` itself) or a dict from submodule names
    (`"layers.*.attention.wq"`, `*` matching within one name part; `""` the module itself) to styles
    or nested plans. An entry that matches no submodule raises. A parameter shared by several
    modules stays shared (their styles must lay it out alike). `src_data_rank` is the coordinate whose parameter
    values every rank receives (None: each rank slices its own, identical, copy; no communication).

    >>> parallelize_module(nn.Linear(8, 8), mesh, ColwiseParallel()).weight.placements  # doctest: +SKIP
    (Shard(dim=0),)
    """
    mesh = device_mesh if device_mesh is not None else current_mesh()
    check_tp_mesh(mesh, "parallelize_module")
    if parallelize_plan is None:
        raise ValueError(
            "parallelize_module needs a parallelize_plan: a ParallelStyle or a dict {submodule name: style}"
        )
    tied = _tied_parameters(module)
    _apply_plan(module, mesh, parallelize_plan, "", src_data_rank)
    _retie(tied)
    return module
