"""Kernels of scratchlm's own: in Triton for the GPU path, `flash_attention` (FlashAttention-2, forward,
split-key decode and backward; `flash_kernels`, `flash`), with launch settings that fit the GPU (`launch`), the
model's choice of attention (`dispatch`) and the kernels compiled ahead of time for every architecture
(`aot`); in C++ for the CPU, a few rows of activations times an int8 matrix (`int8_cpu`, `--quantize int8`).

The Triton modules need Triton (`pip install triton`; it installs on CPU-only machines too, where the kernels
run under its interpreter with `TRITON_INTERPRET=1`); `flash_attention` is imported from it on first use, so
that the CPU kernel does not need Triton."""

from __future__ import annotations

from typing import Any

__all__ = ["flash_attention"]


def __getattr__(name: str) -> Any:
    if name == "flash_attention":
        from scratchlm.kernels.flash import flash_attention  # noqa: PLC0415  (Triton, only where it is used)

        return flash_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
