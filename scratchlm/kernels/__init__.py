"""Kernels written in Triton for the GPU path: `flash_attention` (FlashAttention-2, forward and backward).

Importing this package needs Triton (`pip install triton`; it installs on CPU-only machines too, where the
kernels run under its interpreter with `TRITON_INTERPRET=1`)."""

from scratchlm.kernels.flash import flash_attention

__all__ = ["flash_attention"]
