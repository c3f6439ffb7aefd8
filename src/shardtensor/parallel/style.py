"""What every parallel style is: a small value that lays out one module over a 1-D mesh.

A style's one job is to make the module's parameters DTensors and to fix the layouts at the
module's boundary with forward pre-/post-hooks (its inputs become DTensors with the layouts the
module's math needs; its outputs are moved to the layouts the plan asks for). No style knows about
another; `parallelize_module` applies them by name.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from torch import nn

from ..api import distribute_module, distribute_tensor
from ..mesh import DeviceMesh
from ..placement import Placement, Replicate

__all__ = [
    "ParallelStyle",
    "UnsupportedModuleError",
    "as_placements",
    "distribute_parameters",
    "linear_input_sizes",
    "linear_or_embedding",
    "unsupported_module_error",
]


class UnsupportedModuleError(TypeError):
    """A style was applied to a module whose math it does not know how to lay out."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelStyle(ABC):
    """How one module is laid out over a 1-D device mesh (the tensor-parallel mesh dim).

    Subclasses implement `_apply(module, device_mesh)`: distribute the module's parameters and
    register its forward hooks, then return the module. `src_data_rank` is the coordinate whose
    parameter values every rank receives (None: each rank slices its own copy, no communication);
    `parallelize_module(..., src_data_rank=...)` sets it for the whole plan.
    """

    src_data_rank: int | None = 0

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Lay out `module` over `device_mesh` in place and return it."""


def unsupported_module_error(style: ParallelStyle, module: nn.Module, supported: Sequence[type], hint: str) -> UnsupportedModuleError:
    names = ", ".join(f"nn.{kind.__name__}" for kind in supported)
    return UnsupportedModuleError(
        f"{type(style).__name__} cannot lay out a {type(module).__name__} module: it supports {names}. {hint}"
    )


def as_placements(layouts: Placement | Sequence[Placement | None] | None, default: Placement | None) -> tuple:
    """One placement or a sequence of them (None where an input is left alone) as a tuple."""
    if layouts is None:
        return (default,)
    if isinstance(layouts, Placement):
        return (layouts,)
    return tuple(layouts)


def distribute_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Placement],
    src_data_rank: int | None,
    input_fn=None,
    output_fn=None,
) -> nn.Module:
    """`distribute_module` with each named parameter of `module` itself on its placement (others Replicate).

    Parameters stay `nn.Parameter`s (holding DTensors) with their `requires_grad`.
    """

    def partition(name: str, submodule: nn.Module, device_mesh: DeviceMesh) -> None:
        for parameter_name, parameter in list(submodule.named_parameters(recurse=False)):
            placement = placements.get(parameter_name, Replicate()) if submodule is module else Replicate()
            distributed = distribute_tensor(parameter.detach(), device_mesh, [placement], src_data_rank=src_data_rank)
            submodule.register_parameter(parameter_name, nn.Parameter(distributed, parameter.requires_grad))

    return distribute_module(module, mesh, partition, input_fn, output_fn)


def linear_or_embedding(style: ParallelStyle, module: nn.Module) -> None:
    """Colwise/Rowwise take exactly these two modules (their weight's dims mean different things)."""
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        raise unsupported_module_error(
            style,
            module,
            (nn.Linear, nn.Embedding),
            "Apply it to the Linear/Embedding submodules by name (\"block.*.fc\"), use SequenceParallel for "
            "norms and dropout, or PrepareModuleInput/PrepareModuleOutput to fix a module's input/output layouts.",
        )


def linear_input_sizes(module: nn.Module) -> dict[int, int]:
    """Global sizes of input dims a module defines: a Linear's last dim is its in_features."""
    return {-1: module.in_features} if isinstance(module, nn.Linear) else {}
