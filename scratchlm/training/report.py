"""What a training session reports: the console lines, the metrics records (`RUN/metrics.jsonl` and the
optional sinks of `MetricsLogger`) and the summary.

The loop reads values back from the accelerator (`.item()`, which waits for it) only every `log_interval`
steps, so the CPU keeps queueing work ahead of the GPU; losses and gradient norms are summed on the device in
between (`Interval`). That is also where the checks that need those numbers happen: a non-finite loss or
gradient norm stops the run before any checkpoint could save the damage. Only the main process of a run
prints and writes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from scratchlm.console import console, format_seconds
from scratchlm.device import Plan
from scratchlm.errors import DivergedError
from scratchlm.run.directory import RunDirectory
from scratchlm.run.metrics import BudgetRecord, EvalRecord, SetupRecord, TrainRecord
from scratchlm.run.summary import RunSummary, StopReason
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.budget import BudgetDecision, TimeBudget
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import Distributed, all_reduce
from scratchlm.training.metrics import MetricsLogger


class Interval:
    """The steps since the last log step: their summed loss and gradient norm, kept on the device so that the
    loop reads from the accelerator (and waits for it) once per interval, and their wall time less the pauses
    for evaluation and checkpoints, so that tokens/s measures training alone."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.loss = torch.zeros((), device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.steps, self.skipped, self.start, self.paused = 0, 0, clock(), 0.0
        self.paused_in_session = 0.0  # over every interval of the session: the time budget's measurement

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, applied: bool = True) -> None:
        """A step's loss and gradient norm; a step skipped for an fp16 overflow counts its loss only (its
        norm is infinite by definition)."""
        self.loss += loss
        if applied:
            self.grad_norm += grad_norm
        else:
            self.skipped += 1
        self.steps += 1

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent inside does not count towards the interval's tokens/s."""
        start = self.clock()
        yield
        self.paused += self.clock() - start
        self.paused_in_session += self.clock() - start

    def means(self, step: int, run: RunDirectory) -> tuple[float, float | None]:
        """The mean loss (over all processes) and gradient norm of the interval so far; stops the run with a
        `DivergedError` if either is not finite."""
        loss = all_reduce(self.loss / max(self.steps, 1)).item()
        applied = self.steps - self.skipped
        norm = self.grad_norm.item() / applied if applied else None  # None: every step was skipped (fp16)
        if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
            kept = run.latest_checkpoint()
            raise DivergedError(
                "loss" if not math.isfinite(loss) else "gradient norm", step, str(kept) if kept else None
            )
        return loss, norm

    def close(self, tokens_per_step: int) -> float:
        """Ends the interval and starts the next; returns the ended interval's tokens/s."""
        now = self.clock()
        tokens_per_s = self.steps * tokens_per_step / max(now - self.start - self.paused, 1e-9)
        self.loss.zero_()
        self.grad_norm.zero_()
        self.steps, self.skipped, self.start, self.paused = 0, 0, now, 0.0
        return tokens_per_s


# Said at the start of a run trained without a tokenizer, which its token files alone do not record.
NO_TOKENIZER = (
    "no tokenizer (data.tokenizer is not set): generate, chat, serve and export will need --tokenizer DIR "
    "for this run; to record one, set data.tokenizer to the tokenizer that made the token files "
    "(--set data.tokenizer=DIR)"
)

# How the user continues a run that stopped before its end, as the command that trains it says it: `train`, `sft`
# and `rl` take --resume (after a time budget, with a larger one); `quickstart` and `sweep` resume an
# interrupted run when the same command runs again (`resume_hint`), and take one that used its time budget as
# done, so theirs is said after an interruption only.
_RESUME_HINT: ContextVar[str | None] = ContextVar("resume_hint", default=None)


@contextlib.contextmanager
def resume_hint(text: str) -> Iterator[None]:
    """Within the block, an interrupted run says `text` (e.g. "rerun `scratchlm quickstart` to continue")."""
    token = _RESUME_HINT.set(text)
    try:
        yield
    finally:
        _RESUME_HINT.reset(token)


def how_to_resume(stopped: StopReason = StopReason.INTERRUPTED) -> str | None:
    """What a run that stopped for `stopped` tells the user to do to continue it (`resume_hint`), or None when
    there is nothing to say: it finished, or its command takes a used time budget as the end."""
    hint = _RESUME_HINT.get()
    if stopped is StopReason.FINISHED or (hint is not None and stopped is not StopReason.INTERRUPTED):
        return None
    return hint or "continue with --resume"


