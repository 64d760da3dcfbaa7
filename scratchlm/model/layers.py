"""The building blocks of a LLaMA-style Transformer, each written from tensor operations.

In the order a token meets them:

- `Embedding`: row lookup in a `(vocab, d_model)` matrix.
- `RMSNorm`: `a / sqrt(mean(a²) + eps) * g` (Zhang & Sennrich, 2019), computed in at least float32.
- `MultiHeadSelfAttention`: causal `softmax(Q Kᵀ / sqrt(d_k)) V` with the heads as a batch dimension, and
  `RotaryPositionalEmbedding` (RoPE, Su et al., 2021) rotating queries and keys by an angle proportional to
  their position, so that a score depends only on how far apart two tokens are. Its backward pass is written
  out (that of FlashAttention-2) rather than left to autograd, which keeps less and computes less.
- `SwiGLU`: the gated feed-forward network `W2 (silu(W1 x) ⊙ W3 x)` (Shazeer, 2020); `SiLUFeedForward`, the
  ungated `W2 silu(W1 x)` that the ablation compares it with.
- `Linear`: `y = x Wᵀ` without bias, `W` stored `(out, in)` as in the reference implementation.

Every function accepts extra leading batch dimensions (`...`). Low-precision inputs (bfloat16 under
`torch.autocast`) are normalised and soft-maxed in float32, because a sum of squares or of exponentials over
hundreds of bfloat16 values loses most of its digits.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from scratchlm.errors import ScratchlmError
from scratchlm.model.kv_cache import LayerKVCache


def _at_least_float32(x: Tensor) -> Tensor:
    """`x` in float32 if it is in a lower precision (bfloat16, float16); float32 and float64 are kept."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class Linear(nn.Module):
    """`y = x Wᵀ`, no bias. Init `N(0, 2 / (in + out))` truncated at ±3σ, which keeps the variance of
    activations and of gradients about constant through the layer (Glorot & Bengio, 2010)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        # `matmul` folds the leading dimensions into one (tokens × d_in) @ (d_in × d_out) product; an einsum
        # over "..." would run a batched product against an expanded copy of W, twice as slow on CPU.
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    """Token id -> row of a `(num_embeddings, embedding_dim)` matrix; init `N(0, 1)` truncated at ±3."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

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
        self,
        d_model: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        x32 = _at_least_float32(x)
        inv_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * _at_least_float32(self.weight)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def silu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """SiLU (swish): `x · σ(x)`, a ReLU that is smooth at 0."""
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """The gated feed-forward network `W2 (silu(W1 x) ⊙ W3 x)`: `W1, W3: (d_ff, d_model)`, `W2: (d_model, d_ff)`."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class SiLUFeedForward(nn.Module):
    """The ungated feed-forward network `W2 silu(W1 x)` of the SwiGLU ablation (with `d_ff = 4 d_model` it has
    as many parameters as SwiGLU with `d_ff = 8/3 d_model`)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(silu(self.w1(x)))


def softmax(x: Float[Tensor, "..."], dim: int) -> Float[Tensor, "..."]:
    """`exp(x) / sum(exp(x))` along `dim`. The maximum is subtracted first, which changes nothing
    mathematically but keeps `exp` from overflowing; a low-precision input is exponentiated and summed in
    float32 and the result returned in the input's dtype. Entries equal to -inf get probability exactly 0."""
    x32 = _at_least_float32(x)
    # The shift is a constant to autograd: the softmax does not depend on it, so its gradient is 0 anyway.
    exps = torch.exp(x32 - x32.amax(dim=dim, keepdim=True).detach())
    return (exps / exps.sum(dim=dim, keepdim=True)).to(x.dtype)


def scaled_dot_product_attention(
    Q: Float[Tensor, "... queries d_k"],
    K: Float[Tensor, "... keys d_k"],
    V: Float[Tensor, "... keys d_v"],
    mask: Bool[Tensor, "... queries keys"] | None = None,
) -> Float[Tensor, "... queries d_v"]:
    """`softmax(Q Kᵀ / sqrt(d_k)) V` (Vaswani et al., 2017). `mask[i, j]` True means query i may attend to
    key j; a masked score becomes -inf before the softmax, so its probability is exactly 0. Dividing by
    `sqrt(d_k)` keeps the scores' variance about 1 whatever the head size, so the softmax does not saturate."""
    return _Attention.apply(Q, K, V, mask)


