"""The key/value cache that makes generation cost one token's work per new token.

Without a cache, generating token t recomputes the keys and values of tokens 0..t-1 in every layer. With
one, each layer keeps the keys and values it has already computed, and a call gets only the new tokens:
their queries attend to the cached keys plus their own, and their keys and values are appended.

A cache holds at most `window` tokens, the model's context length: the positions the model was trained on.
Appending past that is an error. (Dropping the oldest entries would not give the logits of the model run on
the last `window` tokens: a cached key of layer 2 and above was computed while older tokens were visible.
`scratchlm.generation` therefore recomputes over the last `window` tokens once a sequence outgrows it.)

Keys are stored *after* the position encoding (`ModelConfig.positions`), each at its absolute position (the
count of tokens before it, `LayerKVCache.seen`): a decode step encodes its new token's query and key only,
never the cached ones again, and the cached keys are exactly those a forward pass over the whole sequence
computes.

    cache = model.new_kv_cache(batch_size=1)
    logits = model(prompt_ids, kv_cache=cache)        # prefill: (1, prompt_len, vocab)
    logits = model(next_id[:, None], kv_cache=cache)  # decode:  (1, 1, vocab)

`PaddedKVCache` is the other layout, for decoding sequences of different lengths in one batch (the batched
decoding engine, `scratchlm.generation.engine`): one preallocated `(rows, kv_heads, context, d_k)` tensor per layer, row
r holding sequence r's tokens from index 0 and its own length. A decode step writes each row's new key at that
row's length, and its query attends, under a mask, to that row's keys alone: rows never see each other's tokens
or the stale entries past their lengths. Keys start at index 0 in every row, so position j is token j for
all of them, and only the query positions differ from row to row (`attention_layout`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig


def decode_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a decode step attends in, and so the dtype a KV cache holds keys and values of `dtype` in, on
    `device`: float32 on a CPU, `dtype` elsewhere. A decode step's scores and output are matrix-vector
    products, which cost little next to the projections in float32 but run slowly in bf16 on a CPU (measured
    on an AVX-512-BF16 EPYC, 16 heads: 187 µs a product against 8.6 µs in float32); a float32 cache is
    converted once, as each key is written, instead of whole at every step."""
    return torch.promote_types(dtype, torch.float32) if device.type == "cpu" else dtype


def check_fits(cache: KVCache | PaddedKVCache | WholeWindowKVCache, token_ids: Int[Tensor, "..."]) -> None:
    """Refuse, with a one-line error, new tokens that `cache` cannot take: a forward pass through a cache
    takes `(batch, new_tokens)` for the cache's batch, and no more new tokens than its room."""
    if token_ids.dim() != 2 or token_ids.shape[0] != cache.batch_size:
        raise ScratchlmError(
            f"with a KV cache the input must be (batch={cache.batch_size}, new_tokens); "
            f"got shape {tuple(token_ids.shape)}"
        )
    if token_ids.shape[-1] > cache.room():
        raise ScratchlmError(
            f"the KV cache holds at most {cache.window} tokens a sequence (the context_length); "
            f"{token_ids.shape[-1]} more do not fit"
        )


