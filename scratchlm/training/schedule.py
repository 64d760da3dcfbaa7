"""Learning-rate schedules with linear warm-up: the cosine (as in LLaMA and the CS336 assignment-1 handout) and the
trapezoid warm-up / stable / decay (WSD).

For step `t`, peak rate `α_max`, final rate `α_min`, warm-up length `T_w` and the step `T_c` where the cosine
ends:

    t < T_w:          α_t = t / T_w · α_max                     (linear warm-up from 0)
    T_w ≤ t ≤ T_c:    α_t = α_min + ½ (1 + cos((t - T_w) / (T_c - T_w) · π)) (α_max - α_min)
    t > T_c:          α_t = α_min                               (flat tail)

WSD (Hu et al., 2024, MiniCPM; the schedule of modded-nanogpt and nanochat) holds the peak and decays only at
the end, linearly, over the last `T_d` steps of the `T` it lasts:

    t < T_w:              α_t = t / T_w · α_max
    T_w ≤ t ≤ T - T_d:    α_t = α_max                               (stable)
    T - T_d < t ≤ T:      α_t = α_max + (t - T + T_d) / T_d · (α_min - α_max)    (linear decay)
    t > T:                α_t = α_min

A cosine spends most of a run below its peak; WSD trains at the peak for longer and gets the loss drop of
annealing in its short final decay. Its rate before the decay does not depend on the run's length either, so
a run can be extended by moving only the decay.

Both are pure functions of the step, so resuming a run continues the schedule exactly. The trainer never
chooses between them: `build_schedule` turns the `[schedule]` section and the run's length into one
`Schedule`, a callable from the step to the rate, and the step only calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scratchlm.training.config import ScheduleConfig


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


def wsd_lr_schedule(
    it: int,
    max_learning_rate: float,
    min_learning_rate: float,
    warmup_iters: int,
    total_iters: int,
    decay_fraction: float,
) -> float:
    """The learning rate at step `it` of a warm-up / stable / decay schedule that ends at `total_iters`, the
    last `decay_fraction` of its steps (at least one) decaying linearly to `min_learning_rate`."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    decay_iters = max(1, round(decay_fraction * total_iters))
    decay_start = max(warmup_iters, total_iters - decay_iters)
    if it <= decay_start:
        return max_learning_rate
    if it >= total_iters:
        return min_learning_rate
    progress = (it - decay_start) / (total_iters - decay_start)
    return max_learning_rate + progress * (min_learning_rate - max_learning_rate)


@dataclass(frozen=True)
class Schedule:
    """The learning rate of every step of one run: `schedule(step)`. `end` is the step where the rate reaches
    `min_lr` (the cosine's `T_c`, or the WSD's `T`); the run's length when the config leaves it open."""

    kind: str
    lr: float
    min_lr: float
    warmup_iters: int
    end: int
    decay_fraction: float

    def __call__(self, step: int) -> float:
        # The functions are looked up when called, so that a test may wrap them in this module.
        if self.kind == "wsd":
            return wsd_lr_schedule(
                step, self.lr, self.min_lr, self.warmup_iters, self.end, self.decay_fraction
            )
        return cosine_lr_schedule(step, self.lr, self.min_lr, self.warmup_iters, self.end)


def build_schedule(config: ScheduleConfig, lr: float, min_lr: float, total_steps: int) -> Schedule:
    """The schedule `config` describes for a run of `total_steps` steps from `lr` down to `min_lr`: it ends at
    `config.cosine_cycle_iters`, or at the run's last step when that is 0."""
    return Schedule(
        config.kind,
        lr,
        min_lr,
        config.warmup_iters,
        config.cosine_cycle_iters or total_steps,
        config.decay_fraction,
    )
