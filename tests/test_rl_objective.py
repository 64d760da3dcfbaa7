"""The RL objective (scratchlm.chat.rl.objective) and the rewards (scratchlm.chat.rl.rewards) against values
computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from scratchlm.chat.rl import objective
from scratchlm.chat.rl.objective import (
    group_advantages,
    policy_loss,
    teaching_mean,
    token_entropy,
    token_logprobs,
    uniform_groups,
)
from scratchlm.chat.rl.rewards import RewardError, load_reward, score
from scratchlm.errors import ScratchlmError

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])


def test_advantages_are_rewards_minus_the_group_mean_and_optionally_over_its_std():
    assert group_advantages(REWARDS, normalize_std=False).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]
    # sample std of (1, 0, 0, 1): sqrt(4 × 0.25 / 3) = 0.57735; 0.5 / 0.57735 = 0.866025
    normalized = group_advantages(REWARDS, normalize_std=True)
    torch.testing.assert_close(normalized[0], torch.tensor([0.866024, -0.866024, -0.866024, 0.866024]))
    assert normalized[1].tolist() == [0.0] * 4  # an all-equal group: 0 / (0 + eps), not a division by zero


def test_a_group_whose_rewards_are_all_equal_is_uniform():
    assert uniform_groups(REWARDS).tolist() == [False, True]
    assert uniform_groups(torch.tensor([[0.3, 0.3], [0.3, 0.31]])).tolist() == [True, False]


# Two rows of three tokens, sampled with log-probability 0; the policy's ratios are chosen: row 0 (A = +1)
# 1.5, 1.0 and (not a reply token) 0.5; row 1 (A = −1) 0.5, 1.1, 2.0.
RATIOS = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.1, 2.0]])
MASK = torch.tensor([[True, True, False], [True, True, True]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def loss(length_norm: str, **kw) -> object:
    logprobs = RATIOS.log()
    return policy_loss(logprobs, torch.zeros(2, 3), ADVANTAGES, MASK, 0.2, length_norm, 4, **kw)


def test_the_clipped_loss_per_token_and_both_length_normalisations():
    # row 0: min(1.5, 1.2) = 1.2 (clipped), min(1, 1) = 1; the third token is not the reply's: −(1.2 + 1)
    # row 1: min(−0.5, −0.8) = −0.8 (clipped), min(−1.1, −1.1), min(−2, −1.2) = −2: +(0.8 + 1.1 + 2) = 3.9
    sequence = loss("sequence")
    torch.testing.assert_close(sequence.per_row, torch.tensor([-2.2 / 2, 3.9 / 3]))
    constant = loss("constant")
    torch.testing.assert_close(constant.per_row, torch.tensor([-2.2 / 4, 3.9 / 4]))
    assert sequence.clipped.tolist() == [[True, False, False], [True, False, False]]
    assert sequence.kl.abs().sum() == 0  # no reference: no KL


def test_the_kl_term_is_k3_to_the_reference_weighted_by_its_coefficient():
    with_kl = loss("sequence", ref_logprobs=torch.zeros(2, 3), kl_coef=0.1)
    # π_ref / π_θ = 1 / ρ: KL = 1/ρ + log ρ − 1; for ρ = 1.5: 0.666667 + 0.405465 − 1 = 0.072132
    torch.testing.assert_close(with_kl.kl[0, 0], torch.tensor(0.072132), atol=1e-6, rtol=0)
    assert with_kl.kl[0, 1] == 0  # the same policy: no divergence
    expected = (-1.2 + 0.1 * 0.072132 - 1.0) / 2
    torch.testing.assert_close(with_kl.per_row[0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_the_kl_is_measured_without_a_weight_and_changes_nothing_then():
    measured = loss("sequence", ref_logprobs=torch.zeros(2, 3))
    torch.testing.assert_close(measured.kl[0, 0], torch.tensor(0.072132), atol=1e-6, rtol=0)
    assert torch.equal(measured.per_row, loss("sequence").per_row)


def test_the_rows_of_a_uniform_group_are_left_out_of_the_mean_and_get_no_gradient():
    per_row = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    counted = torch.tensor([True, True, False, False])  # the second group's rewards were all equal
    mean = teaching_mean(per_row, counted)
    assert mean.item() == 1.5  # (1 + 2) / 2, not (1 + 2) / 4
    mean.backward()
    assert per_row.grad.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_at_the_sampling_policy_the_gradient_is_the_policy_gradient_on_reply_tokens_only():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    result = policy_loss(logprobs, torch.zeros(2, 3), ADVANTAGES, MASK, 0.2, "sequence", 4)
    result.per_row.sum().backward()
    # d/d logπ of −ρA / |o| at ρ = 1: −A / |o|, and nothing for a token outside the reply
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


def test_log_probabilities_and_entropy_of_the_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.75)]]))
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(token_entropy(logits), torch.tensor([[entropy]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_log_probabilities_in_chunks_match_log_softmax_and_its_gradient(monkeypatch, dtype):
    """Chunks of 2 positions (a float32 copy of the logits never whole): the values and the gradient are float64
    log_softmax's on the same (rounded) logits, to float32's precision in the values (1e-5 at logsumexps near 10),
    and in the gradient (softmax times weights at most 1) that error through exp plus the rounding to the logits'
    dtype it is stored in (a relative 2^-8 for bf16, 2^-11 for fp16, twice for safety)."""
    monkeypatch.setattr(objective, "CHUNK_FLOATS", 2 * 50)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=generator) * 4).to(dtype)
    targets = torch.randint(0, 50, (3, 5), generator=generator)
    weights = torch.rand(3, 5, generator=generator)
    ours, oracle = logits.clone().requires_grad_(), logits.double().requires_grad_()
    got = token_logprobs(ours, targets)
    expected = torch.log_softmax(oracle, dim=-1).gather(-1, targets[..., None])[..., 0]
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    assert got.dtype == torch.float32 and ours.grad.dtype == dtype
    torch.testing.assert_close(got.double(), expected.detach(), rtol=0, atol=1e-5)
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    torch.testing.assert_close(ours.grad.double(), oracle.grad, rtol=0, atol=2 * ulp + 1e-5)
    entropy = -(torch.softmax(oracle, -1) * torch.log_softmax(oracle, -1)).sum(-1)
    torch.testing.assert_close(token_entropy(logits).double(), entropy.detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "name, reply, answer, expected",
    [
        ("exact", "  42\n", "42", 1.0),
        ("exact", "42.", "42", 0.0),
        ("contains", "it is 42 apples", "42", 1.0),
        ("number", "so the answer is 1,000.", "1000", 1.0),
        ("number", "42 apples, then 43", "42", 0.0),
        ("number", "no number", "42", 0.0),
        ("number", "-2.50", "x = -2.5", 1.0),
        ("regex", "The answer: B", r"answer: [AB]\b", 1.0),
        ("regex", "The answer: C", r"answer: [AB]\b", 0.0),
    ],
)
def test_the_built_in_rewards(name, reply, answer, expected):
    assert load_reward(name)(reply, answer, []) == expected


def test_a_user_reward_that_fails_is_one_line_naming_it_and_the_prompt(tmp_path):
    module = tmp_path / "mine.py"
    module.write_text(
        "import time\n"
        "def half(reply, answer, messages): return 0.5\n"
        "def boom(reply, answer, messages): raise ValueError('bad reply\\nsecond line')\n"
        "def nan(reply, answer, messages): return float('nan')\n"
        "def text(reply, answer, messages): return 'yes'\n"
        "def hang(reply, answer, messages):\n    time.sleep(30)\n"
    )

    def scored(function: str) -> float:
        name = f"{module}:{function}"
        return score(load_reward(name), function, "r", "a", [], "p.jsonl:7", timeout_s=0.3)

    assert scored("half") == 0.5
    for function, message in [
        ("boom", r"^reward boom raised ValueError: bad reply on the prompt of p\.jsonl:7$"),
        ("nan", r"^reward nan returned nan on the prompt of p\.jsonl:7; a reward returns a finite number$"),
        ("text", r"returned 'yes'"),
        ("hang", r"^reward hang ran longer than 0\.3 s on the prompt of p\.jsonl:7$"),
    ]:
        with pytest.raises(RewardError, match=message):
            scored(function)
    with pytest.raises(ScratchlmError, match="has no function missing"):
        load_reward(f"{module}:missing")
    with pytest.raises(ScratchlmError, match="neither a built-in reward"):
        load_reward("fuzzy")
