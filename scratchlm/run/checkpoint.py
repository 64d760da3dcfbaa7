"""Checkpoints: everything needed to continue a run, or to use the model it trained. This module is their one
owner: the keys of the file are named here and nowhere else, `Checkpoint` is the typed content that training,
import, export, `eval` and `generate` all read and write, and `save_checkpoint` (with `load_checkpoint`,
`scratchlm.run.load`) is the interface of the CS336 assignment-1 handout to the same file. Reading a file is
here; which kind of checkpoint a path is (a file or a sharded one's directory), and loading any checkpoint into
a model, is `scratchlm.run.load`'s.

A checkpoint is one `torch.save`d dict:

    model         the model's state dict, under the handout's names (`layers.0.attn.q_proj.weight`, ...)
    optimizer     the optimizer's state dict (absent from an imported model, which has none)
    iteration     the number of optimizer steps taken
    model_config  `ModelConfig.to_dict()`, so the model can be rebuilt without the training config
    tokenizer_fingerprint
                  that of the tokenizer the model was trained or imported with, when known
    imported_from the directory an imported model was read from
    train_config, data_rng, torch_rng, cuda_rng, elapsed_s, tokens, precision, time_budget, loss_scale,
    lora          a LoRA run's adapters (`scratchlm.model.lora.Adapters.to_dict`: rank, alpha, targets, the base's
                  path and the fingerprint of its weights, `weights_fingerprint`); then `model` holds only the
                  run's trainable tensors (the adapters, and the embeddings when the vocabulary grew), and
                  the base's weights are read from the base (`scratchlm.run.load.read_weights`)
    world_size    what a training run adds (`TrainingState`): its config, the RNG and data-sampling states,
                  its time, what `precision = "auto"` resolved to, the time budget's decision, in fp16 the
                  loss scaler's state, and the number of processes that saved it. A checkpoint has a training
                  state when it has a `train_config`; `elapsed_s` and `tokens` are in every checkpoint (0 for
                  an imported model)

A run that shards its model (`training.parallel = "fsdp"`) saves a checkpoint as a directory instead, each
process writing its shards of the model and the optimizer (`scratchlm.run.sharded`); its other entries are the
ones above, in a file of this format inside it. `Checkpoint.read` reads a file; `scratchlm.run.load.read_any`
reads either kind.

Compiled (`torch.compile`) and data-parallel (`DistributedDataParallel`) models wrap the real module and prefix
its parameter names with `_orig_mod.` and `module.`; the checkpoint always stores the unwrapped names, so it
loads into a plain model, and names with such prefixes are stripped on load. Saving to a path is atomic: a
crash mid-write never leaves a truncated checkpoint under the real name. Checkpoints hold only tensors and
plain Python values, so they load with `weights_only=True` (no code runs when reading one).

A checkpoint also carries `sha256`, a digest of its content (every tensor's dtype, shape and bytes and every
plain value, in order), checked when it is read: bytes damaged on disk or in transit would otherwise load
without complaint, since nothing in the file format checks the tensor data, and training would go on from
garbage. The digest is computed from the values rather than from the file, so it does not depend on how
`torch.save` lays them out. Checkpoints written before it existed load unchecked.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write
from scratchlm.model.config import ModelConfig
from scratchlm.model.lora import adapters_of, trainable_state

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
CHECKSUM_KEY = "sha256"
# The keys of the checkpoint dict (the module docstring): a field of `Checkpoint` or its `TrainingState` each.
MODEL, OPTIMIZER, STEP, MODEL_CONFIG = "model", "optimizer", "iteration", "model_config"
TRAIN_CONFIG, TOKENIZER_FINGERPRINT, PRECISION, TIME_BUDGET = (
    "train_config",
    "tokenizer_fingerprint",
    "precision",
    "time_budget",
)
DATA_RNG, TORCH_RNG, CUDA_RNG, ELAPSED, TOKENS = "data_rng", "torch_rng", "cuda_rng", "elapsed_s", "tokens"
IMPORTED_FROM, LOSS_SCALE, WORLD_SIZE = "imported_from", "loss_scale", "world_size"
LORA = "lora"


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / torch.compile wrappers (in any nesting)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`module._orig_mod.lm_head.weight` -> `lm_head.weight`."""
    clean = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        clean[key] = value
    return clean


def save_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    iteration: int,
    out: str | os.PathLike | IO[bytes],
    **extra: Any,
) -> None:
    """Write model, optimizer, iteration (and `extra` entries) to `out`, a path (atomically) or a binary file."""
    model = unwrap_model(model)
    state: dict[str, Any] = {
        MODEL: model.state_dict(),
        OPTIMIZER: optimizer.state_dict(),
        STEP: int(iteration),
    }
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        state[MODEL_CONFIG] = config.to_dict()
    state.update(extra)
    _write(state, out)


