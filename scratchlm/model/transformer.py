"""A decoder-only Transformer language model in the LLaMA style (pre-norm RMSNorm, RoPE, SwiGLU, no biases).

    token ids (... seq)
      -> token_embeddings                      (... seq d_model)
      -> num_layers × TransformerBlock:        x = x + attn(ln1(x));  x = x + ffn(ln2(x))
      -> ln_final -> lm_head                   (... seq vocab)   unnormalised logits

The ablations of the experiments are switches of `ModelConfig`: `norm="post"` puts the RMSNorms after each
residual addition as in the original Transformer (`x = ln1(x + attn(x))`, `x = ln2(x + ffn(x))`; the block's
output is already normalised, so there is no `ln_final`), `norm="none"` drops every RMSNorm, `positions="none"`
drops RoPE (causal attention alone still tells a token how many tokens precede it), `ffn="silu"` swaps SwiGLU
for `W2 silu(W1 x)`, and `tie_embeddings` makes the LM head reuse the token embedding matrix. The fast
recipe's switches are `qk_norm` (`scratchlm.model.attention`) and `ffn="relu2"` (`scratchlm.model.ffn`),
`zero_init` (each block's output projections start at zero, so the model starts as embeddings -> head and
every block learns a change of the residual stream from nothing), `logit_softcap` (`c · tanh(z / c)`),
`value_embeddings` and `unet_skips` (both from modded-nanogpt):

    value_embeddings = n:  block i and block L - n + i (i < n) add a table of their own, ve_i[token], to the
                           attention values (`MultiHeadSelfAttention`): a token's identity reaches the tokens
                           that attend to it directly, without first crossing the residual stream.
    unet_skips:            x_i = the output of block i; block L - 1 - i (i < L / 2) reads x + w_i · x_i, with
                           a learnt weight w_i starting at 1, as a U-Net's decoder reads its encoder: the late
                           blocks see the early, less processed representation.

Whatever is absent is absent from the state dict, and the default configuration has exactly the reference
implementation's state-dict keys.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from scratchlm.errors import ScratchlmError
from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.config import ModelConfig
from scratchlm.model.ffn import feed_forward
from scratchlm.model.kv_cache import (
    KVCache,
    LayerKVCache,
    PaddedKVCache,
    WholeWindowKVCache,
    check_fits,
    decode_dtype,
)
from scratchlm.model.layers import Embedding, Linear, RMSNorm, at_least_float32
from scratchlm.model.loss import cross_entropy, fused_linear_cross_entropy
from scratchlm.model.part import ConfigModule, Device, DType, handout_config


class TransformerBlock(ConfigModule):
    """Causal self-attention then a feed-forward network, each inside a residual connection, with RMSNorm
    before each (pre-norm, default), after each addition (post-norm), or nowhere (`config.norm`)."""

    def __init__(self, config: ModelConfig, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.norm = config.norm
        with_norms = config.norm != "none"
        self.ln1 = RMSNorm(config.d_model, config.norm_eps, device, dtype) if with_norms else None
        self.attn = MultiHeadSelfAttention(config, device, dtype)
        self.ln2 = RMSNorm(config.d_model, config.norm_eps, device, dtype) if with_norms else None
        self.ffn = feed_forward(config, device, dtype)
        if config.zero_init:  # after the random init, so the other weights are those of zero_init=False
            with torch.no_grad():
                self.attn.output_proj.weight.zero_()
                self.ffn.w2.weight.zero_()

    @classmethod
    def from_handout(
        cls,
        d_model: int,
        num_heads: int,
        d_ff: int,
        max_seq_len: int,
        theta: float | None = 10_000.0,
        *,
        device: Device = None,
        dtype: DType = None,
        **switches: Any,
    ) -> TransformerBlock:
        """The handout's signature (`theta=None`: no position encoding); other `ModelConfig` fields (`norm`,
        `ffn`, ...) as keyword arguments."""
        return cls(handout_config(d_model, num_heads, d_ff, max_seq_len, theta, **switches), device, dtype)

    def forward(
        self,
        x: Float[Tensor, "... seq d_model"],
        kv_cache: LayerKVCache | None = None,
        value_embedding: Float[Tensor, "... seq d_kv"] | None = None,
    ) -> Float[Tensor, "... seq d_model"]:
        # The one place where the normalisation's placement (`config.norm`) is decided.
        def attn(h: Tensor) -> Tensor:
            return self.attn(h, kv_cache=kv_cache, value_embedding=value_embedding)

        if self.norm == "pre":
            x = x + attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        if self.norm == "post":
            x = self.ln1(x + attn(x))
            return self.ln2(x + self.ffn(x))
        x = x + attn(x)
        return x + self.ffn(x)


class TransformerLM(ConfigModule):
    """Token ids `(..., seq)` -> next-token logits `(..., seq, vocab_size)`, `seq <= context_length`.

    With a `kv_cache` (from `new_kv_cache`), `token_ids` `(batch, n)` are the tokens that follow those the
    cache has seen; with a `PaddedKVCache`, `(batch, 1)`: one token per row, each row at its own position. See
    `scratchlm.model.kv_cache`.
    """

    def __init__(self, config: ModelConfig, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(config, device, dtype) for _ in range(config.num_layers))
        d_kv = config.kv_heads * config.head_dim
        self.value_embeddings = (
            nn.ModuleList(
                Embedding(config.vocab_size, d_kv, device=device, dtype=dtype)
                for _ in range(config.value_embeddings)
            )
            if config.value_embeddings
            else None
        )
        self.skip_weights = (
            nn.Parameter(torch.ones(config.num_layers // 2, device=device, dtype=dtype))
            if config.unet_skips
            else None
        )
        # A post-norm block already ends with an RMSNorm; with norm="none" there is none anywhere.
        self.ln_final = (
            RMSNorm(config.d_model, config.norm_eps, device, dtype) if config.norm == "pre" else None
        )
        self.lm_head = Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        # Set by `prepare_for_inference` where PyTorch's own matrix-vector kernels measured faster than
        # oneDNN's (bf16 on a CPU with native bf16: 29 GB/s against 15 on an AVX-512-BF16 EPYC): a forward pass
        # over one token (a decode step at batch 1) then runs without oneDNN. oneDNN stays for everything else,
        # where it is the faster by far (4 tokens and more, it is 2-8x faster on that CPU).
        self.one_token_without_onednn = False
        # Set by `prepare_for_inference`: generation may compile its decode steps
        # (`scratchlm.generation.decode`).
        self.compiled_decode = False
        if config.tie_embeddings:
            # One matrix for both ends. It takes the LM head's initialisation (std ≈ sqrt(2 / (vocab + d_model)))
            # rather than the embedding's N(0, 1): unit-variance rows would make the initial logits
            # sqrt(d_model) times too large.
            self.token_embeddings.weight = self.lm_head.weight

    @classmethod
    def from_handout(
        cls,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int | None = None,
        rope_theta: float = 10_000.0,
        *,
        device: Device = None,
        dtype: DType = None,
        **switches: Any,
    ) -> TransformerLM:
        """The CS336 assignment-1 handout's signature; other `ModelConfig` fields (`norm`, `positions`, `tie_embeddings`, ...)
        as keyword arguments."""
        sizes = {"vocab_size": vocab_size, "num_layers": num_layers}
        config = handout_config(d_model, num_heads, d_ff, context_length, rope_theta, **sizes, **switches)
        return cls(config, device, dtype)

    def forward(
        self,
        token_ids: Int[Tensor, "... seq"],
        kv_cache: KVCache | PaddedKVCache | WholeWindowKVCache | None = None,
        targets: Int[Tensor, "... seq"] | None = None,
        last_only: bool = False,
    ) -> Float[Tensor, "... seq vocab_size"] | Float[Tensor, ""]:
        """The logits; with `targets`, instead, the mean cross-entropy loss of predicting them, computed with
        the LM head over chunks of tokens so that the logits never exist whole
        (`scratchlm.model.loss.fused_linear_cross_entropy`; equal to `cross_entropy(model(ids), targets)`).
        `last_only`: the logits of the last position alone, `(..., 1, vocab_size)`, which is what generating
        after a prompt needs; the LM head is then one row's product instead of one a position (for a prompt
        of 200 tokens and a vocabulary of 10,000, a third of the pass)."""
        if not (self.one_token_without_onednn and token_ids.numel() == 1):
            return self._forward(token_ids, kv_cache, targets, last_only)
        onednn = torch.backends.mkldnn  # a process-wide switch (its `flags()` context warns on every CPU)
        enabled, onednn.enabled = onednn.enabled, False
        try:
            return self._forward(token_ids, kv_cache, targets, last_only)
        finally:
            onednn.enabled = enabled

    def _forward(
        self,
        token_ids: Int[Tensor, "... seq"],
        kv_cache: KVCache | PaddedKVCache | WholeWindowKVCache | None,
        targets: Int[Tensor, "... seq"] | None,
        last_only: bool = False,
    ) -> Float[Tensor, "... seq vocab_size"] | Float[Tensor, ""]:
        seq = token_ids.shape[-1]
        if seq > self.config.context_length:
            raise ScratchlmError(
                f"input of {seq} tokens is longer than the model's context_length ({self.config.context_length})"
            )
        if kv_cache is not None:
            check_fits(kv_cache, token_ids)
        layer_caches = kv_cache.layers if kv_cache is not None else [None] * len(self.layers)

        x = self.token_embeddings(token_ids)
        tables = (
            [] if self.value_embeddings is None else [table(token_ids) for table in self.value_embeddings]
        )
        skips: list[Tensor] = []  # unet_skips: the outputs of the first half's blocks, the latest last
        num_skips = 0 if self.skip_weights is None else len(self.skip_weights)
        for i, (block, layer_cache) in enumerate(zip(self.layers, layer_caches, strict=True)):
            if i >= len(self.layers) - num_skips:  # block L - 1 - j reads block j's output
                x = x + self.skip_weights[len(self.layers) - 1 - i] * skips.pop()
            table = self.config.value_embedding_table(i)
            x = block(x, kv_cache=layer_cache, value_embedding=None if table is None else tables[table])
            if i < num_skips:
                skips.append(x)
        if self.ln_final is not None:
            x = self.ln_final(x)
        if kv_cache is not None:
            kv_cache.advance(seq)
        int8_head = self.lm_head.weight_scale is not None  # held in int8 for inference (`--quantize`)
        if targets is not None and not int8_head:
            hidden, weight = self.lm_head.as_one_product(x)  # (x, W), or with LoRA's columns on the head
            return fused_linear_cross_entropy(hidden, weight, targets, self.config.logit_softcap)
        logits = self.lm_head(x[..., -1:, :] if last_only else x)
        if self.config.logit_softcap:
            # In at least float32 (tanh in bfloat16 would round most logits): about the identity for |z| << c
            # and bounded by ±c, so no logit can run away from the others.
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(at_least_float32(logits) / cap)
        return logits if targets is None else cross_entropy(logits, targets)

    def decode(
        self, token_ids: Int[Tensor, "rows 1"], kv_cache: PaddedKVCache | WholeWindowKVCache
    ) -> Float[Tensor, "rows vocab_size"]:
        """One decode step: each row's newest token in, the logits of its next token out. What a compiled
        step traces (`scratchlm.generation.decode`): the forward pass alone, without `forward`'s process-wide
        switch of the one-token path (a compiled step does not run through oneDNN either way)."""
        return self._forward(token_ids, kv_cache, None)[:, -1]

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """The parameters by the role they play, which optimizers give settings of their own
        (`scratchlm.training.optim.parameter_groups`); the model declares them from its own structure:

        - "embeddings": the token embedding matrix (a row lookup; tied to the head, it is still this one) and
          the value-embedding tables;
        - "head": the output projection to the vocabulary, when it is a matrix of its own;
        - "gains": the RMSNorm gains and the U-net skip weights;
        - "matrices": the weight matrices of the blocks (attention's projections, the feed-forward's);
        - "adapters": what fine-tuning adds to those matrices (LoRA's low-rank factors, `scratchlm.model.lora`).

        Within a group the parameters keep the order of `parameters()`, the order optimizer states are saved
        in. The caller checks that the groups hold every parameter exactly once."""
        embeddings = [self.token_embeddings.weight]
        if self.value_embeddings is not None:
            embeddings += [table.weight for table in self.value_embeddings]
        head = [] if self.config.tie_embeddings else [self.lm_head.weight]
        gains = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        if self.skip_weights is not None:
            gains.append(self.skip_weights)
        matrices = [m.weight for m in self.layers.modules() if isinstance(m, Linear)]
        adapters = [p for m in self.modules() if isinstance(m, Linear) for p in m.adapters()]
        declared = {"matrices": matrices, "embeddings": embeddings, "head": head, "gains": gains}
        declared["adapters"] = adapters
        order = {id(p): i for i, p in enumerate(self.parameters())}
        return {name: sorted(params, key=lambda p: order.get(id(p), -1)) for name, params in declared.items()}

    def new_kv_cache(self, batch_size: int) -> KVCache:
        """An empty cache for generating `batch_size` sequences at once (it fills on the model's device, in
        the dtype of the keys it is given)."""
        return KVCache(len(self.layers), self.config.context_length, batch_size)

    def new_padded_kv_cache(self, max_rows: int) -> PaddedKVCache:
        """An empty cache of `max_rows` rows of different lengths (serving), preallocated on the model's device
        in the dtype a decode step attends in (`decode_dtype` of the weights' dtype, the dtype the model
        computes keys in for inference: `prepare_for_inference`; the embeddings', which stay in it when the
        matrices are held in int8)."""
        embeddings = self.token_embeddings
        dtype, device = embeddings.output_dtype, embeddings.weight.device
        return PaddedKVCache.for_model(self.config, max_rows, decode_dtype(dtype, device), device)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Trainable parameters, each shared tensor counted once. `non_embedding` leaves out the embedding
        tables (lookups, no compute): the value embeddings, and the token embedding matrix unless it is tied
        to the LM head, which uses it."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            total -= self.token_embeddings.weight.numel()
        if non_embedding and self.value_embeddings is not None:
            total -= sum(table.weight.numel() for table in self.value_embeddings)
        return total

    def extra_repr(self) -> str:
        params = self.num_parameters()
        return f"parameters={params:,} ({params / 1e6:.1f}M), non-embedding={self.num_parameters(True):,}"
