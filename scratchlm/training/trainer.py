"""The training loop: sample batches, take optimizer steps on a schedule, evaluate, log, checkpoint.

One optimizer step at step number t (1-based):

    lr ← schedule(t)   (the cosine or the WSD of `build_schedule`, sized by the time budget when there is one)
    draw `batch_size` windows of the training tokens (the global batch; this process takes its slice)
    for each of the `grad_accum` micro-batches:  loss = cross_entropy(model(x), y) / grad_accum;  backward
    clip the gradients to norm `grad_clip`;  optimizer step;  zero the gradients

In fp16 the loss is scaled before each backward and the gradients unscaled before clipping; a step whose
gradients overflowed is skipped (`scratchlm.training.loss_scale`), and the log line counts the skipped steps.

`training.batch_size` is the global batch: sequences per optimizer step over all processes and micro-batches,
so `tokens = steps × batch_size × context_length` whatever the hardware. Every process draws the same window
positions from the same generator and keeps its own slice, so the data a step sees does not depend on how many
processes share it: two processes give the same run as one with the same global batch.

The loop reads values back from the accelerator (`.item()`, which waits for it) only every `log_interval`
steps, so the CPU keeps queueing work ahead of the GPU; losses and gradient norms are summed on the device in
between. That is also where the checks that need those numbers happen: a non-finite loss or gradient norm
stops the run before any checkpoint could save the damage.

A checkpoint holds the model, the optimizer, the step, the sampling generator's state, torch's RNG state and
the elapsed time. The schedule is a function of the step, so a resumed run continues exactly: on CPU, N steps,
resume, N steps gives bit-for-bit the parameters of 2N steps in one go. Ctrl-C (SIGINT) and SIGTERM (`kill`,
`timeout`, `docker stop`, a cluster scheduler) finish the current step, save a checkpoint and raise
`Interrupted`, whose signal number the command line turns into its exit status (130, 143); so does the
wall-clock budget `max_time_s` (counted across resumes), which returns normally. With a budget the run also
sizes its schedule to the steps that fit, measured on the machine (`scratchlm.training.budget`), so that it
ends with its decay complete inside the budget; the decision is saved with the checkpoints.
Resuming a run that has no steps left changes nothing in it and returns the summary it wrote.

A session is made of components, each built by a function of the config before the loop starts: the data
(`load_training_data`, checked before the run directory is claimed), the model (`build_model`), the optimizer
over the groups the model declares (`build_optimizer`), the starting point with its time budget (`restore`,
or `start_from_weights` for `training.init_from`) and how the model runs (`build_execution`: compilation,
DDP, precision). `build_session` puts them together; `_Run` holds them and runs the step and the loop.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scratchlm.allocator import keep_freed_memory
from scratchlm.console import console, format_seconds
from scratchlm.data.tokens import gather_batch, load_tokens, sample_starts
from scratchlm.device import Plan, apply_threads, plan, resolve_device
from scratchlm.device.choices import ThreadTuner
from scratchlm.errors import DivergedError, Interrupted, ScratchlmError
from scratchlm.model.config import COMPUTATION_FIELDS
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import Checkpoint
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import check_pair, find_checkpoint
from scratchlm.run.summary import RunSummary, StopReason
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.budget import BudgetDecision, TimeBudget
from scratchlm.training.config import TrainConfig, config_changes, config_differences, read_toml
from scratchlm.training.distributed import (
    Distributed,
    all_reduce,
    init_distributed,
    shutdown_distributed,
    wrap_ddp,
)
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.loss_scale import LossScaler
from scratchlm.training.metrics import MetricsLogger
from scratchlm.training.optim import build_optimizer

EVAL_SEED_OFFSET = 1_000_003  # the validation batches come from their own generator: the same ones every time
# The clock of the time budget, tokens/s and the elapsed time; a test replaces it with a fake one.
clock = time.perf_counter


class StopRequest:
    """Ctrl-C or SIGTERM asks the loop to stop after the current step (it then saves a checkpoint); a second
    signal in a single-process run aborts at once. Under torchrun every process gets the signal (or one of them
    does), and the processes agree to stop at the next log step, so that all of them leave together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, distributed: bool) -> None:
        self.signum: int | None = None  # the signal that asked to stop
        self.distributed = distributed

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and not self.distributed:
            raise Interrupted(signum)
        self.signum = signum
        console.print(
            f"{signal.Signals(signum).name}: stopping after this step to save a checkpoint (again to abort)",
            style="yellow",
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def train(config: TrainConfig, resume: bool = False, allow_config_change: bool = False) -> RunSummary:
    """Train a model as `config` says (continuing the run in `config.logging.run_dir` if `resume`); returns
    the summary that is also written to `RUN/summary.json`. A resumed run whose config differs from the one it
    trained with (beyond `CHANGEABLE_ON_RESUME`) is refused unless `allow_config_change`."""
    device = resolve_device(config.training.device, option="training.device")
    dist_info, device = init_distributed(device)
    t = config.training
    choices = plan(device, t.precision, t.compile, t.threads, t.fused_loss, config.logging.peak_tflops)
    apply_threads(choices.threads.value)
    if device.type == "cpu":
        # AdamW's second moments decay into denormal floats, which x86 CPUs process about 10x slower
        # (measured: 2.8 s vs 0.26 s for clip + AdamW per bf16 step); flushing them to zero costs nothing.
        torch.set_flush_denormal(True)
        keep_freed_memory()  # halves the time of a CPU training step; see scratchlm.allocator
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
        data = load_training_data(config)
        with RunDirectory(config.logging.run_dir).lock() if dist_info.is_main else contextlib.nullcontext():
            run = build_session(config, data, dist_info, device, choices, resume, allow_config_change)
            summary = run.run()
        finished = True
        return summary
    except Interrupted:
        # A stop the processes agreed on: the checkpoint is saved and they leave together.
        finished = run is not None and run.stopped is StopReason.INTERRUPTED
        raise
    finally:
        shutdown_distributed(finished)


class _Interval:
    """The steps since the last log step: their summed loss and gradient norm, kept on the device so that the
    loop reads from the accelerator (and waits for it) once per interval, and their wall time less the pauses
    for evaluation and checkpoints, so that tokens/s measures training alone."""

    def __init__(self, device: torch.device) -> None:
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
        start = clock()
        yield
        self.paused += clock() - start
        self.paused_in_session += clock() - start

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
        now = clock()
        tokens_per_s = self.steps * tokens_per_step / max(now - self.start - self.paused, 1e-9)
        self.loss.zero_()
        self.grad_norm.zero_()
        self.steps, self.skipped, self.start, self.paused = 0, 0, now, 0.0
        return tokens_per_s


@dataclass(frozen=True)
class TrainingData:
    """What a run reads: the training and validation tokens (memory-mapped, checked against the model's
    vocabulary) and the tokenizer of `data.tokenizer`, if set, checked against the model and against the copy
    in the run directory, which a resumed run must not change."""

    train: np.ndarray
    valid: np.ndarray
    tokenizer: Tokenizer | None


def load_training_data(config: TrainConfig) -> TrainingData:
    m = config.model
    train_tokens = load_tokens(config.data.train, m.vocab_size, m.context_length)
    valid_tokens = load_tokens(config.data.valid, m.vocab_size, m.context_length)
    return TrainingData(train_tokens, valid_tokens, _load_tokenizer(config))


def _load_tokenizer(config: TrainConfig) -> Tokenizer | None:
    if not config.data.tokenizer:
        return None
    tokenizer = Tokenizer.from_dir(config.data.tokenizer)
    check_pair(config.model, tokenizer, None, f"data.tokenizer {config.data.tokenizer}", "[model]")
    copy = RunDirectory(config.logging.run_dir).tokenizer_dir
    if copy.is_dir() and Tokenizer.from_dir(copy).fingerprint != tokenizer.fingerprint:
        raise ScratchlmError(
            f"data.tokenizer {config.data.tokenizer} is not the tokenizer this run was trained with "
            f"({copy}); use another logging.run_dir"
        )
    return tokenizer


# -- the components of a session, each built by a function of the config ------------------------------------


def build_model(config: TrainConfig, device: torch.device) -> TransformerLM:
    """The model of `[model]`, its initial weights drawn from `training.seed`."""
    torch.manual_seed(config.training.seed)
    return TransformerLM(config.model, device=device)


@dataclass
class Progress:
    """Where a session starts: the steps taken, the newest checkpoint on disk, the data-sampling generator,
    the training time of earlier sessions, the time budget (with the length an earlier session decided) and
    the fp16 loss scaler's state."""

    step: int
    last_saved: int | None
    generator: np.random.Generator
    elapsed_s: float
    budget: TimeBudget
    loss_scale: dict[str, Any] | None = None


def restore(
    config: TrainConfig,
    model: TransformerLM,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    dist: Distributed,
    resume: bool,
    allow_config_change: bool = False,
) -> Progress:
    """A new run's starting point, or, when resuming, the newest intact checkpoint's, loaded into `model` and
    `optimizer` with the RNG states it saved (a run with checkpoints must be resumed, and with the config it
    trained with, beyond `CHANGEABLE_ON_RESUME`, unless `allow_config_change`)."""
    run_dir = RunDirectory(config.logging.run_dir)
    fresh = Progress(0, None, np.random.default_rng(config.training.seed), 0.0, TimeBudget(config))
    existing = run_dir.latest_checkpoint()
    if existing is not None and not resume:
        raise ScratchlmError(
            f"run directory {run_dir} already has checkpoints; continue it with --resume, "
            "or choose another logging.run_dir"
        )
    if existing is None:
        if resume and dist.is_main:
            console.print(f"no checkpoint in {run_dir}: starting a new run")
        return fresh
    existing, checkpoint, damaged = _newest_intact_checkpoint(run_dir, dist)
    _check_config_changes(run_dir, config, checkpoint, allow_config_change, dist)
    checkpoint.load_into(model, optimizer)
    fresh.generator.bit_generator.state = checkpoint.data_rng
    torch.set_rng_state(checkpoint.torch_rng)
    if device.type == "cuda" and checkpoint.cuda_rng is not None:
        torch.cuda.set_rng_state(checkpoint.cuda_rng, device)
    budget = fresh.budget
    if checkpoint.time_budget is not None:  # the length this run decided: the same schedule continues
        budget = TimeBudget(config, BudgetDecision.from_dict(checkpoint.time_budget))
    if dist.is_main:
        for bad in damaged:  # only now that the resume goes ahead: a refused one changes nothing
            console.print(f"set {bad} aside as {run_dir.set_aside(bad).name}", style="yellow")
        if damaged:
            console.print(f"falling back to the newest intact checkpoint, {existing}", style="yellow")
        console.print(f"resuming from {existing} (step {checkpoint.step})")
    return Progress(
        checkpoint.step, checkpoint.step, fresh.generator, checkpoint.elapsed_s, budget, checkpoint.loss_scale
    )


def start_from_weights(
    config: TrainConfig, model: TransformerLM, tokenizer: Tokenizer | None, dist: Distributed
) -> None:
    """Start from the weights of `training.init_from` (a run directory or a checkpoint: fine-tuning, or
    continued pretraining) with this run's fresh optimizer. Its model must be the one `[model]` describes,
    and its tokenizer, when both are known, the one of `data.tokenizer`."""
    path, _ = find_checkpoint(config.training.init_from)
    checkpoint = Checkpoint.read(path)
    differing = [
        f"{key} = {ours!r}, theirs {theirs!r}"
        for key, theirs, ours in config_differences(
            {"model": checkpoint.model_config.to_dict()},
            {"model": config.model.to_dict()},
            sections=("model",),
            changeable={f"model.{name}" for name in COMPUTATION_FIELDS},
        )
    ]
    if differing:
        raise ScratchlmError(
            f"training.init_from: the model of {path} is not the one [model] describes ({'; '.join(differing)})"
        )
    if tokenizer is not None:
        try:
            check_pair(config.model, tokenizer, checkpoint.tokenizer_fingerprint)
        except ScratchlmError:
            raise ScratchlmError(
                f"training.init_from: {path} was trained with another tokenizer than data.tokenizer "
                f"({config.data.tokenizer})"
            ) from None
    checkpoint.load_into(model)
    if dist.is_main:
        console.print(f"starting from the weights of {path} (step {checkpoint.step}), fresh optimizer")


def _newest_intact_checkpoint(
    run_dir: RunDirectory, dist: Distributed
) -> tuple[Path, Checkpoint, list[Path]]:
    """The newest checkpoint that reads back intact, read, and the newer ones that did not (a checksum that
    does not match, a truncated file), each reported by name. Once the resume goes ahead, those are set aside
    as `NAME.damaged` (kept for inspection) so that `generate` or `eval` never pick them up."""
    damaged: list[Path] = []
    for path in reversed(run_dir.checkpoints()):
        try:
            return path, Checkpoint.read(path), damaged
        except ScratchlmError as e:
            if dist.is_main:
                console.print(f"{e}; trying the checkpoint before it", style="yellow")
            damaged.append(path)
    raise ScratchlmError(
        f"no intact checkpoint in {run_dir.checkpoints_dir} ({len(damaged)} damaged, the newest "
        f"{damaged[0].name}); nothing was changed. Start a new run in another logging.run_dir"
    )


def _check_config_changes(
    run_dir: RunDirectory, config: TrainConfig, checkpoint: Checkpoint, allowed: bool, dist: Distributed
) -> None:
    """Compare the config with the one the checkpoint was trained with (or, failing that, the run's
    config.toml): a difference is refused unless `allowed`, and then named."""
    recorded = checkpoint.train_config or None
    if recorded is None and run_dir.config.is_file():
        recorded = read_toml(run_dir.config)
    changes = config_changes(recorded, config) if recorded is not None else []
    if changes and not allowed:
        raise ScratchlmError(
            f"the config differs from the one run {run_dir} trained with ({'; '.join(changes)}); "
            "pass --allow-config-change to continue with the new values, or choose another logging.run_dir"
        )
    if changes and dist.is_main:
        console.print(f"resuming with a changed config: {'; '.join(changes)}", style="yellow")


@dataclass(frozen=True)
class Execution:
    """How the model runs: compiled (the compiled module serves evaluation) and, under several processes,
    wrapped by DistributedDataParallel for training; the rest (autocast, loss scaling, the fused loss) is the
    plan's."""

    forward_model: torch.nn.Module
    train_model: torch.nn.Module


def build_execution(
    model: TransformerLM, choices: Plan, device: torch.device, dist: Distributed
) -> Execution:
    forward_model = torch.compile(model) if choices.compile.value else model
    train_model = wrap_ddp(forward_model, device) if dist.enabled else forward_model
    return Execution(forward_model, train_model)


def build_session(
    config: TrainConfig,
    data: TrainingData,
    dist: Distributed,
    device: torch.device,
    choices: Plan,
    resume: bool,
    allow_config_change: bool = False,
) -> _Run:
    """The components of one session, each from its function, in the order that keeps runs reproducible:
    the model's weights are drawn, then the optimizer made, then a checkpoint (or `init_from`) loaded."""
    model = build_model(config, device)
    optimizer = build_optimizer(config.optimizer, model, precision=choices.precision.value)
    progress = restore(config, model, optimizer, device, dist, resume, allow_config_change)
    if config.training.init_from and progress.last_saved is None:  # a resumed run continues its own weights
        start_from_weights(config, model, data.tokenizer, dist)
    execution = build_execution(model, choices, device, dist)
    return _Run(config, data, dist, device, choices, model, optimizer, progress, execution)


class _Run:
    """One session of a run: its components (built by `build_session`), then `run()`, the loop."""

    def __init__(
        self,
        config: TrainConfig,
        data: TrainingData,
        dist_info: Distributed,
        device: torch.device,
        choices: Plan,
        model: TransformerLM,
        optimizer: torch.optim.Optimizer,
        progress: Progress,
        execution: Execution,
    ) -> None:
        self.config, self.dist, self.device, self.choices = config, dist_info, device, choices
        self.precision = choices.precision.value  # "auto" resolved
        t = config.training
        self.run_dir = RunDirectory(config.logging.run_dir)
        self.context = config.model.context_length
        self.micro_batch = t.batch_size // dist_info.world_size // t.grad_accum
        self.eval_batch = config.eval.batch_size or t.batch_size
        self.tokens_per_step = t.batch_size * self.context
        self.train_tokens, self.valid_tokens, self.tokenizer = data.train, data.valid, data.tokenizer
        self.model, self.optimizer = model, optimizer
        self.step, self.last_saved = (
            progress.step,
            progress.last_saved,
        )  # last_saved: the newest checkpoint's step
        self.generator, self.elapsed_before, self.budget = (
            progress.generator,
            progress.elapsed_s,
            progress.budget,
        )
        self.committed_rng = self.generator.bit_generator.state  # the sampling state after `self.step` steps
        self.in_update = False
        self.forward_model, self.train_model = execution.forward_model, execution.train_model
        self.autocast, self.fused_loss = choices.autocast(), choices.fused_loss.value
        self.scaler = LossScaler(choices.loss_scaling)
        if progress.loss_scale is not None and self.scaler.enabled:
            self.scaler.load_state_dict(progress.loss_scale)
        self.flops_per_token = config.model.flops_per_token
        self.peak = choices.peak_flops.value

        # What this session has seen so far; `run` starts the clock.
        self.start_step = self.step
        self.stop = StopRequest(dist_info.enabled)
        self.stop_signal = 0  # the signal that interrupted the run, once the processes agree on one
        self.stopped = StopReason.FINISHED
        self.final_train_loss: float | None = None
        self.final_val_loss: float | None = None
        self.last_eval: int | None = None
        self.logger: MetricsLogger | None = None

    # -- the pieces of a step -------------------------------------------------------------------------------

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step; returns the (device-resident) mean loss, the gradient norm before clipping, and
        whether the update was applied (fp16 skips a step whose gradients overflowed)."""
        t = self.config.training
        lr = self.budget.schedule(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        starts = sample_starts(len(self.train_tokens), t.batch_size, self.context, self.generator)
        per_process = t.batch_size // self.dist.world_size
        mine = starts[self.dist.rank * per_process : (self.dist.rank + 1) * per_process]
        loss_sum = torch.zeros((), device=self.device)
        for k in range(t.grad_accum):
            inputs, targets = gather_batch(
                self.train_tokens,
                mine[k * self.micro_batch : (k + 1) * self.micro_batch],
                self.context,
                self.device,
            )
            # Gradients are averaged across processes once per step, on the last micro-batch's backward.
            last = k == t.grad_accum - 1
            no_sync = (
                self.train_model.no_sync() if self.dist.enabled and not last else contextlib.nullcontext()
            )
            with no_sync:
                with self.autocast:
                    if self.fused_loss:
                        loss = self.train_model(inputs, targets=targets) / t.grad_accum
                    else:
                        loss = cross_entropy(self.train_model(inputs), targets) / t.grad_accum
                self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.model.parameters())
        grad_norm = clip_grad_norm(self.model.parameters(), self.config.optimizer.grad_clip or math.inf)
        applied = self.scaler.update(grad_norm)
        if self.scaler.collapsed:
            kept = self.run_dir.latest_checkpoint()
            raise DivergedError("gradient norm", self.step + 1, str(kept) if kept else None)
        # The update commits the step. An abort (KeyboardInterrupt) before it leaves model and optimizer at the
        # previous step, with the sampling state of `self.committed_rng`; one inside it leaves no usable state.
        self.in_update = True
        if applied:
            self.optimizer.step()
        self.step += 1
        self.committed_rng = self.generator.bit_generator.state
        self.in_update = False
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, applied

    @torch.no_grad()
    def _validation_loss(self) -> float:
        """Mean loss over `eval.iters` fixed batches of validation windows. Each process takes its share of
        every batch and runs it in chunks of the training micro-batch (which fits in memory)."""
        self.model.eval()
        generator = np.random.default_rng(self.config.training.seed + EVAL_SEED_OFFSET)
        total = torch.zeros((), device=self.device)
        for _ in range(self.config.eval.iters):
            starts = sample_starts(len(self.valid_tokens), self.eval_batch, self.context, generator)
            mine = np.array_split(starts, self.dist.world_size)[self.dist.rank]
            for chunk in np.array_split(mine, max(1, math.ceil(len(mine) / self.micro_batch))):
                if len(chunk):
                    inputs, targets = gather_batch(self.valid_tokens, chunk, self.context, self.device)
                    with self.autocast:
                        total += cross_entropy(self.forward_model(inputs), targets) * len(chunk)
        self.model.train()
        return all_reduce(total, "sum").item() / (self.config.eval.iters * self.eval_batch)

    def _save(self) -> Path | None:
        self.last_saved = self.step
        if not self.dist.is_main:
            return None
        path = self.run_dir.checkpoint(self.step)
        Checkpoint.of(
            self.model,
            self.step,
            optimizer=self.optimizer.state_dict(),
            train_config=self.config.to_dict(),
            tokenizer_fingerprint=None if self.tokenizer is None else self.tokenizer.fingerprint,
            data_rng=self.committed_rng,
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            elapsed_s=self._elapsed(),
            tokens=self.step * self.tokens_per_step,
            precision=self.precision,
            time_budget=None if self.budget.decision is None else self.budget.decision.to_dict(),
            loss_scale=self.scaler.state_dict() if self.scaler.enabled else None,
        ).save(path)
        self.run_dir.prune_checkpoints(self.config.checkpoint.keep)
        return path

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        if self.step >= self.total_steps:
            return self._already_finished()
        self._start()
        config = self.config
        try:
            try:
                with self.stop.installed():
                    while self.step < self.total_steps:
                        self.interval.add(*self._train_step())
                        self._observe_budget()

                        at_log = self.step % config.logging.log_interval == 0 or self.step == self.total_steps
                        at_eval = config.eval.interval and self.step % config.eval.interval == 0
                        at_save = config.checkpoint.interval and self.step % config.checkpoint.interval == 0
                        if at_log or at_save:  # a checkpoint is written only after this finiteness check
                            self.final_train_loss, grad_norm = self.interval.means(self.step, self.run_dir)
                        if at_log:
                            self._log_train(self.final_train_loss, grad_norm)
                        with self.interval.pause():
                            if at_eval and config.eval.iters:
                                self._evaluate()
                            if at_save:
                                self._save()
                        if self._maybe_stop(at_log):
                            break
            except KeyboardInterrupt:
                self._save_after_abort()
                raise
            self._end_session()
        except DivergedError:
            # The summary says so: a resumed run must not keep the "finished" of an earlier session.
            self.stopped = StopReason.DIVERGED
            self._finish()
            raise
        finally:
            if self.logger is not None:
                self.logger.close()
        return self._finish()

    def _start(self) -> None:
        """Write the run's config, announce the run, open the metrics log and start the clocks."""
        config = self.config
        if self.dist.is_main:
            choices = self.choices
            resolved = f"resolved to {choices.precision.value!r} on {choices.profile.name}: {choices.precision.reason}"
            self.run_dir.create(config.to_toml(notes={"training.precision": resolved}), self.tokenizer)
            console.print(choices.summary(), markup=False, highlight=False)
            for warning in choices.warnings:
                console.print(f"warning: {warning}", style="yellow", markup=False)
            budget = self.budget
            steps = (
                f"as many steps as fit in {format_seconds(budget.seconds)}"
                + (f" (at most {budget.planned:,})" if budget.planned else "")
                if budget.deciding
                else f"{self.total_steps:,} steps"
            )
            console.print(
                f"training {self.model.num_parameters():,} parameters on {self.device}"
                f"{f' × {self.dist.world_size} processes' if self.dist.enabled else ''}: {steps}"
                f" of {config.training.batch_size} × {self.context} tokens → {self.run_dir}"
            )
            self.logger = MetricsLogger(
                self.run_dir,
                config.to_dict(),
                None if budget.deciding else self.total_steps,
                start_step=self.step,
                wandb=config.logging.wandb,
                wandb_project=config.logging.wandb_project,
                tensorboard=config.logging.tensorboard,
            )
            self.logger.note(
                {
                    "step": self.step,
                    "time": round(self.elapsed_before, 3),
                    "tokens": self.step * self.tokens_per_step,
                    "setup": {
                        "device": choices.device,
                        "device_name": choices.profile.name,
                        "precision": choices.precision.value,
                        "threads": choices.threads.value,
                        "compile": choices.compile.value,
                    },
                }
            )
        self.session_start = clock()
        self.interval = _Interval(self.device)
        self.threads = ThreadTuner(self.choices.threads, compiled=self.choices.compile.value)

    def _elapsed(self) -> float:
        """Seconds of training in this run, over all its sessions."""
        return self.elapsed_before + clock() - self.session_start

    @property
    def total_steps(self) -> int:
        return self.budget.total_steps

    def _observe_budget(self) -> None:
        """Let the time budget measure this step and, at its decision step, size the schedule; the decision
        goes into the metrics log here and into every checkpoint from now on."""
        if self.budget.deciding:
            if self.budget.wants_clock(self.step, self.start_step) and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the work done, not the work queued
            decision = self.budget.observe(
                self.step, self.start_step, self._elapsed(), self.interval.paused_in_session
            )
            if decision is not None and self.dist.enabled:
                # Each process timed its own clock; all must stop at the same step: the shortest length.
                negated = torch.tensor(-float(decision.total_steps), device=self.device)
                decision = self.budget.settle(-int(all_reduce(negated, "max").item()))
            revised = False
        else:
            # Revising would need the processes to agree at every step: single-process runs only.
            decision = None if self.dist.enabled else self.budget.revise(self.step, self._elapsed())
            revised = True
        if decision is None or not self.dist.is_main:
            return
        console.print(
            f"{decision.step_s:.3f} s a step{' since the last decision' if revised else ''}: "
            f"{decision.total_steps:,} steps fit in the time budget of "
            f"{format_seconds(self.config.training.max_time_s)}; the schedule ends at step {decision.total_steps:,}"
        )
        if self.logger is not None:
            self.logger.set_total(decision.total_steps)
            self.logger.note(
                {"step": self.step, "time": round(self._elapsed(), 3), "time_budget": decision.to_dict()}
            )

    def _log(self, record: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(
                {
                    "step": self.step,
                    "time": round(self._elapsed(), 3),
                    "tokens": self.step * self.tokens_per_step,
                    **record,
                }
            )

    def _log_train(self, loss: float, grad_norm: float | None) -> None:
        """Log the interval that ends at this step, and start the next."""
        tokens_per_s = self.interval.close(self.tokens_per_step)
        if (change := self.threads.update()) is not None and self.dist.is_main:
            console.print(change, style="dim")
        mfu = tokens_per_s * self.flops_per_token / (self.peak * self.dist.world_size) if self.peak else None
        lr = self.optimizer.param_groups[0]["lr"]
        scaling = (
            {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped}
            if self.scaler.enabled
            else {}
        )
        self._log(
            {
                "train_loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                **scaling,
            }
        )

    def _evaluate(self) -> None:
        loss = self._validation_loss()
        self.final_val_loss, self.last_eval = loss, self.step
        self._log({"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))})

    def _maybe_stop(self, at_log: bool) -> bool:
        """Whether to stop early, for a signal or the time budget. Several processes must agree, which they do
        at log steps: a signal that reached any one of them stops them all, as an interruption."""
        if self.dist.enabled and not at_log:
            return False
        budget = self.config.training.max_time_s
        signum, over_budget = self.stop.signum or 0, bool(budget and self._elapsed() > budget)
        if self.dist.enabled:
            agreed = all_reduce(
                torch.tensor([signum, over_budget], dtype=torch.float32, device=self.device), "max"
            )
            signum, over_budget = (int(value) for value in agreed.tolist())
        if signum:
            self.stopped, self.stop_signal = StopReason.INTERRUPTED, signum
        elif over_budget:
            self.stopped = StopReason.TIME_BUDGET
        return bool(signum or over_budget)

    def _save_after_abort(self) -> None:
        """After a second Ctrl-C (or any KeyboardInterrupt), save the last completed step if it is sound."""
        # (Several processes cannot agree on a checkpoint here; they stop together on Ctrl-C instead.)
        if self.in_update or self.step == self.last_saved or self.dist.enabled:
            return
        if self.interval.steps:
            self.interval.means(self.step, self.run_dir)
        if (path := self._save()) is not None:
            console.print(f"saved {path}; continue with --resume")

    def _end_session(self) -> None:
        """The loop has ended: check the last steps, evaluate the model as it is now, save it."""
        if self.interval.steps:
            self.final_train_loss, _ = self.interval.means(self.step, self.run_dir)
        if (
            self.config.eval.iters
            and self.step > self.start_step
            and self.last_eval != self.step
            and self.stopped is not StopReason.INTERRUPTED
        ):
            self._evaluate()
        if self.step != self.last_saved:
            self._save()

    def _finish(self) -> RunSummary:
        """Write and print the summary; an interrupted run then raises `Interrupted` with its signal (a
        diverged one is ended by its `DivergedError`, which the caller re-raises)."""
        session_time = clock() - self.session_start
        summary = self._summary(
            wall_time_s=self._elapsed(),
            tokens_per_s=(self.step - self.start_step) * self.tokens_per_step / session_time,
        )
        if self.dist.is_main:
            summary.write(self.run_dir.summary_file)
        if self.dist.is_main and self.stopped is not StopReason.DIVERGED:  # the error itself tells that story
            console.print(
                f"{self.stopped.value} at step {self.step} after {format_seconds(summary.wall_time_s)}: train loss "
                f"{_fmt(self.final_train_loss)}, val loss {_fmt(self.final_val_loss)}; "
                f"checkpoint in {self.run_dir.checkpoints_dir}"
                + ("" if self.stopped is StopReason.FINISHED else " (continue with --resume)")
            )
        if self.stopped is StopReason.INTERRUPTED:
            raise Interrupted(self.stop_signal)
        return summary

    def _summary(self, wall_time_s: float, tokens_per_s: float | None) -> RunSummary:
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=self.step,
            tokens=self.step * self.tokens_per_step,
            wall_time_s=wall_time_s,
            final_train_loss=self.final_train_loss,
            final_val_loss=self.final_val_loss,
            tokens_per_s=tokens_per_s,
            parameters=self.model.num_parameters(),
            stopped=self.stopped,
        )

    def _already_finished(self) -> RunSummary:
        """A resumed run with no steps left is left as it is; its summary is the one it wrote when it ended
        (or, if that is missing or from an earlier step, one without the losses, which were not kept)."""
        summary = self.run_dir.summary()
        if summary is None or summary.steps != self.step:
            summary = self._summary(wall_time_s=self.elapsed_before, tokens_per_s=None)
        if self.dist.is_main:
            console.print(f"run already finished at step {self.step}: nothing to train in {self.run_dir}")
        return summary


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