def _write(state: dict[str, Any], out: str | os.PathLike | IO[bytes]) -> None:
    state[CHECKSUM_KEY] = content_digest(state)
    if isinstance(out, str | os.PathLike):
        with atomic_write(out, "wb") as f:
            writer = _Writer(f)
            try:
                torch.save(state, writer)
            except RuntimeError:
                # torch.save turns the OSError of a failed write (a full disk) into an opaque RuntimeError;
                # the OSError itself is what `atomic_write` reports as a one-line fault.
                if writer.error is not None:
                    raise writer.error from None
                raise
    else:
        torch.save(state, out)


class _Writer:
    """A file for `torch.save` that keeps the OSError of a failed write, which torch.save hides."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.error = file, None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.file.flush()


def read_checkpoint(src: str | os.PathLike | IO[bytes]) -> dict[str, Any]:
    """The checkpoint dict, on the CPU; a one-line error naming the file for a missing, empty, truncated or
    foreign one."""
    if isinstance(src, str | os.PathLike):
        path = Path(src)
        if not path.exists():
            raise ScratchlmError(f"checkpoint {src} not found")
        if not path.is_file():
            raise ScratchlmError(f"checkpoint {src} is not a file")
        if path.stat().st_size == 0:
            raise ScratchlmError(f"checkpoint {src} is empty (0 bytes): not a checkpoint")
    try:
        state = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused the content: another format, or arbitrary objects
        raise ScratchlmError(
            f"checkpoint {src} is not a scratchlm checkpoint (not a PyTorch file of tensors and plain values)"
        ) from None
    except Exception:
        # A truncated or corrupt archive: torch raises whatever its reader met first (an OSError "[Errno 22]",
        # a KeyError "255", miniz's "failed finding central directory"), none of which says what is wrong.
        raise ScratchlmError(
            f"checkpoint {src} is not a complete checkpoint (truncated or corrupt): PyTorch cannot read its "
            "archive; use an earlier checkpoint"
        ) from None
    if not isinstance(state, dict) or MODEL not in state:
        raise ScratchlmError(f"checkpoint {src} is not a scratchlm checkpoint (no 'model' entry)")
    recorded = state.pop(CHECKSUM_KEY, None)
    if recorded is not None and recorded != content_digest(state):
        raise ScratchlmError(
            f"checkpoint {src} is damaged: its content does not match the checksum saved with it"
        )
    return state


def content_digest(state: dict[str, Any]) -> str:
    """The SHA-256 of a checkpoint's content (see the module docstring), as hex."""
    digest = hashlib.sha256()
    _hash_value(digest, state)
    return digest.hexdigest()


