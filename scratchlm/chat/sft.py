"""Supervised fine-tuning: a base run taught to chat on conversations, with the training loop underneath.

    base run (train or import-hf) + conversations (JSONL)
      -> the base's tokenizer with the chat template (and its special tokens, if it lacked them)
      -> the base's model, its vocabulary grown by those tokens' rows (`training.start.grow_vocabulary`)
      -> `train`, its batches conversations instead of windows of tokens, its loss counting the assistant's
         tokens only (`scratchlm.chat.conversations`)

A fine-tuning run is a training run whose stage is `SFT` (its config's `[sft]` section, registered here:
`scratchlm.training.stage`): the same run directory, metrics, plots, checkpoints, time budget and resume. Its `[model]` is the base's, filled in here (a config that sets
one is refused), and `training.init_from` is the base. `SFT_DEFAULTS` are the settings that differ from
pretraining's; the config file and `--set` override them. The run's tokenizer carries the template
(`RUN/tokenizer/chat_template.jinja`), which is how the run records that it is a chat model, and which
template it speaks, for `scratchlm chat`, `serve` and the exports.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from scratchlm.chat.conversations import ConversationBatches, encode_conversations, read_conversations
from scratchlm.chat.template import ChatTemplate, with_chat_tokens
from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig, default_lora_targets
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import load_trained
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.config import TrainConfig
from scratchlm.training.config_reader import given_keys, read_toml
from scratchlm.training.stage import Stage, TrainingData, check_run_tokenizer, register_stage

# What fine-tuning changes from pretraining's defaults: no weight decay (a short run should move the base
# towards the format, not shrink what it knows), a rate decayed to a tenth. The optimizer and its groups' rates
# follow the base's recipe (`follow_base`), and the rate itself is measured (`scratchlm.chat.rate`) unless the
# user gives one; the `lr` here is the one a run takes when neither can be (a base without a recipe, and
# `sft.lr_sweep_fraction = 0`).
SFT_DEFAULTS: dict[str, dict] = {
    "optimizer": {"name": "adamw", "lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.0, "grad_clip": 1.0},
    "schedule": {"kind": "cosine", "warmup_iters": 20},
    "training": {"batch_size": 32, "max_steps": 1000},
    "eval": {"interval": 100, "iters": 8},
    "checkpoint": {"interval": 200},
    "logging": {"run_dir": "runs/sft", "log_interval": 10},
}

# The optimizer settings a fine-tuning run takes from its base's recipe when the user names no optimizer, so
# that a base trained with Muon is fine-tuned with Muon; and the group rates it keeps in the base's proportion
# to `lr` (the gains' rate), whatever `lr` is chosen.
RECIPE_KEYS = ("name", "betas", "eps", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_bf16")
GROUP_RATES = ("embedding_lr", "head_lr", "muon_lr")


@dataclass(frozen=True)
class SFTConfig:
    base: str = ""  # the run (or checkpoint) fine-tuned: one of train or import-hf
    train: str = ""  # conversations, JSONL in OpenAI's messages format; set: a fine-tuning run
    valid: str = ""  # held-out conversations; "": valid_fraction of train's, the same ones every time
    valid_fraction: float = 0.05
    # Filled in by `scratchlm sft`, the run's record of it: the chat template's special tokens the base's
    # tokenizer lacked, added with the next free ids, their embedding (and head) rows the mean of the others.
    added_tokens: tuple[str, ...] = ()
    # The rate, when the user gives no optimizer.lr: a short run at each candidate, the lowest held-out loss
    # chosen (`scratchlm.chat.rate`). The candidates are optimizer.lr's, the other groups' rates in proportion.
    lr_candidates: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2)
    lr_sweep_fraction: float = 0.25  # of the time budget (else of max_steps) the short runs share; 0: none
    # Filled in: how optimizer.lr was chosen ("given", "default", or the sweep's losses), the run's record.
    lr_chosen: str = ""

    def check(self, source: str) -> None:
        """Checks across keys."""
        if not self.train:
            raise ScratchlmError(
                f"{source}: sft.train is required: the conversations to fine-tune on (JSONL)"
            )
        if not self.base:
            raise ScratchlmError(f"{source}: sft.base is required (the run to fine-tune)")
        if not self.lr_candidates or not all(lr > 0 for lr in self.lr_candidates):
            raise ScratchlmError(
                f"{source}: sft.lr_candidates must be positive rates, got {list(self.lr_candidates)!r}"
            )
        if not 0 <= self.lr_sweep_fraction < 1:
            raise ScratchlmError(
                f"{source}: sft.lr_sweep_fraction must lie in [0, 1), got {self.lr_sweep_fraction!r}"
            )
        if not 0 < self.valid_fraction < 1:
            raise ScratchlmError(
                f"{source}: sft.valid_fraction must lie in (0, 1), got {self.valid_fraction!r}"
            )


VALID_SPLIT_SEED = 0  # the held-out conversations of a file without a valid file: the same ones every time

T = TypeVar("T")


def sft_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    flags: dict[str, tuple[str, Any]] | None = None,
) -> TrainConfig:
    """The fine-tuning config: `SFT_DEFAULTS`, the file at `path`, a command's `flags` (`TrainConfig.load`),
    the `overrides`, then the base's model (its vocabulary grown for the chat tokens) `training.init_from =
    sft.base` and `sft.added_tokens`."""
    if path is not None and "model" in read_toml(Path(path)):
        raise ScratchlmError(f"{path}: a fine-tuning config has no [model]: the model is sft.base's")
    if any(o.strip().startswith("model.") for o in overrides):
        raise ScratchlmError("--set model.*: a fine-tuning run's model is sft.base's")
    config = TrainConfig.load(path, overrides, defaults=SFT_DEFAULTS, flags=flags, stage="sft")
    base_model, tokenizer, added, base_optimizer = _base(config.sft.base)
    given = given_keys(path, overrides, flags)
    values = config.to_dict()
    values["model"] = base_model.to_dict() | {"vocab_size": max(base_model.vocab_size, tokenizer.vocab_size)}
    values["training"]["init_from"] = config.sft.base
    values["sft"]["added_tokens"] = added
    if "lora.targets" not in given:
        values["lora"]["targets"] = list(default_lora_targets(base_model))
    values["optimizer"] = follow_base(values["optimizer"], base_optimizer, given)
    if "optimizer.lr" in given:
        values["sft"]["lr_chosen"] = "given"
    elif not config.sft.lr_sweep_fraction:
        values["sft"]["lr_chosen"] = "default"
    return TrainConfig.from_dict(values, str(path) if path is not None else "sft config")


def follow_base(optimizer: dict[str, Any], base: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The `[optimizer]` values with the base's recipe (`base`: its run's `[optimizer]`, {} when it has
    none): its optimizer and settings (`RECIPE_KEYS`) and its groups' rates in the same proportion to `lr`,
    for each key the user did not set (`given`); all of it only when the user names no optimizer."""
    if not base or "optimizer.name" in given:
        return optimizer
    values = dict(optimizer)
    for key in RECIPE_KEYS:
        if key in base and f"optimizer.{key}" not in given:
            values[key] = base[key]
    for key in GROUP_RATES:
        if base.get(key) and base.get("lr") and f"optimizer.{key}" not in given:
            values[key] = base[key] / base["lr"] * values["lr"]
    return values


def at_rate(optimizer: dict[str, Any], lr: float, given: set[str] = frozenset()) -> dict[str, Any]:
    """The `[optimizer]` values with peak rate `lr`: every group's own rate (`GROUP_RATES`) and `min_lr`
    scaled with it, except the keys the user set (`given`)."""
    scale = lr / optimizer["lr"]
    values = dict(optimizer, lr=lr)
    own = GROUP_RATES if optimizer["name"] == "muon" else ("embedding_lr", "head_lr")  # muon_lr: Muon's alone
    scaled = [*own, "min_lr"]
    for key in scaled:
        if f"optimizer.{key}" not in given:
            values[key] = optimizer[key] * scale
    return values


def _base(base: str) -> tuple[ModelConfig, Tokenizer, list[str], dict[str, Any]]:
    """The base's model config, its tokenizer with the chat template, the special tokens added to it, and its
    training's `[optimizer]` ({} when it has none: an imported model)."""
    if not Path(base).exists():  # named as the command's flag and the config's key, which both set it
        raise ScratchlmError(
            f"--base (sft.base) {base}: not found: expected a run directory or a checkpoint file"
        )
    trained = load_trained(base, "cpu")
    if trained.tokenizer is None:
        raise ScratchlmError(
            f"sft.base {base} has no tokenizer (none in the run directory or its config): the conversations "
            "cannot be encoded"
        )
    tokenizer, added = with_chat_tokens(trained.tokenizer)
    return trained.model.config, tokenizer, added, dict(trained.train_config.get("optimizer", {}))


def held_out_split(items: list[T], fraction: float, one: str) -> tuple[list[T], list[T]]:
    """`items` split into those kept for training and `fraction` of them (at least one) held out for
    validation, the same ones every time (`VALID_SPLIT_SEED`); `one` names a single item, which cannot be
    split."""
    if len(items) < 2:
        raise ScratchlmError(f"{one} cannot be split into training and validation")
    order = np.random.default_rng(VALID_SPLIT_SEED).permutation(len(items))
    held_out = set(order[: max(1, math.ceil(len(items) * fraction))].tolist())
    return (
        [item for i, item in enumerate(items) if i not in held_out],
        [item for i, item in enumerate(items) if i in held_out],
    )


def load_conversations(config: TrainConfig, run_dir: RunDirectory) -> TrainingData:
    """The training and held-out conversations of `[sft]`, encoded with the chat template, and the tokenizer
    that carries it, which a resumed run must not have changed. Conversations cut or skipped for their length
    are reported."""
    s, context = config.sft, config.model.context_length
    train = read_conversations(s.train)
    if s.valid:
        valid = read_conversations(s.valid)
    else:
        train, valid = held_out_split(train, s.valid_fraction, f"{s.train}: one conversation")
    _, tokenizer, added, _ = _base(s.base)
    if added:
        console.print(f"the base's tokenizer lacks {', '.join(added)}: added for the chat template")
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ScratchlmError(
            f"the chat tokenizer has {tokenizer.vocab_size} tokens, more than [model]'s {config.model.vocab_size}"
        )
    template = ChatTemplate(tokenizer)
    batches = []
    for name, conversations in (("training", train), ("validation", valid)):
        encoded = encode_conversations(conversations, template, context)
        kept = len(encoded)
        line = f"{name}: {kept:,} conversations, {int(encoded.counted.sum()):,} assistant tokens"
        if encoded.cut or encoded.skipped:
            line += (
                f"; longer than the context ({context} tokens): {encoded.cut} cut after their last whole "
                f"assistant turn, {encoded.skipped} skipped"
            )
        console.print(line)
        batches.append(ConversationBatches(encoded))
    check_run_tokenizer(tokenizer, f"the chat tokenizer of sft.base {s.base}", run_dir)
    return TrainingData(batches[0], batches[1], tokenizer)


SFT = register_stage(Stage("sft", SFTConfig, load_conversations, grows_vocabulary=True))
