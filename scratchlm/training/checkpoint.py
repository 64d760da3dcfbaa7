"""Checkpoints: everything needed to continue a run, or to use the model it trained.

A checkpoint is one `torch.save`d dict:

    model         the model's state dict, under the specification's names (`layers.0.attn.q_proj.weight`, ...)
    optimizer     the optimizer's state dict (AdamW moments and step counts)
    iteration     the number of optimizer steps taken
    model_config  `ModelConfig.to_dict()`, so the model can be rebuilt without the training config
    ...           whatever the caller adds (the trainer adds the train config, RNG states, elapsed time)

Compiled (`torch.compile`) and data-parallel (`DistributedDataParallel`) models wrap the real module and prefix
its parameter names with `_orig_mod.` and `module.`; the checkpoint always stores the unwrapped names, so it
loads into a plain model, and names with such prefixes are stripped on load. Saving to a path is atomic: a
crash mid-write never leaves a truncated checkpoint under the real name. Checkpoints hold only tensors and
plain Python values, so they load with `weights_only=True` (no code runs when reading one).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import IO, Any

import torch

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
CHECKPOINT_NAME = re.compile(r"step_(\d+)\.pt")


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
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "iteration": int(iteration),
    }
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        state["model_config"] = config.to_dict()
    state.update(extra)
    if isinstance(out, str | os.PathLike):
        with atomic_write(out, "wb") as f:
            torch.save(state, f)
    else:
        torch.save(state, out)


def read_checkpoint(src: str | os.PathLike | IO[bytes]) -> dict[str, Any]:
    """The checkpoint dict, on the CPU; a clear error for a missing or unreadable file."""
    if isinstance(src, str | os.PathLike) and not Path(src).is_file():
        raise ScratchlmError(f"checkpoint {src} not found")
    try:
        state = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch raises several types
        raise ScratchlmError(f"checkpoint {src} could not be read: {e}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise ScratchlmError(f"checkpoint {src} is not a scratchlm checkpoint (no 'model' entry)")
    return state


def load_checkpoint(
    src: str | os.PathLike | IO[bytes] | dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Restore model (and optimizer) state from `src` (a path, a binary file or a read dict); return the iteration."""
    state = src if isinstance(src, dict) else read_checkpoint(src)
    try:
        unwrap_model(model).load_state_dict(strip_wrapper_prefixes(state["model"]))
    except RuntimeError as e:
        raise ScratchlmError(f"checkpoint does not fit the model: {e}") from None
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's checkpoints, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := CHECKPOINT_NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The run's most recent checkpoint, or None when it has none."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> None:
    """Delete all but the `keep` most recent checkpoints."""
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)


def load_model(path_or_run_dir: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Any, dict]:
    """Rebuild a trained model from a checkpoint file or a run directory (its latest checkpoint).

    Returns the model in eval mode on `device`, and the checkpoint's train config dict (empty when absent).
    """
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import TransformerLM

    path = Path(path_or_run_dir)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise ScratchlmError(
                f"run directory {path} has no checkpoints (expected {checkpoint_dir(path)}/step_*.pt)"
            )
        path = found
    state = read_checkpoint(path)
    if "model_config" not in state:
        raise ScratchlmError(f"checkpoint {path} has no model_config; cannot rebuild the model")
    model = TransformerLM.from_config(ModelConfig.from_dict(state["model_config"]), device=device)
    load_checkpoint(state, model)
    model.eval()
    return model, state.get("train_config", {})
