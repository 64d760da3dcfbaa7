"""An independent Transformer LM built from torch.nn modules, the oracle of the model tests.

Same architecture and state-dict names as scratchlm's `TransformerLM` (so one state dict loads into both), but
made of `nn.Embedding`, `nn.Linear`, `nn.RMSNorm`, `F.silu`, `F.scaled_dot_product_attention` and a RoPE written
with complex numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scratchlm import ModelConfig


def complex_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Adjacent pairs as complex numbers, multiplied by e^{i·pos·θ^(-2k/d)}."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[..., None] * freqs
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(rotated).reshape(x.shape).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        kv_dim = c.kv_heads * c.head_dim
        self.q_proj, self.output_proj = (nn.Linear(c.d_model, c.d_model, bias=False) for _ in range(2))
        self.k_proj, self.v_proj = (nn.Linear(c.d_model, kv_dim, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *batch, seq, d = x.shape
        h = self.c.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*batch, seq, -1, d // h).transpose(-2, -3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if self.c.positions == "rope":
            pos = torch.arange(seq)
            q, k = complex_rope(q, pos, self.c.rope_theta), complex_rope(k, pos, self.c.rope_theta)
        gqa = self.c.kv_heads < h  # grouped-query attention: torch repeats each K/V head over its group
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.output_proj(out.transpose(-2, -3).reshape(*batch, seq, d))


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gated = c.ffn == "swiglu"
        self.w1 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=False)
        if self.gated:
            self.w3 = nn.Linear(c.d_model, c.d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w1(x))
        return self.w2(hidden * self.w3(x) if self.gated else hidden)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.norm = c.norm
        if c.norm != "none":
            self.ln1, self.ln2 = nn.RMSNorm(c.d_model, eps=1e-5), nn.RMSNorm(c.d_model, eps=1e-5)
        self.attn, self.ffn = Attention(c), FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm == "pre":
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        if self.norm == "post":
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.ffn(x))
        x = x + self.attn(x)
        return x + self.ffn(x)


class ReferenceLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.token_embeddings = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        if c.norm == "pre":
            self.ln_final = nn.RMSNorm(c.d_model, eps=1e-5)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token_embeddings(ids)
        for block in self.layers:
            x = block(x)
        if self.c.norm == "pre":
            x = self.ln_final(x)
        return self.lm_head(x)


def reference_from(model: nn.Module) -> ReferenceLM:
    """A reference model holding a copy of `model`'s weights (loaded through the state dict)."""
    reference = ReferenceLM(model.config)
    reference.load_state_dict(model.state_dict(), strict=True)
    return reference


def assert_matches_reference(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """`model`'s logits and the gradients of its cross-entropy equal those of its `reference_from` twin."""
    reference = reference_from(model)
    logits, expected = model(tokens), reference(tokens)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    ours = dict(model.named_parameters())
    for key, param in reference.named_parameters():
        torch.testing.assert_close(ours[key].grad, param.grad, atol=2e-5, rtol=1e-3, msg=key)
