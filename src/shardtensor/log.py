"""Logging through Python's `logging` (logger `shardtensor`): what propagation decided, what it costs.

At DEBUG, `shardtensor.propagation` logs every sharding decision it makes (once per new decision:
the op, where the inputs are, where the rule wants them, the output layouts and the planner's cost
of moving the inputs) and `shardtensor.redistribute` every plan the planner builds (its explain
text, with bytes and cost). Cached decisions and plans log nothing and cost nothing: the check
runs only where a new one is computed.

Switch it on in code with `logging.getLogger("shardtensor").setLevel(logging.DEBUG)` (and a
handler), or without code changes with the environment variable `SHARDTENSOR_LOG=debug` (also
`info`, `warning`, `error`), which sets the level and adds a stderr handler at import.

    $ SHARDTENSOR_LOG=debug torchrun --nproc-per-node 2 train.py  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from .layout import Layout
from .redistribute.planner import plan as plan_redistribute

__all__ = ["logger", "propagation_logger", "DEBUG", "LEVELS", "configure_from_environment", "log_decision"]

DEBUG = logging.DEBUG
logger = logging.getLogger("shardtensor")
propagation_logger = logging.getLogger("shardtensor.propagation")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
ENVIRONMENT_VARIABLE = "SHARDTENSOR_LOG"


def _level_error(value: str) -> ValueError:
    return ValueError(
        f"{ENVIRONMENT_VARIABLE}={value!r} is not a log level; use one of {sorted(LEVELS)} "
        f"(case-insensitive), or unset it to leave logging to the program"
    )


def configure_from_environment(environment=os.environ) -> None:
    """Apply `SHARDTENSOR_LOG` (if set): the level of the `shardtensor` logger and a stderr handler."""
    value = environment.get(ENVIRONMENT_VARIABLE, "").strip()
    if not value:
        return
    if value.lower() not in LEVELS:
        raise _level_error(value)
    logger.setLevel(LEVELS[value.lower()])
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def _placements_text(layout: Layout) -> str:
    return "[" + ", ".join(str(placement) for placement in layout.placements) + "]"


def log_decision(op, layouts: Sequence[Layout], decision, input_itemsizes: Sequence[int]) -> None:
    """Log one new propagation decision: inputs from -> to, outputs, and the cost of moving the inputs."""
    moves, cost_us = [], 0.0
    for layout, target, itemsize in zip(layouts, decision.input_layouts, input_itemsizes):
        if target is not None and target != layout:
            cost_us += plan_redistribute(layout, target, itemsize).total_cost_us
            moves.append(f"{_placements_text(layout)} -> {_placements_text(target)}")
        else:
            moves.append(_placements_text(layout))
    outputs = ", ".join("-" if layout is None else f"{_placements_text(layout)} {layout.shape}"
                        for layout in decision.output_layouts)
    rows = ", ".join(str(row) for row in decision.rows)
    propagation_logger.debug("%s on mesh %s: inputs %s; outputs %s; rows per mesh dim %s; moving inputs costs %.2f us",
                             op, layouts[0].mesh_shape if layouts else (), "; ".join(moves), outputs, rows, cost_us)


configure_from_environment()
