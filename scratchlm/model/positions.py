"""Where a token is: the position encoding applied to queries and keys (`config.positions`). RoPE rotates
them by angles proportional to their positions, so that a score depends only on how far apart two tokens
are; NoPE leaves them as they are.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import at_least_float32
from scratchlm.model.part import Device


class RotaryPositionalEmbedding(nn.Module):
    """RoPE: rotate each adjacent pair `(x[2k], x[2k+1])` of a query or key at position i by the angle
    `i · θ^(-2k/d_k)`. A dot product of two rotated vectors depends on the difference of their positions
    only, which is how attention learns relative order. No parameters: the cosines and sines of every
    position below `max_seq_len` are computed once, in float64, and kept as non-persistent buffers (they
    follow the module to a device but are not saved in a state dict)."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device: Device = None) -> None:
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
        return self._rotate(x, self.cos[token_positions], self.sin[token_positions])

    def encode_from(self, x: Float[Tensor, "... seq d_k"], start: int) -> Float[Tensor, "... seq d_k"]:
        """`forward` at the consecutive positions `start, start + 1, …` (below `max_seq_len`): a slice of the
        table rather than a gather."""
        stop = start + x.shape[-2]
        return self._rotate(x, self.cos[start:stop], self.sin[start:stop])

    @staticmethod
    def _rotate(
        x: Float[Tensor, "... seq d_k"],
        cos: Float[Tensor, "... seq half"],
        sin: Float[Tensor, "... seq half"],
    ) -> Float[Tensor, "... seq d_k"]:
        # (... d_k) -> (... half 2): the pairs. `unflatten`/`flatten` rather than einops here: RoPE runs twice
        # per layer at every decoded token, where einops' parsing costs as much as the arithmetic.
        pairs = at_least_float32(x.unflatten(-1, (-1, 2)))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


class NoPositionEncoding(nn.Module):
    """NoPE: queries and keys are left as they are. Causal attention alone still tells a token how many
    tokens precede it (Haviv et al., 2022)."""

    def forward(
        self, x: Float[Tensor, "... seq d_k"], token_positions: Int[Tensor, "... seq"]
    ) -> Float[Tensor, "... seq d_k"]:
        return x

    def encode_from(self, x: Float[Tensor, "... seq d_k"], start: int) -> Float[Tensor, "... seq d_k"]:
        return x


def position_encoding(config: ModelConfig, device: Device = None) -> nn.Module:
    """The position encoding `config.positions` names, applied to queries and keys: a module called as
    `encoding(x, token_positions)`, or `encoding.encode_from(x, start)` for the consecutive positions from
    `start` on. The KV cache keeps keys already encoded, at their absolute positions, so a decode step
    encodes only its new tokens."""
    if config.positions == "rope":
        return RotaryPositionalEmbedding(config.rope_theta, config.head_dim, config.context_length, device)
    return NoPositionEncoding()
