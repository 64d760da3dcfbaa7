"""Which device a command runs on ("auto" or a name torch knows: `resolve_device`), and what it is (`identity`:
its name and capabilities, as the device profile records them). A new kind of device starts here."""

from __future__ import annotations

from typing import Any

import torch

from scratchlm.device.host import cpu_name_and_flags
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


def identity(device: torch.device) -> dict[str, Any]:
    """The device's name and capabilities, as `DeviceProfile`'s fields of those names (no measurement)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "native_bf16": props.major >= 8,  # Ampere and later; older GPUs emulate bf16
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
        }
    if device.type == "mps":
        import platform

        return {"type": "mps", "name": f"Apple GPU (macOS {platform.mac_ver()[0]})", "native_bf16": False}
    name, flags = cpu_name_and_flags()
    return {
        "type": "cpu",
        "name": name,
        "flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16")),
    }