class LayerKVCache:
    """One attention layer's cached keys (after the position encoding) and values, `(batch, kv_heads, window,
    d_k)` each, of which the first `seen` positions are filled: under grouped-query attention only the
    `num_kv_heads` key/value heads are kept."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.seen = 0  # tokens appended so far: the position of the next one

    def append(
        self,
        keys: Float[Tensor, "batch kv_heads new d_k"],
        values: Float[Tensor, "batch kv_heads new d_k"],
    ) -> tuple[Float[Tensor, "batch kv_heads seen d_k"], Float[Tensor, "batch kv_heads seen d_k"]]:
        """Append the new tokens' keys and values and return all the cached ones, the new tokens last.

        They are held in `decode_dtype` (float32 on a CPU; measured on the TinyStories model, bf16 weights:
        153 → 166 tokens/s against a bf16 cache converted at every step). A prefill (several new tokens) gets
        them back in its own dtype."""
        dtype, new = keys.dtype, keys.shape[-2]
        held = decode_dtype(dtype, keys.device)
        keys, values = keys.to(held), values.to(held)
        end = self.seen + new
        if end > self.window:
            raise ScratchlmError(f"the cache holds {self.window} tokens; {self.seen} + {new} do not fit")
        if self.keys is None or self.values is None:
            # The whole window at once, written in place: appending by concatenation would copy every
            # cached key and value at every step.
            self.keys = keys.new_empty((*keys.shape[:-2], self.window, keys.shape[-1]))
            self.values = values.new_empty((*values.shape[:-2], self.window, values.shape[-1]))
        self.keys[..., self.seen : end, :] = keys
        self.values[..., self.seen : end, :] = values
        self.seen = end
        keys, values = self.keys[..., :end, :], self.values[..., :end, :]
        return (keys, values) if new == 1 else (keys.to(dtype), values.to(dtype))

    def attention_layout(
        self,
    ) -> tuple[int | Int[Tensor, "batch 1 1"], Bool[Tensor, "batch 1 1 keys"] | None]:
        """Before `append`: the new tokens' positions and the keys each may attend to. Here the first new
        token's position, the same for every row, and no mask: the new tokens are the last of the keys and
        attend causally. (A `PaddedKVCache` layer gives a position and a mask per row.)"""
        return self.seen, None


class KVCache:
    """The caches of all layers of one model for one batch of sequences, at most `window` tokens each;
    `length` counts the tokens seen."""

    def __init__(self, num_layers: int, window: int, batch_size: int) -> None:
        self.window, self.batch_size = window, batch_size
        self.layers = [LayerKVCache(window) for _ in range(num_layers)]
        self.length = 0

    def room(self) -> int:
        """How many more tokens each sequence may take."""
        return self.window - self.length

    def advance(self, num_new: int) -> None:
        """Count `num_new` more tokens seen (the model calls this after each forward pass)."""
        self.length += num_new

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, window={self.window}, batch_size={self.batch_size}, length={self.length})"


class PaddedKVCache:
    """The caches of all layers for up to `max_rows` sequences of different lengths, one row each (see the
    module docstring). A forward pass through it takes one new token per row for the first `batch_size`
    rows; `store` puts a sequence prefilled in a `KVCache` into a row, `move` compacts rows when one leaves."""

    def __init__(
        self,
        num_layers: int,
        window: int,
        max_rows: int,
        kv_heads: int,
        d_k: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self.window, self.max_rows = window, max_rows
        self.batch_size = 0  # the rows in use: 0 .. batch_size - 1
        self.lengths = [0] * max_rows
        # For the current step: the rows, their positions, their keys' mask and the keys the step reads.
        self._layout: tuple[Tensor, Tensor, Tensor, int] | None = None
        self._key_index = torch.arange(window, device=device)
        self._rows = torch.arange(max_rows, device=device)
        shape = (max_rows, kv_heads, window, d_k)
        # Zeros, not empty: a masked key's probability is exactly 0, and 0 times a finite value is 0.
        self.layers = [
            PaddedLayerKVCache(
                self,
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(
        cls, config: ModelConfig, max_rows: int, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> PaddedKVCache:
        """The cache a model of `config` fills: one layer each of its blocks, its context length as the
        window, its key/value heads and head dimension."""
        return cls(
            config.num_layers,
            config.context_length,
            max_rows,
            config.kv_heads,
            config.head_dim,
            dtype,
            device,
        )

    def store(self, row: int, cache: KVCache, sequence: int = 0) -> None:
        """Copy sequence `sequence` of `cache` (a prefill's: batch size 1, or a batch of prompts of one length)
        into `row`."""
        if not 0 <= sequence < cache.batch_size or cache.length > self.window:
            raise ScratchlmError(
                f"a row takes one sequence of at most {self.window} tokens; got sequence {sequence} of {cache!r}"
            )
        for mine, theirs in zip(self.layers, cache.layers, strict=True):
            mine.keys[row, :, : cache.length] = theirs.keys[sequence, :, : cache.length].to(mine.keys.dtype)
            mine.values[row, :, : cache.length] = theirs.values[sequence, :, : cache.length].to(
                mine.values.dtype
            )
        self.lengths[row] = cache.length
        self._layout = None

    def move(self, source: int, target: int) -> None:
        """Copy row `source` (its tokens so far) into row `target`."""
        length = self.lengths[source]
        for layer in self.layers:
            layer.keys[target, :, :length] = layer.keys[source, :, :length]
            layer.values[target, :, :length] = layer.values[source, :, :length]
        self.lengths[target] = length
        self._layout = None

    def room(self) -> int:
        """How many more tokens each row in use may take: the longest row's room."""
        return self.window - max(self.lengths[: self.batch_size], default=0)

    def advance(self, num_new: int) -> None:
        """Each of the first `batch_size` rows has seen `num_new` more tokens."""
        for row in range(self.batch_size):
            self.lengths[row] += num_new
        self._layout = None

    def layout(
        self,
    ) -> tuple[Int[Tensor, " batch"], Int[Tensor, " batch"], Bool[Tensor, "batch 1 1 keys"], int]:
        """For this step (computed once, for every layer): the rows in use, each row's new position (its
        length), which keys each row's query sees (its own tokens and the new one), and how many keys the
        longest row has (the window the step computes on)."""
        if self._layout is None:
            lengths = self.lengths[: self.batch_size]
            positions = torch.tensor(lengths, device=self._key_index.device)
            num_keys = max(lengths) + 1
            mask = self._key_index[:num_keys] <= positions[:, None]
            self._layout = self._rows[: self.batch_size], positions, mask[:, None, None, :], num_keys
        return self._layout

    def __repr__(self) -> str:
        return f"PaddedKVCache(layers={len(self.layers)}, window={self.window}, rows={self.batch_size}/{self.max_rows})"


class PaddedLayerKVCache:
    """One layer's rows of a `PaddedKVCache`: keys (after the position encoding) and values,
    `(max_rows, kv_heads, window, d_k)` each."""

    def __init__(self, owner: PaddedKVCache, keys: Tensor, values: Tensor) -> None:
        self.owner, self.keys, self.values = owner, keys, values

    def append(
        self,
        keys: Float[Tensor, "batch kv_heads 1 d_k"],
        values: Float[Tensor, "batch kv_heads 1 d_k"],
    ) -> tuple[Float[Tensor, "batch kv_heads keys d_k"], Float[Tensor, "batch kv_heads keys d_k"]]:
        """Write each row's new key and value at that row's length; return the rows up to the longest."""
        if keys.shape[-2] != 1:
            raise ScratchlmError(f"a padded cache takes one new token per row, got {keys.shape[-2]}")
        rows, positions, _, num_keys = self.owner.layout()
        # In the cache's dtype: the keys of a model run under autocast over float32 weights arrive in the
        # autocast dtype, those of a model held in bf16 in bf16.
        self.keys[rows, :, positions] = keys[:, :, 0].to(self.keys.dtype)
        self.values[rows, :, positions] = values[:, :, 0].to(self.values.dtype)
        return self.keys[: len(rows), :, :num_keys], self.values[: len(rows), :, :num_keys]

    def attention_layout(self) -> tuple[Int[Tensor, "batch 1 1"], Bool[Tensor, "batch 1 1 keys"]]:
        """Row r's query is at position `lengths[r]` and sees keys `0 .. lengths[r]`."""
        _, positions, mask, _ = self.owner.layout()
        return positions[:, None, None], mask


class WholeWindowKVCache:
    """The first `rows` rows of `cache` for a compiled decode step (see the module docstring), over the first
    `window` positions of each row (default: all of them). Row r's new token is written at `positions[r]`,
    which must be below `window`, and its query sees keys `0 .. positions[r]`; the caller fills `positions`
    before each step (`set_positions`) and counts the tokens itself, so `advance` does nothing. Rows past the
    sequences in use (a batch rounded up to `rows`) compute on whatever they hold, and write their keys and
    values at their own position in rows no sequence uses."""

    def __init__(self, cache: PaddedKVCache, rows: int, window: int | None = None) -> None:
        if not 1 <= rows <= cache.max_rows:
            raise ScratchlmError(f"a whole-window view takes 1 to {cache.max_rows} rows, got {rows}")
        window = cache.window if window is None else window
        if not 1 <= window <= cache.window:
            raise ScratchlmError(f"a whole-window view takes 1 to {cache.window} positions, got {window}")
        self.window, self.batch_size = window, rows
        device = cache.layers[0].keys.device
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.key_index = torch.arange(self.window, device=device)
        self.row_index = torch.arange(rows, device=device)
        self.layers = [WholeWindowLayerKVCache(self, layer.keys, layer.values) for layer in cache.layers]

    def tensors(self) -> list[Tensor]:
        """Every tensor a step reads or writes in place: they keep their addresses (CUDA graphs replay on
        them)."""
        held = [t for layer in self.layers for t in (layer.keys, layer.values)]
        return [*held, self.positions, self.key_index, self.row_index]

    def over(self, tensors: Sequence[Tensor]) -> WholeWindowKVCache:
        """The same view reading and writing `tensors` (in the order of `tensors()`) instead of its own: what
        a step traced into a graph takes as its inputs."""
        view = copy.copy(self)
        *held, view.positions, view.key_index, view.row_index = tensors
        view.layers = [
            WholeWindowLayerKVCache(view, keys, values)
            for keys, values in zip(held[0::2], held[1::2], strict=True)
        ]
        return view

    def set_positions(self, lengths: list[int]) -> None:
        """Each row's length, the position of its next token (missing rows: 0)."""
        padded = lengths + [0] * (self.batch_size - len(lengths))
        self.positions.copy_(torch.tensor(padded), non_blocking=True)

    def room(self) -> int:
        return 1  # a step takes one token a row; the caller keeps each row within the window

    def advance(self, num_new: int) -> None:
        """Nothing: the caller counts the tokens (a step reads its positions, never changes them)."""

    def __repr__(self) -> str:
        return f"WholeWindowKVCache(layers={len(self.layers)}, window={self.window}, rows={self.batch_size})"


class WholeWindowLayerKVCache:
    """One layer of a `WholeWindowKVCache`: the whole `(max_rows, kv_heads, context, d_k)` tensors of the
    `PaddedKVCache` it views, of which a step uses the first `rows` and their first `window` positions."""

    def __init__(self, owner: WholeWindowKVCache, keys: Tensor, values: Tensor) -> None:
        self.owner, self.keys, self.values = owner, keys, values

    def append(
        self,
        keys: Float[Tensor, "rows kv_heads 1 d_k"],
        values: Float[Tensor, "rows kv_heads 1 d_k"],
    ) -> tuple[Float[Tensor, "rows kv_heads window d_k"], Float[Tensor, "rows kv_heads window d_k"]]:
        rows, positions = self.owner.row_index, self.owner.positions
        self.keys[rows, :, positions] = keys[:, :, 0].to(self.keys.dtype)
        self.values[rows, :, positions] = values[:, :, 0].to(self.values.dtype)
        n, window = self.owner.batch_size, self.owner.window
        return self.keys[:n, :, :window], self.values[:n, :, :window]

    def attention_layout(self) -> tuple[Int[Tensor, "rows 1 1"], Bool[Tensor, "rows 1 1 window"]]:
        positions = self.owner.positions
        mask = self.owner.key_index <= positions[:, None]
        return positions[:, None, None], mask[:, None, None, :]
