"""A plan in words beside the plan that moves the fewest bytes: for small tensors the cost model
prefers fewer collectives over fewer bytes, and a plan above its lower bound says what fewer bytes
would have cost.
"""

from __future__ import annotations

from ..layout import Layout
from .planner import DEFAULT_COST_MODEL, CostModel, Plan, plan

__all__ = ["fewest_bytes_plan", "explain_plan"]

# Prices bytes first (1 us per byte): among plans moving the fewest bytes, the fewest collectives,
# then the fewest local steps.
_BYTES_ONLY = CostModel(latency_us=1e-3, exchange_latency_us=1e-3, bytes_per_us=1.0, local_step_us=1e-5)


def fewest_bytes_plan(source: Layout, target: Layout, itemsize: int) -> Plan:
    """The plan moving the fewest bytes (latency ignored), to compare a plan with what bytes alone
    would choose: for small tensors the cost model prefers fewer collectives over fewer bytes."""
    return plan(source, target, itemsize, _BYTES_ONLY)


def explain_plan(result: Plan, cost_model: CostModel = DEFAULT_COST_MODEL) -> str:
    """`str(result)`, and when it moves more than its lower bound, the fewest-bytes plan beside it,
    priced with the same `cost_model` (a plan above the bound then shows what fewer bytes would cost)."""
    text = str(result)
    if result.total_bytes <= result.lower_bound_bytes:
        return text
    fewest = fewest_bytes_plan(result.source, result.target, result.itemsize)
    if fewest.total_bytes >= result.total_bytes:
        return f"{text}\n  no plan of these steps moves fewer bytes"
    cost = sum(cost_model.step_cost(step.collective, step.bytes_per_rank) for step in fewest.steps)
    return (
        f"{text}\n  fewest bytes: {fewest.total_bytes} bytes/rank in {len(fewest.collectives)} collective(s) "
        f"({' + '.join(fewest.collectives)}) would cost {cost:.2f} us: latency per collective outweighs the bytes"
    )
