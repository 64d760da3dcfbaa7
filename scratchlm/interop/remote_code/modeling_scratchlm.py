"""scratchlm's decoder-only Transformer language model, written for transformers:
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` builds a `ScratchlmForCausalLM` from the
directory's config.json (`ScratchlmConfig`) and model.safetensors. It depends on torch and transformers only.

The model. Token ids t_1 … t_n become next-token logits through L blocks (0 … L-1) acting on a residual
stream of width d (`hidden_size`):

    h_0     = E[t]                                  E: the token embeddings (vocab × d)
    h_{l+1} = Block_l(h_l + s_l)                    l = 0 … L-1
    z       = W_head N(h_L)                         N: a final RMSNorm with pre-norm, none otherwise
    z       = c · tanh(z / c)                       with logit soft-capping (c = logit_softcap > 0)

where `RMSNorm(a) = a / sqrt(mean(a²) + ε) ⊙ g` (computed in float32 at least), W_head = E when the embeddings
are tied, and s_l = 0 except with U-net skips: block L - 1 - j reads block j's output, s_{L-1-j} = w_j h_{j+1}
for j < L / 2, with learnt scalars w_j (`skip_weights`). A block is attention then a feed-forward network, each
in a residual connection, normalised as `norm` says:

    pre:   x = x + Attn(N_1(x));  x = x + FFN(N_2(x))
    post:  x = N_1(x + Attn(x));  x = N_2(x + FFN(x))
    none:  x = x + Attn(x);       x = x + FFN(x)

Attention has H query heads and G key/value heads of size d_h = d / H (grouped-query attention when G < H:
query head h attends with key/value head h // (H / G)). Per token, q = W_Q x, k = W_K x and v = W_V x + V_j[t],
where V_j is a table of value embeddings (vocab × G d_h) for the first n and the last n blocks (block i and
block L - n + i use table i; n = `value_embeddings`). With `qk_norm`, each head of the queries, and of the keys,
goes through an RMSNorm whose gains (one per head dimension) its heads share. RoPE then rotates each adjacent
pair (x_{2k}, x_{2k+1}) of a query or key head at position p by the angle p · θ^(-2k / d_h) (NoPE: no
rotation). The scores q · k / sqrt(d_h) are causally masked and soft-maxed, and W_O maps the concatenated heads
back to d.

The feed-forward network is SwiGLU, `W_2 (silu(W_1 x) ⊙ W_3 x)`, or one of the ungated `W_2 silu(W_1 x)` and
`W_2 relu(W_1 x)²`. There are no biases.

The parameters keep scratchlm's names (`layers.0.attn.q_proj.weight`, ...) and layouts, so a scratchlm state
dict loads as it is. Keys and values are kept in transformers' cache (`DynamicCache`) after RMSNorm and RoPE,
and a 2-D `attention_mask` (1: a token, 0: padding) hides padding from every query, so that a left- or
right-padded row computes what it computes alone: RoPE's scores depend on the distance between two positions
only, so the positions that padding shifts change none of them.
"""

import dataclasses

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_scratchlm import ScratchlmConfig

# The output's name for the cache: `cache` in recent transformers, `past_key_values` before.
CACHE_FIELD = next(
    name
    for name in ("cache", "past_key_values")
    if name in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
)


def at_least_float32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


# The layers are written from tensor operations, as scratchlm's own are: no torch.nn layer or functional op.


class ScratchlmLinear(nn.Module):
    """y = x Wᵀ, without bias; W is (out, in), as in scratchlm and transformers."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))

    def forward(self, x):
        return x @ self.weight.t()


class ScratchlmEmbedding(nn.Module):
    """Row `i` of the table for token id `i`."""

    def __init__(self, num_embeddings, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids):
        return self.weight[ids]


def silu(x):
    return x * torch.sigmoid(x)


def attend(q, k, v, mask):
    """softmax(q kᵀ / sqrt(d_h)) v over the keys `mask` lets each query see, the softmax in float32 at least
    (its maximum subtracted first, so that no exp overflows)."""
    scores = at_least_float32(q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(v.dtype) @ v


def cross_entropy(logits, targets, ignore_index=-100):
    """The mean of -log softmax(logits)[target] over the targets that are not `ignore_index`."""
    logits = at_least_float32(logits)
    kept = targets != ignore_index
    logits, targets = logits[kept], targets[kept]
    picked = logits.gather(-1, targets[:, None])[:, 0]
    return (torch.logsumexp(logits, dim=-1) - picked).mean()


class ScratchlmRMSNorm(nn.Module):
    """`a / sqrt(mean(a²) + eps) ⊙ g`, in float32 at least, returned in the input's dtype."""

    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        x32 = at_least_float32(x)
        inv_rms = torch.rsqrt(x32.square().mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * at_least_float32(self.weight)).to(x.dtype)


