"""What a training run reads: its token files and its tokenizer, checked before anything is written."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scratchlm.data.tokens import load_tokens
from scratchlm.errors import ScratchlmError
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import check_pair
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.config import TrainConfig


@dataclass(frozen=True)
class TrainingData:
    """What a run reads: the training and validation tokens (memory-mapped, checked against the model's
    vocabulary) and the tokenizer of `data.tokenizer`, if set, checked against the model and against the copy
    in the run directory, which a resumed run must not change."""

    train: np.ndarray
    valid: np.ndarray
    tokenizer: Tokenizer | None


def load_training_data(config: TrainConfig, run_dir: RunDirectory) -> TrainingData:
    m = config.model
    train_tokens = load_tokens(config.data.train, m.vocab_size, m.context_length)
    valid_tokens = load_tokens(config.data.valid, m.vocab_size, m.context_length)
    return TrainingData(train_tokens, valid_tokens, _load_tokenizer(config, run_dir))


def _load_tokenizer(config: TrainConfig, run_dir: RunDirectory) -> Tokenizer | None:
    if not config.data.tokenizer:
        return None
    tokenizer = Tokenizer.from_dir(config.data.tokenizer)
    check_pair(config.model, tokenizer, None, f"data.tokenizer {config.data.tokenizer}", "[model]")
    copy = run_dir.tokenizer_dir
    if copy.is_dir() and Tokenizer.from_dir(copy).fingerprint != tokenizer.fingerprint:
        raise ScratchlmError(
            f"data.tokenizer {config.data.tokenizer} is not the tokenizer this run was trained with "
            f"({copy}); use another logging.run_dir"
        )
    return tokenizer
