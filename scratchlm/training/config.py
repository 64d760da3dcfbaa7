"""The training configuration: a TOML file, command-line overrides, validated key by key.

    [data]        train, valid (memory-mapped .npy token files), tokenizer (directory, optional): pretraining
                  (scratchlm.training.inputs, which registers it)
    [model]       the ModelConfig fields (shape and ablation switches)
    [optimizer]   name (adamw | sgd | muon), lr, min_lr, betas, eps, weight_decay, grad_clip, embedding_lr,
                  head_lr, muon_lr, muon_momentum, muon_nesterov, muon_ns_steps, muon_bf16, muon_weight_decay
                  (scratchlm.training.optimizers: the section beside the registry of optimizers)
    [schedule]    kind (cosine | wsd | linear), warmup_iters, cosine_cycle_iters (0: the run's last step),
                  decay_fraction (scratchlm.training.schedule: the section beside the registry of schedules)
    [training]    batch_size, grad_accum, max_steps or max_tokens, max_time_s, device, precision, threads,
                  compile, seed, init_from, parallel (ddp | fsdp: scratchlm.parallelisms),
                  reshard_after_forward, activation_checkpointing (scratchlm.parallel)
    [eval]        interval, iters, batch_size
    [checkpoint]  interval, keep
    [logging]     run_dir, log_interval, wandb, wandb_project, tensorboard, peak_tflops
    [lora]        rank (0: none), alpha, targets, base_dtype, train: low-rank adapters on a frozen base, for
                  the fine-tuning stages (scratchlm.model.lora; the section beside ModelConfig)
    [sft]         base, train, valid, valid_fraction, added_tokens: fine-tuning on conversations (the chat
                  package's `sft` module, which registers it)
    [rl]          base, train, valid, valid_fraction, reward, reward_timeout_s, group_size, temperature,
                  max_reply_tokens, normalize_std, length_norm, clip_eps, epochs_per_batch, kl_coef:
                  reinforcement learning on prompts with answers (the chat package's `rl.stage` module)

[data], [sft] and [rl] are stages' sections: a config holds exactly one, which says where the run's batches
and its loss come from (`scratchlm.training.stage`); each is defined and registered beside its stage's code
(the command of a stage imports it; pretraining's, which this module names but never imports, the training
package imports), and a config without one is pretraining's.

Every section is a dataclass; its field types are the schema. A file or an override (`section.key=value`) is
read and checked against it by `scratchlm.training.config_reader`: unknown keys are rejected with the list of
known ones, a value of the wrong type names the key and the expected type. The resolved configuration
(defaults filled in) is written back as TOML into the run directory (`scratchlm.io.to_toml`), which is how
every run records exactly what it trained with; what a resumed run may change of it is
`scratchlm.training.start.CHANGEABLE_ON_RESUME`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scratchlm.errors import ScratchlmError
from scratchlm.io import to_toml
from scratchlm.model.config import LoRAConfig, ModelConfig
from scratchlm.parallelisms import ParallelName
from scratchlm.precisions import Precision
from scratchlm.training.config_reader import build_section, parse_override, read_toml
from scratchlm.training.optimizers import OptimizerConfig
from scratchlm.training.recipes import merged
from scratchlm.training.schedule import ScheduleConfig
from scratchlm.training.stage import PRETRAINING, STAGES


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int = 32  # sequences per optimizer step, over all processes and micro-batches
    grad_accum: int = 1  # micro-batches per step (each process)
    max_steps: int = 0  # steps to train; 0: derived from max_tokens
    max_tokens: int = 0  # or a token budget: steps = ceil(max_tokens / (batch_size * context_length))
    # wall-clock budget in seconds (0: none): the schedule is sized to the steps that fit, measured on the
    # machine, max_steps / max_tokens (when set) being the most it may have (scratchlm.training.budget)
    max_time_s: float = 0.0
    device: str = "auto"  # auto: cuda, then mps, then cpu
    # auto: bf16 where the device computes it natively and fast (measured), fp16 on a GPU with fast fp16 only,
    # else fp32; bf16, fp16: autocast of the matmuls over float32 weights, fp16 with loss scaling
    # (scratchlm.device.choices)
    precision: Precision = "auto"
    threads: int = 0  # CPU threads; 0: the usable cores other processes leave free (scratchlm.device.choices)
    compile: bool = False  # torch.compile the model
    # LM head + loss over chunks of tokens, never the whole (tokens × vocab) logits; auto: on a CUDA device
    fused_loss: Literal["auto", "on", "off"] = "auto"
    seed: int = 0
    init_from: str = ""  # a run directory or checkpoint whose weights a new run starts from (fresh optimizer)
    # how the processes of a torchrun launch share the model (scratchlm.parallel): ddp, a whole copy each;
    # fsdp, a shard each of the parameters, gradients and optimizer state. One process ignores it
    parallel: ParallelName = "ddp"
    # fsdp: free each block's gathered parameters after its forward and gather them again for its backward;
    # false keeps them until the backward: more memory, less communication
    reshard_after_forward: bool = True
    # recompute each block's activations in the backward pass rather than keep them: less memory, about one
    # more forward pass of compute a step
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class EvalConfig:
    interval: int = 500  # steps between validation estimates; 0: only at the end
    iters: int = 20  # validation batches per estimate (the same batches every time)
    batch_size: int = 0  # sequences per estimate; 0: training.batch_size


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 1000  # steps between checkpoints; 0: only at the end
    keep: int = 3  # most recent checkpoints kept


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/default"
    log_interval: int = 10  # steps between train-loss records
    wandb: bool = False
    wandb_project: str = "scratchlm"
    tensorboard: bool = False
    peak_tflops: float = 0.0  # accelerator peak for the MFU estimate; 0: look it up for known GPUs


# The sections every config has; besides them, one stage's (`STAGES`).
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "training": TrainingConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "lora": LoRAConfig,
}


def _section_type(name: str, source: str) -> type:
    """The dataclass of section `name`."""
    if (found := SECTIONS.get(name) or (STAGES[name].config if name in STAGES else None)) is None:
        raise _unknown_sections([name], source)
    return found


def _unknown_sections(names: list[str], source: str) -> ScratchlmError:
    """The error for sections no config has, naming those it may have: pretraining's first, then those of every
    config, then the other stages' registered so far."""
    others = [stage for stage in STAGES if stage != PRETRAINING]
    known = ", ".join([PRETRAINING, *SECTIONS, *others])
    return ScratchlmError(f"{source}: unknown section(s) {', '.join(names)}; known: {known}")


