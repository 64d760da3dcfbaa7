"""The feed-forward network of a block, `d_model -> d_ff -> d_model`, applied to every token on its own:
`SwiGLU`, the gated `W2 (silu(W1 x) ⊙ W3 x)` (Shazeer, 2020), LLaMA's and the default; `SiLUFeedForward`, the
ungated `W2 silu(W1 x)` that the SwiGLU ablation compares it with; and `ReLUSquaredFeedForward`,
`W2 relu(W1 x)²` (So et al., 2021), the fast recipe's. `config.ffn` picks one (`FEED_FORWARDS`).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Linear, LinearStack
from scratchlm.model.part import Device, DType


def silu(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    """SiLU (swish): `x · σ(x)`, a ReLU that is smooth at 0."""
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """The gated feed-forward network `W2 (silu(W1 x) ⊙ W3 x)`: `W1, W3: (d_ff, d_model)`, `W2: (d_model, d_ff)`."""

    def __init__(self, d_model: int, d_ff: int, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w13 = LinearStack(self.w1, self.w3)  # one matmul at inference

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        gate, up = self.w13(x)
        return self.w2(silu(gate) * up)


class UngatedFeedForward(nn.Module):
    """`W2 act(W1 x)`, `W1: (d_ff, d_model)`, `W2: (d_model, d_ff)`: the classic two-matrix feed-forward
    network; a subclass names its activation. With `d_ff = 4 d_model` it has as many parameters as SwiGLU with
    `d_ff = 8/3 d_model`."""

    def __init__(self, d_model: int, d_ff: int, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    @staticmethod
    def activation(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
        raise NotImplementedError

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        return self.w2(self.activation(self.w1(x)))


class SiLUFeedForward(UngatedFeedForward):
    """`W2 silu(W1 x)`, the ungated network that the SwiGLU ablation compares with."""

    activation = staticmethod(silu)


def relu_squared(x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    return x.clamp_min(0).square()


class ReLUSquaredFeedForward(UngatedFeedForward):
    """`W2 relu(W1 x)²` (Primer, So et al., 2021). Squaring makes the activation sparse (half the
    pre-activations are exactly 0) yet smooth where it is active; modded-nanogpt and nanochat use it in place
    of SwiGLU."""

    activation = staticmethod(relu_squared)


#: `ModelConfig.ffn` -> the feed-forward network of every block; each takes `(d_model, d_ff, device, dtype)`.
FEED_FORWARDS: dict[str, type[nn.Module]] = {
    "swiglu": SwiGLU,
    "silu": SiLUFeedForward,
    "relu2": ReLUSquaredFeedForward,
}


def feed_forward(config: ModelConfig, device: Device = None, dtype: DType = None) -> nn.Module:
    """The feed-forward network `config.ffn` names, `d_model -> d_ff -> d_model`."""
    return FEED_FORWARDS[config.ffn](config.d_model, config.d_ff, device=device, dtype=dtype)
