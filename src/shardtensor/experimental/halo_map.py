"""`halo_map`: run a neighbourhood function written for plain tensors on spatially sharded DTensors.

Each rank's shard is widened by a halo along the given tensor dims (rows from its neighbours, point
to point; at the field's edges rows by the edge mode), `func` runs on the widened local tensor, and
its result is trimmed back to the shard's rows and wrapped as a DTensor laid out like the input.
Differentiable: the gradients of halo rows go back to the ranks that own them. In the spirit of
`local_map`, for stencils, finite differences and users' own convolutions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..autograd import FromLocal
from ..dtensor import DTensor
from ..halo import Exchange, differentiable_exchange, shard_bounds
from ..layout import Layout
from ..placement import Partial, Replicate
from ..spec import DTensorSpec, global_stride

__all__ = ["halo_map"]

HALO_EDGES = ("zeros", "reflect", "replicate", "circular")


def _halo_map_error(problem: str, allowed: str) -> ValueError:
    return ValueError(f"halo_map: {problem}; {allowed}")


def _widths(halo, dims: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(before, after) per dim from an int, or one int or (before, after) pair per dim."""
    entries = [halo] * len(dims) if isinstance(halo, int) else list(halo)
    if len(entries) != len(dims):
        raise _halo_map_error(f"halo={halo!r} has {len(entries)} entries for dims {dims}",
                              "give one int for every dim, or one int or (before, after) pair per dim")
    widths = []
    for entry in entries:
        pair = (entry, entry) if isinstance(entry, int) else tuple(entry)
        if len(pair) != 2 or not all(isinstance(width, int) and width >= 0 for width in pair):
            raise _halo_map_error(f"halo entry {entry!r} is not a width", "give non-negative ints (before, after)")
        widths.append(pair)
    return tuple(widths)


def halo_map(func: Callable | None = None, *, dims: Sequence[int], halo, edge: str = "zeros"):
    """Wrap `func(tensor, *args, **kwargs)` so that its first argument is a DTensor sharded along
    spatial `dims`, seen by `func` as its local shard widened by `halo` rows on each side.

    `halo`: one width for every dim, or per dim a width or a `(before, after)` pair. `edge`: how
    rows past the field's edges are filled: "zeros", "reflect", "replicate" or "circular" (wrapping
    across the first and last shard). A dim of `dims` that is not sharded is widened the same way,
    locally. Other DTensor arguments must be Replicate (a weight): `func` gets their local tensors,
    and their gradients are Partial(sum) over the ranks, reduced like any other Partial.

    Trim: along each dim of `dims`, a result as long as the widened tensor loses `before` rows at
    the start and `after` at the end (a stencil written with `roll` or padded convolutions); a
    result as long as the shard (a valid convolution that consumed the halo) is kept as it is;
    any other length is an error. Along other dims the result may change sizes only where the
    input is not sharded (channels). The result is laid out like the input, its shard sizes exact.

        >>> laplacian = halo_map(lambda u: u.roll(1, 2) + u.roll(-1, 2) + u.roll(1, 3) + u.roll(-1, 3) - 4 * u,
        ...                      dims=(2, 3), halo=1, edge="circular")  # doctest: +SKIP
        >>> smoothed = halo_map(lambda t, w: F.conv2d(t, w), dims=(2, 3), halo=1)(field, weight)  # doctest: +SKIP
    """
    if func is None:
        return functools.partial(halo_map, dims=dims, halo=halo, edge=edge)
    if not callable(func):
        raise TypeError(f"halo_map wraps a function, got {type(func).__name__}")
    dims = tuple(dims)
    widths = _widths(halo, dims)
    if edge not in HALO_EDGES:
        raise _halo_map_error(f"edge={edge!r} is unknown", f"use one of {HALO_EDGES}")

    @functools.wraps(func)
    def wrapped(tensor, *args, **kwargs):
        if not isinstance(tensor, DTensor):
            raise TypeError(f"halo_map: the first argument must be a DTensor sharded along dims {dims}, "
                            f"got {type(tensor).__name__}; distribute it first (or call the function directly)")
        layout, mesh = tensor._spec.layout, tensor.device_mesh
        if layout.partial_mesh_dims():
            raise _halo_map_error(f"the input is Partial ({list(layout.placements)})",
                                  "a halo needs the values themselves: redistribute it to Shard or Replicate first")
        normalized = tuple(dim % tensor.ndim for dim in dims)
        if len(set(normalized)) != len(normalized):
            raise _halo_map_error(f"dims {dims} name a dim twice", "name each dim once")
        exchanges = _exchanges(layout, normalized, widths, edge)
        local = tensor.to_local()
        window = differentiable_exchange(local, mesh, exchanges)
        args = tuple(_local_argument(value) for value in args)
        kwargs = {name: _local_argument(value) for name, value in kwargs.items()}
        if any(local.size(dim) == 0 for dim in normalized):
            result = _empty_shard_result(func, window, args, kwargs, normalized, widths)
        else:
            result = func(window, *args, **kwargs)
        if not isinstance(result, torch.Tensor) or isinstance(result, DTensor):
            raise _halo_map_error(f"func returned {type(result).__name__}", "return one plain tensor")
        result = _trimmed(result, local, window, normalized, widths)
        return _wrapped_result(result, local, tensor, layout)

    return wrapped


