"""Attention: `softmax(Q Kᵀ / sqrt(d_k)) V` (Vaswani et al., 2017), causal, and the multi-head
self-attention of every block.

`causal_attention` computes the scores by blocks of queries, skipping the blocks the causal mask hides, and
its backward pass is written out (that of FlashAttention-2) rather than left to autograd, which keeps less and
computes less. `MultiHeadSelfAttention` splits `d_model` into heads that attend as one more batch dimension,
with grouped-query attention, QK-norm, value embeddings and a KV cache; on a GPU it may hand the computation
to the Triton kernel of `scratchlm.kernels`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.kv_cache import LayerKVCache, decode_dtype
from scratchlm.model.layers import Linear, LinearStack, RMSNorm, at_least_float32
from scratchlm.model.part import ConfigModule, Device, DType, handout_config
from scratchlm.model.positions import position_encoding


def softmax(x: Float[Tensor, "..."], dim: int) -> Float[Tensor, "..."]:
    """`exp(x) / sum(exp(x))` along `dim`. The maximum is subtracted first, which changes nothing
    mathematically but keeps `exp` from overflowing; a low-precision input is exponentiated and summed in
    float32 and the result returned in the input's dtype. Entries equal to -inf get probability exactly 0."""
    x32 = at_least_float32(x)
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
    return _attention(Q, K, V, mask, None)


def causal_attention(
    Q: Float[Tensor, "... queries d_k"],
    K: Float[Tensor, "... keys d_k"],
    V: Float[Tensor, "... keys d_v"],
    block_size: int = 64,
) -> Float[Tensor, "... queries d_v"]:
    """`scaled_dot_product_attention` with the causal mask, the queries being the last `queries` of the
    `keys` positions (all of them in training; the new tokens after a KV cache's keys in generation).

    Half of a causal score matrix is masked out, so it is computed by blocks of `block_size` queries, each
    against only the keys up to its last query: with 256 queries in blocks of 64, 10/16 of the scores are
    computed and the rest, which would be exactly zero after the softmax, are skipped. The smaller score
    blocks also stay in cache; on a CPU this makes attention's forward and backward about twice as fast."""
    if block_size < 1:
        raise ScratchlmError(f"causal_attention needs a block_size of at least 1, got {block_size}")
    return _attention(Q, K, V, None, block_size)


class _Attention(torch.autograd.Function):
    """Attention with a hand-written backward pass, that of FlashAttention-2 (Dao, 2023), over blocks of
    queries (one block of all queries when a general mask is given).

    With `S = Q Kᵀ s` (s = 1/sqrt(d_k)), `P = softmax(S)`, `O = P V` and the output's gradient `dO`:

        dV = Pᵀ dO        dP = dO Vᵀ        dS = P ⊙ (dP − D) s        dQ = dS K        dK = dSᵀ Q

    where `D_i = Σ_j P_ij dP_ij` is the softmax's backward term. Since `Σ_j P_ij dP_ij = Σ_c dO_ic O_ic`, D is
    computed from two (queries × d_v) tensors instead of two (queries × keys) ones, and only P is kept from the
    forward pass. Autograd differentiating the forward's operations one by one would also keep the
    exponentials and their sums and take extra passes over the (queries × keys) matrices. A block of queries
    contributes to dK and dV only for the keys it sees, and its rows of dQ are its own.
    """

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, block_size: int | None) -> Tensor:
        out, probs, blocks = _attention_blocks(Q, K, V, mask, block_size)
        ctx.blocks = blocks
        ctx.save_for_backward(Q, K, V, out, *probs)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        Q, K, V, out, *probs = ctx.saved_tensors
        scale = 1 / math.sqrt(Q.shape[-1])
        grad_out = grad_out.to(V.dtype)  # backward runs outside autocast: match the forward's dtype
        D = (at_least_float32(grad_out) * at_least_float32(out)).sum(dim=-1, keepdim=True)
        grad_Q_blocks, grad_K_blocks, grad_V_blocks = [], [], []
        for (start, stop, keys), P in zip(ctx.blocks, probs, strict=True):
            grad_O = grad_out[..., start:stop, :]
            grad_P = grad_O @ V[..., :keys, :].transpose(-2, -1)
            grad_S = (at_least_float32(P) * (at_least_float32(grad_P) - D[..., start:stop, :]) * scale).to(
                Q.dtype
            )
            grad_Q_blocks.append(grad_S @ K[..., :keys, :])
            grad_K_blocks.append(grad_S.transpose(-2, -1) @ Q[..., start:stop, :])
            grad_V_blocks.append(P.transpose(-2, -1) @ grad_O)
        grad_Q = torch.cat(grad_Q_blocks, dim=-2)
        grad_K, grad_V = (
            _sum_over_blocks(grad_K_blocks, ctx.blocks),
            _sum_over_blocks(grad_V_blocks, ctx.blocks),
        )
        # Inputs broadcast against each other (e.g. one K for every head) get their gradients summed back.
        return (
            grad_Q.sum_to_size(Q.shape),
            grad_K.sum_to_size(K.shape),
            grad_V.sum_to_size(V.shape),
            None,
            None,
        )


