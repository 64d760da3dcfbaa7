"""Next-token distribution: temperature, top-k and top-p against hand-computed values and a brute-force
reference; sampling against its distribution and its seed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.errors import ScratchlmError
from scratchlm.generation import sampling
from scratchlm.generation.sampling import (
    draw,
    next_token_probs,
    sample_next_token,
    top_k_filter,
    top_p_filter,
)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_temperature_one_is_softmax_and_temperature_scales_logits() -> None:
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(next_token_probs(logits), torch.softmax(logits, dim=-1))
    torch.testing.assert_close(next_token_probs(logits, temperature=0.5), torch.softmax(logits / 0.5, dim=-1))
    torch.testing.assert_close(next_token_probs(logits, temperature=3.0), torch.softmax(logits / 3.0, dim=-1))


def test_temperature_to_zero_is_argmax() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    assert torch.equal(next_token_probs(logits, temperature=0), greedy)
    # The limit: a temperature well below the gap between the two largest logits puts all the mass on the
    # argmax (exp(-50) of it elsewhere).
    top2 = logits.topk(2).values
    small = float((top2[:, 0] - top2[:, 1]).min()) / 50
    torch.testing.assert_close(next_token_probs(logits, temperature=small), greedy)
    assert torch.equal(sample_next_token(logits, temperature=0), logits.argmax(-1))
    generator = torch.Generator().manual_seed(2)
    assert torch.equal(sample_next_token(logits, temperature=small, generator=generator), logits.argmax(-1))


def test_greedy_draws_no_randomness() -> None:
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    sample_next_token(torch.randn(4, 9), temperature=0, generator=generator)
    assert torch.equal(generator.get_state(), state)


def test_top_k_hand_computed() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    # k = 2 keeps logits 3 and 2: e^3 / (e^3 + e^2) = e / (1 + e).
    e = math.e
    expected = torch.tensor([0.0, e / (1 + e), 1 / (1 + e), 0.0])
    torch.testing.assert_close(next_token_probs(logits, top_k=2), expected)
    torch.testing.assert_close(next_token_probs(logits, top_k=1), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(next_token_probs(logits, top_k=4), torch.softmax(logits, -1))
    torch.testing.assert_close(next_token_probs(logits, top_k=100), torch.softmax(logits, -1))
    # Ties with the k-th largest logit all stay.
    tied = top_k_filter(torch.tensor([2.0, 1.0, 2.0, 2.0, 0.0]), 2)
    assert torch.equal(torch.isfinite(tied), torch.tensor([True, False, True, True, False]))


def test_top_p_hand_computed() -> None:
    # Sorted probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625, given in a shuffled order.
    probs = [0.125, 0.5, 0.0625, 0.25, 0.0625]
    logits = logits_of(probs)
    # p = 0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it -> {0.5, 0.25} renormalised.
    torch.testing.assert_close(
        next_token_probs(logits, top_p=0.7), torch.tensor([0.0, 2 / 3, 0.0, 1 / 3, 0.0])
    )
    # p = 0.8: needs 0.125 as well -> 4/7, 2/7, 1/7.
    torch.testing.assert_close(
        next_token_probs(logits, top_p=0.8), torch.tensor([1 / 7, 4 / 7, 0.0, 2 / 7, 0.0])
    )
    # p below the top probability: the most likely token alone (never an empty set).
    torch.testing.assert_close(next_token_probs(logits, top_p=0.3), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(next_token_probs(logits, top_p=1e-9), torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    # p = 1: unchanged.
    torch.testing.assert_close(next_token_probs(logits, top_p=1.0), torch.tensor(probs, dtype=torch.float32))


def test_temperature_then_top_k_then_top_p() -> None:
    logits = torch.tensor([[4.0, 2.0, 1.0, 0.5, -1.0]])
    # The reference order of operations, with torch's softmax: divide by τ, keep the top 4, then nucleus 0.9.
    scaled = logits / 2.0
    probs = torch.softmax(scaled.masked_fill(scaled < scaled.topk(4).values[..., -1:], -math.inf), -1)
    order = probs.argsort(descending=True)
    sorted_probs = probs.gather(-1, order)
    keep = (sorted_probs.cumsum(-1) - sorted_probs) < 0.9
    expected = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    expected /= expected.sum()
    assert 1 < int((expected > 0).sum()) < 4  # the example exercises both filters
    torch.testing.assert_close(next_token_probs(logits, temperature=2.0, top_k=4, top_p=0.9), expected)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=30),
    p=st.floats(min_value=0.01, max_value=0.999),
)
def test_top_p_matches_brute_force(weights: list[int], p: float) -> None:
    total = sum(weights)
    probs = [w / total for w in weights]
    # Brute force: the smallest k whose k most likely tokens (ties: lower index first) sum to >= p.
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    for k in range(1, len(probs) + 1):
        mass = sum(probs[i] for i in order[:k])
        if mass >= p:
            break
    if abs(mass - p) < 1e-9 or (k > 1 and abs(mass - probs[order[k - 1]] - p) < 1e-9):
        return  # on the boundary the answer depends on float rounding
    kept = set(order[:k])
    expected = torch.tensor([probs[i] / mass if i in kept else 0.0 for i in range(len(probs))])
    got = top_p_filter(torch.tensor(probs, dtype=torch.float64), p)
    torch.testing.assert_close(got, expected.double())


def test_samples_follow_the_filtered_distribution() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -3.0])
    expected = next_token_probs(logits, temperature=0.8, top_p=0.95)
    n = 40_000
    draws = sample_next_token(
        logits.expand(n, -1), temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(4)
    )
    frequencies = torch.bincount(draws, minlength=5).double() / n
    assert frequencies[expected == 0].sum() == 0  # filtered tokens are never drawn
    # 5 standard errors of a binomial proportion
    tolerance = 5 * (expected.double() * (1 - expected.double()) / n).sqrt() + 1e-12
    assert torch.all((frequencies - expected.double()).abs() <= tolerance)


@pytest.mark.parametrize(
    "u, expected",
    # u = 1 stands for u · total rounded up to the total (u itself is below 1).
    [(0.0, 0), (0.2499, 0), (0.25, 2), (0.9, 2), (1 - 2**-24, 2), (1.0, 2)],
    ids=["zero", "inside-the-first", "on-a-boundary", "inside-the-last", "largest-uniform", "rounded-up"],
)
def test_a_draw_inverts_the_cumulative_distribution_and_never_picks_probability_zero(
    monkeypatch, u: float, expected: int
) -> None:
    """Token 0 owns [0, 0.25) of the unit interval and token 2 [0.25, 1); the tokens of probability 0 own
    nothing, even where u times the total rounds up to the total."""
    probs = torch.tensor([[0.25, 0.0, 0.75, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **options: torch.full((1, 1), u))
    assert draw(probs).tolist() == [expected]


def test_seed_reproduces_samples_and_shapes() -> None:
    logits = torch.randn(2, 3, 50)
    a = sample_next_token(logits, generator=torch.Generator().manual_seed(7))
    b = sample_next_token(logits, generator=torch.Generator().manual_seed(7))
    assert a.shape == (2, 3) and a.dtype == torch.long
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_bad_options_are_user_errors(options: dict, message: str) -> None:
    with pytest.raises(ScratchlmError, match=message):
        sample_next_token(torch.randn(5), **options)


def per_row(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Top-p by a stable float sort of each row, written out: the oracle of the filter's faster paths."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_ahead = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(mass_ahead >= p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


def test_top_p_filter_matches_a_stable_float_sort_of_each_row():
    # The filter sorts float32 rows by value only and picks the tokens by threshold; the result must be the
    # per-row stable sort's, ties included.
    generator = torch.Generator().manual_seed(0)
    for shape, scale in [((16, 1000), 0.1), ((3, 61), 1.0), ((2, 3, 50), 5.0), ((61,), 30.0)]:
        probs = torch.softmax(torch.randn(shape, generator=generator) * scale, dim=-1)
        tied = probs.round(decimals=2) + 1e-3  # many equal probabilities
        for x in (probs, tied / tied.sum(dim=-1, keepdim=True)):
            for p in (0.3, 0.9, 0.999):
                assert torch.equal(top_p_filter(x, p), per_row(x, p))


def test_top_p_filter_over_a_large_vocabulary_matches_a_stable_float_sort_of_each_row():
    """Rows of 10,000 tokens: peaked ones (a nucleus of a few tokens), ones whose nucleus needs hundreds, and
    flat ones (most of the row), with ties cut by the nucleus's end, several rows at once."""
    generator = torch.Generator().manual_seed(1)
    for rows, scale in [(1, 8.0), (3, 8.0), (2, 3.0), (1, 0.3), (4, 1.5)]:
        probs = torch.softmax(torch.randn(rows, 10_000, generator=generator) * scale, dim=-1)
        tied = probs.round(decimals=4) + 1e-5
        for x in (probs, tied / tied.sum(dim=-1, keepdim=True)):
            for p in (0.1, 0.5, 0.9, 0.95):
                assert torch.equal(top_p_filter(x, p), per_row(x, p)), (rows, scale, p)


