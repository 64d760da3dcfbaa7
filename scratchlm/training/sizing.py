"""The shape of a model for the steps a time budget buys.

In a budget of minutes the loss a model reaches is a race between what the model can hold and how many
optimizer steps it gets. A small step (2 layers, 8 sequences) takes about half the time of one twice its
size, so the small shape wins while steps are few; given enough of them, the larger one catches up and
passes it. Which side of that line a run is on depends on the machine (its precision, its threads, whether it
compiles) and on the budget, not on the text, so the shape is chosen from those, before anything trains:

    timing   each shape's training step, timed where the run will train (`measure_step`): a few steps of
             the run itself (its config, data, precision, threads and compilation) in a scratch directory,
             the first one (compiling, the allocator filling its pools) apart; kept per machine beside the
             device profile (train-timings.json), so that a machine is measured once. A compiled run times
             the smallest shape compiled and scales the others by their eager steps (`ladder_timings`)
    steps    the length the time budget will decide for that shape (`predicted_steps`, the trainer's own
             rule, `scratchlm.training.budget.fit_steps`): its first steps and start-up, then the steps that
             fit in the rest, each with its share of the periodic evaluations
    choice   the largest shape whose steps reach its `min_steps`; the smallest when none does

A rule from the matmul rate (steps = budget × a step's share of the rate / FLOPs) would need that share, and
it is not a constant: about 0.7 for the quickstart's model in fp32 on a 2-core Zen 3, about 0.35 in bf16 on a
Zen 5, which doubled the steps it promised there. Timing the step measures the share, the compilation and the
framework's own time together, on whatever the machine is.

Each `min_steps` is in steps, what learning is counted in, so it holds on any machine: it was measured by
racing the shapes against each other at several budgets (docs/experiments.md, "The shape for the budget").
The predicted steps are a count, not a promise: the run still measures its own speed and fits its schedule to
it (`scratchlm.training.budget`), and the steps predicted and taken are both recorded (shape.json). What the run
measured when it decided its length then replaces the probe's timing of its shape (`record_run`), so that
the next prediction starts from a real run's start-up and step.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from scratchlm.console import console
from scratchlm.device import timings
from scratchlm.device.planning import Plan, plan
from scratchlm.run.metrics import read_metrics
from scratchlm.training.budget import CALIBRATION_STEPS, MEASURE_FROM, evaluation_share, fit_steps
from scratchlm.training.config import TrainConfig
from scratchlm.training.recipes import Recipe

KIND = "train"  # train-timings.json (`scratchlm.device.timings`)
# Steps a shape is timed over: the first ones (start-up, the allocator filling its pools) apart, as the
# trainer's own measurement leaves them out (`MEASURE_FROM`), the median of the rest.
PROBE_STEPS = 12


@dataclass(frozen=True)
class Shape:
    """One rung of a ladder: what it sets (`{section: {key: value}}`, as a recipe) and the fewest steps of its
    own it needs, in the budget, to reach a lower loss than the rung below it."""

    name: str
    changes: Recipe
    min_steps: int = 0


@dataclass(frozen=True)
class StepTiming:
    """A shape's training step on this machine: `startup_s` from the start of training to the end of its first
    step (compiling, the allocator filling its pools), `step_s` a step after that."""

    startup_s: float
    step_s: float


@dataclass(frozen=True)
class ShapeChoice:
    shape: Shape
    steps: dict[str, int]  # the steps the budget buys each shape of the ladder, by name
    reason: str
    timings: dict[str, StepTiming] | None = None  # what the steps were predicted from, by name

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.name,
            "changes": self.shape.changes,
            "steps": self.steps,
            "reason": self.reason,
            "timings": {name: asdict(t) for name, t in (self.timings or {}).items()},
        }


def timing_key(config: TrainConfig, choices: Plan) -> str:
    """What a step's time depends on: the device (its profile's key), precision, threads, compilation, the
    model's shape and the batch."""
    m = config.model
    shape = (m.vocab_size, m.context_length, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.value_embeddings)
    # Keyed by the run's threads, not by the process's current ones: a probe or a run sets them while it trains.
    threads = choices.threads.value or None
    return timings.timings_key(
        torch.device(choices.device),
        choices.precision.value,
        f"threads={choices.threads.value}",
        f"compile={choices.compile.value}",
        ",".join(map(str, shape)),
        f"batch={config.training.batch_size}",
        threads=threads,
    )


def recorded_step(config: TrainConfig, choices: Plan) -> StepTiming | None:
    """The timing kept on this machine for `config`'s step as `choices` runs it, if any."""
    known = timings.read_timings(KIND).get(timing_key(config, choices))
    try:
        return StepTiming(**known) if known is not None else None
    except TypeError:  # written by another version
        return None


