"""Global geometry of padding and resampling along one tensor dim: for every output row, the input rows
it reads (taps), their weights, and the one input row that decides which coordinate owns it.

Pure arithmetic on the global sizes, the same on every rank, so every rank knows every other rank's
output rows and input window. The interpolation taps reproduce torch's CPU kernels
(`ATen/native/UpSample.h`): the scale as the kernel computes it (from `scales` when given, else from
the sizes), the source coordinate in the kernel's own precision (float32 for nearest, the op's
accumulation type for linear and cubic), the same clamping. A local computation that gathers these
taps from a window therefore gives the global op's numbers on every shard.

Ownership (`halo.output_bounds`' idea, with torch's own source rows): output row `o` belongs to the
coordinate holding its *source row*, the input row nearest to its source coordinate (for nearest
modes the one row it reads). Source rows never decrease along the output, so each coordinate owns
one contiguous run of output rows (possibly empty); even shards upscaled by an integer factor stay
even, a linear window reaches one row into each neighbour, and nearest reads only rows its owner
holds (no exchange).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Taps", "interpolation_taps", "owned_outputs", "input_windows", "owners_from_outputs"]

_CUBIC_A = -0.75  # torch's bicubic convolution constant
# The tables are host metadata: cached across devices, read on the host to plan the exchanges, and moved
# slice by slice to the data's device where they are applied (`spatial_resample.gather_taps`). Saying so
# keeps them there under `torch.set_default_device`.
_HOST = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Taps:
    """Per output row of one dim: `indices[o, k]` the global input rows read (inside [0, N)),
    `weights[o, k]` their weights (None: one tap of weight 1), `sources[o]` the row deciding ownership."""

    indices: torch.Tensor
    weights: torch.Tensor | None
    sources: torch.Tensor

    @property
    def output_size(self) -> int:
        return self.indices.shape[0]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type torch's upsample kernels compute coordinates and weights in (`opmath_type`)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel_scale(input_size: int, output_size: int, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """`compute_scales_value`: 1/scale when a positive scale was given, else input/output, in `dtype`."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=torch.float64, device=_HOST).to(dtype)
    return torch.tensor(input_size, dtype=dtype, device=_HOST) / output_size


def _area_scale(input_size: int, output_size: int, align_corners: bool, scale, dtype) -> torch.Tensor:
    """`area_pixel_compute_scale`: the step between output rows in input coordinates."""
    if align_corners:
        if output_size > 1:
            return torch.tensor(input_size - 1, dtype=dtype, device=_HOST) / (output_size - 1)
        return torch.zeros((), dtype=dtype, device=_HOST)
    return _kernel_scale(input_size, output_size, scale, dtype)


def _source_coordinates(input_size, output_size, align_corners, scale, dtype, cubic: bool) -> torch.Tensor:
    """`area_pixel_compute_source_index` for every output row (clamped at 0 except for cubic)."""
    ratio = _area_scale(input_size, output_size, align_corners, scale, dtype)
    rows = torch.arange(output_size, dtype=dtype, device=_HOST)
    if align_corners:
        return ratio * rows
    coordinates = ratio * (rows + 0.5) - 0.5
    return coordinates if cubic else coordinates.clamp_min(0)


def _nearest(mode: str, input_size: int, output_size: int, scale) -> Taps:
    rows = torch.arange(output_size, dtype=torch.int64, device=_HOST)
    if mode == "nearest" and output_size == input_size:
        indices = rows
    elif mode == "nearest" and output_size == 2 * input_size:
        indices = rows // 2
    else:
        step = _kernel_scale(input_size, output_size, scale, torch.float32)
        if mode == "nearest":
            coordinates = rows.to(torch.float32) * step
        else:  # `(dst_index + 0.5) * scale` in double, rounded to float for floorf
            coordinates = ((rows.to(torch.float64) + 0.5) * step.to(torch.float64)).to(torch.float32)
        indices = coordinates.floor().to(torch.int64).clamp_max(input_size - 1)
    return Taps(indices[:, None], None, indices)


