"""The three styles that lay out parameters: ColwiseParallel, RowwiseParallel, SequenceParallel.

Megatron-style tensor parallelism for a Linear: the first layer of a pair splits its output
features (`ColwiseParallel`: the output is sharded on its last dim, no communication), the second
its input features (`RowwiseParallel`: each rank computes a partial sum, reduced once). For an
Embedding the table is split by embedding columns (Colwise) or by vocabulary rows (Rowwise: the
lookup is local and gives a Partial sum, no gather of the table). `SequenceParallel` runs norms
and dropout on activations sharded along the sequence dim with replicated parameters.

    >>> plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}  # doctest: +SKIP
    >>> parallelize_module(mlp, mesh["tp"], plan)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..mesh import DeviceMesh
from ..placement import Placement, Replicate, Shard
from .layouts import check_tp_mesh, redistribute_to, to_dtensor, to_output
from .style import (
    ParallelStyle,
    as_placements,
    distribute_parameters,
    linear_input_sizes,
    linear_or_embedding,
)

__all__ = ["ColwiseParallel", "RowwiseParallel", "SequenceParallel"]

_REPLICATE = (Replicate(),)  # made once: torch.compile traces every hook call, and a placement made there is traced too


def _prepare_first_input(style, module, inputs, mesh, given: tuple, desired: tuple):
    """The module's first positional input as a DTensor with `desired` placements (others untouched)."""
    where = f"{type(style).__name__} on {type(module).__name__}"
    first = to_dtensor(inputs[0], mesh, given, where, known_sizes=linear_input_sizes(module))
    return (redistribute_to(first, desired), *inputs[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColwiseParallel(ParallelStyle):
    """Split a Linear's weight by output features (an Embedding's by embedding columns).

    The input (`input_layouts`, default Replicate) is replicated before the module; the output is
    sharded on its last dim and moved to `output_layouts` (default `Shard(-1)`), returned as the
    local tensor when `use_local_output` (default True, as in PyTorch).
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linear_or_embedding(self, module)
        check_tp_mesh(device_mesh, type(self).__name__)
        given = as_placements(self.input_layouts, Replicate())
        output = as_placements(self.output_layouts, Shard(-1))
        if isinstance(module, nn.Linear):
            placements = {"weight": Shard(0), "bias": Shard(0)}
        else:
            placements = {"weight": Shard(1)}
        return distribute_parameters(
            module,
            device_mesh,
            placements,
            self.src_data_rank,
            input_fn=lambda hooked, inputs, mesh: _prepare_first_input(self, hooked, inputs, mesh, given, _REPLICATE),
            output_fn=lambda hooked, outputs, mesh: to_output(outputs, output, self.use_local_output),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowwiseParallel(ParallelStyle):
    """Split a Linear's weight by input features (an Embedding's by vocabulary rows).

    A Linear takes its input sharded on the last dim (`input_layouts`, default `Shard(-1)`, the
    output of a ColwiseParallel layer), an Embedding takes replicated indices; either computes a
    Partial sum, which is reduced to `output_layouts` (default Replicate: one all_reduce;
    `Shard(1)`: one reduce_scatter, for sequence parallelism). The bias is replicated.
    """

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        linear_or_embedding(self, module)
        check_tp_mesh(device_mesh, type(self).__name__)
        given = as_placements(self.input_layouts, Shard(-1))
        output = as_placements(self.output_layouts, Replicate())
        if isinstance(module, nn.Linear):
            placements, desired = {"weight": Shard(1), "bias": Replicate()}, (Shard(-1),)
        else:
            placements, desired = {"weight": Shard(0)}, _REPLICATE
        return distribute_parameters(
            module,
            device_mesh,
            placements,
            self.src_data_rank,
            input_fn=lambda hooked, inputs, mesh: _prepare_first_input(self, hooked, inputs, mesh, given, desired),
            output_fn=lambda hooked, outputs, mesh: to_output(outputs, output, self.use_local_output),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """Run a position-wise module (a norm, dropout, or one written in Python such as Llama's RMSNorm)
    on activations sharded along `sequence_dim` (default 1); any module is accepted, as in PyTorch.

    Parameters are replicated; each rank sees part of the sequence, so their gradients arrive as
    partial sums and are reduced into Replicate gradients when backward ends (one all_reduce with
    the other such gradients, `gradients.py`). The input is read or moved to `Shard(sequence_dim)`;
    the output stays so, as a DTensor unless `use_local_output`. Uneven sequences (7 over 4 ranks)
    are exact.
    """

    sequence_dim: int = 1
    use_local_output: bool = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        check_tp_mesh(device_mesh, type(self).__name__)
        sequence = (Shard(self.sequence_dim),)
        return distribute_parameters(
            module,
            device_mesh,
            {},
            self.src_data_rank,
            input_fn=lambda hooked, inputs, mesh: _prepare_first_input(self, hooked, inputs, mesh, sequence, sequence),
            output_fn=lambda hooked, outputs, mesh: to_output(outputs, None, self.use_local_output),
        )
