"""Whole-file evaluation: the loss and perplexity of a model on every token of a token file.

The periodic validation of the training loop estimates the loss on a few random batches; this module gives the
exact figure, the same on every run. The file of N tokens is cut into consecutive, non-overlapping windows of
`context_length` inputs, each with its targets shifted by one token:

    inputs  x[0 : C]     x[C : 2C]      ...  x[kC : N-1]     (the last window may be shorter)
    targets x[1 : C+1]   x[C+1 : 2C+1]  ...  x[kC+1 : N]

so every token after the first is predicted exactly once, from the tokens before it in its window. Because the
windows are consecutive, a batch of them is one contiguous slice of the file reshaped to (batch, C) — no copy
per window. The loss is the mean over all N - 1 predictions (windows weighted by their length) and the
perplexity is `exp(loss)`.

The model computes in the dtype its weights are held in (`prepare_for_inference` puts them in the resolved
precision's); the loss itself is summed in float32 whatever the logits' dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange

from scratchlm.console import progress
from scratchlm.errors import ScratchlmError
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per predicted token, in nats
    perplexity: float  # exp(loss)
    tokens: int  # number of predicted tokens: len(file) - 1
    windows: int  # number of context windows (the last one may be shorter)


@torch.no_grad()
def evaluate(
    model: TransformerLM,
    tokens: np.ndarray,
    batch_size: int = 32,
    context_length: int | None = None,
    show_progress: bool = False,
) -> EvalResult:
    """Loss and perplexity of `model` over all of `tokens` (a 1-D array of ids, e.g. a memory-mapped `.npy`).

    `context_length` defaults to the model's; a smaller one evaluates with less context per prediction.
    """
    context = model.config.context_length if context_length is None else context_length
    if not 1 <= context <= model.config.context_length:
        raise ScratchlmError(
            f"context_length must be between 1 and the model's {model.config.context_length}, got {context}"
        )
    if batch_size < 1:
        raise ScratchlmError(f"batch_size must be at least 1, got {batch_size}")
    if tokens.ndim != 1 or len(tokens) < 2:
        raise ScratchlmError(
            f"evaluation needs a 1-D array of at least 2 token ids, got shape {tokens.shape}"
        )
    device = next(model.parameters()).device
    predictions = len(tokens) - 1
    full_windows = predictions // context

    def window_loss_sum(start: int, stop: int, length: int) -> float:
        """Summed loss of the consecutive windows of `length` inputs that cover predictions start..stop-1."""
        chunk = torch.from_numpy(np.asarray(tokens[start : stop + 1], dtype=np.int64)).to(device)
        if int(chunk.max()) >= model.config.vocab_size or int(chunk.min()) < 0:
            raise ScratchlmError(
                f"token ids {int(chunk.min())}..{int(chunk.max())} near position {start} are outside the "
                f"model's vocabulary [0, {model.config.vocab_size}): was the file encoded with its tokenizer?"
            )
        inputs = rearrange(chunk[:-1], "(batch seq) -> batch seq", seq=length)
        targets = rearrange(chunk[1:], "(batch seq) -> batch seq", seq=length)
        return cross_entropy(model(inputs), targets).item() * targets.numel()

    # Start positions of each batch of full windows, then the shorter last window if the file has a remainder.
    batch_starts = range(0, full_windows, batch_size)
    remainder = predictions - full_windows * context
    total = 0.0
    with progress(transient=True) as bar:
        task = bar.add_task("evaluating", total=predictions, visible=show_progress)
        for first in batch_starts:
            last = min(first + batch_size, full_windows)
            total += window_loss_sum(first * context, last * context, context)
            bar.advance(task, (last - first) * context)
        if remainder:
            total += window_loss_sum(full_windows * context, predictions, remainder)
            bar.advance(task, remainder)
    loss = total / predictions
    try:
        perplexity = math.exp(loss)
    except OverflowError:  # a loss above ~709.8 nats (a diverged model)
        perplexity = math.inf
    return EvalResult(loss, perplexity, predictions, full_windows + (1 if remainder else 0))
