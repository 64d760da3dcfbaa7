"""Loading a trained model, and the tokenizer it was trained with, for inference (`generate`, `eval`, ...).

A model is found from a run directory (its latest checkpoint) or a checkpoint file, rebuilt from the
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
from scratchlm.run.directory import RunDirectory
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.checkpoint import load_checkpoint, read_checkpoint

TOKENIZER_DIR = "tokenizer"  # the run directory's copy of its tokenizer


@dataclass
class TrainedModel:
    model: TransformerLM  # in eval mode
    tokenizer: Tokenizer | None  # None when none was given or found
    checkpoint: Path
    train_config: dict[str, Any]  # the checkpoint's training config (empty when it has none)
    tokenizer_fingerprint: str | None  # that of the tokenizer the model was trained with, when recorded


def find_checkpoint(source: str | os.PathLike) -> tuple[Path, RunDirectory | None]:
    """The checkpoint file `source` names (a run directory: its latest checkpoint), and its run directory
    (that of a checkpoint file is the directory above its `checkpoints/`, if there is one)."""
    path = Path(source)
    if path.is_dir():
        run = RunDirectory(path)
        found = run.latest_checkpoint()
        if found is None:
            raise ScratchlmError(
                f"run directory {path} has no checkpoints (expected {run.checkpoints_dir}/step_*.pt)"
            )
        return found, run
    if not path.exists():
        raise ScratchlmError(f"{path} not found: expected a run directory or a checkpoint file")
    parent = path.resolve().parent
    return path, RunDirectory(parent.parent) if parent.name == "checkpoints" else None


def load_model(
    path_or_run_dir: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[TransformerLM, dict]:
    """Rebuild a trained model from a checkpoint file or a run directory (its latest checkpoint).

    Returns the model in eval mode on `device`, and the checkpoint's train config dict (empty when absent)."""
    trained = _load(*find_checkpoint(path_or_run_dir), device)
    return trained.model, trained.train_config


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
            candidates.append(run.path / TOKENIZER_DIR)
        if tokenizer is None:
            candidates.append(trained.train_config.get("data", {}).get("tokenizer"))
        found = next((Path(c) for c in candidates if c and Path(c).is_dir()), None)
        if tokenizer is not None and found is None:
            raise ScratchlmError(f"tokenizer directory {tokenizer} not found")
        if found is None:
            return trained
        trained.tokenizer, origin = Tokenizer.from_dir(found), f"the tokenizer in {found}"
    _check_pair(trained, origin)
    return trained


def _load(path: Path, run: RunDirectory | None, device: str | torch.device) -> TrainedModel:
    state = read_checkpoint(path)
    if "model_config" not in state:
        raise ScratchlmError(f"checkpoint {path} has no model_config; cannot rebuild the model")
    model = TransformerLM.from_config(ModelConfig.from_dict(state["model_config"]), device=device)
    load_checkpoint(state, model)
    model.eval()
    return TrainedModel(model, None, path, state.get("train_config", {}), state.get("tokenizer_fingerprint"))


def _check_pair(trained: TrainedModel, origin: str) -> None:
    """Refuse a tokenizer the model was not trained with."""
    tokenizer, vocab_size = trained.tokenizer, trained.model.config.vocab_size
    recorded = trained.tokenizer_fingerprint
    if recorded is not None and tokenizer.fingerprint != recorded:
        raise ScratchlmError(
            f"{origin} is not the one the model in {trained.checkpoint} was trained with (their vocabularies or "
            "merges differ); pass the run's tokenizer with --tokenizer DIR"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ScratchlmError(
            f"{origin} has {tokenizer.vocab_size} tokens but the model in {trained.checkpoint} only {vocab_size}: "
            "they do not belong together (pass the run's tokenizer with --tokenizer DIR)"
        )
    if recorded is None and tokenizer.vocab_size < vocab_size:
        console.print(
            Text.assemble(
                ("warning:", "yellow"),
                f" {trained.checkpoint} records no tokenizer and {origin} has {tokenizer.vocab_size} tokens "
                f"for a model of {vocab_size}; make sure they belong together",
            )
        )
