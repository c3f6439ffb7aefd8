"""`local_map`: run a function written for plain tensors on the local shards of DTensors.

The inputs' local tensors go in (after checking, or redistributing to, `in_placements`), and the
outputs come back as DTensors with `out_placements`. Differentiable: gradients flow through
`to_local` (read with `in_grad_placements` when given) and `from_local`. Mirrors
`torch.distributed.tensor.experimental.local_map`, with exact uneven output shards.

    >>> @local_map(out_placements=[Replicate()], in_placements=(None, [Shard(1)], [Shard(0)]))  # doctest: +SKIP
    ... def mm_allreduce_forward(device_mesh, W, X):
    ...     return comm.all_reduce(torch.mm(W, X), device_mesh, 0, reduce_op="sum")
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..placement import Placement, normalize_placements

__all__ = ["local_map"]

PlacementType = Sequence[Placement] | None
OUT_SHARD_SIZES = ("infer", "chunk")


def _local_map_error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"local_map: {problem}; {allowed}")


def _is_placement_type(value) -> bool:
    return value is None or (
        isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(p, Placement) for p in value)
    )


def _output_specs(out_placements) -> tuple[PlacementType, ...]:
    """One PlacementType per flattened output: a sequence of Placements is one output's, a tuple of
    PlacementTypes (sequences or None) gives one per output."""
    if _is_placement_type(out_placements):
        return (out_placements,)
    if isinstance(out_placements, tuple) and all(_is_placement_type(spec) for spec in out_placements):
        return out_placements
    raise _local_map_error(
        f"out_placements={out_placements!r} is not understood",
        "give a sequence of Placements (one output), or a tuple with one sequence (or None for a "
        "non-tensor output) per flattened output",
    )


def _check_input_specs(name: str, specs) -> None:
    if specs is not None and (not isinstance(specs, Sequence) or not all(_is_placement_type(s) for s in specs)):
        raise _local_map_error(
            f"{name}={specs!r} is not understood",
            "give a tuple with one sequence of Placements (or None for a non-tensor argument) per flattened argument",
        )


def local_map(
    func: Callable | None = None,
    out_placements=None,
    in_placements: Sequence[PlacementType] | None = None,
    in_grad_placements: Sequence[PlacementType] | None = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
    out_shard_sizes: str = "infer",
):
    """Wrap `func` (written for plain tensors) so that it takes DTensors and returns DTensors.

    `in_placements` (one entry per flattened argument, None for non-tensors) are checked against
    each DTensor argument: a mismatch raises a ValueError, or redistributes the argument when
    `redistribute_inputs=True`. Plain tensors and other values pass through unchanged.
    `in_grad_placements` says how to read the gradient of each local input (default: the input's
    placements). Outputs become DTensors on `device_mesh` (default: the DTensor arguments' mesh)
    with `out_placements`, one PlacementType per flattened output (None for a non-tensor output).
    Keyword arguments go to `func` as they are. Called without any DTensor argument, `func` runs as is.

    Beyond PyTorch: `out_shard_sizes="infer"` (default) makes Shard outputs exact when shards are
    uneven (one exchange of local shapes per such output); "chunk" assumes `torch.chunk` sizes
    without communicating, as PyTorch does. Used without `func`, `local_map(...)` is a decorator.
    """
    if func is None:
        return functools.partial(
            local_map, out_placements=out_placements, in_placements=in_placements,
            in_grad_placements=in_grad_placements, device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs, out_shard_sizes=out_shard_sizes,
        )
    if not callable(func):
        raise TypeError(f"local_map wraps a function, got {type(func).__name__}")
    output_specs = _output_specs(out_placements)
    _check_input_specs("in_placements", in_placements)
    _check_input_specs("in_grad_placements", in_grad_placements)
    if out_shard_sizes not in OUT_SHARD_SIZES:
        raise _local_map_error(f"out_shard_sizes={out_shard_sizes!r} is not understood", f"use one of {OUT_SHARD_SIZES}")

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        flat_args, args_spec = tree_flatten(args)
        local_args, mesh = _local_arguments(flat_args, in_placements, in_grad_placements, device_mesh, redistribute_inputs)
        output = func(*tree_unflatten(local_args, args_spec), **kwargs)
        if mesh is None:  # no DTensor argument: plain tensors in, plain tensors out
            return output
        flat_outputs, output_spec = tree_flatten(output)
        return tree_unflatten(_distributed_outputs(flat_outputs, output_specs, mesh, out_shard_sizes), output_spec)

    return wrapped


def _local_arguments(flat_args, in_placements, in_grad_placements, device_mesh, redistribute_inputs):
    """The local tensors to call `func` with, and the mesh of the outputs (None: no DTensor argument)."""
    for name, specs in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if specs is not None and len(specs) != len(flat_args):
            raise _local_map_error(
                f"{name} has {len(specs)} entries but the call has {len(flat_args)} flattened arguments",
                "give one entry per argument (None for a non-tensor argument)",
            )
    mesh, local_args, seen_dtensor = device_mesh, [], False
    for index, argument in enumerate(flat_args):
        spec = None if in_placements is None else in_placements[index]
        if not isinstance(argument, DTensor):
            if spec is not None and not isinstance(argument, torch.Tensor):
                raise _local_map_error(
                    f"argument {index} is a {type(argument).__name__}, not a tensor, but in_placements[{index}] = {spec!r}",
                    "give None for non-tensor arguments",
                )
            local_args.append(argument)  # plain tensors and other values pass through
            continue
        seen_dtensor = True
        if mesh is None:
            mesh = argument.device_mesh
        elif argument.device_mesh != mesh:
            raise _local_map_error(
                f"argument {index} lives on {argument.device_mesh!r}, but the outputs' mesh is {mesh!r}",
                "every DTensor argument must be on the device_mesh given (or the first DTensor argument's mesh)",
            )
        if in_placements is not None:
            argument = _placed(argument, index, spec, redistribute_inputs)
        grad_spec = None if in_grad_placements is None else in_grad_placements[index]
        if in_grad_placements is not None and grad_spec is None:
            raise _local_map_error(f"in_grad_placements[{index}] is None for a DTensor argument",
                                   "give the placements its local gradient is laid out in")
        grad_placements = None if grad_spec is None else normalize_placements(grad_spec, argument.ndim, mesh.ndim)
        local_args.append(argument.to_local(grad_placements=grad_placements))
    return local_args, mesh if seen_dtensor else None


def _placed(argument: DTensor, index: int, spec, redistribute_inputs: bool) -> DTensor:
    """The argument with placements `spec`: as is, redistributed, or a ValueError when that is off."""
    if spec is None:
        raise _local_map_error(
            f"argument {index} is a DTensor with placements {argument.placements!r} but in_placements[{index}] is None",
            "give the placements func expects for it",
        )
    wanted = normalize_placements(tuple(spec), argument.ndim, argument.device_mesh.ndim)
    if wanted == argument.placements:
        return argument
    if not redistribute_inputs:
        raise _local_map_error(
            f"argument {index} has placements {argument.placements!r} but in_placements[{index}] = {wanted!r}",
            "redistribute it first, or pass redistribute_inputs=True to let local_map do it",
        )
    return argument.redistribute(placements=wanted)


def _distributed_outputs(flat_outputs, output_specs, mesh: DeviceMesh, out_shard_sizes: str) -> list:
    if len(flat_outputs) != len(output_specs):
        raise _local_map_error(
            f"func returned {len(flat_outputs)} flattened outputs but out_placements gives {len(output_specs)}",
            "give one PlacementType per output (a tuple of them for several outputs)",
        )
    results = []
    for index, (output, spec) in enumerate(zip(flat_outputs, output_specs)):
        if isinstance(output, DTensor):
            raise _local_map_error(f"func returned a DTensor as output {index}",
                                   "func works on local tensors and must return plain tensors")
        if not isinstance(output, torch.Tensor):
            if spec is not None:
                raise _local_map_error(f"output {index} is a {type(output).__name__}, not a tensor, "
                                       f"but out_placements gives it {spec!r}", "give None for non-tensor outputs")
            results.append(output)
            continue
        if spec is None:
            raise _local_map_error(f"output {index} is a tensor but its out_placements entry is None",
                                   "give the placements of every tensor output")
        results.append(DTensor.from_local(output, mesh, tuple(spec), shard_sizes=out_shard_sizes))
    return results
