"""The key/value cache that makes generation cost one token's work per new token.

Without a cache, generating token t recomputes the keys and values of tokens 0..t-1 in every layer. With
one, each layer keeps the keys and values it has already computed, and a call gets only the new tokens:
their queries attend to the cached keys plus their own, and their keys and values are appended.

The cache is a sliding window of at most `window` (the model's context length) tokens: when it is full the
oldest are dropped, so a new token attends to itself and the `window - 1` tokens before it, in every layer —
sliding-window attention (as in Longformer and Mistral). In a one-layer model this is exactly a forward pass
over the last `window` tokens; in deeper ones the cached keys and values of layer 2 and above were computed
when older tokens were still visible, so they carry information from beyond the window (the receptive field
grows by a window per layer), and the logits differ from a forward pass over the last `window` tokens alone.

Keys are stored *before* the position encoding (`ModelConfig.positions`), and the attention layer encodes the
whole window on every call with positions counted from the window's start. The cache itself knows nothing of
positions. For RoPE, whose scores depend only on the distance between two tokens, this gives the same scores
as absolute positions would, and the positions never leave the RoPE table however long the generation runs.

    cache = model.new_kv_cache(batch_size=1)
    logits = model(prompt_ids, kv_cache=cache)        # prefill: (1, prompt_len, vocab)
    logits = model(next_id[:, None], kv_cache=cache)  # decode:  (1, 1, vocab)
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


class LayerKVCache:
    """One attention layer's cached keys (before the position encoding) and values, `(batch, kv_heads, ≤ window,
    d_k)` each: under grouped-query attention only the `num_kv_heads` key/value heads are kept."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def append(
        self,
        keys: Float[Tensor, "batch kv_heads new d_k"],
        values: Float[Tensor, "batch kv_heads new d_k"],
    ) -> tuple[Float[Tensor, "batch kv_heads window d_k"], Float[Tensor, "batch kv_heads window d_k"]]:
        """Append the new tokens' keys and values, drop what falls out of the window, return the window.
        Several new tokens share one window: the last sees `window` tokens, the earlier ones fewer."""
        if self.keys is not None and self.values is not None:
            keys = torch.cat((self.keys, keys), dim=-2)
            values = torch.cat((self.values, values), dim=-2)
        self.keys, self.values = keys[..., -self.window :, :], values[..., -self.window :, :]
        return self.keys, self.values


class KVCache:
    """The caches of all layers of one model for one batch of sequences; `length` counts the tokens seen
    (it keeps growing past the window, while each layer keeps at most `window` tokens)."""

    def __init__(self, num_layers: int, window: int, batch_size: int) -> None:
        self.window, self.batch_size = window, batch_size
        self.layers = [LayerKVCache(window) for _ in range(num_layers)]
        self.length = 0

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, window={self.window}, batch_size={self.batch_size}, length={self.length})"
