"""Debug tools: count the collectives a block issues (per module), show who holds what, and
explain a redistribute before it runs.

Mirrors `torch.distributed.tensor.debug` (`CommDebugMode`, `visualize_sharding`) and adds
`explain_redistribute`.
"""

from .comm_mode import CommDebugMode
from .explain import explain_redistribute
from .visualize import visualize_sharding

__all__ = ["CommDebugMode", "explain_redistribute", "visualize_sharding"]
