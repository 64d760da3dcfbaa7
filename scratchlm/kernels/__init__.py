"""Kernels written in Triton for the GPU path: `flash_attention` (FlashAttention-2, forward, split-key decode
and backward; `flash_kernels`, `flash`), with launch settings that fit the GPU (`launch`), the model's choice
of attention (`dispatch`) and the kernels compiled ahead of time for every architecture (`aot`).

Importing this package needs Triton (`pip install triton`; it installs on CPU-only machines too, where the
kernels run under its interpreter with `TRITON_INTERPRET=1`)."""

from scratchlm.kernels.flash import flash_attention

__all__ = ["flash_attention"]
