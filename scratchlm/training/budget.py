"""The time budget (`training.max_time_s`) as part of the schedule, not only a stop.

A schedule needs a step count, a budget gives seconds, and how many steps fit depends on the machine. A run
that merely stopped when its time ran out would stop wherever it was, before its decay had begun when the
machine is slower than its config assumed, and the decay is the part of a schedule that matters most. So a
run with a budget decides its length while it trains:

    steps 1 .. MEASURE_FROM         start-up: compilation, the allocator filling its pools (not measured)
    steps MEASURE_FROM .. CALIBRATION_STEPS    measured: seconds per step, evaluations and checkpoints excluded
    at step CALIBRATION_STEPS       total = CALIBRATION_STEPS + the steps that fit in the rest of the budget,
                                    each with its share of the periodic evaluations (`evaluation_share`),
                                    at most the config's own length (max_steps / max_tokens, when set)
    then                            the schedule sized to `total` (WSD: warm-up, stable, decay; cosine: its
                                    length), ending at its minimum rate on the last step, inside the budget

The steps measured run at the rates of the schedule as first planned (the config's length, or an open-ended
one). Before the decision is known only the warm-up is certain to be the same whatever the length, so the
fast recipe warms up over at least `CALIBRATION_STEPS` steps; a shorter warm-up is allowed, and its measured
steps then run at the planned schedule's rates.

While the schedule is still at its peak rate (a WSD's stable phase), the decision is revised when the steps
since it, evaluations and checkpoints included, show that the run would overrun, or that it has a good deal
of time to spare (`TimeBudget.revise`): the run is shortened or lengthened so that its decay ends inside the
budget, and a measurement disturbed by other work on the machine does not cut the run short for good. The
decision (`BudgetDecision`, the latest one) is recorded in every checkpoint saved after it and in the metrics
log, so a resumed run continues the same schedule bit for bit, whatever the speed of the machine it resumes
on. The budget also stays a hard
limit: the run stops when it is spent, whatever the schedule says.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from scratchlm.training.config import TrainConfig
from scratchlm.training.schedule import Schedule, ScheduleConfig, build_schedule

CALIBRATION_STEPS = 20  # the step where a budgeted run decides its length
MEASURE_FROM = 5  # steps before it are start-up, not measured
# The share of the remaining budget planned for training steps and their periodic evaluations: the rest is for
# what the plan leaves out (checkpoints, the final evaluation, a machine a little slower than it was while
# measured).
BUDGET_SHARE = 0.92
# A forward pass costs about a third of a training step's forward and backward (the backward computes two
# products for each of the forward's: the gradients of the inputs and of the weights).
FORWARD_SHARE = 1 / 3

# A run is lengthened when this many times its steps fit (a smaller gain is not worth a new schedule).
REVISE_GAIN = 1.05
# The length of a schedule before a budgeted run without max_steps or max_tokens has decided its own.
OPEN_ENDED = 2**62


def evaluation_share(config: TrainConfig) -> float:
    """The time of the periodic validation estimates, as a fraction of the training steps' time: each
    estimate runs `eval.iters` forward passes of `eval.batch_size` sequences every `eval.interval` steps of
    `training.batch_size` sequences forward and backward. (The tiny config: 10 × 16 / (3 × 16 × 50) = 7 %.)"""
    if config.eval.interval <= 0:
        return 0.0
    sequences = config.eval.iters * (config.eval.batch_size or config.training.batch_size)
    return FORWARD_SHARE * sequences / (config.training.batch_size * config.eval.interval)


def fit_steps(done: int, elapsed_s: float, budget_s: float, step_s: float) -> int:
    """The total step count that fills `budget_s`: `done` steps taken in `elapsed_s` seconds, then as many as
    fit in `BUDGET_SHARE` of the rest at `step_s` seconds per step."""
    if step_s <= 0:
        return done
    return done + max(0, int(BUDGET_SHARE * (budget_s - elapsed_s) / step_s))


@dataclass(frozen=True)
class BudgetDecision:
    """How long a budgeted run is: decided at `step`, after measuring `step_s` seconds per step, with
    `elapsed_s` of the budget spent; the schedule then ends at `total_steps`."""

    step: int
    step_s: float
    elapsed_s: float
    total_steps: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BudgetDecision:
        return cls(
            int(values["step"]),
            float(values["step_s"]),
            float(values["elapsed_s"]),
            int(values["total_steps"]),
        )


class TimeBudget:
    """The run's length and schedule, and, while a budgeted run has not decided them, the measurement that
    will. `observe` is called after every step with the budget's clock (elapsed seconds over all sessions, and
    the seconds of them spent outside training steps); it returns the decision on the step that makes it."""

    def __init__(self, config: TrainConfig, decision: BudgetDecision | None = None) -> None:
        self.seconds = config.training.max_time_s
        self.planned = config.total_steps  # 0: as many as fit
        self.schedule_config = config.schedule
        self.lr, self.min_lr = config.optimizer.lr, config.optimizer.min_lr
        self.evaluation_share = evaluation_share(config)
        self.decision = decision
        self._window: tuple[int, float] | None = None  # (step, training seconds) where measuring began
        self.schedule = self._schedule()

    @property
    def total_steps(self) -> int:
        """The run's last step: the decided one, else the config's (open-ended while a budget decides it)."""
        if self.decision is not None:
            return self.decision.total_steps
        return self.planned or OPEN_ENDED

    @property
    def deciding(self) -> bool:
        """Whether the run still has to decide its length: a budget, and more planned steps than it measures."""
        return (
            self.decision is None
            and self.seconds > 0
            and (not self.planned or self.planned > CALIBRATION_STEPS)
        )

    def wants_clock(self, step: int, session_start: int) -> bool:
        """Whether step `step` begins or ends the measurement (the caller then waits for the device first, so
        that the clock sees the work done rather than the work queued)."""
        if not self.deciding:
            return False
        return step == self._window_start(session_start) or step == self._decision_step(session_start)

    def observe(
        self, step: int, session_start: int, elapsed_s: float, paused_s: float
    ) -> BudgetDecision | None:
        """Record the clock after step `step`; at the decision step, decide and resize the schedule."""
        if not self.deciding:
            return None
        training_s = elapsed_s - paused_s
        if step == self._window_start(session_start):
            self._window = (step, training_s)
        if step != self._decision_step(session_start) or self._window is None:
            return None
        first, start_s = self._window
        step_s = (training_s - start_s) / (step - first)
        total = fit_steps(step, elapsed_s, self.seconds, step_s * (1 + self.evaluation_share))
        if self.planned:
            total = min(total, self.planned)
        self.decision = BudgetDecision(step, step_s, elapsed_s, total)
        self.schedule = self._schedule()
        return self.decision

    def settle(self, total_steps: int) -> BudgetDecision:
        """The decision with the length several processes agreed on (each measured its own clock)."""
        assert self.decision is not None
        self.decision = dataclasses.replace(self.decision, total_steps=total_steps)
        self.schedule = self._schedule()
        return self.decision

    def spent(self, elapsed_s: float) -> bool:
        """Whether the budget is used up: the run stops then, whatever its schedule says (a hard limit)."""
        return self.seconds > 0 and elapsed_s > self.seconds

    def revise(self, step: int, elapsed_s: float) -> BudgetDecision | None:
        """After the decision, fit the run's length again to the rate of the steps since it, evaluations and
        checkpoints included: shorter when the run would overrun the budget (a machine that got busier,
        evaluations that cost more than the margin), longer when `REVISE_GAIN` more steps fit (the decision
        measured a moment when other work slowed the machine down). Only while the schedule is still at its
        peak rate, so that the steps taken had the same rate under either length (a WSD's stable phase; a
        cosine decays from its warm-up on, and keeps its length), never beyond the config's own length, and
        never so short that the decay would have to start before this step."""
        decision = self.decision
        # Over a fifth of the run at least, so that a one-off cost (the first evaluation compiles its graph)
        # is spread as it will be, not read as the rate of every step to come.
        window = max(CALIBRATION_STEPS, decision.total_steps // 5) if decision is not None else 0
        if decision is None or self.seconds <= 0 or step - decision.step < window:
            return None
        if self.schedule(step + 1) < self.lr:
            return None
        step_s = (elapsed_s - decision.elapsed_s) / (step - decision.step)
        fraction = self.schedule_config.decaying_share
        earliest = math.ceil(step / (1 - fraction)) if fraction < 1 else step + 1
        total = max(fit_steps(step, elapsed_s, self.seconds, step_s), earliest)
        if self.planned:
            total = min(total, self.planned)
        overruns = elapsed_s + (decision.total_steps - step) * step_s > self.seconds
        if not (overruns and total < decision.total_steps) and total < decision.total_steps * REVISE_GAIN:
            return None
        self.decision = BudgetDecision(step, step_s, elapsed_s, total)
        self.schedule = self._schedule()
        return self.decision

    def _window_start(self, session_start: int) -> int:
        # A session's first step pays for compilation: a resumed session measures from its second.
        return max(MEASURE_FROM, session_start + 1)

    def _decision_step(self, session_start: int) -> int:
        return max(CALIBRATION_STEPS, self._window_start(session_start) + MEASURE_FROM)

    def _schedule(self) -> Schedule:
        if self.decision is None:
            return build_schedule(self.schedule_config, self.lr, self.min_lr, self.total_steps)
        return build_schedule(
            fitted(self.schedule_config, self.decision), self.lr, self.min_lr, self.total_steps
        )


def fitted(schedule: ScheduleConfig, decision: BudgetDecision) -> ScheduleConfig:
    """The schedule sized to the decided length: it ends on the run's last step (a `cosine_cycle_iters`
    beyond it is brought in), and a warm-up longer than the run ends a step before it, so that the last step
    is at the minimum rate."""
    total = decision.total_steps
    end = min(schedule.cosine_cycle_iters or total, total)
    warmup = min(schedule.warmup_iters, max(end - 1, 0))
    return dataclasses.replace(schedule, cosine_cycle_iters=end, warmup_iters=warmup)
