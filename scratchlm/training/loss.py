"""The language-modelling loss: cross-entropy of the next token, computed stably.

For logits `o` over the vocabulary and the true next token `x`,

    ℓ = -log softmax(o)[x] = log Σ_j exp(o_j) - o_x.

Exponentiating large logits overflows, so the maximum `m` is subtracted first (the softmax does not change):
`ℓ = log Σ_j exp(o_j - m) - (o_x - m)`. The log and the exp of the target term cancel, so the probability of
the target is never formed (it can underflow to 0, whose log is -inf). The loss is averaged over every batch
dimension; perplexity is `exp` of that mean. Arithmetic is float32 even for bfloat16 logits (autocast), because
a sum of 10^4..10^5 exponentials in bfloat16 loses most of its digits.
"""

from __future__ import annotations

from jaxtyping import Float, Int
from torch import Tensor


def cross_entropy(logits: Float[Tensor, "... vocab"], targets: Int[Tensor, "..."]) -> Float[Tensor, ""]:
    """Mean over all batch dimensions of `-log softmax(logits)[target]`, in float32."""
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_sum_exp = shifted.exp().sum(dim=-1).log()
    target_logit = shifted.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return (log_sum_exp - target_logit).mean()
