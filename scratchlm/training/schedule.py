"""Learning-rate schedules with linear warm-up: the cosine (as in LLaMA and the CS336 assignment-1 handout), the
trapezoid warm-up / stable / decay (WSD) and a linear decay, with the `[schedule]` section that names them.

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

The linear schedule decays from the end of its warm-up to `T_c` in a straight line:

    T_w ≤ t ≤ T_c:    α_t = α_max + (t - T_w) / (T_c - T_w) · (α_min - α_max)

A cosine spends most of a run below its peak; WSD trains at the peak for longer and gets the loss drop of
annealing in its short final decay. Its rate before the decay does not depend on the run's length either, so
a run can be extended by moving only the decay.

Each is a pure function of the step, so resuming a run continues the schedule exactly. The trainer never
chooses between them: `build_schedule` turns the `[schedule]` section and the run's length into one
`Schedule`, a callable from the step to the rate, and the step only calls it. A new schedule is one function
and one line in `SCHEDULES`, which says how it computes a rate and which share of the run, at its end, decays
(what a time budget may still move, `scratchlm.training.budget`); `schedule.kind` accepts every key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


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


def linear_lr_schedule(
    it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, decay_end: int
) -> float:
    """The learning rate at step `it` of a warm-up then a straight decay to `min_learning_rate` at `decay_end`."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it >= decay_end:
        return min_learning_rate
    progress = (it - warmup_iters) / (decay_end - warmup_iters)
    return max_learning_rate + progress * (min_learning_rate - max_learning_rate)


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule of the registry: its rate at a step, and the share of the run that decays at its end."""

    rate: Callable[[Schedule, int], float]
    decaying_share: Callable[[ScheduleConfig], float]


# The functions are looked up when called, so that a test may wrap them in this module.
SCHEDULES: dict[str, ScheduleKind] = {
    "cosine": ScheduleKind(
        lambda s, t: cosine_lr_schedule(t, s.lr, s.min_lr, s.config.warmup_iters, s.end), lambda c: 1.0
    ),
    "wsd": ScheduleKind(
        lambda s, t: wsd_lr_schedule(
            t, s.lr, s.min_lr, s.config.warmup_iters, s.end, s.config.decay_fraction
        ),
        lambda c: c.decay_fraction,
    ),
    "linear": ScheduleKind(
        lambda s, t: linear_lr_schedule(t, s.lr, s.min_lr, s.config.warmup_iters, s.end), lambda c: 1.0
    ),
}
ScheduleName = Literal[tuple(SCHEDULES)]  # the config accepts exactly the registered kinds


@dataclass(frozen=True)
class ScheduleConfig:
    # cosine: warm-up, then a cosine down to min_lr. wsd: warm-up, stable at lr, then a linear decay to min_lr
    # over the last decay_fraction of the steps (the trapezoid of modded-nanogpt and nanochat). linear:
    # warm-up, then a straight decay to min_lr.
    kind: ScheduleName = "cosine"
    warmup_iters: int = 100
    cosine_cycle_iters: int = 0  # the step where the decay ends; 0: the run's last step
    decay_fraction: float = 0.2  # wsd: the share of the schedule's steps that decays, in (0, 1]

    @property
    def decaying_share(self) -> float:
        """The share of the run, at its end, whose rate is below the peak (1: from the warm-up on)."""
        return SCHEDULES[self.kind].decaying_share(self)


@dataclass(frozen=True)
class Schedule:
    """The learning rate of every step of one run: `schedule(step)`. `end` is the step where the rate reaches
    `min_lr` (the cosine's `T_c`, the WSD's `T`); the run's length when the config leaves it open."""

    config: ScheduleConfig
    lr: float
    min_lr: float
    end: int

    def __call__(self, step: int) -> float:
        return SCHEDULES[self.config.kind].rate(self, step)


def build_schedule(config: ScheduleConfig, lr: float, min_lr: float, total_steps: int) -> Schedule:
    """The schedule `config` describes for a run of `total_steps` steps from `lr` down to `min_lr`: it ends at
    `config.cosine_cycle_iters`, or at the run's last step when that is 0."""
    return Schedule(config, lr, min_lr, config.cosine_cycle_iters or total_steps)
