"""The objective of reinforcement learning with verifiable rewards (GRPO; Dr. GRPO's corrections), as pure
functions of tensors.

For a prompt q the sampling policy π_old (the model when the batch was sampled) writes a group of G replies
o_1 … o_G, and a program scores each: r_i. There is no value network: the group is its own baseline.

    advantage      A_i = r_i − mean(r_1 … r_G)                  (÷ (std(r_1 … r_G) + 1e-6) if normalize_std)

A reply better than its group's average gets a positive advantage, a worse one a negative one, and a group
whose rewards are all equal gets A = 0 everywhere: it teaches nothing, and its rows are left out of the loss
(`uniform_groups`), so that they do not dilute the mean either.

The policy gradient theorem says ∇ E[r] = E[A ∇ log π(o)], and log π(o) is the sum of the log-probabilities of
the reply's tokens. To take more than one optimizer step on a batch sampled from π_old, each token's term is
weighted by the importance ratio of the current policy π_θ to the sampling one, and PPO's clip keeps π_θ near
π_old (the ratio's gradient is cut once it leaves [1 − ε, 1 + ε] in the direction the advantage pushes it):

    ρ_{i,t}   = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    ℓ_{i,t}   = −min(ρ_{i,t} A_i,  clip(ρ_{i,t}, 1 − ε, 1 + ε) A_i)
              + β · KL_{i,t}                                    (β = rl.kl_coef; 0 by default)
    KL_{i,t}  = π_ref/π_θ − log(π_ref/π_θ) − 1                  (at the sampled token; π_ref the starting model)

At the first step on a batch ρ = 1, so ∇ℓ = −A ∇ log π_θ: the plain policy gradient. The KL term is
Schulman's "k3" estimator of KL(π_θ ‖ π_ref) from a sample of π_θ: never negative, unbiased, and low in
variance; it pulls the policy back towards the model it started from.

How the token terms of a reply become its loss is the length normalisation, and it matters:

    "sequence" (GRPO):       L_i = (1 / |o_i|) Σ_t ℓ_{i,t}       each reply weighs the same, whatever its length
    "constant" (Dr. GRPO):   L_i = (1 / L_max) Σ_t ℓ_{i,t}       each token weighs the same (L_max: the reply
                                                                 token budget, rl.max_reply_tokens)

Per reply, a token of a short reply moves the model more than a token of a long one. For a right reply
(A > 0) that favours short ones; for a wrong one (A < 0) it penalises a long wrong reply less per token than a
short one, so the policy drifts to longer and longer wrong answers (Liu et al., 2025, "Understanding R1-Zero-like
training"). A constant divisor makes the gradient the unbiased policy gradient and removes that drift. Dividing
by the group's std has a bias of its own: it weighs the questions whose rewards vary little (nearly always right
or nearly always wrong) above the others, which is why `rl.normalize_std` is a setting, off in Dr. GRPO.

The loss of a batch is the mean of L_i over the rows of the groups that teach something.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

LengthNorm = Literal["sequence", "constant"]

STD_EPS = 1e-6  # keeps a group of nearly equal rewards from dividing by nearly zero


def group_advantages(
    rewards: Float[Tensor, "groups size"], normalize_std: bool
) -> Float[Tensor, "groups size"]:
    """Each reward minus its group's mean, divided by the group's (sample) standard deviation plus `STD_EPS`
    if `normalize_std`."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + STD_EPS)


def uniform_groups(rewards: Float[Tensor, "groups size"]) -> Bool[Tensor, " groups"]:
    """The groups whose rewards are all equal: their advantages are zero, and they are left out of the loss."""
    return rewards.amax(dim=-1) == rewards.amin(dim=-1)


# Positions whose logits one float32 chunk holds: 2^24 floats (64 MiB) whatever the vocabulary.
CHUNK_FLOATS = 1 << 24


def _chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, CHUNK_FLOATS // vocab)
    return [slice(start, start + step) for start in range(0, rows, step)]


