"""The training loop: take steps, evaluate, log, checkpoint, stop when told or when the time is spent.

A session is made of components, each built by a function of the config before the loop starts:

    the data            `load_training_data`: the stage's, checked before the run directory is claimed
                                                                                             (stage.py)
    the model           `build_model`, its weights drawn from `training.seed`; a LoRA run's, its base's
                        weights frozen with adapters on them (`adapt`)                   (adapters.py)
    the optimizer       `build_optimizer`, over the parameter groups the model declares     (optimizers.py)
    the starting point  `restore` (resume) or `start_from_weights` (`training.init_from`), with the time
                        budget                                                               (start.py)
    how the model runs  `build_execution`: checkpointed, compiled, under DDP or FSDP     (scratchlm.parallel);
                        the rest (precision, autocast, loss scaling, the fused loss) is the device plan's
                                                                                             (scratchlm.device)

`build_session` puts them together; `_Run` holds them and runs the loop, which calls the step (step.py), the
measurements of its log and evaluation steps (monitor.py) and the reporting (report.py).
`training.batch_size` is the global batch: sequences per optimizer step over all processes and micro-batches,
so `tokens = steps × batch_size × context_length` whatever the hardware.

Ctrl-C (SIGINT), SIGTERM and SIGHUP finish the current step, save a checkpoint and raise `Interrupted`
(signals.py); so does the wall-clock budget `max_time_s` (counted across resumes), which returns normally. With
a budget the run also sizes its schedule to the steps that fit, measured on the machine
(`scratchlm.training.budget`), so that it ends with its decay complete inside the budget. The console's lines
are copied to `RUN/log.txt` (`scratchlm.console.ConsoleLog`), which notes when the console went away (a closed
pipe or terminal): the run goes on without it. Resuming a run that has no steps left changes nothing
in it and returns the summary it wrote.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from scratchlm.allocator import keep_freed_memory
from scratchlm.console import ConsoleLog, console
from scratchlm.device import Plan, apply_threads, plan, resolve_device
from scratchlm.errors import DivergedError, Interrupted, ScratchlmError
from scratchlm.model.transformer import TransformerLM
from scratchlm.parallel import Execution, ParallelSettings, parallelize
from scratchlm.run.directory import RunDirectory
from scratchlm.run.sharded import save_sharded
from scratchlm.run.summary import RunSummary, StopReason
from scratchlm.training.adapters import adapt
from scratchlm.training.config import TrainConfig, TrainingConfig
from scratchlm.training.distributed import Distributed, all_reduce, init_distributed, shutdown_distributed
from scratchlm.training.loss_scale import LossScaler
from scratchlm.training.monitor import Monitor
from scratchlm.training.optimizers import build_optimizer
from scratchlm.training.report import Interval, Reporter, how_to_resume
from scratchlm.training.signals import StopRequest
from scratchlm.training.stage import STAGES, TrainingData, load_training_data
from scratchlm.training.start import Progress, restore, start_from_weights
from scratchlm.training.step import TrainStep

# The clock of the time budget, tokens/s and the elapsed time; a test replaces it with a fake one.
clock = time.perf_counter


def train(config: TrainConfig, resume: bool = False, allow_config_change: bool = False) -> RunSummary:
    """Train a model as `config` says (continuing the run in `config.logging.run_dir` if `resume`); returns
    the summary that is also written to `RUN/summary.json`. A resumed run whose config differs from the one it
    trained with (beyond `CHANGEABLE_ON_RESUME`) is refused unless `allow_config_change`."""
    device = resolve_device(config.training.device, option="training.device")
    dist_info, device = init_distributed(device)
    t = config.training
    run_dir = RunDirectory(config.logging.run_dir)
    finished = False
    run: _Run | None = None
    try:
        # The batch and the data are checked before the run directory is claimed: a run refused for either
        # leaves nothing behind.
        if t.batch_size % (dist_info.world_size * t.grad_accum):
            raise ScratchlmError(
                f"training.batch_size ({t.batch_size}) must be divisible by processes × grad_accum "
                f"({dist_info.world_size} × {t.grad_accum})"
            )
        data = load_training_data(config, run_dir)
        # The plan may measure the device (seconds, the first time on a machine): after the checks.
        choices = plan(device, t.precision, t.compile, t.threads, t.fused_loss, config.logging.peak_tflops)
        apply_threads(choices.threads.value)
        if device.type == "cpu":
            # AdamW's second moments decay into denormal floats, which x86 CPUs process about 10x slower
            # (measured: 2.8 s vs 0.26 s for clip + AdamW per bf16 step); flushing them to zero costs nothing.
            torch.set_flush_denormal(True)
            keep_freed_memory()  # halves the time of a CPU training step; see scratchlm.allocator
        main = dist_info.is_main
        with (
            run_dir.lock() if main else nullcontext(),
            ConsoleLog(run_dir.log) if main else nullcontext() as log,
        ):
            session = Session(config, run_dir, data, dist_info, device, choices)
            run = build_session(session, resume, allow_config_change)
            if log is not None and run.step < run.budget.total_steps:  # a session that trains: it is logged
                log.keep()
            summary = run.run()
        finished = True
        return summary
    except Interrupted:
        # A stop the processes agreed on: the checkpoint is saved and they leave together.
        finished = run is not None and run.stopped is StopReason.INTERRUPTED
        raise
    finally:
        shutdown_distributed(finished)


def build_model(config: TrainConfig, device: torch.device) -> TransformerLM:
    """The model of `[model]`, its initial weights drawn from `training.seed`."""
    torch.manual_seed(config.training.seed)
    return TransformerLM(config.model, device=device)


def build_execution(
    model: TransformerLM, training: TrainingConfig, choices: Plan, device: torch.device, dist: Distributed
) -> Execution:
    """How the model runs (`scratchlm.parallel.parallelize`, given the plain values it uses): its blocks
    checkpointed where `training.activation_checkpointing`, compiled where the plan says, and under several
    processes DistributedDataParallel or FSDP (`training.parallel`)."""
    if not dist.enabled and training.parallel != "ddp" and dist.is_main:
        console.print(f'training.parallel = "{training.parallel}" in one process: ignored')
    settings = ParallelSettings(
        dist.world_size, choices.dtype, choices.compile.value, training.reshard_after_forward
    )
    return parallelize(model, training.parallel, device, settings, training.activation_checkpointing)


@dataclass(frozen=True)
class Session:
    """What a session is given: the config, the run directory, the data, the processes, the device and the
    plan for it."""

    config: TrainConfig
    run_dir: RunDirectory
    data: TrainingData
    dist: Distributed
    device: torch.device
    choices: Plan


def build_session(session: Session, resume: bool, allow_config_change: bool = False) -> _Run:
    """The components of one session, each from its function, in the order that keeps runs reproducible:
    the model's weights are drawn, then how it runs is built (FSDP turns its parameters into shards, which
    the optimizer must be made over), then the optimizer made, then a checkpoint (or `init_from`) loaded."""
    config, run_dir, data = session.config, session.run_dir, session.data
    dist, device, choices = session.dist, session.device, session.choices
    model = build_model(config, device)
    if config.lora.rank:  # the base first, then its adapters: the optimizer and execution see what trains
        adapt(config, model, data.tokenizer, dist, choices.dtype)
    execution = build_execution(model, config.training, choices, device, dist)
    optimizer = build_optimizer(config.optimizer, model, precision=choices.precision.value)
    progress = restore(config, run_dir, model, optimizer, device, dist, resume, allow_config_change)
    fresh = progress.last_saved is None and not config.lora.rank  # a resumed run continues its own weights
    if config.training.init_from and fresh:
        start_from_weights(config, model, data.tokenizer, dist)
    scaler = LossScaler(choices.loss_scaling)
    if progress.loss_scale is not None and scaler.enabled:
        scaler.load_state_dict(progress.loss_scale)
    stepper = TrainStep(
        config,
        dist,
        device,
        model,
        optimizer,
        execution,
        choices,
        scaler,
    )
    return _Run(session, model, stepper, progress)


class _Run:
    """One session of a run: its components (built by `build_session`), then `run()`, the loop."""

    def __init__(
        self, session: Session, model: TransformerLM, stepper: TrainStep, progress: Progress
    ) -> None:
        self.config, self.run_dir, self.data = session.config, session.run_dir, session.data
        self.dist, self.device, self.choices = session.dist, session.device, session.choices
        self.model, self.stepper = model, stepper
        self.stage = STAGES[self.config.stage_name]
        self.step, self.last_saved = progress.step, progress.last_saved  # last_saved: the newest checkpoint's
        self.generator, self.budget = progress.generator, progress.budget
        self.elapsed_before = progress.elapsed_s
        self.committed_rng = self.generator.bit_generator.state  # the sampling state after `self.step` steps
        self.in_update = False
        per_row = session.data.train.tokens_per_row  # tokens a sequence of the batch holds
        self.report = Reporter(self.config, self.dist, self.run_dir, self.choices, per_row)
        self.tokens_per_step = self.report.tokens_per_step
        self.start_step = self.step  # what this session has seen so far; `run` starts the clock
        self.stop = StopRequest(self.dist.enabled)
        self.stop_signal = 0  # the signal that interrupted the run, once the processes agree on one
        self.stopped = StopReason.FINISHED
        self.final_train_loss: float | None = None
        self.monitor = Monitor(
            self.config, self.dist, self.choices, self.stage, self.data, model, stepper, self.report
        )

    def run(self) -> RunSummary:
        if self.step >= self.budget.total_steps:
            return self._already_finished()
        self._start()
        config = self.config
        try:
            try:
                with self.stop.installed():  # until the last checkpoint is written
                    while self.step < self.budget.total_steps:
                        self.interval.add(*self._take_step())
                        self._observe_budget()
                        last = self.step == self.budget.total_steps
                        at_log = self.step % config.logging.log_interval == 0 or last
                        at_eval = config.eval.interval and self.step % config.eval.interval == 0
                        at_save = config.checkpoint.interval and self.step % config.checkpoint.interval == 0
                        if at_log or at_save:  # a checkpoint is written only after this finiteness check
                            self.final_train_loss, grad_norm = self.interval.means(self.step, self.run_dir)
                        if at_log:
                            self.monitor.log_train(
                                self.step, self._elapsed(), self.interval, self.final_train_loss, grad_norm
                            )
                        with self.interval.pause():
                            if at_eval and config.eval.iters:
                                self.monitor.evaluate(self.step, self._elapsed())
                            if at_save:
                                self._save()
                        if self._maybe_stop(at_log):
                            break
                    self._end_session()
            except KeyboardInterrupt:
                self._save_after_abort()
                raise
        except DivergedError:
            # The summary says so: a resumed run must not keep the "finished" of an earlier session.
            self.stopped = StopReason.DIVERGED
            self._finish()
            raise
        finally:
            self.report.close()
        return self._finish()

    def _take_step(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        loss, grad_norm, applied = self.stepper.gradients(
            self.step + 1, self.budget, self.data.train, self.generator, self.run_dir
        )
        # The update commits the step. An abort (KeyboardInterrupt) before it leaves model and optimizer at the
        # previous step, with the sampling state of `self.committed_rng`; one inside it leaves no usable state.
        self.in_update = True
        self.stepper.update(applied)
        self.step += 1
        self.committed_rng = self.generator.bit_generator.state
        self.in_update = False
        return loss, grad_norm, applied

    def _start(self) -> None:
        parameters = self.model.num_parameters()
        self.report.open(parameters, self.data.tokenizer, self.budget, self.step, self.elapsed_before)
        self.session_start = clock()
        self.interval = Interval(self.device, clock)

    def _elapsed(self) -> float:
        """Seconds of training in this run, over all its sessions."""
        return self.elapsed_before + clock() - self.session_start

    def _observe_budget(self) -> None:
        """Let the time budget measure this step and, at its decision step, size the schedule; the decision
        goes into the metrics log here and into every checkpoint from now on."""
        revised = not self.budget.deciding
        if not revised:
            if self.budget.wants_clock(self.step, self.start_step) and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the work done, not the work queued
            paused = self.interval.paused_in_session
            decision = self.budget.observe(self.step, self.start_step, self._elapsed(), paused)
            if decision is not None and self.dist.enabled:
                # Each process timed its own clock; all must stop at the same step: the shortest length.
                negated = torch.tensor(-float(decision.total_steps), device=self.device)
                decision = self.budget.settle(-int(all_reduce(negated, "max").item()))
        else:  # revising would need the processes to agree at every step: single-process runs only
            decision = None if self.dist.enabled else self.budget.revise(self.step, self._elapsed())
        if decision is not None:
            self.report.decision(self.step, self._elapsed(), decision, revised, self.budget)

    def _maybe_stop(self, at_log: bool) -> bool:
        """Whether to stop early, for a signal or the time budget. Several processes must agree, which they do
        at log steps: a signal that reached any one of them stops them all, as an interruption."""
        self.stop.announce()
        if self.dist.enabled and not at_log:
            return False
        signum, over_budget = self.stop.agreed(self.budget.spent(self._elapsed()), self.device)
        if signum:
            self.stopped, self.stop_signal = StopReason.INTERRUPTED, signum
        elif over_budget:
            self.stopped = StopReason.TIME_BUDGET
        return bool(signum or over_budget)

    def _save(self) -> Path | None:
        """Rank 0 writes the checkpoint; a sharded one (`training.parallel = "fsdp"`) every process writes."""
        self.last_saved = self.step
        sharded = self.config.training.parallel == "fsdp"
        if not (self.dist.is_main or sharded):
            return None
        path = self.run_dir.checkpoint(self.step, sharded)
        fingerprint = None if self.data.tokenizer is None else self.data.tokenizer.fingerprint
        checkpoint = self.stepper.checkpoint(
            self.step, self.committed_rng, self._elapsed(), self.budget, whole=not sharded
        )
        checkpoint = dataclasses.replace(checkpoint, tokenizer_fingerprint=fingerprint)
        if sharded:
            save_sharded(checkpoint, self.model, self.stepper.optimizer, path)
        else:
            checkpoint.save(path)
        if self.dist.is_main:
            self.run_dir.prune_checkpoints(self.config.checkpoint.keep)
        return path if self.dist.is_main else None

    def _save_after_abort(self) -> None:
        """After a second Ctrl-C (or any KeyboardInterrupt), save the last completed step if it is sound."""
        # (Several processes cannot agree on a checkpoint here; they stop together on Ctrl-C instead.)
        if self.in_update or self.step == self.last_saved or self.dist.enabled:
            return
        if self.interval.steps:
            self.interval.means(self.step, self.run_dir)
        if (path := self._save()) is not None:
            console.print(f"saved {path}; {how_to_resume()}")

    def _end_session(self) -> None:
        """The loop has ended: check the last steps, evaluate the model as it is now, save it."""
        if self.interval.steps:
            self.final_train_loss, _ = self.interval.means(self.step, self.run_dir)
        interrupted = self.stopped is StopReason.INTERRUPTED
        if (
            self.config.eval.iters
            and self.step > self.start_step
            and self.monitor.last_eval != self.step
            and not interrupted
        ):
            self.monitor.evaluate(self.step, self._elapsed())
        if self.step != self.last_saved:
            self._save()

    def _finish(self) -> RunSummary:
        """Write and print the summary; an interrupted run then raises `Interrupted` with its signal, and so
        does a run that finished while a signal asked it to stop (during its last checkpoint), so that the
        command stops too (a diverged one is ended by its `DivergedError`, which the caller re-raises)."""
        tokens_per_s = (self.step - self.start_step) * self.tokens_per_step / (clock() - self.session_start)
        summary = self._summary(self._elapsed(), tokens_per_s)
        self.report.summary(summary)
        if self.stopped is StopReason.INTERRUPTED:
            raise Interrupted(self.stop_signal)
        if self.stopped is StopReason.FINISHED and self.stop.signum is not None:
            raise Interrupted(self.stop.signum)
        return summary

    def _summary(self, wall_time_s: float, tokens_per_s: float | None) -> RunSummary:
        losses = {"final_train_loss": self.final_train_loss, "final_val_loss": self.monitor.final_val_loss}
        return RunSummary(
            str(self.run_dir), self.step, self.step * self.tokens_per_step, wall_time_s, **losses,
            tokens_per_s=tokens_per_s, parameters=self.model.num_parameters(), stopped=self.stopped,
        )  # fmt: skip

    def _already_finished(self) -> RunSummary:
        """A resumed run with no steps left is left as it is (see `Reporter.already_finished`)."""
        return self.report.already_finished(self.step, self._summary(self.elapsed_before, None))
