"""The language-modelling loss: cross-entropy of the next token, computed stably.

For logits `o` over the vocabulary and the true next token `x`,

    ℓ = -log softmax(o)[x] = log Σ_j exp(o_j) - o_x.

Exponentiating large logits overflows, so the maximum `m` is subtracted first (the softmax does not change):
`ℓ = log Σ_j exp(o_j - m) - (o_x - m)`. The log and the exp of the target term cancel, so the probability of
the target is never formed (it can underflow to 0, whose log is -inf). The loss is averaged over every batch
dimension; perplexity is `exp` of that mean. Arithmetic is float32 even for bfloat16 logits (autocast), because
a sum of 10^4..10^5 exponentials in bfloat16 loses most of its digits.

The gradient is written out: with `N` positions averaged, `∂ℓ/∂o_j = (softmax(o)_j - [j = x]) / N`, one pass
over the (positions × vocab) logits that needs only them and each row's `log Σ exp`. Autograd would instead
scatter the target term's gradient into a zero matrix and add it to the softmax's in a second pass.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor


def cross_entropy(logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."]) -> Float[Tensor, ""]:
    """Mean over all batch dimensions of `-log softmax(logits)[target]`, in float32."""
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
