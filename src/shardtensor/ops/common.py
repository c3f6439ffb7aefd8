"""Helpers that op families share: dims, rows of one-input ops, local ops that run on real shards
only, and the one way to give a shard without elements its results without running a kernel.

Kernels refuse some empty inputs that the whole tensor would not give them (MKL's FFT on an empty
batch, attention on zero heads, pooling without channels). A rank whose shard is empty must not
raise alone (the others would wait in their next collective), so rules compute its results from
shapes: `empty_shard_results` runs the op on meta tensors and makes results on the device of the
data, filled with a value the rule chooses (zeros for a shard that contributes nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from ..rules import OpCall, Row

__all__ = ["normalized_dim", "dim_argument", "one_input_row", "on_shards", "meta_like", "empty_shard_results"]


def normalized_dim(dim: int, ndim: int) -> int:
    """`dim` in `range(ndim)` (negative dims count from the end; a 0-d tensor's dim is 0)."""
    return dim % max(ndim, 1)


def dim_argument(call: OpCall, name: str = "dim") -> int:
    """The call's argument `name` (a dim of its first tensor input), normalized."""
    return normalized_dim(call.argument(name), call.inputs[0].ndim)


def one_input_row(output, first_input, inputs: int) -> Row:
    """A row for a one-input op; an `out=` tensor (a second input) lies like the output."""
    return Row((output,), (first_input,) + (output,) * (inputs - 1))


def on_shards(op, function: Callable) -> Callable:
    """A rule's local op: `function(mesh, ...)` on real shards; on meta tensors (mesh None: the
    engine evaluating output shapes) `op` itself."""

    def run(mesh, *args, **kwargs):
        return op(*args, **kwargs) if mesh is None else function(mesh, *args, **kwargs)

    return run


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `tensor`'s shape, stride and dtype: what an op gives without data."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def empty_shard_results(op, args: tuple, kwargs: dict | None = None, *, stand_in: Callable = meta_like,
                        local_shape: Callable | None = None, fill=0):
    """`op`'s results on this rank's shard without running its kernel: shapes and dtypes from `op`
    on meta tensors (`stand_in` makes each tensor argument's, by default of the same shape; some
    meta kernels refuse empty dims too, so a rule may give them size 1), each result of shape
    `local_shape(meta_result)` (default: the meta result's) filled with `fill`, on the device of
    the data (the first tensor argument)."""
    kwargs = kwargs or {}
    device = next(value.device for value in tree_flatten((args, kwargs))[0] if isinstance(value, torch.Tensor))
    meta_args, meta_kwargs = tree_map_only(torch.Tensor, stand_in, (args, kwargs))
    results = op(*meta_args, **meta_kwargs)

    def filled(meta: torch.Tensor) -> torch.Tensor:
        shape = meta.shape if local_shape is None else local_shape(meta)
        return torch.full(shape, fill, dtype=meta.dtype, device=device)

    return tree_map_only(torch.Tensor, filled, results)