class _LogSumExp(torch.autograd.Function):
    """logsumexp over the last dimension, in float32, a chunk of positions at a time in both directions: the
    float32 form of bf16 or fp16 logits exists one chunk at a time, and the backward pass keeps only the logits
    (which the forward pass through the head keeps anyway) and the result."""

    @staticmethod
    def forward(ctx: Any, logits: Float[Tensor, "... vocab"]) -> Float[Tensor, "..."]:
        flat = logits.reshape(-1, logits.shape[-1])
        result = torch.empty(len(flat), dtype=torch.float32, device=logits.device)
        for rows in _chunks(len(flat), flat.shape[-1]):
            result[rows] = torch.logsumexp(flat[rows].float(), dim=-1)
        ctx.save_for_backward(logits, result)
        return result.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: Float[Tensor, "..."]) -> Float[Tensor, "... vocab"]:
        logits, result = ctx.saved_tensors
        flat, grad = logits.reshape(-1, logits.shape[-1]), grad.reshape(-1)
        grad_logits = torch.empty_like(flat)
        for rows in _chunks(len(flat), flat.shape[-1]):  # d logsumexp / d logits = softmax
            grad_logits[rows] = torch.exp(flat[rows].float() - result[rows, None]) * grad[rows, None]
        return grad_logits.view(logits.shape)


def token_logprobs(
    logits: Float[Tensor, "... seq vocab"], targets: Int[Tensor, "... seq"]
) -> Float[Tensor, "... seq"]:
    """log softmax(logits)[target] at each position, in float32: the target's logit less the logsumexp over the
    vocabulary (`_LogSumExp`), so that bf16 or fp16 logits are never copied whole to float32."""
    return logits.gather(-1, targets[..., None])[..., 0].float() - _LogSumExp.apply(logits)


def kl_estimate(
    logprobs: Float[Tensor, "... seq"], ref_logprobs: Float[Tensor, "... seq"]
) -> Float[Tensor, "... seq"]:
    """Schulman's k3 estimate of KL(π ‖ π_ref) at each sampled token: r − log r − 1, r = π_ref / π."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


@torch.no_grad()
def token_entropy(logits: Float[Tensor, "... seq vocab"]) -> Float[Tensor, "... seq"]:
    """The entropy −Σ p log p of the next-token distribution at each position, in float32, a chunk of positions
    at a time (a metric: no gradient)."""
    flat = logits.reshape(-1, logits.shape[-1])
    entropy = torch.empty(len(flat), dtype=torch.float32, device=logits.device)
    for rows in _chunks(len(flat), flat.shape[-1]):
        logprobs = torch.log_softmax(flat[rows].float(), dim=-1)
        entropy[rows] = -(logprobs.exp() * logprobs).sum(dim=-1)
    return entropy.view(logits.shape[:-1])


@dataclass(frozen=True)
class PolicyLoss:
    """The loss of each row (`per_row`, L_i above), and what it is made of, per token: the importance ratio,
    whether the clip cut its gradient, and the KL estimate (zero without a reference)."""

    per_row: Float[Tensor, " rows"]
    ratio: Float[Tensor, "rows seq"]
    clipped: Bool[Tensor, "rows seq"]
    kl: Float[Tensor, "rows seq"]


def policy_loss(
    logprobs: Float[Tensor, "rows seq"],
    old_logprobs: Float[Tensor, "rows seq"],
    advantages: Float[Tensor, " rows"],
    mask: Bool[Tensor, "rows seq"],
    clip_eps: float,
    length_norm: LengthNorm,
    max_reply_tokens: int,
    ref_logprobs: Float[Tensor, "rows seq"] | None = None,
    kl_coef: float = 0.0,
) -> PolicyLoss:
    """The clipped policy-gradient loss of each row (module docstring): `logprobs` under the policy being
    trained, `old_logprobs` under the one that sampled, `ref_logprobs` under the starting model (needed when
    `kl_coef` > 0), each at the row's target tokens; `mask` marks the reply's tokens, the only ones counted.
    `length_norm` divides each row's sum by its reply's length ("sequence") or by `max_reply_tokens`
    ("constant")."""
    ratio = torch.exp(logprobs - old_logprobs)
    advantage = advantages[:, None]
    unclipped = ratio * advantage
    clipped_term = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    per_token = -torch.minimum(unclipped, clipped_term)
    clipped = clipped_term < unclipped  # the min took the clipped term: no gradient through the ratio
    kl = torch.zeros_like(logprobs) if ref_logprobs is None else kl_estimate(logprobs, ref_logprobs)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    total = (per_token * mask).sum(dim=-1)
    length = mask.sum(dim=-1).clamp(min=1) if length_norm == "sequence" else max_reply_tokens
    per_row = total / length
    return PolicyLoss(per_row, ratio.detach(), clipped & mask, kl.detach())


def teaching_mean(per_row: Float[Tensor, " rows"], counted: Bool[Tensor, " rows"]) -> Float[Tensor, ""]:
    """The mean of the rows' losses over the `counted` rows, those of groups whose rewards differ: the rows of a
    uniform group neither add to the loss nor dilute its mean, and get no gradient."""
    return torch.where(counted, per_row, 0.0).sum() / counted.sum()