class _Attention(torch.autograd.Function):
    """Attention with a hand-written backward pass, that of FlashAttention-2 (Dao, 2023) without the tiling.

    With `S = Q Kᵀ s` (s = 1/sqrt(d_k)), `P = softmax(S)`, `O = P V` and the output's gradient `dO`:

        dV = Pᵀ dO        dP = dO Vᵀ        dS = P ⊙ (dP − D) s        dQ = dS K        dK = dSᵀ Q

    where `D_i = Σ_j P_ij dP_ij` is the softmax's backward term. Since `Σ_j P_ij dP_ij = Σ_c dO_ic O_ic`, D is
    computed from two (queries × d_v) tensors instead of two (queries × keys) ones, and only P is kept from the
    forward pass. Autograd differentiating the forward's operations one by one would also keep the
    exponentials and their sums and take extra passes over the (queries × keys) matrices; this takes about a
    fifth less time for attention's forward and backward on a CPU, and compiles into one graph as well.
    """

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None) -> Tensor:
        scale = 1 / math.sqrt(Q.shape[-1])
        scores = (Q @ K.transpose(-2, -1)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = softmax(scores, dim=-1)
        out = probs @ V
        ctx.save_for_backward(Q, K, V, probs, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        Q, K, V, probs, out = ctx.saved_tensors
        scale = 1 / math.sqrt(Q.shape[-1])
        grad_out = grad_out.to(V.dtype)  # backward runs outside autocast: match the forward's dtype
        grad_V = probs.transpose(-2, -1) @ grad_out
        grad_probs = grad_out @ V.transpose(-2, -1)
        D = (_at_least_float32(grad_out) * _at_least_float32(out)).sum(dim=-1, keepdim=True)
        grad_scores = (_at_least_float32(probs) * (_at_least_float32(grad_probs) - D) * scale).to(Q.dtype)
        grad_Q = grad_scores @ K
        grad_K = grad_scores.transpose(-2, -1) @ Q
        # Inputs broadcast against each other (e.g. one K for every head) get their gradients summed back.
        return grad_Q.sum_to_size(Q.shape), grad_K.sum_to_size(K.shape), grad_V.sum_to_size(V.shape), None


class RotaryPositionalEmbedding(nn.Module):
    """RoPE: rotate each adjacent pair `(x[2k], x[2k+1])` of a query or key at position i by the angle
    `i · θ^(-2k/d_k)`. A dot product of two rotated vectors depends on the difference of their positions
    only, which is how attention learns relative order. No parameters: the cosines and sines of every
    position below `max_seq_len` are computed once, in float64, and kept as non-persistent buffers (they
    follow the module to a device but are not saved in a state dict)."""

    def __init__(
        self, theta: float, d_k: int, max_seq_len: int, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if d_k % 2:
            raise ScratchlmError(f"RoPE rotates pairs of dimensions; d_k must be even, got {d_k}")
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        inv_freq = theta ** (-torch.arange(0, d_k, 2, dtype=torch.float64, device=device) / d_k)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (max_seq_len, d_k/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(
        self, x: Float[Tensor, "... seq d_k"], token_positions: Int[Tensor, "... seq"]
    ) -> Float[Tensor, "... seq d_k"]:
        cos, sin = self.cos[token_positions], self.sin[token_positions]  # (... seq, d_k/2)
        pairs = _at_least_float32(rearrange(x, "... (half two) -> ... half two", two=2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rearrange(rotated, "... half two -> ... (half two)").to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


class MultiHeadSelfAttention(nn.Module):
    """Causal multi-head self-attention: project to queries, keys and values, split `d_model` into
    `num_heads` heads of `d_k = d_model / num_heads` that attend independently (as one more batch
    dimension), concatenate, project back. With `theta`, queries and keys are rotated by RoPE (the same
    rotation for every head; values are not rotated).

    With a `kv_cache` (one layer's `LayerKVCache`), `x` holds only the new tokens: their keys and values are
    appended to the cached ones (a sliding window of at most `max_seq_len` tokens), and they attend to the
    whole window and causally among themselves. RoPE positions are counted from the window's start; scores
    depend only on distances, so this equals rotating by absolute positions.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        max_seq_len: int | None = None,
        theta: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ScratchlmError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope: RotaryPositionalEmbedding | None = None
        if theta is not None:
            if max_seq_len is None:
                raise ScratchlmError("RoPE needs max_seq_len (the longest sequence it will rotate)")
            self.rope = RotaryPositionalEmbedding(theta, d_model // num_heads, max_seq_len, device=device)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        split_heads = "... seq (heads d_k) -> ... heads seq d_k"
        q = rearrange(self.q_proj(x), split_heads, heads=self.num_heads)
        k = rearrange(self.k_proj(x), split_heads, heads=self.num_heads)
        v = rearrange(self.v_proj(x), split_heads, heads=self.num_heads)
        if kv_cache is not None:
            if token_positions is not None:
                raise ScratchlmError(
                    "with a KV cache, positions come from the cache; token_positions must be None"
                )
            # The cache holds keys before rotation: the window is rotated afresh from position 0 each call.
            k, v = kv_cache.append(k, v)

        # Query i of the `seq` new tokens is token `keys - seq + i` of the key sequence and sees keys 0..itself.
        num_queries, num_keys = q.shape[-2], k.shape[-2]
        key_index = torch.arange(num_keys, device=x.device)
        query_index = key_index[num_keys - num_queries :]
        causal = query_index[:, None] >= key_index[None, :]

        if self.rope is not None:
            if token_positions is None:
                q, k = self.rope(q, query_index), self.rope(k, key_index)
            else:
                positions = rearrange(token_positions, "... seq -> ... 1 seq")  # the same for every head
                q, k = self.rope(q, positions), self.rope(k, positions)

        heads = scaled_dot_product_attention(q, k, v, mask=causal)
        return self.output_proj(rearrange(heads, "... heads seq d_k -> ... seq (heads d_k)"))