def measure_step(config: TrainConfig, choices: Plan) -> StepTiming:
    """`config`'s training step on this machine as `choices` (the plan its run makes) runs it, compiled or
    not: recorded, or timed now over `PROBE_STEPS` steps of the run itself in a scratch directory (no
    evaluation, no checkpoint kept).

    A compiled run is timed after a first, untimed step has compiled it: the run that follows finds the
    compiler's on-disk caches filled, and starts in a fraction of the first compilation (on a 2-core Zen 3,
    the quickstart's 16-sequence shape: 70 s cold, 10 to 25 s warm in a new process)."""
    known = recorded_step(config, choices)
    if known is not None:
        return known
    compiled = bool(choices.compile.value)
    with tempfile.TemporaryDirectory(prefix="scratchlm-probe-") as scratch:
        if compiled:
            _train_briefly(config, compiled, 1, Path(scratch, "compile"))
        clock = _train_briefly(config, compiled, PROBE_STEPS, Path(scratch, "timed"))
    steps = [b - a for a, b in zip(clock[MEASURE_FROM - 1 :], clock[MEASURE_FROM:], strict=False)]
    timing = StepTiming(startup_s=round(clock[0], 3), step_s=round(statistics.median(steps), 4))
    timings.record_timing(KIND, timing_key(config, choices), asdict(timing))
    return timing


def ladder_timings(ladder: Sequence[tuple[Shape, TrainConfig]], choices: Plan) -> dict[str, StepTiming]:
    """Each shape's step as `choices` will run it. Eager runs: each timed (`measure_step`). Compiled runs:
    compiling a shape takes a minute on a small CPU, so only the smallest is timed compiled; a shape with no
    record of its own (a probe, or a run that trained it: `record_run`) takes the smallest's start-up and its
    step scaled by the two shapes' eager steps (seconds to time: the shapes differ in batch and depth, which
    the compiler speeds up alike)."""
    if not choices.compile.value:
        return {shape.name: measure_step(config, choices) for shape, config in ladder}
    smallest = ladder[0][1]
    base = measure_step(smallest, choices)
    eager = plan(
        torch.device(choices.device),
        choices.precision.value,
        compile=False,
        threads=choices.threads.value or 0,
    )
    base_eager = measure_step(smallest, eager).step_s
    timed = {}
    for shape, config in ladder:
        known = base if config is smallest else recorded_step(config, choices)
        if known is None:
            ratio = measure_step(config, eager).step_s / base_eager
            known = StepTiming(startup_s=base.startup_s, step_s=round(base.step_s * ratio, 4))
        timed[shape.name] = known
    return timed


def _train_briefly(config: TrainConfig, compiled: bool, steps: int, run_dir: Path) -> list[float]:
    """Train `steps` steps of `config` (compiled or not) in `run_dir`, quietly; the training clock at the end
    of each step."""
    from scratchlm.training.trainer import train  # the loop itself: the probe is the run, shortened

    values = config.to_dict()
    values["training"] |= {"max_steps": steps, "max_tokens": 0, "max_time_s": 0.0, "compile": compiled}
    values["eval"] |= {"interval": 0}
    values["checkpoint"] |= {"interval": 0}
    values["logging"] |= {"run_dir": str(run_dir), "log_interval": 1}
    quiet, console.quiet = console.quiet, True
    try:
        train(TrainConfig.from_dict(values))
    finally:
        console.quiet = quiet
    return [r["time"] for r in read_metrics(run_dir) if "train_loss" in r]


def record_run(config: TrainConfig, choices: Plan, step: int, step_s: float, elapsed_s: float) -> None:
    """What a budgeted run of `config` measured when it decided its length (`step_s` a step, `elapsed_s` spent
    at `step`), kept as its shape's timing for the next prediction: a run is the truest probe of itself (its
    start-up in a fresh process, the compiler's caches as a run finds them, the machine as it is now)."""
    startup_s = max(0.0, elapsed_s - (step - 1) * step_s)
    record = StepTiming(startup_s=round(startup_s, 3), step_s=round(step_s, 4))
    timings.record_timing(KIND, timing_key(config, choices), asdict(record))


def predicted_steps(config: TrainConfig, budget_s: float, timing: StepTiming) -> int:
    """The length a run of `config` will decide for `budget_s` (`scratchlm.training.budget`) at `timing`: its
    first `CALIBRATION_STEPS` steps, start-up included, then the steps that fit in the rest, evaluations and
    all; at most the config's own length."""
    elapsed = timing.startup_s + (CALIBRATION_STEPS - 1) * timing.step_s
    total = fit_steps(CALIBRATION_STEPS, elapsed, budget_s, timing.step_s * (1 + evaluation_share(config)))
    return min(total, config.total_steps) if config.total_steps else total


def choose_shape(
    ladder: Sequence[tuple[Shape, TrainConfig]], budget_s: float, choices: Plan, rate: str
) -> ShapeChoice:
    """The largest shape of `ladder` (smallest first, each with the config it gives) whose predicted steps in
    `budget_s` reach its `min_steps`, each shape's step timed as `choices` will run it (`ladder_timings`);
    `rate` says how the run trains, for the reason."""
    timed = ladder_timings(ladder, choices)
    steps = {shape.name: predicted_steps(config, budget_s, timed[shape.name]) for shape, config in ladder}
    shapes = [shape for shape, _ in ladder]
    chosen = max(i for i, shape in enumerate(shapes) if i == 0 or steps[shape.name] >= shape.min_steps)
    shape = shapes[chosen]
    step_s = timed[shape.name].step_s
    reason = f"{shape.name}: the budget buys it about {steps[shape.name]:,} steps of {step_s:.3f} s ({rate})"
    if chosen + 1 < len(shapes):
        next_up = shapes[chosen + 1]
        reason += (
            f"; {next_up.name} would get {steps[next_up.name]:,}, short of the {next_up.min_steps:,} it needs"
        )
    return ShapeChoice(shape, steps, reason, timed)
