"""What a training run reads: its token files (or, fine-tuning, its conversations) and its tokenizer, checked
before anything is written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scratchlm.data.tokens import TokenWindows, load_tokens
from scratchlm.errors import ScratchlmError
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import check_pair
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.config import TrainConfig
from scratchlm.training.step import Batches


@dataclass(frozen=True)
class TrainingData:
    """What a run reads: its training and validation batches (windows of memory-mapped tokens checked against
    the model's vocabulary, or conversations) and its tokenizer (`data.tokenizer`, if set, or the base's with
    the chat template), checked against the model and the copy in the run directory, which a resumed run must
    not change."""

    train: Batches
    valid: Batches
    tokenizer: Tokenizer | None


def load_training_data(config: TrainConfig, run_dir: RunDirectory) -> TrainingData:
    """Token windows of `[data]`, or, for fine-tuning (`[sft]`), the conversations of `sft.train`."""
    if config.sft.train:
        from scratchlm.chat.sft import load_conversations

        train, valid, tokenizer = load_conversations(config)
        _check_run_copy(tokenizer, f"the chat tokenizer of sft.base {config.sft.base}", run_dir)
        return TrainingData(train, valid, tokenizer)
    m = config.model
    train_tokens = load_tokens(config.data.train, m.vocab_size, m.context_length)
    valid_tokens = load_tokens(config.data.valid, m.vocab_size, m.context_length)
    return TrainingData(
        TokenWindows(train_tokens, m.context_length),
        TokenWindows(valid_tokens, m.context_length),
        _load_tokenizer(config, run_dir),
    )


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
    _check_run_copy(tokenizer, f"data.tokenizer {config.data.tokenizer}", run_dir)
    return tokenizer


def _check_run_copy(tokenizer: Tokenizer, name: str, run_dir: RunDirectory) -> None:
    """A resumed run must not change its tokenizer."""
    copy = run_dir.tokenizer_dir
    if copy.is_dir() and Tokenizer.from_dir(copy).fingerprint != tokenizer.fingerprint:
        raise ScratchlmError(
            f"{name} is not the tokenizer this run was trained with ({copy}); use another logging.run_dir"
        )