def _attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, block_size: int | None) -> Tensor:
    """`_Attention` where a gradient is wanted; its forward alone where none is (generation, evaluation), which
    saves autograd's bookkeeping at every decoded token."""
    if torch.is_grad_enabled() and (Q.requires_grad or K.requires_grad or V.requires_grad):
        return _Attention.apply(Q, K, V, mask, block_size)
    return _attention_blocks(Q, K, V, mask, block_size)[0]


def _attention_blocks(
    Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, block_size: int | None
) -> tuple[Tensor, list[Tensor], list[tuple[int, int, int]]]:
    """The forward pass: the output, each query block's probabilities and the blocks."""
    scale = 1 / math.sqrt(Q.shape[-1])
    blocks = _query_blocks(Q.shape[-2], K.shape[-2], block_size)
    outs, probs = [], []
    for start, stop, keys in blocks:
        scores = (Q[..., start:stop, :] @ K[..., :keys, :].transpose(-2, -1)) * scale
        block_mask = mask
        if (
            block_size is not None and stop - start > 1
        ):  # causal: the queries are the last keys (one sees all)
            key_index = torch.arange(keys, device=Q.device)
            block_mask = key_index[keys - (stop - start) :, None] >= key_index[None, :]
        if block_mask is not None:
            scores = scores.masked_fill(~block_mask, float("-inf"))
        probs.append(softmax(scores, dim=-1))
        outs.append(probs[-1] @ V[..., :keys, :])
    return torch.cat(outs, dim=-2), probs, blocks


def _query_blocks(num_queries: int, num_keys: int, block_size: int | None) -> list[tuple[int, int, int]]:
    """`(start, stop, keys)` for each block of queries `start:stop` and the number of keys it attends to:
    all of them without a block size; with one, causally, queries being the last `num_queries` positions."""
    if block_size is None:
        return [(0, num_queries, num_keys)]
    blocks = []
    for start in range(0, num_queries, block_size):
        stop = min(start + block_size, num_queries)
        blocks.append((start, stop, num_keys - num_queries + stop))
    return blocks


def _sum_over_blocks(per_block: list[Tensor], blocks: list[tuple[int, int, int]]) -> Tensor:
    """The gradient of the keys (or values) from each query block's part, which covers the first `keys` of
    them: the keys up to block 0's last query get a part from every block, the next ones from every block but
    the first, and so on. Summed segment by segment and concatenated, rather than added into slices of one
    tensor, which compiles into plain vectorised loops."""
    bounds = [0] + [keys for _, _, keys in blocks]
    segments = []
    for i, (low, high) in enumerate(zip(bounds, bounds[1:], strict=False)):
        parts = [part[..., low:high, :] for part in per_block[i:]]
        segments.append(sum(parts[1:], parts[0]))
    return torch.cat(segments, dim=-2)


