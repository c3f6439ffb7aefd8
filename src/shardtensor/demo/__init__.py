"""The main job: a small GPT trained on a 2x2 mesh (sharded data parallel x tensor parallel) with
`parallelize_module` over "tp", `fully_shard` over "dp" (`--data-parallel ddp`: replicated instead)
and `loss_parallel`, checkable against one device (`--compare`).

    python -m shardtensor.demo                   # 4 local CPU ranks, no launcher needed
    torchrun --nproc-per-node 4 -m shardtensor.demo   # the same under torchrun (nccl on GPUs)

`model.GPT` / `model.parallelize` build and lay out the model, `train.train` is one rank's loop.
"""

from .cli import main

__all__ = ["main"]