def _hash_value(digest: Any, value: Any) -> None:
    """Feed `value` into `digest`: type and shape first, so that differently nested values never collide."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest.update(f"tensor {data.dtype} {tuple(data.shape)}\n".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)}\n".encode())
        for key, item in value.items():
            _hash_value(digest, key)
            _hash_value(digest, item)
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__} {len(value)}\n".encode())
        for item in value:
            _hash_value(digest, item)
    else:
        digest.update(f"{type(value).__name__} {value!r}\n".encode())


@dataclass
class TrainingState:
    """What a training run adds to its model: what continues the run exactly (`scratchlm.training.start`)."""

    config: dict[str, Any]  # TrainConfig.to_dict()
    data_rng: dict[str, Any] | None = None  # the data-sampling generator's state after `step` steps
    torch_rng: torch.Tensor | None = None
    cuda_rng: torch.Tensor | None = None
    elapsed_s: float = 0.0  # seconds of training over all sessions
    tokens: int = 0
    precision: str | None = None  # what training.precision resolved to
    time_budget: dict[str, Any] | None = None  # the time budget's decision (scratchlm.training.budget)
    loss_scale: dict[str, Any] | None = None  # fp16: the loss scaler's state (scratchlm.training.loss_scale)
    world_size: int | None = None  # the processes that trained it (None: not recorded)

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> TrainingState | None:
        """The training state of a checkpoint dict; None for one without (an imported model)."""
        if TRAIN_CONFIG not in state:  # a training run always records its config
            return None
        return cls(
            config=state[TRAIN_CONFIG],
            data_rng=state.get(DATA_RNG),
            torch_rng=state.get(TORCH_RNG),
            cuda_rng=state.get(CUDA_RNG),
            elapsed_s=float(state.get(ELAPSED, 0.0)),
            tokens=int(state.get(TOKENS, 0)),
            precision=state.get(PRECISION),
            time_budget=state.get(TIME_BUDGET),
            loss_scale=state.get(LOSS_SCALE),
            world_size=state.get(WORLD_SIZE),
        )


@dataclass
class Checkpoint:
    """The typed content of a checkpoint file. `read` converts any checkpoint scratchlm has written (a key it
    lacks takes its default), so the rest of the code never looks at the dict."""

    model: dict[str, torch.Tensor]  # the state dict, unwrapped names
    step: int
    model_config: ModelConfig
    optimizer: dict[str, Any] | None = None  # None: an imported model, which has none
    tokenizer_fingerprint: str | None = (
        None  # that of the tokenizer it was trained or imported with, if known
    )
    imported_from: str | None = None  # the directory an imported model was read from
    training: TrainingState | None = None  # None: an imported model
    lora: dict[str, Any] | None = None  # a LoRA run's adapters and base (`Adapters.to_dict`); None: none
    # A sharded checkpoint's directory, when its model and optimizer were left there to be read into a model
    # by each process, its own shards (`scratchlm.run.load`); None: `model` and `optimizer` hold them. Not a
    # key of the file.
    shards: Path | None = None

    @property
    def tokenizer_dir(self) -> str | None:
        """The tokenizer directory the run's training config named (`data.tokenizer`), if any."""
        data = (self.training.config.get("data") if self.training else None) or {}
        return data.get("tokenizer") or None

    @classmethod
    def of(cls, model: torch.nn.Module, step: int, **fields: Any) -> Checkpoint:
        """The checkpoint of `model` (unwrapped from compile / DDP) at `step`, with `fields`; of an adapted
        model (`scratchlm.model.lora`), its trainable tensors only and its adapters' record."""
        model = unwrap_model(model)
        if (adapters := adapters_of(model)) is not None:
            state, lora = trainable_state(model), adapters.to_dict()
            return cls(state, int(step), model.config, lora=lora, **fields)  # type: ignore[arg-type]
        return cls(model.state_dict(), int(step), model.config, **fields)  # type: ignore[arg-type]

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a failure leaves no file under `path`."""
        _write(self.to_dict(), path)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint dict (the module docstring), without its checksum."""
        state: dict[str, Any] = {
            MODEL: self.model,
            STEP: self.step,
            MODEL_CONFIG: self.model_config.to_dict(),
        }
        training = self.training or TrainingState({})  # an imported model: no config, 0 s and 0 tokens
        optional = {
            OPTIMIZER: self.optimizer,
            TRAIN_CONFIG: training.config or None,
            TOKENIZER_FINGERPRINT: self.tokenizer_fingerprint,
            DATA_RNG: training.data_rng,
            TORCH_RNG: training.torch_rng,
            CUDA_RNG: training.cuda_rng,
            ELAPSED: training.elapsed_s,
            TOKENS: training.tokens,
            PRECISION: training.precision,
            TIME_BUDGET: training.time_budget,
            IMPORTED_FROM: self.imported_from,
            LOSS_SCALE: training.loss_scale,
            WORLD_SIZE: training.world_size,
            LORA: self.lora,
        }
        state.update({key: value for key, value in optional.items() if value is not None})
        return state

    @classmethod
    def read(cls, path: str | os.PathLike) -> Checkpoint:
        """The checkpoint file at `path`, checked (see `read_checkpoint`); one without a model config cannot
        be used on its own and is refused, naming the file. (A sharded checkpoint's directory, or either:
        `scratchlm.run.load.read_any`.)"""
        return cls.from_dict(read_checkpoint(path), path)

    @classmethod
    def from_dict(cls, state: dict[str, Any], path: str | os.PathLike) -> Checkpoint:
        """The checkpoint of a checkpoint dict read from `path` (named in errors)."""
        if MODEL_CONFIG not in state:
            raise ScratchlmError(f"checkpoint {path} has no model_config; cannot rebuild the model")
        return cls(
            model=strip_wrapper_prefixes(state[MODEL]),
            step=int(state[STEP]),
            model_config=ModelConfig.from_dict(state[MODEL_CONFIG]),
            optimizer=state.get(OPTIMIZER),
            tokenizer_fingerprint=state.get(TOKENIZER_FINGERPRINT),
            imported_from=state.get(IMPORTED_FROM),
            training=TrainingState.from_checkpoint(state),
            lora=state.get(LORA),
        )

    def weights_fingerprint(self) -> str:
        """A digest of the model's config and weights (`content_digest`), which names exactly these weights: a
        LoRA run records its base's, and refuses a base whose weights have changed since."""
        return content_digest({MODEL_CONFIG: self.model_config.to_dict(), MODEL: self.model})
