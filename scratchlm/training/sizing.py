"""The shape of a model for the steps a time budget buys.

In a budget of minutes the loss a model reaches is a race between what the model can hold and how many
optimizer steps it gets. A small step (2 layers, 8 sequences) takes about half the time of one twice its
size, so the small shape wins while steps are few; given enough of them, the larger one catches up and
passes it. Which side of that line a run is on depends on the machine (its matmul rate in the precision
and with the threads the run will have) and on the budget, not on the text, so the shape is chosen from those,
before anything trains:

    rate     the device profile's matmul rate at the run's precision and thread count (GFLOP/s: the
             measurement "auto" precision rests on, scratchlm.device.profile)
    step_s   train_step_flops(shape) / (STEP_EFFICIENCY × rate)      for each shape of a ladder
    steps    budget_s / step_s                                        "the steps the budget buys"
    choice   the largest shape whose steps reach its `min_steps`; the smallest when none does

`STEP_EFFICIENCY` is the share of the matmul rate that a small model's whole training step reaches
(attention, norms, the optimizer and the framework's own time included): measured about 0.7 for the
quickstart's 2-layer model on 2 cores. The predicted steps are therefore a count, not a promise; the run still
measures its own speed and fits its schedule to it (`scratchlm.training.budget`). Each `min_steps` was
measured in the same units by racing the shapes against each other at several budgets (docs/experiments.md,
"The shape for the budget"). A run with 2 threads has about twice the rate of one with 1, and bf16 on a CPU
with native bf16 about four times fp32's, so both buy steps, and both can move a run up the ladder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scratchlm.model.accounting import train_step_flops
from scratchlm.training.config import TrainConfig
from scratchlm.training.recipes import Recipe

#: The share of the device's matmul rate (`DeviceProfile.rate`) a small model's training step reaches.
STEP_EFFICIENCY = 0.7


@dataclass(frozen=True)
class Shape:
    """One rung of a ladder: what it sets (`{section: {key: value}}`, as a recipe) and the fewest steps of its
    own it needs, in the budget, to reach a lower loss than the rung below it."""

    name: str
    changes: Recipe
    min_steps: int = 0


@dataclass(frozen=True)
class ShapeChoice:
    shape: Shape
    steps: dict[str, int]  # the steps the budget buys each shape of the ladder, by name
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape.name,
            "changes": self.shape.changes,
            "steps": self.steps,
            "reason": self.reason,
        }


def budget_steps(config: TrainConfig, budget_s: float, gflops: float) -> int:
    """The training steps of `config`'s model and batch that fit in `budget_s` at `gflops` of matmuls."""
    flops = train_step_flops(config.model, config.training.batch_size)
    return int(budget_s * STEP_EFFICIENCY * gflops * 1e9 / flops)


def choose_shape(
    ladder: Sequence[tuple[Shape, TrainConfig]], budget_s: float, gflops: float, rate: str
) -> ShapeChoice:
    """The largest shape of `ladder` (smallest first, each with the config it gives) whose steps in `budget_s`
    at `gflops` reach its `min_steps`; `rate` says where the rate came from, for the reason."""
    steps = {shape.name: budget_steps(config, budget_s, gflops) for shape, config in ladder}
    shapes = [shape for shape, _ in ladder]
    chosen = max(i for i, shape in enumerate(shapes) if i == 0 or steps[shape.name] >= shape.min_steps)
    shape = shapes[chosen]
    reason = f"{shape.name}: the budget buys it about {steps[shape.name]:,} steps ({rate})"
    if chosen + 1 < len(shapes):
        next_up = shapes[chosen + 1]
        reason += (
            f"; {next_up.name} would get {steps[next_up.name]:,}, short of the {next_up.min_steps:,} it needs"
        )
    return ShapeChoice(shape, steps, reason)