@dataclass(frozen=True)
class TrainConfig:
    """A run's configuration: the sections of `SECTIONS`, and `stage`, the one stage's section (pretraining's
    `[data]` by default), read as the attribute of its name (`config.data`, `config.sft`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    stage: Any = field(default_factory=lambda: STAGES[PRETRAINING].config())

    def __getattr__(self, name: str) -> Any:
        """The stage's section by its name: `config.data`, `config.sft`."""
        if name != "stage" and name == self.stage_name:
            return self.stage
        raise AttributeError(f"{type(self).__name__} has no section {name!r}")

    @property
    def stage_name(self) -> str:
        """The name of the stage's section (a key of `STAGES`)."""
        return next(name for name, stage in STAGES.items() if isinstance(self.stage, stage.config))

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: list[str] | tuple[str, ...] = (),
        defaults: dict[str, dict[str, Any]] | None = None,
        flags: dict[str, tuple[str, Any]] | None = None,
        stage: str = PRETRAINING,
    ) -> TrainConfig:
        """Defaults (the dataclasses', then `defaults`: a command's own, such as fine-tuning's), then the TOML
        file at `path` (if any), then `flags`, then the `section.key=value` overrides. `flags` are a command's
        own options for config keys, each named as the user typed it so that an error names it too:
        `{"--out": ("logging.run_dir", "runs/x")}`. `stage`: the stage's section when the values name none."""
        values, source = merged(defaults or {}, {}), "config"
        if path is not None:
            path, source = Path(path), str(path)
            values = merged(values, read_toml(path))
        settings = [(flag, *key.split(".", 1), value) for flag, (key, value) in (flags or {}).items()]
        settings += [(f"--set {override}", *parse_override(override)) for override in overrides]
        for name, section, key, value in settings:
            build_section(section, _section_type(section, name), {key: value}, name, construct=False)
            values.setdefault(section, {})[key] = value
        given = [*(flags or {}), *(["--set overrides"] if overrides else [])]
        if given:
            source = f"{source} with {', '.join(given)}" if path is not None else ", ".join(given)
        return cls.from_dict(values, source, stage)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], source: str = "config", stage: str = PRETRAINING
    ) -> TrainConfig:
        """The config of `values` (section -> key -> value); `stage`: the stage's section when `values` name
        none."""
        unknown = sorted(set(values) - set(SECTIONS) - set(STAGES))
        if unknown:
            raise _unknown_sections(unknown, source)
        stages = [name for name in STAGES if name in values]
        if len(stages) > 1:
            raise ScratchlmError(
                f"{source}: [{'] and ['.join(stages)}] are different stages' sections; a config has one"
            )
        stage = stages[0] if stages else stage
        sections = {}
        for name, section_type in [*SECTIONS.items(), (stage, STAGES[stage].config)]:
            section_values = values.get(name, {})
            if not isinstance(section_values, dict):
                raise ScratchlmError(f"{source}: [{name}] must be a table of settings")
            sections[name] = build_section(name, section_type, section_values, source)
        config = cls(**{name: sections.pop(name) for name in SECTIONS}, stage=sections[stage])
        config._check(source)
        return config

    def _check(self, source: str) -> None:
        """Checks across keys (types are checked when reading)."""
        t = self.training
        self.stage.check(source)
        self.lora.check(source)
        if self.lora.rank and self.stage_name == PRETRAINING:
            raise ScratchlmError(
                f"{source}: lora.rank = {self.lora.rank}: adapters fine-tune a base, in the sft and rl stages "
                "only; pretraining trains every weight"
            )
        positive = {
            "training.batch_size": t.batch_size,
            "training.grad_accum": t.grad_accum,
            "logging.log_interval": self.logging.log_interval,
            "checkpoint.keep": self.checkpoint.keep,
            "optimizer.lr": self.optimizer.lr,
            "optimizer.muon_lr": self.optimizer.muon_lr,
            "optimizer.muon_ns_steps": self.optimizer.muon_ns_steps,
        }
        non_negative = {
            "training.max_steps": t.max_steps,
            "training.max_tokens": t.max_tokens,
            "training.max_time_s": t.max_time_s,
            "schedule.warmup_iters": self.schedule.warmup_iters,
            "schedule.cosine_cycle_iters": self.schedule.cosine_cycle_iters,
            "eval.interval": self.eval.interval,
            "eval.iters": self.eval.iters,
            "training.threads": t.threads,
            "eval.batch_size": self.eval.batch_size,
            "checkpoint.interval": self.checkpoint.interval,
            "optimizer.min_lr": self.optimizer.min_lr,
            "optimizer.eps": self.optimizer.eps,
            "optimizer.weight_decay": self.optimizer.weight_decay,
            "optimizer.grad_clip": self.optimizer.grad_clip,
            "optimizer.embedding_lr": self.optimizer.embedding_lr,
            "optimizer.head_lr": self.optimizer.head_lr,
            "optimizer.muon_weight_decay": self.optimizer.muon_weight_decay,
            "logging.peak_tflops": self.logging.peak_tflops,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ScratchlmError(f"{source}: {key} must be positive, got {value!r}")
        for key, value in non_negative.items():
            if not value >= 0:
                raise ScratchlmError(f"{source}: {key} must be >= 0, got {value!r}")
        if not t.max_time_s <= MAX_TIME_S:  # infinite, or a slip of units
            raise ScratchlmError(
                f"{source}: training.max_time_s must be at most {MAX_TIME_S:,.0f} seconds (a year; 0: no time "
                f"limit), got {t.max_time_s!r}{_duration(t.max_time_s)}"
            )
        if not all(0 <= beta < 1 for beta in self.optimizer.betas):
            raise ScratchlmError(
                f"{source}: optimizer.betas must lie in [0, 1), got {list(self.optimizer.betas)}"
            )
        if not 0 <= self.optimizer.muon_momentum < 1:
            raise ScratchlmError(
                f"{source}: optimizer.muon_momentum must lie in [0, 1), got {self.optimizer.muon_momentum!r}"
            )
        if not 0 < self.schedule.decay_fraction <= 1:
            raise ScratchlmError(
                f"{source}: schedule.decay_fraction must lie in (0, 1], got {self.schedule.decay_fraction!r}"
            )
        if (t.max_steps and t.max_tokens) or not (t.max_steps or t.max_tokens or t.max_time_s):
            raise ScratchlmError(
                f"{source}: set exactly one of training.max_steps and training.max_tokens (or neither, with "
                "training.max_time_s: then the run is as long as fits in the time)"
            )
        if t.batch_size % t.grad_accum:
            raise ScratchlmError(
                f"{source}: training.batch_size ({t.batch_size}) must be divisible by training.grad_accum "
                f"({t.grad_accum})"
            )

    @property
    def total_steps(self) -> int:
        """The steps the config plans; 0 when only a time budget sizes the run."""
        if self.training.max_steps:
            return self.training.max_steps
        if not self.training.max_tokens:
            return 0
        return math.ceil(self.training.max_tokens / (self.training.batch_size * self.model.context_length))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Section -> key -> value, the stage's section first."""
        sections = {self.stage_name: self.stage} | {name: getattr(self, name) for name in SECTIONS}
        return {name: section_dict(section) for name, section in sections.items()}

    def to_toml(self, notes: dict[str, str] | None = None) -> str:
        """The config as TOML; `notes` ("section.key" -> text) become comments after those keys."""
        return to_toml(self.to_dict(), notes)

    def replace(self, **sections: dict[str, Any]) -> TrainConfig:
        """A copy with some keys changed: `config.replace(training={"max_steps": 10})`."""
        values = self.to_dict()
        for name, changes in sections.items():
            values.setdefault(name, {}).update(changes)
        return TrainConfig.from_dict(values, stage=self.stage_name)


# The longest time budget accepted, a year: a longer one is a slip (seconds typed as minutes, an exponent too
# many), and an infinite one sizes no schedule. No time limit is said by leaving the budget out (0).
MAX_TIME_S = 365 * 24 * 3600.0


def budget_seconds(minutes: float, flag: str = "--minutes", unlimited: str = "") -> float:
    """The time budget in seconds of a command's `flag` (`--minutes M`), checked before any work starts: more
    than 0 and at most `MAX_TIME_S`. `unlimited` says how the command runs without a limit, for the error."""
    if not 0 < minutes <= MAX_TIME_S / 60:
        hint = f"; {unlimited}" if unlimited else ""
        raise ScratchlmError(
            f"{flag} must be a number of minutes above 0 and at most {MAX_TIME_S / 60:,.0f} (a year), got "
            f"{minutes:g}{_duration(minutes * 60)}{hint}"
        )
    return minutes * 60


def _duration(seconds: float) -> str:
    """`" (3,472.2 days)"` for a time too long to be meant; "" otherwise."""
    from scratchlm.console import format_seconds

    return f" ({format_seconds(seconds)})" if math.isfinite(seconds) and seconds > MAX_TIME_S else ""


def training_section(overrides: list[str] | tuple[str, ...] = ()) -> TrainingConfig:
    """The [training] section alone, from defaults and `training.key=value` overrides: for commands that look
    at how a run would execute (device, precision, threads, compile) without a whole config."""
    values: dict[str, Any] = {}
    for override in overrides:
        section, key, value = parse_override(override)
        if section != "training":
            raise ScratchlmError(f"--set {override}: without --config only training.* keys can be set")
        values[key] = value
    return build_section("training", TrainingConfig, values, "--set overrides")


def section_dict(section: Any) -> dict[str, Any]:
    """A section's keys and values (a model config's as it writes them)."""
    if isinstance(section, ModelConfig):
        return section.to_dict()
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
