"""The language-modelling loss: cross-entropy of the next token, computed stably.

For logits `o` over the vocabulary and the true next token `x`,

    ℓ = -log softmax(o)[x] = log Σ_j exp(o_j) - o_x.

Exponentiating large logits overflows, so the maximum `m` is subtracted first (the softmax does not change):
`ℓ = log Σ_j exp(o_j - m) - (o_x - m)`. The log and the exp of the target term cancel, so the probability of
the target is never formed (it can underflow to 0, whose log is -inf). The loss is averaged over every batch
dimension; perplexity is `exp` of that mean. Targets equal to `IGNORE` (the prompt of a conversation in
fine-tuning, padding) are left out of the mean and get no gradient when `ignore_index=IGNORE` is passed. Arithmetic is float32 even for bfloat16 logits (autocast), because
a sum of 10^4..10^5 exponentials in bfloat16 loses most of its digits.

The gradient is written out: with `N` positions averaged, `∂ℓ/∂o_j = (softmax(o)_j - [j = x]) / N`, one pass
over the (positions × vocab) logits that needs only them and each row's `log Σ exp`. Autograd would instead
scatter the target term's gradient into a zero matrix and add it to the softmax's in a second pass.

`fused_linear_cross_entropy` computes the LM head and this loss together over chunks of tokens, so that the
(positions × vocab) logits never exist whole (the largest tensor of training at a large vocabulary).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.errors import ScratchlmError

IGNORE = -1  # a target the loss leaves out


def cross_entropy(
    logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."], ignore_index: int | None = None
) -> Float[Tensor, ""]:
    """Mean of `-log softmax(logits)[target]` over all batch dimensions, in float32; with `ignore_index`,
    targets equal to it are left out of the mean (all of them left out: 0)."""
    if ignore_index is not None:
        return _MaskedCrossEntropy.apply(logits, targets.long(), ignore_index)
    return _CrossEntropy.apply(logits, targets.long())


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:
        logits32 = logits.float()
        max_logit = logits32.amax(dim=-1, keepdim=True)
        log_sum_exp = (logits32 - max_logit).exp().sum(dim=-1, keepdim=True).log() + max_logit
        target_logit = logits32.gather(-1, targets.unsqueeze(-1))
        ctx.save_for_backward(logits, targets, log_sum_exp)
        return (log_sum_exp - target_logit).mean()

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None]:
        logits, targets, log_sum_exp = ctx.saved_tensors
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        is_target = vocab == targets.unsqueeze(-1)
        probs = (logits.float() - log_sum_exp).exp()
        grad_logits = (probs - is_target.float()) * (grad_loss / targets.numel())
        return grad_logits.to(logits.dtype), None


class _MaskedCrossEntropy(torch.autograd.Function):
    """`_CrossEntropy` over the positions whose target is not `ignore_index`: the others add nothing to the
    mean, and their logits get a zero gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
        keep = targets != ignore_index
        count = keep.sum().clamp(min=1)
        targets = torch.where(keep, targets, 0)  # any valid index: its term is multiplied by 0
        logits32 = logits.float()
        max_logit = logits32.amax(dim=-1, keepdim=True)
        log_sum_exp = (logits32 - max_logit).exp().sum(dim=-1, keepdim=True).log() + max_logit
        target_logit = logits32.gather(-1, targets.unsqueeze(-1))
        ctx.save_for_backward(logits, targets, keep, log_sum_exp, count)
        return ((log_sum_exp - target_logit).squeeze(-1) * keep).sum() / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        logits, targets, keep, log_sum_exp, count = ctx.saved_tensors
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        is_target = vocab == targets.unsqueeze(-1)
        probs = (logits.float() - log_sum_exp).exp()
        weight = keep.unsqueeze(-1) * (grad_loss / count)
        return ((probs - is_target.float()) * weight).to(logits.dtype), None, None


CHUNK_LOGITS = 2**24