class Reporter:
    """The console, the metrics log and the summary of one session; silent outside the main process."""

    def __init__(
        self,
        config: TrainConfig,
        dist: Distributed,
        run_dir: RunDirectory,
        choices: Plan,
        tokens_per_row: float | None = None,
    ) -> None:
        """`tokens_per_row`: the tokens a sequence of the batch holds (on average, for conversations of
        different lengths); default the context length."""
        self.config, self.dist, self.run_dir, self.choices = config, dist, run_dir, choices
        per_row = config.model.context_length if tokens_per_row is None else tokens_per_row
        self.tokens_per_step = round(config.training.batch_size * per_row)
        self.logger: MetricsLogger | None = None
        self.last_pass1: float | None = None  # a stage's own validation, for the summary line

    def open(
        self, parameters: int, tokenizer: Tokenizer | None, budget: TimeBudget, step: int, elapsed_s: float
    ) -> None:
        """Lay out the run directory (its config, with a note of what "auto" resolved to, and its copy of the
        tokenizer), announce the session (the plan, its warnings, what it trains) and open the metrics log
        with a `setup` record of what this session runs with."""
        if not self.dist.is_main:
            return
        choices, config, t = self.choices, self.config, self.config.training
        precision = choices.precision
        resolved = f"resolved to {precision.value!r} on {choices.profile.name}: {precision.reason}"
        self.run_dir.create(config.to_toml(notes={"training.precision": resolved}), tokenizer)
        console.print(choices.summary(), markup=False, highlight=False)
        for warning in [*choices.warnings, *([NO_TOKENIZER] if tokenizer is None else [])]:
            console.print(f"warning: {warning}", style="yellow", markup=False)
        steps = (
            f"as many steps as fit in {format_seconds(budget.seconds)}"
            + (f" (at most {budget.planned:,})" if budget.planned else "")
            if budget.deciding
            else f"{budget.total_steps:,} steps"
        )
        processes = f" × {self.dist.world_size} processes ({t.parallel})" if self.dist.enabled else ""
        console.print(
            f"training {parameters:,} parameters on {choices.device}{processes}: {steps}"
            f" of {t.batch_size} × {config.model.context_length} tokens → {self.run_dir}"
        )
        self.logger = MetricsLogger(
            self.run_dir,
            config.to_dict(),
            None if budget.deciding else budget.total_steps,
            start_step=step,
            wandb=config.logging.wandb,
            wandb_project=config.logging.wandb_project,
            tensorboard=config.logging.tensorboard,
        )
        setup = {
            "device": choices.device,
            "device_name": choices.profile.name,
            "precision": choices.precision.value,
            "threads": choices.threads.value,
            "compile": choices.compile.value,
        }
        self.logger.note(SetupRecord(**self._head(step, elapsed_s), setup=setup).to_dict())

    def _head(self, step: int, elapsed_s: float) -> dict[str, Any]:
        return {"step": step, "time": round(elapsed_s, 3), "tokens": step * self.tokens_per_step}

    def train(self, step: int, elapsed_s: float, **fields: Any) -> None:
        """A log interval's `TrainRecord` fields (train_loss, lr, grad_norm, tokens_per_s, mfu, ...)."""
        if self.logger is not None:
            self.logger.log(TrainRecord(**self._head(step, elapsed_s), **fields).to_dict())

    def evaluation(self, step: int, elapsed_s: float, loss: float | None, **fields: float) -> None:
        """A validation estimate: its loss (None for a stage that measures something else), or a stage's own
        `EvalRecord` fields (`val_pass1`)."""
        self.last_pass1 = fields.get("val_pass1", self.last_pass1)
        if self.logger is not None:
            if loss is not None:
                fields |= {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
            self.logger.log(EvalRecord(**self._head(step, elapsed_s), **fields).to_dict())

    def decision(
        self, step: int, elapsed_s: float, decision: BudgetDecision, revised: bool, budget: TimeBudget
    ) -> None:
        """The time budget has sized (or resized) the schedule."""
        if not self.dist.is_main:
            return
        console.print(
            f"{decision.step_s:.3f} s a step{' since the last decision' if revised else ''}: "
            f"{decision.total_steps:,} steps fit in the time budget of "
            f"{format_seconds(budget.seconds)}; the schedule ends at step {decision.total_steps:,}"
        )
        if self.logger is not None:
            self.logger.set_total(decision.total_steps)
            record = BudgetRecord(**self._head(step, elapsed_s), time_budget=decision.to_dict())
            self.logger.note(record.to_dict())

    def note(self, line: str) -> None:
        if self.dist.is_main:
            console.print(line, style="dim")

    def summary(self, summary: RunSummary) -> None:
        """Write the summary and say how the session ended (a diverged run's error tells its own story)."""
        if not self.dist.is_main:
            return
        summary.write(self.run_dir.summary_file)
        if summary.stopped is StopReason.DIVERGED:
            return
        console.print(
            f"{summary.stopped.value} at step {summary.steps} after {format_seconds(summary.wall_time_s)}: "
            f"train loss {_fmt(summary.final_train_loss)}, "
            + (
                f"val pass@1 {self.last_pass1:.1%}; "
                if summary.final_val_loss is None and self.last_pass1 is not None
                else f"val loss {_fmt(summary.final_val_loss)}; "
            )
            + f"checkpoint in {self.run_dir.checkpoints_dir}"
            + ("" if (hint := how_to_resume(summary.stopped)) is None else f" ({hint})")
        )

    def already_finished(self, step: int, without_losses: RunSummary) -> RunSummary:
        """A resumed run with no steps left: its summary is the one it wrote when it ended (or, if that is
        missing or from an earlier step, `without_losses`, since the losses were not kept)."""
        summary = self.run_dir.summary()
        if summary is None or summary.steps != step:
            summary = without_losses
        if self.dist.is_main:
            console.print(f"run already finished at step {step}: nothing to train in {self.run_dir}")
        return summary

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
