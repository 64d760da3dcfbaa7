"""Cosine learning-rate schedule with linear warm-up (as in LLaMA and the specification).

For step `t`, peak rate `α_max`, final rate `α_min`, warm-up length `T_w` and the step `T_c` where the cosine
ends:

    t < T_w:          α_t = t / T_w · α_max                     (linear warm-up from 0)
    T_w ≤ t ≤ T_c:    α_t = α_min + ½ (1 + cos((t - T_w) / (T_c - T_w) · π)) (α_max - α_min)
    t > T_c:          α_t = α_min                               (flat tail)

It is a pure function of the step, so resuming a run continues the schedule exactly.
"""

from __future__ import annotations

import math


def cosine_lr_schedule(
    it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    """The learning rate at step `it`."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it <= cosine_cycle_iters:
        if cosine_cycle_iters == warmup_iters:  # an empty cosine: the peak is also the end
            return max_learning_rate
        progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
        return min_learning_rate + 0.5 * (1 + math.cos(progress * math.pi)) * (
            max_learning_rate - min_learning_rate
        )
    return min_learning_rate