@pytest.mark.parametrize("candidates", [1, 40, 2048])
def test_top_p_filter_among_the_largest_values_first_matches_a_stable_float_sort(monkeypatch, candidates):
    """The nucleus looked for among the `candidates` largest values of each row first: rows whose nucleus
    fits (peaked), rows where it does not (flat: the whole rows are sorted), both in one call, ties at the
    nucleus's end; always the per-row stable sort's result."""
    monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    generator = torch.Generator().manual_seed(2)
    peaked = torch.softmax(torch.randn(3, 3000, generator=generator) * 6.0, dim=-1)
    flat = torch.softmax(torch.randn(2, 3000, generator=generator) * 0.5, dim=-1)
    for probs in (peaked, flat, torch.cat([peaked, flat])):
        tied = probs.round(decimals=4) + 1e-5
        for x in (probs, tied / tied.sum(dim=-1, keepdim=True)):
            for p in (0.05, 0.5, 0.9):
                assert torch.equal(top_p_filter(x, p), per_row(x, p)), (candidates, p)


def test_a_generator_a_row_draws_what_each_row_draws_alone():
    """Rows drawn in one call with a generator each give the tokens of drawing each row alone with its
    generator, and leave each generator where drawing alone leaves it."""
    probs = next_token_probs(torch.randn(6, 300, generator=torch.Generator().manual_seed(3)), 1.0, 0.9)
    together = [torch.Generator().manual_seed(seed) for seed in range(6)]
    alone = [torch.Generator().manual_seed(seed) for seed in range(6)]
    for _ in range(3):
        expected = torch.cat([draw(probs[i : i + 1], alone[i]) for i in range(6)])
        assert torch.equal(draw(probs, together), expected)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(together, alone, strict=True))
