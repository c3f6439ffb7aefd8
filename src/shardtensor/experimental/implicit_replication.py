"""`implicit_replication()`: read every plain tensor mixed with DTensors as Replicate (unchecked).

The block itself is the engine's (`shardtensor.plain_tensors`, where dispatch reads it); it is
offered here, as in `torch.distributed.tensor.experimental`, because it trades a check for speed.
"""

from __future__ import annotations

from ..plain_tensors import implicit_replication

__all__ = ["implicit_replication"]
