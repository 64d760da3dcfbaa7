"""Loading checkpoints: the one way any checkpoint goes into a model, and a trained model, with the tokenizer it
was trained with, for inference (`generate`, `eval`, ...).

A checkpoint is a file (`scratchlm.run.checkpoint`) or a sharded one's directory (`scratchlm.run.sharded`);
`read_any` is the one place that tells them apart, reading a directory consolidated into this process or,
for a resume, leaving its shards to be read by each process. `load_checkpoint` then puts any checkpoint into
a model (and optimizer), sharded or not: it is also the CS336 assignment-1 handout's `load_checkpoint(src, model, optimizer)`.

A trained model is found from a run directory (its latest checkpoint) or a checkpoint, rebuilt from the
`model_config` the checkpoint carries, and put in eval mode. Its tokenizer is, in this order: the one given,
the copy in the run directory (`RUN/tokenizer/`, written when training starts), or the directory the training
config names. A checkpoint records the fingerprint of the tokenizer it was trained with
(`Tokenizer.fingerprint`); any other tokenizer is refused, since it would map the model's ids to other text.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from rich.text import Text

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.lora import Adapters, adapters_of, apply_lora, load_trainable, merge_lora
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import (
    MODEL,
    OPTIMIZER,
    STEP,
    Checkpoint,
    read_checkpoint,
    strip_wrapper_prefixes,
    unwrap_model,
)
from scratchlm.run.directory import RunDirectory
from scratchlm.run.sharded import (
    consolidate,
    is_sharded_checkpoint,
    is_sharded_model,
    load_shards,
    read_state,
    set_full_state,
)
from scratchlm.tokenizer.tokenizer import Tokenizer


def read_any(path: str | os.PathLike, whole: bool = True) -> Checkpoint:
    """The checkpoint at `path`, a file or a sharded checkpoint's directory, checked. A directory's model and
    optimizer are read whole into this process (`consolidate`), or, when not `whole`, left for
    `load_checkpoint` to read into a model, each process its own shards (`Checkpoint.shards`): a resume."""
    if Path(path).is_dir():
        return consolidate(path) if whole else read_state(path)
    return Checkpoint.read(path)


def load_checkpoint(
    src: str | os.PathLike | IO[bytes] | Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Load `src` (a checkpoint read, or a path or binary file to read: `read_any`) into `model` (and
    `optimizer`), sharded or not: whole tensors go into a plain model directly and into a sharded one through
    `set_full_state`, each process keeping its shards; a sharded checkpoint's shards are read by each process
    (`load_shards`). Returns the checkpoint's step (the handout's iteration)."""
    if isinstance(src, Checkpoint):
        checkpoint = src
    elif isinstance(src, str | os.PathLike) and Path(src).is_dir():
        checkpoint = read_any(src, whole=False)
    else:
        # A file, read as its dict: the handout's `save_checkpoint` of a model without a config records none,
        # which `Checkpoint` needs, and here the model is given.
        state = read_checkpoint(src)
        _load_whole(model, state[MODEL], optimizer, state.get(OPTIMIZER))
        return int(state[STEP])
    if checkpoint.shards is not None:
        load_shards(checkpoint.shards, model, optimizer)
    elif checkpoint.lora is not None or adapters_of(unwrap_model(model)) is not None:
        _load_adapters(checkpoint, unwrap_model(model), optimizer)
    else:
        _load_whole(model, checkpoint.model, optimizer, checkpoint.optimizer)
    return checkpoint.step


def _load_whole(
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    optimizer_state: dict[str, Any] | None,
) -> None:
    if optimizer is not None and optimizer_state is None:
        raise ScratchlmError("checkpoint has no optimizer state (an imported model): start a new run from it")
    if is_sharded_model(model):
        set_full_state(model, model_state, optimizer, optimizer_state)
        return
    try:
        unwrap_model(model).load_state_dict(strip_wrapper_prefixes(model_state))
    except RuntimeError as e:
        raise ScratchlmError(f"checkpoint does not fit the model: {e}") from None
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)


