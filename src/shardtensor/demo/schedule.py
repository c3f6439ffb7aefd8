"""The demo's learning-rate schedule: a linear warmup, then a cosine decay to a small fraction of the peak.

A pure function of the step, so a run resumed from a checkpoint (which stores the step) continues on
the same curve, and the one-device model of `--compare` follows it step for step.
"""

from __future__ import annotations

import math

import torch

__all__ = ["learning_rate_at", "set_learning_rate"]


def learning_rate_at(step: int, peak: float, steps: int, warmup_steps: int, final_fraction: float) -> float:
    """The learning rate of `step` (0-based) of `steps`: rising linearly to `peak` over the first
    `warmup_steps` steps (a fresh AdamW's first updates are the largest it makes, so the ramp keeps
    them from throwing the model into a plateau), then falling along half a cosine to
    `final_fraction * peak` at the last step.

    >>> [round(learning_rate_at(step, 1.0, 10, 2, 0.1), 3) for step in (0, 1, 2, 9)]
    [0.5, 1.0, 1.0, 0.1]
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = steps - 1 - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, learning_rate: float) -> None:
    """Give every parameter group of `optimizer` this learning rate for its next step."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
