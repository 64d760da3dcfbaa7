"""The time budget sizes the schedule: measured speed, the steps that fit, the decay complete inside the
budget, the decision kept across a resume."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest
import torch
from test_trainer import assert_same_state, final_state, records, small_config, token_files

from scratchlm.cli import main
from scratchlm.run import StopReason
from scratchlm.run.checkpoint import read_checkpoint
from scratchlm.training import budget, trainer
from scratchlm.training import step as step_module
from scratchlm.training.budget import (
    BUDGET_SHARE,
    CALIBRATION_STEPS,
    MEASURE_FROM,
    BudgetDecision,
    TimeBudget,
    fit_steps,
)
from scratchlm.training.schedule import cosine_lr_schedule, wsd_lr_schedule
from scratchlm.training.trainer import train

LR, MIN_LR, BUDGET = 1e-2, 1e-3, 60.0


class FakeClock:
    """A clock that only training steps move: `step_s` seconds each (evaluation and checkpoints take none)."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.steps = 1000.0, step_s, 0

    def __call__(self) -> float:
        return self.now

    def install(self, monkeypatch: pytest.MonkeyPatch, interrupt_at: int | None = None) -> None:
        clip = step_module.clip_grad_norm

        def a_step_that_takes_time(*args, **kwargs):  # called once per optimizer step
            self.now += self.step_s
            self.steps += 1
            if self.steps == interrupt_at:
                signal.raise_signal(signal.SIGINT)
            return clip(*args, **kwargs)

        monkeypatch.setattr(trainer, "clock", self)
        monkeypatch.setattr(step_module, "clip_grad_norm", a_step_that_takes_time)


def slower_after_the_decision(monkeypatch: pytest.MonkeyPatch, step_s: float, extra_s: float) -> None:
    """A fake clock at `step_s` a step while the budget measures, `step_s + extra_s` after its decision."""
    clock = FakeClock(step_s)
    clock.install(monkeypatch)
    measured_step = step_module.clip_grad_norm

    def slower(*args, **kwargs):
        if clock.steps >= CALIBRATION_STEPS:
            clock.now += extra_s
        return measured_step(*args, **kwargs)

    monkeypatch.setattr(step_module, "clip_grad_norm", slower)


def budget_config(tmp_path, run: str, kind: str = "wsd"):
    return small_config(
        tmp_path,
        run,
        optimizer={"lr": LR, "min_lr": MIN_LR},
        schedule={
            "kind": kind,
            "warmup_iters": CALIBRATION_STEPS,
            "cosine_cycle_iters": 0,
            "decay_fraction": 0.5,
        },
        training={"batch_size": 4, "max_steps": 0, "max_time_s": BUDGET, "device": "cpu"},
        eval={"interval": 0, "iters": 1},
        checkpoint={"interval": 50, "keep": 5},
    )


def expected_total(step_s: float) -> int:
    # Steps 1..20 took 20 step_s; the rest of the budget, less the margin, at step_s each.
    return CALIBRATION_STEPS + int(BUDGET_SHARE * (BUDGET - CALIBRATION_STEPS * step_s) / step_s)


@pytest.mark.parametrize("kind", ["wsd", "cosine"])
def test_the_schedule_fits_the_budget_and_ends_at_its_minimum(tmp_path, monkeypatch, kind):
    clock = FakeClock(0.5)
    clock.install(monkeypatch)
    summary = train(budget_config(tmp_path, "run", kind))
    total = expected_total(0.5)
    assert total == 112  # 20 + int(0.92 × 50 s / 0.5 s)
    assert summary.steps == total and summary.stopped is StopReason.FINISHED
    assert summary.wall_time_s == pytest.approx(total * 0.5) and summary.wall_time_s <= BUDGET
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run", "lr")}
    assert sorted(lrs) == list(range(1, total + 1))
    assert lrs[total] == pytest.approx(MIN_LR)
    for step, lr in lrs.items():  # every step at the rate of the schedule sized to `total` steps
        if kind == "wsd":
            assert lr == pytest.approx(wsd_lr_schedule(step, LR, MIN_LR, CALIBRATION_STEPS, total, 0.5))
        else:
            assert lr == pytest.approx(cosine_lr_schedule(step, LR, MIN_LR, CALIBRATION_STEPS, total))
    (decision,) = records(tmp_path / "run", "time_budget")
    assert decision["time_budget"] == {
        "step": CALIBRATION_STEPS,
        "step_s": 0.5,
        "elapsed_s": CALIBRATION_STEPS * 0.5,
        "total_steps": total,
    }
    assert (
        read_checkpoint(tmp_path / "run" / "checkpoints" / f"step_{total:08d}.pt")["time_budget"]
        == (decision["time_budget"])
    )


