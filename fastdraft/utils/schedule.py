"""Learning-rate schedules, as pure functions of the step."""

from __future__ import annotations

import math


def warmup_lr(step: int, *, lr: float, warmup_steps: int) -> float:
    """Linear warmup to `lr` over warmup_steps (0-based step; `lr` from step warmup_steps - 1
    on; 0 warmup_steps: `lr` throughout)."""
    return lr if step >= warmup_steps else lr * (step + 1) / warmup_steps


def warmup_cosine_lr(step: int, *, lr: float, warmup_steps: int, total_steps: int,
                     min_ratio: float) -> float:
    """Linear warmup to `lr` over warmup_steps, then cosine decay to lr * min_ratio at the last
    step (total_steps - 1)."""
    if step < warmup_steps:
        return warmup_lr(step, lr=lr, warmup_steps=warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_ratio + (1 - min_ratio) * cosine)