def _exchanges(layout: Layout, dims: tuple[int, ...], widths, edge: str) -> tuple[Exchange, ...]:
    steps = []
    for dim, (before, after) in zip(dims, widths):
        windows = tuple((start - before, stop + after) for start, stop in shard_bounds(layout, dim))
        steps.append(Exchange.of_layout(layout, dim, windows, edge))
    return tuple(steps)


def _local_argument(value):
    """A Replicate DTensor argument as its local tensor, whose gradient is Partial(sum) over the ranks."""
    if not isinstance(value, DTensor):
        return value
    if not all(isinstance(placement, Replicate) for placement in value.placements):
        raise _halo_map_error(f"a DTensor argument other than the first has placements {list(value.placements)}",
                              "only Replicate ones (weights) can be given to every rank's function")
    return value.to_local(grad_placements=[Partial("sum")] * value.device_mesh.ndim)


class _NoRows(torch.autograd.Function):
    """Zeros of `shape` standing for `func`'s result on a shard without rows. Its gradient (zeros)
    still reaches the window and `func`'s other tensors: every rank then runs the exchange's
    backward, which its peers wait for, and a weight gets its (zero) Partial gradient everywhere."""

    @staticmethod
    def forward(ctx, shape, dtype, window, *tensors):
        ctx.metas = [(tensor.shape, tensor.dtype) for tensor in (window, *tensors)]
        return window.new_zeros(shape, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        return None, None, *(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.metas)


def _empty_shard_result(func, window, args, kwargs, dims, widths) -> torch.Tensor:
    """`func`'s result on a shard without rows along some of `dims`, without calling it on a window
    that may be too short for it (a 3x3 convolution of two halo rows): its shape and dtype come from
    `func` on meta tensors with a one-row shard, and the empty dims get no rows."""
    empty = [dim for dim, (before, after) in zip(dims, widths) if window.size(dim) == before + after]
    shape = [size + 1 if dim in empty else size for dim, size in enumerate(window.shape)]
    meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (args, kwargs))
    meta = func(torch.empty(shape, dtype=window.dtype, device="meta"), *meta_args, **meta_kwargs)
    # As long as the one-row shard's window: trimmed later to no rows; else already no rows.
    result_shape = [
        (window.size(dim) if meta.size(dim) == shape[dim] else 0) if dim in empty else size
        for dim, size in enumerate(meta.shape)
    ]
    tensors = [value for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor)]
    return _NoRows.apply(result_shape, meta.dtype, window, *tensors)


def _trimmed(result: torch.Tensor, local: torch.Tensor, window: torch.Tensor, dims, widths) -> torch.Tensor:
    if result.ndim != local.ndim:
        raise _halo_map_error(f"func returned {result.ndim} dims for an input of {local.ndim}", "keep the dims")
    for dim, (before, _) in zip(dims, widths):
        if result.size(dim) == window.size(dim):
            result = result.narrow(dim, before, local.size(dim))
        elif result.size(dim) != local.size(dim):
            raise _halo_map_error(
                f"func returned {result.size(dim)} rows on dim {dim}, where the widened input had "
                f"{window.size(dim)} and the shard {local.size(dim)}",
                "return as many rows as the widened input (trimmed to the shard) or as the shard",
            )
    return result


def _wrapped_result(result: torch.Tensor, local: torch.Tensor, tensor: DTensor, layout: Layout) -> DTensor:
    """`result` as a DTensor laid out like the input: sharded dims keep their pieces, whole dims take
    the result's sizes. No communication."""
    shape = list(layout.shape)
    for dim in range(layout.ndim):
        if layout.shard_order[dim]:
            local_size = local.size(dim)
            if result.size(dim) != local_size:
                raise _halo_map_error(
                    f"func returned {result.size(dim)} rows on sharded dim {dim}, whose shard has {local_size}",
                    "change the sizes of whole dims only (or add the dim to dims)",
                )
        else:
            shape[dim] = result.size(dim)
    output = Layout.create(layout.mesh_shape, layout.placements, shape, shard_order=layout.shard_order)
    pieces = tuple(layout.pieces[dim] if layout.shard_order[dim] else output.pieces[dim] for dim in range(layout.ndim))
    output = Layout(output.mesh_shape, output.placements, output.shape, output.shard_order, pieces)
    spec = DTensorSpec(tensor.device_mesh, output, global_stride(result, shape), result.dtype)
    return FromLocal.apply(result, spec, False, type(tensor))

