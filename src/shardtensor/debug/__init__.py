"""Debug tools: count the collectives a block issues, and explain a redistribute before it runs.

Mirrors `torch.distributed.tensor.debug` (`CommDebugMode`) and adds `explain_redistribute`.
"""

from .comm_mode import CommDebugMode
from .explain import explain_redistribute

__all__ = ["CommDebugMode", "explain_redistribute"]
