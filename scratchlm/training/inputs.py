"""Pretraining's stage: its `[data]` section, and what it reads, checked before anything is written: the
training and validation token files, as windows (`scratchlm.data.tokens.TokenWindows`), and the tokenizer that
made them, if the config names one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.data.tokens import TokenWindows, load_tokens
from scratchlm.errors import ScratchlmError
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import check_pair
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.stage import PRETRAINING, Stage, TrainingData, check_run_tokenizer, register_stage

if TYPE_CHECKING:
    from scratchlm.training.config import TrainConfig


@dataclass(frozen=True)
class DataConfig:
    train: str = ""  # training tokens (.npy); required
    valid: str = ""  # validation tokens (.npy); required
    tokenizer: str | None = None  # tokenizer directory, recorded for generation

    def check(self, source: str) -> None:
        for key in ("train", "valid"):
            if not getattr(self, key):
                raise ScratchlmError(f"{source}: data.{key} is required (a .npy file of token ids)")


def load_token_windows(config: TrainConfig, run_dir: RunDirectory) -> TrainingData:
    """Windows of the token files of `[data]`, checked against the model's vocabulary, and its tokenizer."""
    m = config.model
    train_tokens = load_tokens(config.data.train, m.vocab_size, m.context_length)
    valid_tokens = load_tokens(config.data.valid, m.vocab_size, m.context_length)
    return TrainingData(
        TokenWindows(train_tokens, m.context_length),
        TokenWindows(valid_tokens, m.context_length),
        _load_tokenizer(config, run_dir),
    )


register_stage(Stage(PRETRAINING, DataConfig, load_token_windows))


def _load_tokenizer(config: TrainConfig, run_dir: RunDirectory) -> Tokenizer | None:
    if not config.data.tokenizer:
        return None
    if not Path(config.data.tokenizer).is_dir():
        raise ScratchlmError(
            f"data.tokenizer {config.data.tokenizer} is not a directory: set it to the tokenizer that made the "
            'token files (--set data.tokenizer=DIR; `scratchlm prepare` writes one beside them), or to "" '
            "to train without one"
        )
    tokenizer = Tokenizer.from_dir(config.data.tokenizer)
    check_pair(config.model, tokenizer, None, f"data.tokenizer {config.data.tokenizer}", "[model]")
    check_run_tokenizer(tokenizer, f"data.tokenizer {config.data.tokenizer}", run_dir)
    return tokenizer
