"""Where a session starts: a new run, the newest intact checkpoint of a run being resumed, or the weights of
another run (`training.init_from`).

A checkpoint holds the model, the optimizer, the step, the sampling generator's state, torch's RNG state, the
elapsed time, the time budget's decision and (fp16) the loss scale, so a resumed run continues exactly: on CPU,
N steps, resume, N steps gives bit-for-bit the parameters of 2N steps in one go. A resumed run must keep the
config it trained with, beyond `CHANGEABLE_ON_RESUME` (here, with `config_differences`, the one comparison of
configs), unless `--allow-config-change`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.io import toml_value
from scratchlm.model.config import COMPUTATION_FIELDS
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import Checkpoint, TrainingState
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import check_pair, find_checkpoint, load_checkpoint, read_any, read_weights
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.budget import BudgetDecision, TimeBudget
from scratchlm.training.config import TrainConfig, section_dict
from scratchlm.training.config_reader import read_toml
from scratchlm.training.distributed import Distributed, all_reduce
from scratchlm.training.stage import STAGES


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
    run_dir: RunDirectory,
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
    fresh = Progress(0, None, np.random.default_rng(config.training.seed), 0.0, TimeBudget(config))
    existing = run_dir.latest_checkpoint()
    _check_same_checkpoint(existing, dist, device)
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
    training = checkpoint.training
    if training is None:
        raise ScratchlmError(
            f"{existing} has no training state to resume: start a new run from it (training.init_from)"
        )
    load_checkpoint(checkpoint, model, optimizer)  # a sharded one's shards: each process its own
    fresh.generator.bit_generator.state = training.data_rng
    torch.set_rng_state(training.torch_rng)
    if device.type == "cuda" and training.cuda_rng is not None:
        torch.cuda.set_rng_state(training.cuda_rng, device)
    budget = fresh.budget
    if training.time_budget is not None:  # the length this run decided: the same schedule continues
        budget = TimeBudget(config, BudgetDecision.from_dict(training.time_budget))
    if dist.is_main:
        for bad in damaged:  # only now that the resume goes ahead: a refused one changes nothing
            console.print(f"set {bad} aside as {run_dir.set_aside(bad).name}", style="yellow")
        if damaged:
            console.print(f"falling back to the newest intact checkpoint, {existing}", style="yellow")
        console.print(f"resuming from {existing} (step {checkpoint.step})")
        if (layout := layout_change(existing, training, config, dist)) is not None:
            console.print(layout)
    return Progress(
        checkpoint.step, checkpoint.step, fresh.generator, training.elapsed_s, budget, training.loss_scale
    )


def _check_same_checkpoint(existing: Path | None, dist: Distributed, device: torch.device) -> None:
    """Every process must find the same newest checkpoint. Machines that do not share the run directory's file
    system would otherwise each start from their own (or one of them from none) and train apart, rank 0 alone
    writing. A collective: every process calls it."""
    if not dist.enabled:
        return
    step = -1 if existing is None else int(re.sub(r"\D", "", existing.name.split(".")[0]))
    found = all_reduce(torch.tensor([step, -step], dtype=torch.int64, device=device), "max").tolist()
    newest, oldest = found[0], -found[1]
    if newest != oldest:
        seen = ["none" if s < 0 else f"step {s}" for s in (oldest, newest)]
        raise ScratchlmError(
            f"the processes find different newest checkpoints in the run directory ({seen[0]} to {seen[1]}): "
            "every machine must see the same run directory (a shared file system, or the checkpoints copied "
            "to each); see docs/distributed.md"
        )


def start_from_weights(
    config: TrainConfig, model: TransformerLM, tokenizer: Tokenizer | None, dist: Distributed
) -> Checkpoint:
    """Start from the weights of `training.init_from` (a run directory or a checkpoint: fine-tuning, or
    continued pretraining) with this run's fresh optimizer. Its model must be the one `[model]` describes,
    and its tokenizer, when both are known, this run's. A stage that grows the vocabulary (fine-tuning to
    chat, which adds the chat template's tokens) gets rows for them (`grow_vocabulary`). A LoRA run as
    `init_from` gives its merged weights (`read_weights`). Returns the checkpoint read (before any growth)."""
    path, _ = find_checkpoint(config.training.init_from)
    checkpoint = base = read_weights(path)
    base_vocab = checkpoint.model_config.vocab_size
    grows_vocabulary = STAGES[config.stage_name].grows_vocabulary
    grows = grows_vocabulary and base_vocab < config.model.vocab_size
    differing = [
        f"{key} = {ours!r}, theirs {theirs!r}"
        for key, theirs, ours in config_differences(
            {"model": checkpoint.model_config.to_dict()},
            {"model": config.model.to_dict()},
            sections=("model",),
            changeable={f"model.{name}" for name in COMPUTATION_FIELDS}
            | ({"model.vocab_size"} if grows else set()),
        )
    ]
    if differing:
        raise ScratchlmError(
            f"training.init_from: the model of {path} is not the one [model] describes ({'; '.join(differing)})"
        )
    # Such a run's tokenizer is the base's with the chat tokens, checked against the base when loaded.
    if tokenizer is not None and not grows_vocabulary:
        try:
            check_pair(config.model, tokenizer, checkpoint.tokenizer_fingerprint)
        except ScratchlmError:
            raise ScratchlmError(
                f"training.init_from: {path} was trained with another tokenizer than this run's"
                + (f" (data.tokenizer {config.data.tokenizer})" if config.stage_name == "data" else "")
            ) from None
    if grows:
        checkpoint = dataclasses.replace(
            checkpoint, model=grow_vocabulary(checkpoint.model, config.model.vocab_size)
        )
    load_checkpoint(checkpoint, model)  # sharded or not
    if dist.is_main:
        console.print(f"starting from the weights of {path} (step {checkpoint.step}), fresh optimizer")
        if grows:
            console.print(
                f"  the vocabulary grows from {base_vocab} to {config.model.vocab_size} rows for the chat "
                "tokens, each new row the mean of the existing ones"
            )
    return base


def grow_vocabulary(state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """`state` with every table indexed by token id (the embedding, an untied LM head, value embeddings)
    grown to `vocab_size` rows. A new row is the mean of the existing rows: a token the model has never
    seen starts as the average token, neither an outlier in the residual stream nor a logit far from the
    others."""
    grown = dict(state)
    for name, tensor in state.items():
        by_token = name in ("token_embeddings.weight", "lm_head.weight") or name.startswith(
            "value_embeddings."
        )
        if by_token and tensor.shape[0] < vocab_size:
            mean = tensor.float().mean(dim=0, keepdim=True).to(tensor.dtype)
            grown[name] = torch.cat([tensor, mean.expand(vocab_size - tensor.shape[0], -1)])
    return grown


def _newest_intact_checkpoint(
    run_dir: RunDirectory, dist: Distributed
) -> tuple[Path, Checkpoint, list[Path]]:
    """The newest checkpoint that reads back intact, read, and the newer ones that did not (a checksum that
    does not match, a truncated file), each reported by name. Once the resume goes ahead, those are set aside
    as `NAME.damaged` (kept for inspection) so that `generate` or `eval` never pick them up."""
    damaged: list[Path] = []
    for path in reversed(run_dir.checkpoints()):
        try:  # a sharded checkpoint: checked whole, its shards read later by each process (`load_checkpoint`)
            return path, read_any(path, whole=False), damaged
        except ScratchlmError as e:
            if dist.is_main:
                console.print(f"{e}; trying the checkpoint before it", style="yellow")
            damaged.append(path)
    raise ScratchlmError(
        f"no intact checkpoint in {run_dir.checkpoints_dir} ({len(damaged)} damaged, the newest "
        f"{damaged[0].name}); nothing was changed. Start a new run in another logging.run_dir"
    )


def layout_change(path: Path, training: TrainingState, config: TrainConfig, dist: Distributed) -> str | None:
    """What a resume does when the number of processes or the parallelism differs from the checkpoint's (one
    line), or None when neither does."""
    saved_world = training.world_size
    saved_parallel = (training.config.get("training") or {}).get("parallel", "ddp")
    parallel = config.training.parallel
    world = dist.world_size
    if (saved_world in (None, world)) and saved_parallel == parallel:
        return None
    was = (
        f"{saved_world} process{'es' if saved_world != 1 else ''}"
        if saved_world
        else "an unknown number of processes"
    )
    now = f"{world} process{'es' if world != 1 else ''}"
    if path.is_dir():
        how = "its shards are redistributed" if world > 1 else "its shards are gathered into this process"
    else:
        how = (
            "each process takes its shards of it"
            if world > 1 and parallel == "fsdp"
            else "every process loads it whole"
        )
    saves = "sharded directories" if parallel == "fsdp" else "single files"
    return (
        f"the checkpoint was saved by {was} under parallel = {saved_parallel!r}; resuming with {now} under "
        f"parallel = {parallel!r}: {how}, and new checkpoints are {saves}"
    )


def _check_config_changes(
    run_dir: RunDirectory, config: TrainConfig, checkpoint: Checkpoint, allowed: bool, dist: Distributed
) -> None:
    """Compare the config with the one the checkpoint was trained with (or, failing that, the run's
    config.toml): a difference is refused unless `allowed`, and then named."""
    recorded = checkpoint.training.config if checkpoint.training is not None else None
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


# Keys a resumed run may change without --allow-config-change: its budget (to extend or shorten it), where
# and how fast it runs (model.attention and the parallelism included), and how often it evaluates,
# checkpoints and logs (and init_from, which only a new run reads). Every other key shapes what the run
# computes, so a silent change would make one run of two different experiments.
CHANGEABLE_ON_RESUME = (
    "training.max_steps",
    "training.max_tokens",
    "training.max_time_s",
    "training.device",
    "training.precision",
    "training.threads",
    "training.compile",
    "training.fused_loss",
    "training.parallel",
    "training.reshard_after_forward",
    "training.activation_checkpointing",
    "model.attention",
    "training.init_from",
    "eval.interval",
    "eval.iters",
    "checkpoint.interval",
    "checkpoint.keep",
    "logging.*",  # every logging key
)


def config_changes(
    recorded: dict[str, Any],
    current: TrainConfig | dict[str, Any],
    sections: Container[str] | None = None,
    changeable: Container[str] = CHANGEABLE_ON_RESUME,
) -> list[str]:
    """`["optimizer.lr: 0.001 -> 0.0003", ...]`: `config_differences` as one line each."""
    return [
        f"{key}: {_shown(before)} -> {_shown(after)}"
        for key, before, after in config_differences(recorded, current, sections, changeable)
    ]


def config_differences(
    recorded: dict[str, Any],
    current: TrainConfig | dict[str, Any],
    sections: Container[str] | None = None,
    changeable: Container[str] = CHANGEABLE_ON_RESUME,
) -> list[tuple[str, Any, Any]]:
    """`[("optimizer.lr", 0.001, 0.0003), ...]`: the keys, other than `changeable`, whose values in `current`
    differ from the config a run recorded (a `to_dict()` or a parsed config.toml), with both values. A key the
    record lacks (a config written before the key existed, or a None that TOML cannot hold) counts as its
    default.

    This is the one comparison of configs: a resumed run against its record (every section, less
    `CHANGEABLE_ON_RESUME`), `training.init_from` against the model it starts from (`sections=("model",)`,
    less the fields that only choose how it is computed), and the quickstart's run against its recipe.
    `changeable` holds "section.key" names, or "section.*" for a whole section. Only the sections of `current`
    are compared: a record of another stage's section (one written when every config held every stage's) is
    not a difference. Two spellings of one path (relative and absolute, `runs/x` and `./runs/x/`) are the same
    value: a file named either way is the same file."""
    defaults = {name: section_dict(stage.config()) for name, stage in STAGES.items()}
    before = {**_flat(defaults | TrainConfig().to_dict()), **_flat(recorded)}
    after = _flat(current if isinstance(current, dict) else current.to_dict())
    compared = {key.partition(".")[0] for key in after}
    return [
        (key, before.get(key), after.get(key))
        for key in [
            *after,
            *(key for key in before if key not in after and key.partition(".")[0] in compared),
        ]
        if not _same(before.get(key), after.get(key))
        and (sections is None or key.partition(".")[0] in sections)
        and key not in changeable
        and f"{key.partition('.')[0]}.*" not in changeable
    ]


def _flat(values: dict[str, Any]) -> dict[str, Any]:
    """`{"optimizer": {"lr": 1e-3}}` -> `{"optimizer.lr": 1e-3}`, tuples as lists (TOML reads lists)."""
    return {
        f"{section}.{key}": list(value) if isinstance(value, tuple) else value
        for section, entries in values.items()
        if isinstance(entries, dict)
        for key, value in entries.items()
    }


def _shown(value: Any) -> str:
    return "(unset)" if value is None else toml_value(value)


def _same(before: Any, after: Any) -> bool:
    """Equal values, or two non-empty strings that name the same path from here (`os.path.realpath`)."""
    if before == after:
        return True
    strings = isinstance(before, str) and isinstance(after, str) and before and after
    return bool(strings) and os.path.realpath(before) == os.path.realpath(after)