def fused_linear_cross_entropy(
    hidden: Float[Tensor, "... d_model"],
    weight: Float[Tensor, "vocab d_model"],
    targets: Int[Tensor, "..."],
    softcap: float = 0.0,
    chunk_size: int | None = None,
) -> Float[Tensor, ""]:
    """`cross_entropy(softcap(hidden @ weightᵀ), targets)` without the (tokens × vocab) logits: the LM head and
    the loss run over `chunk_size` tokens at a time, and only each token's `log Σ exp` is kept for the
    backward pass, which recomputes each chunk's logits. Peak memory for the logits drops from
    tokens × vocab to chunk_size × vocab (for 128 × 512 tokens and a 32K vocabulary: from 8.4 GB in float32
    to 0.5 GB), for one more head matmul per chunk.

    `softcap` c > 0 caps the logits to `c · tanh(z / c)` in float32, as `TransformerLM` does; its derivative
    `1 - tanh²` multiplies the logits' gradient. The head's matmul runs in the dtype autocast gives it.
    `chunk_size` None: as many tokens as make 2^24 logits (64 MiB in float32; 512 tokens at a 32K vocabulary),
    enough for each chunk's matmul to run at full speed."""
    if chunk_size is None:
        chunk_size = max(1, CHUNK_LOGITS // weight.shape[0])
    if chunk_size < 1:
        raise ScratchlmError(f"fused_linear_cross_entropy needs a chunk_size of at least 1, got {chunk_size}")
    if hidden.shape[:-1] != targets.shape:
        raise ScratchlmError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} must share their leading dimensions"
        )
    return _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(), float(softcap), chunk_size
    )


def _capped_logits(hidden: Tensor, weight: Tensor, softcap: float) -> tuple[Tensor, Tensor | None]:
    """One chunk's float32 logits and, with soft-capping, `tanh(z / c)` (for the derivative)."""
    logits = (hidden @ weight.T).float()
    if not softcap:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return softcap * tanh, tanh


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float, chunk_size: int
    ) -> Tensor:
        # Under autocast the head's matmul runs in the autocast dtype; backward (outside autocast) casts to it.
        # Without, in the hidden states' dtype: a frozen head stored in fewer bits (a LoRA base in bf16 on a
        # float32 plan) is upcast here and in the backward pass, and saved as it is stored.
        compute_dtype = (
            torch.get_autocast_dtype(hidden.device.type)
            if torch.is_autocast_enabled(hidden.device.type)
            else hidden.dtype
        )
        h, w = (x.to(compute_dtype) for x in (hidden, weight))
        log_sum_exps, total = [], torch.zeros((), device=hidden.device)
        for start in range(0, len(targets), chunk_size):
            logits, _ = _capped_logits(h[start : start + chunk_size], w, softcap)
            max_logit = logits.amax(dim=-1, keepdim=True)
            lse = (logits - max_logit).exp().sum(dim=-1, keepdim=True).log() + max_logit
            total = total + (lse - logits.gather(-1, targets[start : start + chunk_size, None])).sum()
            log_sum_exps.append(lse)
        ctx.save_for_backward(hidden, weight, targets, torch.cat(log_sum_exps))
        ctx.softcap, ctx.chunk_size, ctx.compute_dtype = softcap, chunk_size, compute_dtype
        return total / len(targets)

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor | None, None, None, None]:
        hidden, weight, targets, log_sum_exp = ctx.saved_tensors
        h, w = (x.to(ctx.compute_dtype) for x in (hidden, weight))
        grad_hidden = torch.empty_like(hidden)
        # A frozen head (LoRA) needs no gradient: skipping it saves a head-sized product a chunk.
        wants_weight = ctx.needs_input_grad[1]
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        )
        scale = grad_loss / len(targets)
        vocab = torch.arange(weight.shape[0], device=weight.device)
        for start in range(0, len(targets), ctx.chunk_size):
            stop = start + ctx.chunk_size
            logits, tanh = _capped_logits(h[start:stop], w, ctx.softcap)
            # ∂ℓ/∂z = (softmax(z) - onehot(target)) / N, through the cap: times d(c tanh(z/c))/dz = 1 - tanh².
            grad = (logits - log_sum_exp[start:stop]).exp() - (vocab == targets[start:stop, None]).float()
            grad = grad * scale if tanh is None else grad * scale * (1 - tanh.square())
            grad = grad.to(h.dtype)
            grad_hidden[start:stop] = (grad @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad.T @ h[start:stop]).float()
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
