"""PrepareModuleInput / PrepareModuleOutput (and both at once): fix the layouts at a module's boundary, nothing else.

They leave parameters alone (the module's own submodules carry their styles) and only convert:
each input or output is read as the given layout (a plain local tensor becomes a DTensor), then
moved to the desired one. A typical use: an attention block takes a sequence-sharded input and
needs it replicated before its ColwiseParallel projections.

    >>> PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch import nn

from ..mesh import DeviceMesh
from ..placement import Placement
from .layouts import check_tp_mesh, to_dtensor, to_output
from .style import ParallelStyle, as_placements

__all__ = ["PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput"]

Layouts = Placement | Sequence[Placement | None] | None


def _layouts_error(style: str, what: str, given, desired) -> ValueError:
    return ValueError(
        f"{style}: {what} {given!r} and their desired layouts {desired!r} must pair up one to one "
        f"(None where a value is left alone, and a desired layout only where its layout is given)"
    )


def _check_pairs(style: str, what: str, given: tuple, desired: tuple) -> None:
    if len(given) != len(desired) or any((g is None) != (d is None) for g, d in zip(given, desired)):
        raise _layouts_error(style, what, given, desired)


def _convert(value, given: Placement | None, desired: Placement | None, mesh: DeviceMesh, where: str, use_local_output: bool):
    """Read `value` as `given`, move it to `desired` (None: leave the value alone)."""
    if given is None:
        return value
    dtensor = to_dtensor(value, mesh, (given,), where)
    return to_output(dtensor, (desired,), use_local_output)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareModuleInput(ParallelStyle):
    """Convert a module's positional and keyword inputs before its forward.

    `input_layouts[i]` says how positional input i is laid out (a plain tensor is this rank's
    shard of it), `desired_input_layouts[i]` where the module wants it; None leaves it alone.
    `input_kwarg_layouts` / `desired_input_kwarg_layouts` do the same by keyword. With
    `use_local_output` the module receives local tensors.
    """

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: Mapping[str, Placement] | None = None
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = None
    use_local_output: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.input_layouts is not None or self.desired_input_layouts is not None:
            given, desired = as_placements(self.input_layouts, None), as_placements(self.desired_input_layouts, None)
            _check_pairs(name, "input_layouts", given, desired)
        kwargs_given, kwargs_desired = dict(self.input_kwarg_layouts or {}), dict(self.desired_input_kwarg_layouts or {})
        if kwargs_given.keys() != kwargs_desired.keys():
            raise _layouts_error(name, "input_kwarg_layouts", kwargs_given, kwargs_desired)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(device_mesh, type(self).__name__)
        given = () if self.input_layouts is None else as_placements(self.input_layouts, None)
        desired = () if self.desired_input_layouts is None else as_placements(self.desired_input_layouts, None)
        kwargs_given, kwargs_desired = dict(self.input_kwarg_layouts or {}), dict(self.desired_input_kwarg_layouts or {})
        where = f"PrepareModuleInput on {type(module).__name__}"

        def prepare(hooked, args, kwargs):
            if given and len(args) != len(given):
                raise ValueError(
                    f"{where}: the module got {len(args)} positional input(s), but input_layouts lists "
                    f"{len(given)} ({given!r}); give one layout (or None) per positional input"
                )
            args = tuple(
                _convert(value, layout, want, device_mesh, where, self.use_local_output)
                for value, layout, want in zip(args, given or (None,) * len(args), desired or (None,) * len(args))
            )
            kwargs = {
                key: _convert(value, kwargs_given.get(key), kwargs_desired.get(key), device_mesh, where, self.use_local_output)
                for key, value in kwargs.items()
            }
            return args, kwargs

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareModuleOutput(ParallelStyle):
    """Convert a module's output (a tensor or a tuple of them) after its forward.

    Each output is read as `output_layouts[i]` and moved to `desired_output_layouts[i]`; returned as
    the local tensor when `use_local_output` (default True, as in PyTorch).
    """

    output_layouts: Layouts
    desired_output_layouts: Layouts
    use_local_output: bool = True

    def __post_init__(self) -> None:
        given = as_placements(self.output_layouts, None)
        _check_pairs(type(self).__name__, "output_layouts", given, as_placements(self.desired_output_layouts, None))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(device_mesh, type(self).__name__)
        given, desired = as_placements(self.output_layouts, None), as_placements(self.desired_output_layouts, None)
        where = f"PrepareModuleOutput on {type(module).__name__}"

        def prepare(hooked, inputs, outputs):
            single = not isinstance(outputs, tuple)
            values = (outputs,) if single else outputs
            if len(values) != len(given):
                raise ValueError(
                    f"{where}: the module returned {len(values)} output(s), but output_layouts lists "
                    f"{len(given)} ({given!r}); give one layout (or None) per output"
                )
            converted = tuple(
                _convert(value, layout, want, device_mesh, where, self.use_local_output)
                for value, layout, want in zip(values, given, desired)
            )
            return converted[0] if single else converted

        module.register_forward_hook(prepare)
        return module


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module, in one plan entry
    (`use_local_input` is the input side's `use_local_output`)."""

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: Mapping[str, Placement] | None = None
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = None
    use_local_input: bool = False
    output_layouts: Layouts
    desired_output_layouts: Layouts
    use_local_output: bool = True

    def __post_init__(self) -> None:
        self._input_style()
        self._output_style()  # both check their layouts now, as they would on their own

    def _input_style(self) -> PrepareModuleInput:
        return PrepareModuleInput(
            input_layouts=self.input_layouts,
            desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_output=self.use_local_input,
        )

    def _output_style(self) -> PrepareModuleOutput:
        return PrepareModuleOutput(
            output_layouts=self.output_layouts,
            desired_output_layouts=self.desired_output_layouts,
            use_local_output=self.use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._input_style()._apply(module, device_mesh)
        return self._output_style()._apply(module, device_mesh)
