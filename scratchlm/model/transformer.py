"""A decoder-only Transformer language model in the LLaMA style (pre-norm RMSNorm, RoPE, SwiGLU, no biases).

    token ids (... seq)
      -> token_embeddings                      (... seq d_model)
      -> num_layers × TransformerBlock:        x = x + attn(ln1(x));  x = x + ffn(ln2(x))
      -> ln_final -> lm_head                   (... seq vocab)   unnormalised logits

The ablations of the experiments are switches of `ModelConfig`: `norm="post"` puts the RMSNorms after each
residual addition as in the original Transformer (`x = ln1(x + attn(x))`, `x = ln2(x + ffn(x))`; the block's
output is already normalised, so there is no `ln_final`), `norm="none"` drops every RMSNorm, `positions="none"`
drops RoPE (causal attention alone still tells a token how many tokens precede it), `ffn="silu"` swaps SwiGLU
for `W2 silu(W1 x)`, and `tie_embeddings` makes the LM head reuse the token embedding matrix. Whatever is
absent is absent from the state dict, and the default configuration has exactly the reference
implementation's state-dict keys.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.kv_cache import KVCache, LayerKVCache
from scratchlm.model.layers import Embedding, Linear, MultiHeadSelfAttention, RMSNorm, SiLUFeedForward, SwiGLU


class TransformerBlock(nn.Module):
    """Causal self-attention then a feed-forward network, each inside a residual connection, with RMSNorm
    before each (pre-norm, default), after each addition (post-norm), or nowhere."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float | None = 10_000.0,
        *,
        norm: str = "pre",
        ffn: str = "swiglu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        kwargs = {"device": device, "dtype": dtype}
        self.ln1 = RMSNorm(d_model, **kwargs) if norm != "none" else None
        self.attn = MultiHeadSelfAttention(d_model, num_heads, max_seq_len, theta, **kwargs)
        self.ln2 = RMSNorm(d_model, **kwargs) if norm != "none" else None
        feed_forward = SwiGLU if ffn == "swiglu" else SiLUFeedForward
        self.ffn = feed_forward(d_model, d_ff, **kwargs)

    def forward(
        self, x: Float[Tensor, "... seq d_model"], kv_cache: LayerKVCache | None = None
    ) -> Float[Tensor, "... seq d_model"]:
        if self.norm == "pre":
            x = x + self.attn(self.ln1(x), kv_cache=kv_cache)
            return x + self.ffn(self.ln2(x))
        if self.norm == "post":
            x = self.ln1(x + self.attn(x, kv_cache=kv_cache))
            return self.ln2(x + self.ffn(x))
        x = x + self.attn(x, kv_cache=kv_cache)
        return x + self.ffn(x)


class TransformerLM(nn.Module):
    """Token ids `(..., seq)` -> next-token logits `(..., seq, vocab_size)`, `seq <= context_length`.

    With a `kv_cache` (from `new_kv_cache`), `token_ids` `(batch, n)` are the tokens that follow those the
    cache has seen; see `scratchlm.model.kv_cache`.
    """

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int | None,
        rope_theta: float = 10_000.0,
        *,
        norm: str = "pre",
        positions: str = "rope",
        ffn: str = "swiglu",
        tie_embeddings: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = ModelConfig(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            d_ff=d_ff,
            rope_theta=rope_theta,
            norm=norm,
            positions=positions,
            ffn=ffn,
            tie_embeddings=tie_embeddings,
        )
        self.config = config
        kwargs = {"device": device, "dtype": dtype}
        self.token_embeddings = Embedding(vocab_size, d_model, **kwargs)
        theta = rope_theta if positions == "rope" else None
        self.layers = nn.ModuleList(
            TransformerBlock(
                d_model, num_heads, config.d_ff, context_length, theta, norm=norm, ffn=ffn, **kwargs
            )
            for _ in range(num_layers)
        )
        # A post-norm block already ends with an RMSNorm; with norm="none" there is none anywhere.
        self.ln_final = RMSNorm(d_model, **kwargs) if norm == "pre" else None
        self.lm_head = Linear(d_model, vocab_size, **kwargs)
        if tie_embeddings:
            # One matrix for both ends. It takes the LM head's initialisation (std ≈ sqrt(2 / (vocab + d_model)))
            # rather than the embedding's N(0, 1): unit-variance rows would make the initial logits
            # sqrt(d_model) times too large.
            self.token_embeddings.weight = self.lm_head.weight

    @classmethod
    def from_config(
        cls, config: ModelConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> TransformerLM:
        return cls(**config.to_dict(), device=device, dtype=dtype)

    def forward(
        self, token_ids: Int[Tensor, "... seq"], kv_cache: KVCache | None = None
    ) -> Float[Tensor, "... seq vocab_size"]:
        seq = token_ids.shape[-1]
        if seq > self.config.context_length:
            raise ScratchlmError(
                f"input of {seq} tokens is longer than the model's context_length ({self.config.context_length})"
            )
        if kv_cache is not None and (token_ids.dim() != 2 or token_ids.shape[0] != kv_cache.batch_size):
            raise ScratchlmError(
                f"with a KV cache the input must be (batch={kv_cache.batch_size}, new_tokens); "
                f"got shape {tuple(token_ids.shape)}"
            )
        layer_caches = kv_cache.layers if kv_cache is not None else [None] * len(self.layers)

        x = self.token_embeddings(token_ids)
        for block, layer_cache in zip(self.layers, layer_caches, strict=True):
            x = block(x, kv_cache=layer_cache)
        if self.ln_final is not None:
            x = self.ln_final(x)
        logits = self.lm_head(x)

        if kv_cache is not None:
            kv_cache.length += seq
        return logits

    def new_kv_cache(self, batch_size: int) -> KVCache:
        """An empty cache for generating `batch_size` sequences at once (it fills on the model's device, in
        the dtype of the keys it is given)."""
        return KVCache(len(self.layers), self.config.context_length, batch_size)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Trainable parameters, each shared tensor counted once. `non_embedding` leaves out the token
        embedding matrix (a lookup, no compute) unless it is tied to the LM head, which uses it."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            total -= self.token_embeddings.weight.numel()
        return total

    def extra_repr(self) -> str:
        params = self.num_parameters()
        return f"parameters={params:,} ({params / 1e6:.1f}M), non-embedding={self.num_parameters(True):,}"
