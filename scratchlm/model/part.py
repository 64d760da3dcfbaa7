"""How a model part is built (`ConfigModule`): from the model's `ModelConfig`, or from the loose arguments of
the CS336 assignment-1 handout's signatures, which the public API keeps.
"""

from __future__ import annotations

import inspect
from typing import Any, Self

import torch
from torch import nn

from scratchlm.model.config import ModelConfig

Device = torch.device | str | None
DType = torch.dtype | None


class HandoutSignature(type):
    """The metaclass of the model classes built from a `ModelConfig` (`ConfigModule`).

    `Part(config, device, dtype)` is the one constructor. Called with anything else, such as the loose
    arguments of the CS336 assignment-1 handout's signatures (`TransformerLM(vocab_size, context_length,
    d_model, num_layers, num_heads, d_ff, rope_theta)`, which the public API keeps), a class is built by its
    `from_handout`: a thin function that makes the config from those arguments and calls the constructor."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if (args and isinstance(args[0], ModelConfig)) or "config" in kwargs:
            return super().__call__(*args, **kwargs)
        if not hasattr(cls, "from_handout"):
            raise TypeError(f"{cls.__name__} takes a ModelConfig")
        return cls.from_handout(*args, **kwargs)

    @property
    def __signature__(cls) -> inspect.Signature:
        """What `inspect.signature(Part)` and `help` show: the constructor's, not this `__call__`'s."""
        signature = inspect.signature(cls.__init__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


class ConfigModule(nn.Module, metaclass=HandoutSignature):
    """A model part whose constructor takes the model's `ModelConfig`: the config flows down from
    `TransformerLM` and every part reads what it needs from it."""

    @classmethod
    def from_config(cls, config: ModelConfig, device: Device = None, dtype: DType = None) -> Self:
        return cls(config, device, dtype)


def handout_config(
    d_model: int, num_heads: int, d_ff: int | None, max_seq_len: int, theta: float | None, **fields: Any
) -> ModelConfig:
    """The `ModelConfig` of the handout's arguments: `max_seq_len` is the context length, `theta` RoPE's
    (None: no position encoding); `fields` are other `ModelConfig` fields, which win (`positions="none"`)."""
    positions = {"positions": "none"} if theta is None else {"positions": "rope", "rope_theta": theta}
    sizes = {"d_model": d_model, "num_heads": num_heads, "d_ff": d_ff, "context_length": max_seq_len}
    return ModelConfig(**sizes, **{**positions, **fields})
