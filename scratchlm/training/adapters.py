"""A LoRA run's model: its base's weights, frozen, with low-rank adapters on the blocks' matrices
(`scratchlm.model.lora`), made before the optimizer so that it sees only what trains.

    the model of [model]  ->  the base's weights (`training.init_from`, the stage's base; `start_from_weights`)
                          ->  adapters on `lora.targets`, every other parameter frozen (`apply_lora`), the
                              frozen matrices stored as `lora.base_dtype` says (16 bits by default, on a
                              float32 plan too), the adapters in float32
                          ->  the optimizer over the trainable parameters alone; a resume loads the adapters
                              and their optimizer state from the run's checkpoint (`scratchlm.run.load`)

A resumed session makes the model the same way, base first, so a checkpoint needs only the adapters; it
records the base's path and the fingerprint of its weights, and a base that has changed since is refused.
Where the stage grew the vocabulary (chat tokens the base lacked), the grown tables train too: a new token's
row starts as the mean of the others, and frozen there every chat token would look the same to the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.model.lora import Adapters, apply_lora, storage_dtype
from scratchlm.model.transformer import TransformerLM
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.config import TrainConfig
from scratchlm.training.distributed import Distributed
from scratchlm.training.start import start_from_weights


def adapt(
    config: TrainConfig,
    model: TransformerLM,
    tokenizer: Tokenizer | None,
    dist: Distributed,
    dtype: torch.dtype,
) -> None:
    """Load the base into `model` and adapt it as `[lora]` says (see the module docstring); `dtype`: the
    plan's compute dtype, from which `lora.base_dtype = "auto"` chooses the frozen matrices' storage."""
    base_path = config.training.init_from
    if not Path(base_path).exists():
        raise ScratchlmError(
            f"training.init_from {base_path}: the LoRA base is not found (moved or deleted?): the adapters "
            "sit on the base's weights"
        )
    if dist.enabled and config.training.parallel == "fsdp":
        raise ScratchlmError(
            'lora.rank with training.parallel = "fsdp": LoRA runs use ddp (the base is frozen)'
        )
    base = start_from_weights(config, model, tokenizer, dist)
    base_shapes = {key: tuple(value.shape) for key, value in base.model.items()}
    grown = tuple(
        name
        for name, p in model.named_parameters()
        if base_shapes.get(name, tuple(p.shape)) != tuple(p.shape)
    )
    adapters = Adapters(config.lora, str(Path(base_path).resolve()), base.weights_fingerprint())
    stored = storage_dtype(config.lora, dtype)
    adapted = apply_lora(model, adapters, train=grown, base_dtype=stored)
    if dist.is_main:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        lora = config.lora
        console.print(
            f"LoRA: rank {lora.rank}, alpha {lora.alpha or 2 * lora.rank:g} (scaling {lora.scaling:g}) on "
            f"{adapted} matrices ({', '.join(lora.targets)}); training {trainable:,} of {total:,} parameters "
            f"({trainable / total:.2%})"
            + (f", the grown {', '.join(grown)} among them" if grown else "")
            + (f", the {', '.join(lora.train)} whole" if lora.train else "")
            + f"; the frozen weights stored in {str(stored or torch.float32).removeprefix('torch.')}"
        )