def _load_adapters(
    checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A LoRA run's checkpoint into the adapted model of its resumed run: the adapters (and whatever else it
    trains) and their optimizer state, on a base that must be the one they were trained on."""
    ours = adapters_of(model)
    if ours is None or checkpoint.lora is None:
        held = "holds LoRA adapters" if checkpoint.lora is not None else "holds a whole model"
        raise ScratchlmError(
            f"checkpoint (step {checkpoint.step}) {held}, the model "
            + ("has none" if ours is None else "is adapted")
        )
    recorded = Adapters.from_dict(checkpoint.lora)
    if recorded.base_fingerprint != ours.base_fingerprint:
        raise ScratchlmError(
            f"the LoRA base {ours.base} is not the one the adapters (step {checkpoint.step}) were trained on: "
            f"its weights fingerprint {ours.base_fingerprint[:12]}, recorded {recorded.base_fingerprint[:12]}"
        )
    load_trainable(model, checkpoint.model, f"checkpoint (step {checkpoint.step})")
    if optimizer is not None:
        if checkpoint.optimizer is None:
            raise ScratchlmError("checkpoint has no optimizer state: start a new run from it")
        optimizer.load_state_dict(checkpoint.optimizer)


def read_weights(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at `path` with its model's whole weights: a LoRA run's adapters merged into its base
    (`W + (α/r) B A`), which is read from where the run recorded it and must still hold the weights they
    were trained on (a fingerprint of them). Any other checkpoint as `read_any` reads it."""
    return merged(read_any(path), path)


def merged(checkpoint: Checkpoint, path: str | os.PathLike) -> Checkpoint:
    """`checkpoint` (read from `path`) with whole weights: `read_weights`."""
    if checkpoint.lora is None:
        return checkpoint
    adapters = Adapters.from_dict(checkpoint.lora)
    if not Path(adapters.base).exists():
        raise ScratchlmError(
            f"{path}: its LoRA base {adapters.base} is not found (moved or deleted?): the adapters need the "
            "weights they were trained on"
        )
    base = read_weights(find_checkpoint(adapters.base)[0])  # a base may itself be a LoRA run
    if base.weights_fingerprint() != adapters.base_fingerprint:
        raise ScratchlmError(
            f"{path}: its LoRA base {adapters.base} has changed since the adapters were trained on it (its "
            "weights' fingerprint differs from the one recorded)"
        )
    model = TransformerLM(checkpoint.model_config, device="cpu")
    trained = checkpoint.model  # the adapters, and the embeddings when the vocabulary grew
    model.load_state_dict(base.model | {k: v for k, v in trained.items() if k in base.model})
    apply_lora(model, adapters, train=tuple(k for k in trained if k in base.model))
    load_trainable(model, trained, str(path))
    merge_lora(model)
    console.print(
        f"{path}: LoRA adapters (rank {adapters.config.rank}) merged into their base {adapters.base}"
    )
    return dataclasses.replace(checkpoint, model=model.state_dict(), lora=None)


@dataclass
class TrainedModel:
    """A trained model loaded for inference, with what its checkpoint says about its training."""

    model: TransformerLM  # in eval mode
    tokenizer: Tokenizer | None  # None when none was given or found
    checkpoint: Path
    train_config: dict[str, Any]  # the checkpoint's training config (empty when it has none)
    tokenizer_fingerprint: str | None  # that of the tokenizer the model was trained with, when recorded
    precision: str | None = None  # what its training's precision resolved to, when recorded
    recorded_tokenizer: str | None = None  # the tokenizer directory its training config named, if any
    lora: dict[str, Any] | None = None  # a LoRA run's adapters record (`Adapters.to_dict`), merged at load


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
    checkpoint = read_any(path)
    lora = checkpoint.lora
    checkpoint = merged(checkpoint, path)
    model = TransformerLM(checkpoint.model_config, device=device)
    load_checkpoint(checkpoint, model)
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
        lora,
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
