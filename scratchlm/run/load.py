"""Loading a trained model, and the tokenizer it was trained with, for inference (`generate`, `eval`, ...).

A model is found from a run directory (its latest checkpoint) or a checkpoint (a file, or a sharded one's
directory, consolidated here: `scratchlm.run.sharded`), rebuilt from the
`model_config` the checkpoint carries, and put in eval mode. Its tokenizer is, in this order: the one given,
the copy in the run directory (`RUN/tokenizer/`, written when training starts), or the directory the training
config names. A checkpoint records the fingerprint of the tokenizer it was trained with
(`Tokenizer.fingerprint`); any other tokenizer is refused, since it would map the model's ids to other text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.text import Text

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import Checkpoint
from scratchlm.run.directory import RunDirectory
from scratchlm.run.sharded import is_sharded_checkpoint
from scratchlm.tokenizer.tokenizer import Tokenizer


@dataclass
class TrainedModel:
    model: TransformerLM  # in eval mode
    tokenizer: Tokenizer | None  # None when none was given or found
    checkpoint: Path
    train_config: dict[str, Any]  # the checkpoint's training config (empty when it has none)
    tokenizer_fingerprint: str | None  # that of the tokenizer the model was trained with, when recorded
    precision: str | None = None  # what its training's precision resolved to, when recorded
    recorded_tokenizer: str | None = None  # the tokenizer directory its training config named, if any


def find_checkpoint(source: str | os.PathLike) -> tuple[Path, RunDirectory | None]:
    """The checkpoint `source` names (a run directory: its latest checkpoint), and its run directory (that of
    a checkpoint is the directory above its `checkpoints/`, if there is one)."""
    path = Path(source)
    if path.is_dir() and not is_sharded_checkpoint(path):
        run = RunDirectory(path)
        found = run.latest_checkpoint()
        if found is None:
            raise ScratchlmError(
                f"run directory {path} has no checkpoints (expected {run.checkpoints_dir}/step_*.pt "
                "or a sharded step_*/)"
            )
        return found, run
    if not path.exists():
        raise ScratchlmError(f"{path} not found: expected a run directory or a checkpoint file")
    parent = path.resolve().parent
    return path, RunDirectory(parent.parent) if parent.name == "checkpoints" else None


def load_trained(
    source: str | os.PathLike,
    device: str | torch.device = "cpu",
    tokenizer: str | os.PathLike | Tokenizer | None = None,
) -> TrainedModel:
    """The model of a run directory or checkpoint file, with its tokenizer (see the module docstring)."""
    path, run = find_checkpoint(source)
    trained = _load(path, run, device)
    if isinstance(tokenizer, Tokenizer):
        trained.tokenizer, origin = tokenizer, "the given tokenizer"
    else:
        candidates = [tokenizer] if tokenizer is not None else []
        if tokenizer is None and run is not None:
            candidates.append(run.tokenizer_dir)
        if tokenizer is None:
            candidates.append(trained.recorded_tokenizer)
        found = next((Path(c) for c in candidates if c and Path(c).is_dir()), None)
        if tokenizer is not None and found is None:
            raise ScratchlmError(f"tokenizer directory {tokenizer} not found")
        if found is None:
            return trained
        trained.tokenizer, origin = Tokenizer.from_dir(found), f"the tokenizer in {found}"
    _check_pair(trained, origin)
    return trained


def _load(path: Path, run: RunDirectory | None, device: str | torch.device) -> TrainedModel:
    checkpoint = Checkpoint.read(path)
    model = TransformerLM(checkpoint.model_config, device=device)
    checkpoint.load_into(model)
    model.eval()
    training = checkpoint.training
    return TrainedModel(
        model,
        None,
        path,
        training.config if training is not None else {},
        checkpoint.tokenizer_fingerprint,
        training.precision if training is not None else None,
        checkpoint.tokenizer_dir,
    )


def check_pair(
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    fingerprint: str | None = None,
    tokenizer_name: str = "the tokenizer",
    model_name: str = "the model",
) -> None:
    """Refuse a tokenizer that does not belong to a model: one with more tokens than the model's vocabulary
    (its ids would index past the embedding), or, when the model's checkpoint recorded the `fingerprint` of
    the tokenizer it was trained with, any other one (it would map the model's ids to other text). Training,
    `init_from`, loading a trained model and `import-hf` all check here."""
    if fingerprint is not None and tokenizer.fingerprint != fingerprint:
        raise ScratchlmError(
            f"{tokenizer_name} is not the one {model_name} was trained with (their vocabularies or merges "
            "differ); pass the run's tokenizer with --tokenizer DIR"
        )
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ScratchlmError(
            f"{tokenizer_name} has {tokenizer.vocab_size} tokens, more than the vocabulary of {model_name} "
            f"({model_config.vocab_size}): they do not belong together"
        )


def _check_pair(trained: TrainedModel, origin: str) -> None:
    """Refuse a tokenizer the model was not trained with; warn of one whose fit is not recorded."""
    tokenizer, vocab_size = trained.tokenizer, trained.model.config.vocab_size
    assert tokenizer is not None
    recorded = trained.tokenizer_fingerprint
    check_pair(trained.model.config, tokenizer, recorded, origin, f"the model in {trained.checkpoint}")
    if recorded is None and tokenizer.vocab_size < vocab_size:
        console.print(
            Text.assemble(
                ("warning:", "yellow"),
                f" {trained.checkpoint} records no tokenizer and {origin} has {tokenizer.vocab_size} tokens "
                f"for a model of {vocab_size}; make sure they belong together",
            )
        )
