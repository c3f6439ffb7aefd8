"""Tensor parallelism for nn.Modules, with `torch.distributed.tensor.parallel`'s names.

A plan names submodules and the style each is laid out with; `parallelize_module` applies it over
a 1-D mesh (the tensor-parallel mesh dim). `loss_parallel()` computes the cross-entropy of
class-sharded logits without gathering them. `hf_tp_plan(model)` reads a Hugging Face transformers
model's own plan strings as styles.

    >>> from shardtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    >>> parallelize_module(mlp, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})  # doctest: +SKIP
"""

from .api import parallelize_module
from .huggingface import hf_tp_plan
from .loss import loss_parallel
from .prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from .style import ParallelStyle, UnsupportedModuleError
from .styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = [
    "parallelize_module",
    "hf_tp_plan",
    "loss_parallel",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "UnsupportedModuleError",
]
