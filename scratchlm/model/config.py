"""The model's hyperparameters in one dataclass, saved inside every checkpoint.

The defaults are the specification's TinyStories model (≈17M non-embedding parameters). The ablation switches
of the experiments are fields too: `norm` (pre-norm, post-norm, or no RMSNorm at all), `positions` (RoPE or
none, i.e. NoPE), `ffn` (SwiGLU, or a SiLU MLP `W2 silu(W1 x)`) and `tie_embeddings` (the LM head reuses the
token embedding matrix).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from scratchlm.errors import ScratchlmError

NORMS = ("pre", "post", "none")
POSITIONS = ("rope", "none")
FFNS = ("swiglu", "silu")


def default_d_ff(d_model: int, ffn: str = "swiglu") -> int:
    """SwiGLU: 8/3 · d_model rounded to a multiple of 64 (1,344 for 512); SiLU: 4 · d_model, the same
    parameter count as SwiGLU's three matrices."""
    if ffn == "silu":
        return 4 * d_model
    return max(64, round(8 * d_model / 3 / 64) * 64)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 10_000
    context_length: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 16
    d_ff: int | None = None  # None: `default_d_ff(d_model, ffn)`
    rope_theta: float = 10_000.0
    norm: Literal["pre", "post", "none"] = "pre"
    positions: Literal["rope", "none"] = "rope"
    ffn: Literal["swiglu", "silu"] = "swiglu"
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model, self.ffn))
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ScratchlmError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ScratchlmError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads ({self.num_heads})"
            )
        if self.positions == "rope" and (self.d_model // self.num_heads) % 2:
            raise ScratchlmError(
                f"RoPE needs an even head dimension, got d_model/num_heads = {self.head_dim}"
            )
        if not self.rope_theta > 0:
            raise ScratchlmError(f"model.rope_theta must be positive, got {self.rope_theta!r}")
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS), ("ffn", FFNS)):
            if getattr(self, name) not in allowed:
                raise ScratchlmError(
                    f"model.{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}"
                )
        if not isinstance(self.tie_embeddings, bool):
            raise ScratchlmError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_parameters(self) -> int:
        """Trainable parameters, from the formulas of `scratchlm.model.accounting` (equal to
        `TransformerLM.num_parameters()` of a model built from this config; tested)."""
        from scratchlm.model.accounting import num_parameters

        return num_parameters(self)

    @property
    def flops_per_token(self) -> int:
        """Training FLOPs per token of a full-context sequence: forward + backward of every matmul (the
        handout's 3 × forward count, attention scores included), from `scratchlm.model.accounting`. The
        numerator of the MFU estimate."""
        from scratchlm.model.accounting import train_step_flops

        return train_step_flops(self, batch_size=1) // self.context_length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ScratchlmError(
                f"unknown model setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)
