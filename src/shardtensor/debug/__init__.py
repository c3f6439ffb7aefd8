"""Debug tools: count the collectives a block issues (per module), show who holds what, explain a
redistribute before it runs, and report the dispatch caches' hits, misses and decisions per op
(`plan_cache_counts`).

Mirrors `torch.distributed.tensor.debug` (`CommDebugMode`, `visualize_sharding`) and adds
`explain_redistribute`.
"""

from ..collective_check import CollectiveMismatch, check_collectives
from ..plan_cache import CacheCounts
from ..plan_cache import cache_counts as plan_cache_counts
from .comm_mode import CommDebugMode
from .explain import explain_redistribute
from .visualize import visualize_sharding

__all__ = [
    "CommDebugMode", "explain_redistribute", "visualize_sharding", "plan_cache_counts", "CacheCounts",
    "check_collectives", "CollectiveMismatch",
]