class ScratchlmRotaryTable(nn.Module):
    """RoPE's cosines and sines by position, computed in float64 and kept in float32, as scratchlm's are. The
    table is neither a parameter nor a buffer (there is nothing to load): it is built on first use on each
    device, for the context length, and doubles when a sequence outgrows it."""

    def __init__(self, config):
        super().__init__()
        self.theta, self.head_dim = config.rope_theta, config.head_dim
        self.context_length = config.max_position_embeddings
        self.tables = {}  # device -> (cos, sin), each (positions, head_dim / 2)

    def forward(self, position_ids, length):
        """(cos, sin) of `position_ids` (batch, seq), each (batch, 1, seq, head_dim / 2); `length` bounds the
        positions."""
        cos, sin = self.tables.get(position_ids.device, (None, None))
        if cos is None or len(cos) < length:
            size = max(length, self.context_length, 0 if cos is None else 2 * len(cos))
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self.theta**-exponents)
            cos, sin = (t.float().to(position_ids.device) for t in (angles.cos(), angles.sin()))
            self.tables[position_ids.device] = cos, sin
        return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)


def rotate_pairs(x, cos, sin):
    """Rotate each adjacent pair (x_{2k}, x_{2k+1}) of the last dimension by the angle whose cosine and sine are
    cos[k] and sin[k]."""
    pairs = at_least_float32(x.unflatten(-1, (-1, 2)))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class ScratchlmAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        d, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = ScratchlmLinear(d, d)
        self.k_proj = ScratchlmLinear(d, kv)
        self.v_proj = ScratchlmLinear(d, kv)
        self.output_proj = ScratchlmLinear(d, d)
        if config.qk_norm:
            self.q_norm = ScratchlmRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = ScratchlmRMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, rotation, mask, cache, value_embedding):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(x)
        if value_embedding is not None:
            values = values + value_embedding.to(values.dtype)
        v = values.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotation is not None:
            q, k = rotate_pairs(q, *rotation), rotate_pairs(k, *rotation)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        heads = attend(q, k, v, mask)
        return self.output_proj(heads.transpose(1, 2).reshape(batch, seq, -1))


class ScratchlmMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind = config.ffn
        self.w1 = ScratchlmLinear(config.hidden_size, config.intermediate_size)
        self.w2 = ScratchlmLinear(config.intermediate_size, config.hidden_size)
        self.w3 = (
            ScratchlmLinear(config.hidden_size, config.intermediate_size) if self.kind == "swiglu" else None
        )

    def forward(self, x):
        hidden = self.w1(x)
        if self.kind == "swiglu":
            hidden = silu(hidden) * self.w3(x)
        elif self.kind == "silu":
            hidden = silu(hidden)
        else:
            hidden = hidden.clamp_min(0).square()
        return self.w2(hidden)


class ScratchlmBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm = config.norm
        norms = config.norm != "none"
        self.ln1 = ScratchlmRMSNorm(config.hidden_size, config.rms_norm_eps) if norms else None
        self.attn = ScratchlmAttention(config, layer_idx)
        self.ln2 = ScratchlmRMSNorm(config.hidden_size, config.rms_norm_eps) if norms else None
        self.ffn = ScratchlmMLP(config)

    def forward(self, x, rotation, mask, cache, value_embedding):
        def attn(h):
            return self.attn(h, rotation, mask, cache, value_embedding)

        if self.norm == "post":  # normalise each residual sum
            x = self.ln1(x + attn(x))
            return self.ln2(x + self.ffn(x))
        # "pre" normalises each sublayer's input; "none" has no norms at all
        ln1, ln2 = (self.ln1, self.ln2) if self.norm == "pre" else (unchanged, unchanged)
        x = x + attn(ln1(x))
        return x + self.ffn(ln2(x))


def unchanged(x):
    return x