def test_a_slower_machine_fits_fewer_steps_and_a_max_steps_caps_them(tmp_path, monkeypatch):
    FakeClock(1.0).install(monkeypatch)
    assert train(budget_config(tmp_path, "slow")).steps == expected_total(1.0) == 56
    FakeClock(0.5).install(monkeypatch)
    capped = budget_config(tmp_path, "capped").replace(training={"max_steps": 80})
    summary = train(capped)
    assert summary.steps == 80
    assert records(tmp_path / "capped", "lr")[-1]["lr"] == pytest.approx(MIN_LR)


def test_a_resume_continues_the_decided_schedule_on_a_faster_machine(tmp_path, monkeypatch):
    FakeClock(0.5).install(monkeypatch)
    train(budget_config(tmp_path, "straight"))
    FakeClock(0.5).install(monkeypatch, interrupt_at=60)
    with pytest.raises(KeyboardInterrupt):
        train(budget_config(tmp_path, "resumed"))
    assert (tmp_path / "resumed" / "checkpoints" / "step_00000060.pt").exists()
    FakeClock(0.125).install(monkeypatch)  # four times faster: the recorded decision stands
    summary = train(budget_config(tmp_path, "resumed"), resume=True)
    assert summary.steps == expected_total(0.5)
    assert_same_state(final_state(tmp_path / "straight"), final_state(tmp_path / "resumed"))
    straight, resumed = records(tmp_path / "straight", "lr"), records(tmp_path / "resumed", "lr")
    assert [r["lr"] for r in straight] == [r["lr"] for r in resumed]


def test_the_budget_stays_a_hard_limit(tmp_path, monkeypatch):
    """A machine that slows down after the measurement is stopped by the budget, with a checkpoint."""
    slower_after_the_decision(monkeypatch, 0.5, extra_s=1.5)  # four times slower
    summary = train(budget_config(tmp_path, "run"))
    assert summary.stopped is StopReason.TIME_BUDGET and summary.steps < expected_total(0.5)
    assert 60 < summary.wall_time_s <= 62  # stopped by the first step past the budget
    assert (tmp_path / "run" / "checkpoints" / f"step_{summary.steps:08d}.pt").exists()


@pytest.mark.parametrize("planned", [True, False])
def test_periodic_evaluations_are_planned_into_the_budget(tmp_path, monkeypatch, planned):
    """Validation every 10 steps, 4 batches of the training batch's size each: on the fake clock an
    estimate takes 4 forward passes, 4/3 of a step (a forward pass being a third of a step's forward and
    backward). The plan counts their share, and the run ends inside the budget at its minimum rate; planned
    without it (`planned=False`), the same run overruns the budget before its decay ends."""
    clock = FakeClock(0.5)
    clock.install(monkeypatch)
    validation_loss = step_module.TrainStep.validation_loss

    def an_estimate_that_takes_time(stepper, tokens):
        clock.now += 4 * 0.5 / 3
        return validation_loss(stepper, tokens)

    monkeypatch.setattr(step_module.TrainStep, "validation_loss", an_estimate_that_takes_time)
    if not planned:
        monkeypatch.setattr(budget, "evaluation_share", lambda config: 0.0)
    config = budget_config(tmp_path, "run", kind="cosine")
    config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, interval=10, iters=4))
    summary = train(config)
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run", "lr")}
    if planned:
        assert budget.evaluation_share(config) == pytest.approx(4 * 4 / (3 * 4 * 10))
        assert summary.stopped is StopReason.FINISHED and summary.wall_time_s <= BUDGET
        assert lrs[summary.steps] == pytest.approx(MIN_LR)
    else:
        assert summary.stopped is StopReason.TIME_BUDGET and lrs[summary.steps] > MIN_LR * 1.01


def test_a_run_measured_while_the_machine_was_busy_is_lengthened(tmp_path, monkeypatch):
    """0.6 s a step while measured, 0.5 s after: the decision at step 20 (12 s spent) plans
    20 + int(0.92 × 48 s / 0.6 s) = 93 steps. A fifth of the run later (20 steps, at step 40, 22 s spent) the
    rate since shows that 40 + int(0.92 × 38 s / 0.5 s) = 109 fit, over 5 % more: the run is lengthened, its
    decay not begun (it starts at step 47 of 93), and ends at 56.5 s at the minimum rate."""
    slower_after_the_decision(monkeypatch, 0.6, extra_s=-0.1)
    summary = train(budget_config(tmp_path, "run"))
    assert summary.stopped is StopReason.FINISHED and summary.steps == 109
    assert summary.wall_time_s == pytest.approx(56.5)
    first, revised = (r["time_budget"] for r in records(tmp_path / "run", "time_budget"))
    assert (first["total_steps"], revised["step"], revised["total_steps"]) == (93, 40, 109)
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run", "lr")}
    assert lrs[109] == pytest.approx(MIN_LR)
    for step, lr in lrs.items():
        assert lr == pytest.approx(wsd_lr_schedule(step, LR, MIN_LR, CALIBRATION_STEPS, 109, 0.5))


