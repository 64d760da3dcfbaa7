"""How a model runs on a device: the one owner of every choice that depends on the hardware.

Every command gets its `Plan` from `plan()`: training, evaluation, generation, serving, the quickstart and the
benchmarks. The plan holds the choices (`scratchlm.device.choices`, each with its reason) and answers what the
code that runs the model needs to know:

    dtype          the resolved precision's dtype: what matmuls compute in, and what inference weights and
                   every KV cache are held in
    autocast()     the context training runs its forward passes in: low-precision matmuls over float32
                   master weights (fp32: no autocast)
    loss_scaling   whether gradients need dynamic loss scaling (fp16: `scratchlm.training.loss_scale`)
    fused_loss     the LM head and loss over chunks of tokens (`scratchlm.model.loss`)
    peak_flops     what MFU divides by
    matvec         how inference runs a token times a weight matrix (its wide matrices held by columns, or
                   one-token steps without oneDNN): whichever way measured fastest here
    decode         whether inference may compile its one-token decode steps (`scratchlm.generation.decode`),
                   which it then does per model shape where they measured faster and pay for compiling
    int8_matmul    how an eager product by an int8 matrix runs (`--quantize int8`): scratchlm's CPU kernel
                   ("kernel") or PyTorch's ("pack"), whichever measured fastest here and no slower than the
                   weight dequantized into the product ("dequantize"), else that

The plan holds facts and choices only, and this package imports nothing from the model or above it. What
applies them to a model sits above both: inference's layout (weights held in `dtype`, in eval mode, stacks
fused, `matvec`'s way and `int8_matmul`'s) is `scratchlm.generation.layout.prepare_for_inference(model,
plan)`, and training's parallelism is `scratchlm.parallel`.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from scratchlm.device.choices import (
    Choice,
    choose_compile,
    choose_decode,
    choose_fused_loss,
    choose_int8_matmul,
    choose_matvec,
    choose_peak_flops,
    choose_threads,
    resolve_precision,
)
from scratchlm.device.profile import DeviceProfile, device_profile
from scratchlm.device.rates import DTYPES


@dataclass(frozen=True)
class Plan:
    """The choices for one device, each with its reason; `warnings` for explicit choices that are slow here."""

    device: str
    profile: DeviceProfile
    precision: Choice  # "fp32" | "bf16" | "fp16"
    threads: Choice  # an int (CPU), or None (an accelerator: left to torch)
    compile: Choice  # bool
    fused_loss: Choice  # bool
    peak_flops: Choice  # FLOP/s, or None where unknown
    matvec: Choice  # one of `MATVEC_WAYS`: how inference runs a token times a weight matrix
    decode: Choice  # bool: compiled decode steps allowed (where they measure faster)
    int8_matmul: Choice  # "kernel" | "pack" | "dequantize": how an eager product by an int8 matrix runs
    warnings: tuple[str, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision.value]

    @property
    def loss_scaling(self) -> bool:
        """fp16's 5 exponent bits flush small gradients to zero unless the loss is scaled up first."""
        return self.precision.value == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Low-precision matmuls over float32 weights (training), or nothing for fp32."""
        device_type = torch.device(self.device).type
        return torch.autocast(device_type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def summary(self) -> str:
        """The one line a command prints when it starts."""
        p = self.profile
        name = p.name if p.type != "cpu" else f"{p.name} ({'native' if p.native_bf16 else 'no native'} bf16)"
        n = self.threads.value
        threads = "" if n is None else f", {n} thread{'' if n == 1 else 's'}"
        return (
            f"{self.device}: {name} → {self.precision.value}{threads}, "
            f"{'compiled' if self.compile.value else 'not compiled'} "
            f"({self.precision.reason}{'; ' + self.threads.reason if self.threads.value is not None else ''})"
        )

    def to_dict(self) -> dict[str, Any]:
        """What a run records and `scratchlm doctor --json` prints."""
        choices = [f.name for f in fields(self) if isinstance(getattr(self, f.name), Choice)]
        return {
            "device": self.device,
            "profile": self.profile.to_dict(),
            **{name: asdict(getattr(self, name)) for name in choices},
            "warnings": list(self.warnings),
        }


def plan(
    device: torch.device,
    precision: str = "auto",
    compile: bool = False,
    threads: int = 0,
    fused_loss: str = "auto",
    peak_tflops: float = 0.0,
    option: str = "training.precision",
    refresh: bool = False,
    compile_decode: bool = True,
) -> Plan:
    """The choices for running a model on `device` with these requests (a training config's, or a command's
    options; `option` names where the precision came from, in messages). `refresh` measures the device again
    rather than reading its cached profile; `compile_decode=False` (`--no-compile`) keeps inference's decode
    steps eager."""
    threads_choice = choose_threads(threads) if device.type == "cpu" else Choice(None, "")
    # Measured with the threads that will run (a rate at 2 threads is not one at 1).
    previous = torch.get_num_threads()
    if threads_choice.value is not None and threads_choice.value != previous:
        torch.set_num_threads(threads_choice.value)
    try:
        profile = device_profile(device, refresh=refresh)
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
    precision_choice, warnings = resolve_precision(precision, profile, option)
    compile_choice = choose_compile(compile, device)
    if compile and not compile_choice.value:
        warnings.append(f"training.compile = true, but {compile_choice.reason}: running uncompiled")
    return Plan(
        str(device),
        profile,
        precision_choice,
        threads_choice,
        compile_choice,
        choose_fused_loss(fused_loss, device),
        choose_peak_flops(profile, precision_choice.value, peak_tflops),
        choose_matvec(profile, precision_choice.value),
        choose_decode(compile_decode, device),
        choose_int8_matmul(profile, precision_choice.value),
        tuple(warnings),
    )