def triton_attention() -> Any:
    """`scratchlm.kernels.flash_attention`, or None where Triton does not import. Imported on first use, so
    that a model on the CPU never loads Triton."""
    try:
        from scratchlm.kernels import flash_attention
    except ImportError:
        return None
    return flash_attention


class MultiHeadSelfAttention(ConfigModule):
    """Causal multi-head self-attention: project to queries, keys and values, split `d_model` into
    `num_heads` heads of `d_k = d_model / num_heads` that attend independently (as one more batch
    dimension), concatenate, project back. Queries and keys then go through the position encoding of
    `config.positions` (RoPE: the same rotation for every head; values are not rotated).

    With `config.num_kv_heads` below `num_heads` (grouped-query attention), keys and values have only
    `num_kv_heads` heads, and query heads `g·G … g·G + G − 1` (`G = num_heads / num_kv_heads`) all attend with
    key/value head g: the projections and the KV cache shrink by G, the scores do not.

    With a `kv_cache` (one layer's `LayerKVCache`), `x` holds only the new tokens: their queries and keys are
    encoded at their absolute positions (the tokens the cache has seen so far), their keys and values are
    appended to the cached ones (keys cached already encoded, so cached keys are never encoded again), and
    they attend to all the cached keys and causally among themselves.

    `config.attention` picks the computation: the FlashAttention-2 Triton kernel (`scratchlm.kernels`; on a
    CUDA device, with or without a KV cache) or `causal_attention` (anywhere). "auto" takes the kernel only
    where it is correct and fast, a GPU of compute capability 8.0 or more with bf16 or fp16 tensors
    (`scratchlm.kernels.dispatch`); "triton" insists on it (with a warning where it is slow; on a CPU it fails
    with a clear message unless Triton's interpreter is on, `TRITON_INTERPRET=1`, slow, for tests); "torch"
    never uses it.
    """

    def __init__(self, config: ModelConfig, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads = config.d_model, config.num_heads, config.kv_heads
        self.attention = config.attention
        kv_dim = config.kv_heads * config.head_dim
        self.q_proj = Linear(config.d_model, config.d_model, device=device, dtype=dtype)
        self.k_proj = Linear(config.d_model, kv_dim, device=device, dtype=dtype)
        self.v_proj = Linear(config.d_model, kv_dim, device=device, dtype=dtype)
        self.output_proj = Linear(config.d_model, config.d_model, device=device, dtype=dtype)
        self.qkv = LinearStack(self.q_proj, self.k_proj, self.v_proj)  # one matmul at inference
        self.positions = position_encoding(config, device)
        # QK-norm: one gain per head dimension, shared by the heads. Queries and keys of RMS 1 bound every
        # score by sqrt(d_k) times the gains, so attention logits cannot blow up and saturate the softmax.
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps, device, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps, device, dtype) if config.qk_norm else None

    @classmethod
    def from_handout(
        cls,
        d_model: int,
        num_heads: int,
        max_seq_len: int | None = None,
        theta: float | None = None,
        device: Device = None,
        dtype: DType = None,
    ) -> MultiHeadSelfAttention:
        """The CS336 assignment-1 handout's signature: RoPE with `theta` (which needs `max_seq_len`), none
        without."""
        if theta is not None and max_seq_len is None:
            raise ScratchlmError("RoPE needs max_seq_len (the longest sequence it will rotate)")
        return cls(handout_config(d_model, num_heads, None, max_seq_len or 1, theta), device, dtype)

    def _uses_kernel(self, q: Tensor) -> bool:
        """Whether attention runs in the Triton kernel: `config.attention` "triton", or "auto" on a GPU where
        the kernel is fast (sm_80+, bf16/fp16). Either falls back to `causal_attention` where no launch
        setting fits the GPU (`scratchlm.kernels.dispatch`). Decided per call, from where the tensors are."""
        if self.attention == "torch" or (self.attention == "auto" and not q.is_cuda):
            return False
        if triton_attention() is None:
            return self.attention == "triton"  # _kernel() says what is missing
        from scratchlm.kernels.dispatch import uses_kernel

        return uses_kernel(self.attention, q.device, q.dtype, q.shape[-1])

    def _kernel(self) -> Any:
        kernel = triton_attention()
        if kernel is None:
            raise ScratchlmError(
                'model.attention = "triton" needs Triton, which is not installed (pip install triton)'
            )
        return kernel

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        token_positions: Int[Tensor, "... seq"] | None = None,
        kv_cache: LayerKVCache | None = None,
        value_embedding: Float[Tensor, "... seq d_kv"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        """`value_embedding` (`config.value_embeddings`) is added to the values: each token's value then
        carries the token's identity directly, not only through the residual stream."""
        split_heads = "... seq (heads d_k) -> ... heads seq d_k"
        queries, keys, values = self.qkv(x)
        q = rearrange(queries, split_heads, heads=self.num_heads)
        k = rearrange(keys, split_heads, heads=self.num_kv_heads)
        if value_embedding is not None:  # in the projection's dtype (bfloat16 under autocast), as q and k are
            values = values + value_embedding.to(values.dtype)
        v = rearrange(values, split_heads, heads=self.num_kv_heads)
        if self.q_norm is not None:  # per token, so keys are cached normalised
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_cache is not None and q.shape[-2] == 1:  # a decode step attends in the cache's dtype
            held = decode_dtype(q.dtype, q.device)
            q, k, v = q.to(held), k.to(held), v.to(held)
        mask = None
        if kv_cache is not None:
            if token_positions is not None:
                raise ScratchlmError(
                    "with a KV cache, positions come from the cache; token_positions must be None"
                )
            # The new tokens' positions: the first one's (the same for every row), or each row's (a cache
            # whose rows have different lengths, which also gives the keys each row's query may see).
            start, mask = kv_cache.attention_layout()
            if isinstance(start, int):
                q, k = self.positions.encode_from(q, start), self.positions.encode_from(k, start)
            else:
                q, k = self.positions(q, start), self.positions(k, start)
            # The cache keeps keys already encoded: only the new tokens' are encoded, at every step.
            k, v = kv_cache.append(k, v)
        elif token_positions is None:
            q, k = self.positions.encode_from(q, 0), self.positions.encode_from(k, 0)
        else:
            positions = rearrange(token_positions, "... seq -> ... 1 seq")  # the same for every head
            q, k = self.positions(q, positions), self.positions(k, positions)

        if mask is None and self._uses_kernel(q):  # the kernel is causal; a padded cache's mask is not
            # (... heads seq d_k) as the kernel's (batch heads seq d_k); it reads each key/value head for its
            # whole group of query heads, and with a KV cache the queries are the last of the keys' positions.
            lead = q.shape[:-3]
            heads = self._kernel()(
                q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:]), v.reshape(-1, *v.shape[-3:])
            ).reshape(*lead, *q.shape[-3:])
            return self.output_proj(rearrange(heads, "... heads seq d_k -> ... seq (heads d_k)"))

        group = self.num_heads // self.num_kv_heads
        if group > 1:
            # Each key/value head is broadcast over its group of query heads, never copied; causal_attention
            # sums the group's gradients back into it.
            q = rearrange(q, "... (kv group) seq d_k -> ... kv group seq d_k", group=group)
            group_mask = None if mask is None else mask.unsqueeze(-3)
            heads = _attend(q, k.unsqueeze(-3), v.unsqueeze(-3), group_mask).flatten(-4, -3)
        else:
            heads = _attend(q, k, v, mask)
        # In the projections' dtype again (a decode step may have attended in float32).
        return self.output_proj(rearrange(heads.to(values.dtype), "... heads seq d_k -> ... seq (heads d_k)"))


def _attend(
    q: Float[Tensor, "... queries d_k"],
    k: Float[Tensor, "... keys d_k"],
    v: Float[Tensor, "... keys d_v"],
    mask: Bool[Tensor, "... queries keys"] | None,
) -> Float[Tensor, "... queries d_v"]:
    """Causal attention, the queries being the last keys; or, with a mask, the keys the mask allows."""
    return causal_attention(q, k, v) if mask is None else scaled_dot_product_attention(q, k, v, mask)