def attention_mask_4d(attention_mask, past, seq, device):
    """Which keys each new query sees, (batch or 1, 1, seq, past + seq), True where it attends: the keys up to
    its own, less padding. A query always sees its own key, so that a padding row stays finite."""
    keys = torch.arange(past + seq, device=device)
    causal = keys <= keys[past:, None]
    if attention_mask is None:
        return causal[None, None]
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != past + seq:
        raise ValueError(
            f"attention_mask must be (batch, {past + seq}): the cached and the new tokens; "
            f"got {tuple(attention_mask.shape)}"
        )
    own = keys == keys[past:, None]
    return causal & (attention_mask.bool()[:, None, None, :] | own)


class ScratchlmPreTrainedModel(PreTrainedModel):
    config_class = ScratchlmConfig
    base_model_prefix = ""
    _no_split_modules = ["ScratchlmBlock"]

    def _init_weights(self, module):
        # A model built from a config alone (from_pretrained overwrites these): small normal weights.
        if isinstance(module, ScratchlmLinear | ScratchlmEmbedding):
            module.weight.data.normal_(0.0, 0.02)


class ScratchlmForCausalLM(ScratchlmPreTrainedModel, GenerationMixin):
    """The language model of the module docstring, under scratchlm's parameter names; with
    `tie_word_embeddings`, transformers makes `lm_head.weight` the token embedding matrix."""

    _tied_weights_keys = {"lm_head.weight": "token_embeddings.weight"}

    def __init__(self, config):
        super().__init__(config)
        d, layers = config.hidden_size, config.num_hidden_layers
        self.token_embeddings = ScratchlmEmbedding(config.vocab_size, d)
        self.layers = nn.ModuleList(ScratchlmBlock(config, i) for i in range(layers))
        kv = config.num_key_value_heads * config.head_dim
        tables = config.value_embeddings
        self.value_embeddings = (
            nn.ModuleList(ScratchlmEmbedding(config.vocab_size, kv) for _ in range(tables))
            if tables
            else None
        )
        self.skip_weights = nn.Parameter(torch.ones(layers // 2)) if config.unet_skips else None
        self.ln_final = ScratchlmRMSNorm(d, config.rms_norm_eps) if config.norm == "pre" else None
        self.lm_head = ScratchlmLinear(d, config.vocab_size)
        self.rotary = ScratchlmRotaryTable(config) if config.positions == "rope" else None
        self.post_init()

    def get_input_embeddings(self):
        return self.token_embeddings

    def set_input_embeddings(self, value):
        self.token_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def value_table(self, layer):
        """The value-embedding table block `layer` uses: tables 0 … n-1 serve the first n blocks and, in the
        same order, the last n; None for the blocks between."""
        n, layers = self.config.value_embeddings, self.config.num_hidden_layers
        if layer < n:
            return layer
        if layer >= layers - n:
            return layer - (layers - n)
        return None

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        """Logits for `input_ids` (batch, seq) (or `inputs_embeds`, without value embeddings), the tokens after
        those `cache` (`past_key_values`) holds; with `labels`, also the mean cross-entropy of predicting each
        next label (-100: ignored). `logits_to_keep` > 0 computes the logits of the last positions only. The
        other keywords transformers passes (`cache_position`, `return_dict`, ...) tell this model nothing it
        does not know already."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if input_ids is None and self.value_embeddings is not None:
            raise ValueError("value embeddings are looked up by token id: give input_ids, not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        x = self.token_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:  # padding shifts a row's positions alike, which changes none of its scores
            position_ids = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        rotation = None if self.rotary is None else self.rotary(position_ids, past + seq)
        mask = attention_mask_4d(attention_mask, past, seq, x.device)

        tables = (
            [] if self.value_embeddings is None else [table(input_ids) for table in self.value_embeddings]
        )
        layers = len(self.layers)
        skips = 0 if self.skip_weights is None else len(self.skip_weights)
        outputs = []  # with U-net skips: the outputs of the first half's blocks, the latest last
        for i, block in enumerate(self.layers):
            if i >= layers - skips:
                x = x + self.skip_weights[layers - 1 - i] * outputs.pop()
            table = self.value_table(i)
            x = block(x, rotation, mask, cache, None if table is None else tables[table])
            if i < skips:
                outputs.append(x)
        if self.ln_final is not None:
            x = self.ln_final(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(at_least_float32(logits) / cap)

        loss = None
        if labels is not None:
            loss = cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device))
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
