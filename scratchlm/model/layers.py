"""The building blocks of a LLaMA-style Transformer, each written from tensor operations.

In the order a token meets them:

- `Embedding`: row lookup in a `(vocab, d_model)` matrix.
- `RMSNorm`: `a / sqrt(mean(a²) + eps) * g` (Zhang & Sennrich, 2019), computed in at least float32.
- `MultiHeadSelfAttention` (`scratchlm.model.attention`): causal `softmax(Q Kᵀ / sqrt(d_k)) V` with the heads
  as a batch dimension, queries and keys rotated by `RotaryPositionalEmbedding` (`scratchlm.model.positions`;
  RoPE, Su et al., 2021) so that a score depends only on how far apart two tokens are.
- `SwiGLU` (`scratchlm.model.ffn`): the gated feed-forward network `W2 (silu(W1 x) ⊙ W3 x)` (Shazeer, 2020),
  or one of its ablations.
- `Linear`: `y = x Wᵀ` without bias, `W` stored `(out, in)` as in the reference implementation.

Every function accepts extra leading batch dimensions (`...`). Low-precision inputs (bfloat16 under
`torch.autocast`) are normalised and soft-maxed in float32, because a sum of squares or of exponentials over
hundreds of bfloat16 values loses most of its digits.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from scratchlm.model.config import DEFAULT_NORM_EPS
from scratchlm.model.part import Device, DType


def _truncated_normal(rows: int, cols: int, std: float, device: Device, dtype: DType) -> nn.Parameter:
    weight = torch.empty(rows, cols, device=device, dtype=dtype)
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return nn.Parameter(weight)


def at_least_float32(x: Tensor) -> Tensor:
    """`x` in float32 if it is in a lower precision (bfloat16, float16); float32 and float64 are kept."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Linear(nn.Module):
    """`y = x Wᵀ`, no bias. Init `N(0, 2 / (in + out))` truncated at ±3σ, which keeps the variance of
    activations and of gradients about constant through the layer (Glorot & Bengio, 2010)."""

    def __init__(
        self, in_features: int, out_features: int, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        std = math.sqrt(2.0 / (in_features + out_features))
        self.weight = _truncated_normal(out_features, in_features, std, device, dtype)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        # `matmul` folds the leading dimensions into one (tokens × d_in) @ (d_in × d_out) product; an einsum
        # over "..." would run a batched product against an expanded copy of W, twice as slow on CPU.
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Token id -> row of a `(num_embeddings, embedding_dim)` matrix; init `N(0, 1)` truncated at ±3."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = _truncated_normal(num_embeddings, embedding_dim, 1.0, device, dtype)

    def forward(self, token_ids: Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RMSNorm(nn.Module):
    """`a_i / RMS(a) * g_i` with `RMS(a) = sqrt(mean(a²) + eps)`; the gain `g` starts at 1.

    Computed in float32 and returned in the input's dtype: under bfloat16 the mean of squares of
    d_model values would keep only about three significant digits.
    """

    def __init__(
        self, d_model: int, eps: float = DEFAULT_NORM_EPS, device: Device = None, dtype: DType = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = at_least_float32(x)
        inv_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * at_least_float32(self.weight)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
