"""Independent references for scratchlm's int8 x int8 kernel form (`int8_cpu.int8_matmul_q8`): the
activations quantized as llama.cpp's Q8_0 does, written with torch, and the most that rounding moves a
product."""

from __future__ import annotations

import torch


def blocks_of_32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (M, K) float32 quantized as llama.cpp's Q8_0 does, written here independently of the kernel: per
    block of 32 (zeros past K), `d = max|x| / 127` and `q = round(x / d)` in float32, to even; the integers
    (float64, exact) shaped (M, blocks, 32) and the scales (M, blocks)."""
    rows, d_in = x.shape
    blocks = -(-d_in // 32)
    padded = torch.zeros(rows, blocks * 32)
    padded[:, :d_in] = x
    grouped = padded.view(rows, blocks, 32)
    d = grouped.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(grouped / d[..., None]), torch.zeros(()))
    return q.clamp(-127, 127).double(), d


def activation_rounding(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most that quantizing `x` per block of 32 (`blocks_of_32`, the kernel's int8 x int8 form) moves the
    product: half a step `d_b / 2` an activation, `s_j Σ_b (d_b / 2) Σ_{i in b} |q_ji|`, float64 (M, N)."""
    _, d = blocks_of_32(x.reshape(-1, x.shape[-1]).float())
    blocks = d.shape[1]
    padded = torch.zeros(q.shape[0], blocks * 32, dtype=torch.float64)
    padded[:, : q.shape[1]] = q.double().abs()
    step = (padded.view(q.shape[0], blocks, 32).sum(-1)[None] * d.double()[:, None, :] / 2).sum(-1)
    return step * scale.double()