def _linear(input_size, output_size, align_corners, scale, dtype) -> Taps:
    if output_size == input_size:  # the kernels copy
        rows = torch.arange(output_size, dtype=torch.int64, device=_HOST)
        ones, zeros = (torch.full((output_size,), value, dtype=dtype, device=_HOST) for value in (1, 0))
        weights = torch.stack([ones, zeros], 1)
        return Taps(torch.stack([rows, rows], 1), weights, rows)
    coordinates = _source_coordinates(input_size, output_size, align_corners, scale, dtype, cubic=False)
    lower = coordinates.floor().to(torch.int64).clamp_max(input_size - 1)
    fraction = (coordinates - lower).clamp(0, 1)
    upper = lower + (lower < input_size - 1).to(torch.int64)
    nearest = torch.where(fraction >= 0.5, upper, lower)
    return Taps(torch.stack([lower, upper], 1), torch.stack([1 - fraction, fraction], 1), nearest)


def _cubic_near(x: torch.Tensor) -> torch.Tensor:
    return ((_CUBIC_A + 2) * x - (_CUBIC_A + 3)) * x * x + 1


def _cubic_far(x: torch.Tensor) -> torch.Tensor:
    return ((_CUBIC_A * x - 5 * _CUBIC_A) * x + 8 * _CUBIC_A) * x - 4 * _CUBIC_A


def _cubic(input_size, output_size, align_corners, scale, dtype) -> Taps:
    coordinates = _source_coordinates(input_size, output_size, align_corners, scale, dtype, cubic=True)
    floor = coordinates.floor().to(torch.int64).clamp_max(input_size - 1)
    t = (coordinates - floor).clamp(0, 1)
    weights = torch.stack([_cubic_far(t + 1), _cubic_near(t), _cubic_near(1 - t), _cubic_far(2 - t)], 1)
    indices = (floor[:, None] + torch.arange(-1, 3, device=_HOST)).clamp(0, input_size - 1)
    nearest = (floor + (t >= 0.5).to(torch.int64)).clamp(0, input_size - 1)
    return Taps(indices, weights, nearest)


@functools.lru_cache(maxsize=256)
def interpolation_taps(
    mode: str, input_size: int, output_size: int, align_corners: bool, scale: float | None, dtype: torch.dtype
) -> Taps:
    """The taps of `mode` ("nearest", "nearest_exact", "linear", "cubic") along one dim, on the CPU."""
    if mode in ("nearest", "nearest_exact"):
        return _nearest(mode, input_size, output_size, scale)
    dtype = accumulation_dtype(dtype)
    if mode == "linear":
        return _linear(input_size, output_size, bool(align_corners), scale, dtype)
    return _cubic(input_size, output_size, bool(align_corners), scale, dtype)


def owned_outputs(sources: torch.Tensor, shard_bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per coordinate, the run [start, stop) of output rows whose source row it holds."""
    bounds = []
    for start, stop in shard_bounds:
        first = int(torch.searchsorted(sources, start))
        bounds.append((first, max(first, int(torch.searchsorted(sources, stop)))))
    return bounds


def input_windows(indices: torch.Tensor, output_bounds: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per coordinate, the input rows [start, stop) its output rows read (empty for no output rows)."""
    windows = []
    for start, stop in output_bounds:
        if stop > start:
            read = indices[start:stop]
            windows.append((int(read.min()), int(read.max()) + 1))
        else:
            windows.append((0, 0))
    return windows


def owners_from_outputs(
    sources: torch.Tensor, input_size: int, output_bounds: Sequence[tuple[int, int]], preferred_sizes: Sequence[int]
) -> list[tuple[int, int]]:
    """Input shard bounds that own `output_bounds` under the source-row rule (an inverse of
    `owned_outputs`). A coordinate whose outputs start at row s may start anywhere in
    (source of s - 1, source of s]: it takes the start `preferred_sizes` give it (`torch.chunk`'s,
    so an evenly sharded input is always recovered) clamped into that range. Exact whenever every
    input row is some output row's source, as when upscaling."""
    output_size = sources.shape[0]
    starts, preferred = [], 0
    for (start, _), size in zip(output_bounds, preferred_sizes):
        low = 0 if start == 0 else int(sources[start - 1]) + 1
        high = input_size if start >= output_size else int(sources[start])
        starts.append(max(min(preferred, high), low, starts[-1] if starts else 0))
        preferred += size
    return [(start, stop) for start, stop in zip(starts, starts[1:] + [input_size])]