def test_a_lengthened_run_keeps_the_configs_own_length_as_its_limit(tmp_path):
    """Revised with time to spare, a run with `max_steps` grows to that length and no further; a run with no
    time to spare, or already decaying, is left as it is."""
    config = budget_config(tmp_path, "run")
    capped = dataclasses.replace(config, training=dataclasses.replace(config.training, max_steps=100))
    budget_ = TimeBudget(capped, BudgetDecision(step=20, step_s=0.6, elapsed_s=12.0, total_steps=90))
    assert budget_.revise(40, 22.0).total_steps == 100  # 109 would fit at 0.5 s a step
    steady = TimeBudget(config, BudgetDecision(step=20, step_s=0.5, elapsed_s=10.0, total_steps=112))
    assert steady.revise(43, 21.5) is None  # the rate the decision measured: nothing to revise
    decaying = TimeBudget(config, BudgetDecision(step=20, step_s=0.6, elapsed_s=12.0, total_steps=60))
    assert decaying.revise(40, 22.0) is None  # its decay began at step 30


def test_fit_steps_by_hand():
    assert fit_steps(20, 10.0, 60.0, 0.5) == 20 + 92
    assert fit_steps(20, 70.0, 60.0, 0.5) == 20  # the budget is spent: no more steps
    assert MEASURE_FROM < CALIBRATION_STEPS


@pytest.mark.slow
def test_train_with_a_two_minute_budget_on_the_real_clock(tmp_path):
    """`scratchlm train --set training.max_time_s=120` on the tiny config: the run ends inside the budget
    (nothing is compiled on a CPU), at the schedule's minimum rate on its last step."""
    train_file, valid_file = token_files(tmp_path)
    run = tmp_path / "run"
    args = [
        "train", "--config", "configs/tiny.toml", "--set", f"data.train={train_file}",
        "--set", f"data.valid={valid_file}", "--set", "data.tokenizer=\"\"", "--set", "training.max_steps=0",
        "--set", "training.max_time_s=120",
        "--set", "training.device=cpu", "--set", f"logging.run_dir={run}", "--set", "logging.log_interval=1",
    ]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    # The planned steps end close to the budget; the last evaluation's time moves with the machine's load,
    # by milliseconds (120.006 s once on a busy CI machine): a second's grace, under 1 % of the budget.
    assert summary["stopped"] == "finished" and summary["wall_time_s"] <= 121
    last = records(run, "lr")[-1]
    assert last["step"] == summary["steps"] and last["lr"] == pytest.approx(3e-4)
    assert torch.isfinite(torch.tensor(summary["final_val_loss"]))


def test_a_run_that_slows_down_is_shortened_and_still_ends_its_decay_inside_the_budget(tmp_path, monkeypatch):
    """0.5 s a step while measured, 0.6 s after. Revisions look at a fifth of the run at least (22 of its 112
    steps): at step 42 it would overrun (23.2 s + 70 × 0.6 s > 60 s), so it is shortened to
    42 + int(0.92 × 36.8 s / 0.6 s) = 98 steps, which end at 56.8 s at the minimum rate. The steps before the
    revision had the peak rate under either length."""
    slower_after_the_decision(monkeypatch, 0.5, extra_s=0.1)
    summary = train(budget_config(tmp_path, "run"))
    assert summary.stopped is StopReason.FINISHED and summary.steps == 98
    assert summary.wall_time_s == pytest.approx(56.8) and summary.wall_time_s <= BUDGET
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "run", "lr")}
    assert lrs[98] == pytest.approx(MIN_LR)
    for step, lr in lrs.items():
        assert lr == pytest.approx(wsd_lr_schedule(step, LR, MIN_LR, CALIBRATION_STEPS, 98, 0.5))
    first, revised = (r["time_budget"] for r in records(tmp_path / "run", "time_budget"))
    assert (first["total_steps"], revised["step"], revised["total_steps"]) == (112, 42, 98)
    assert revised["step_s"] == pytest.approx(0.6)
