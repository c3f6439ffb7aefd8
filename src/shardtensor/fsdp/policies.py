"""What `fully_shard` is told about dtypes and offloading: small frozen values with PyTorch's names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

# torch 2.15 changed what reduce_dtype=None means for FSDP2: gradients are reduced in the parameters' own
# dtype, no longer in param_dtype (its MixedPrecisionPolicy docstring, "versionchanged:: 2.15").
_NONE_REDUCES_IN_PARAMETER_DTYPE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 15)


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Dtypes of one FSDP unit: sharded parameters keep their dtype, the gathered ones use `param_dtype`.

    `param_dtype`: the dtype parameters are all-gathered in and the forward/backward compute in
    (None: the parameters' own). `reduce_dtype`: the dtype gradients are summed in across ranks (None:
    as the installed torch's FSDP2 does, the parameters' own dtype on torch >= 2.15, `param_dtype` before;
    `reduce_dtype_for`). `output_dtype`: floating outputs of the module's forward are cast to it
    (None: left alone). `cast_forward_inputs`: floating inputs of the forward are cast to
    `param_dtype`.

    >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # doctest: +SKIP
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(
                    f"MixedPrecisionPolicy({name}={value!r}): give a floating torch.dtype "
                    f"(torch.bfloat16, torch.float16, torch.float32, ...) or None to keep the parameters' dtype"
                )


def reduce_dtype_for(policy: MixedPrecisionPolicy, parameter_dtype: torch.dtype) -> torch.dtype:
    """The dtype a unit of `parameter_dtype` parameters reduces its gradients in under `policy`."""
    if policy.reduce_dtype is not None:
        return policy.reduce_dtype
    if _NONE_REDUCES_IN_PARAMETER_DTYPE:
        return parameter_dtype
    return policy.param_dtype or parameter_dtype


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the mesh's device."""


@dataclass(frozen=True, slots=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory between uses.

    On a CPU mesh they already live there, so this policy changes nothing (it is accepted so that
    the same training script runs on CPU and GPU). On a CUDA mesh it is not implemented yet and
    `fully_shard` raises. `pin_memory` is PyTorch's option for the host copies.
    """

    pin_memory: bool = True
