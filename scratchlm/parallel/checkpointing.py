"""Activation checkpointing: each Transformer block keeps only its input for the backward pass, and runs its
forward again there to get the activations it needs, instead of keeping them from the forward pass.

A block's saved activations (the norms' outputs, attention's queries, keys, values and probabilities, the
feed-forward's hidden layer) are many times its input; with checkpointing a block keeps its input alone, for
one more forward pass of compute (a step costs about 4 forward passes instead of 3). It is the memory lever orthogonal to sharding, and works under every
kind of parallelism and in a single process.

The block's `forward` is replaced on the instance (`torch.utils.checkpoint`, non-reentrant), so the model's
modules, parameter names and state-dict keys are unchanged, and sharding and compiling apply to the block as
they would without it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from scratchlm.model.transformer import TransformerLM


def apply_activation_checkpointing(model: TransformerLM) -> None:
    """Recompute each of `model`'s blocks in the backward pass instead of keeping its activations."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed, type(block).forward.__get__(block))


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    # The model draws no random numbers, so the RNG state need not be saved and restored for the recompute.
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
