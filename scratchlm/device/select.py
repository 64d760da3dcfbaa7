"""Choosing the device a command runs on: "auto" or a name torch knows."""

from __future__ import annotations

import torch

from scratchlm.errors import ScratchlmError


def resolve_device(requested: str, option: str = "--device") -> torch.device:
    """ "auto" -> cuda, then mps, then cpu; anything else must name a device torch has. `option` names the
    setting the value came from in error messages (`training.device`, `--device`)."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ScratchlmError(
            f"{option} {requested!r} is not a device name (auto, cpu, cuda, cuda:1, mps)"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ScratchlmError(f"{option} is {requested!r} but CUDA is not available here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ScratchlmError(f"{option} is {requested!r} but MPS is not available here")
    return device
