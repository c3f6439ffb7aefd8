"""Debug tools: count the collectives a block issues, and explain a redistribute before it runs.

Mirrors `torch.distributed.tensor.debug` (`CommDebugMode`) and adds `explain_redistribute`.
"""

from ..collective_check import CollectiveMismatch, check_collectives
from .comm_mode import CommDebugMode
from .explain import explain_redistribute

__all__ = ["CommDebugMode", "explain_redistribute", "check_collectives", "CollectiveMismatch"]
