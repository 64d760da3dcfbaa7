"""`SamplingOptions`: the one declaration of a sequence's settings. Its checks against the messages users
read (the API and the command line name the options their own way and keep the rest), its generator against
`torch.Generator.manual_seed`, and its sampling against the argmax where top-k leaves one token."""

from __future__ import annotations

import math

import pytest
import torch

from scratchlm.errors import ScratchlmError
from scratchlm.generation.sampling import InvalidOption, SamplingOptions

BAD = [
    ({"max_new_tokens": -1}, "max_new_tokens", "must be an integer >= 0, got -1"),
    ({"max_new_tokens": 2.0}, "max_new_tokens", "must be an integer >= 0, got 2.0"),
    ({"max_new_tokens": True}, "max_new_tokens", "must be an integer >= 0, got True"),
    ({"temperature": -0.5}, "temperature", "must be a finite number >= 0 (0 = greedy), got -0.5"),
    ({"temperature": math.inf}, "temperature", "must be a finite number >= 0 (0 = greedy), got inf"),
    ({"temperature": math.nan}, "temperature", "must be a finite number >= 0 (0 = greedy), got nan"),
    ({"temperature": "hot"}, "temperature", "must be a finite number >= 0 (0 = greedy), got 'hot'"),
    ({"top_p": 0}, "top_p", "must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p", "must be in (0, 1], got 1.5"),
    ({"top_p": None}, "top_p", "must be in (0, 1], got None"),
    ({"top_k": 0}, "top_k", "must be a positive integer (or None for no limit), got 0"),
    ({"top_k": 2.5}, "top_k", "must be a positive integer (or None for no limit), got 2.5"),
    ({"top_k": False}, "top_k", "must be a positive integer (or None for no limit), got False"),
    ({"stop": [""]}, "stop", "must be non-empty strings, got ['']"),
    ({"stop": ["a", 3]}, "stop", "must be non-empty strings, got ['a', 3]"),
    ({"stop": 3}, "stop", "must be non-empty strings, got 3"),
    ({"seed": 2**64}, "seed", f"must be an integer of 64 bits (or None for a random seed), got {2**64}"),
    (
        {"seed": -(2**63) - 1},
        "seed",
        f"must be an integer of 64 bits (or None for a random seed), got {-(2**63) - 1}",
    ),
    ({"seed": "7"}, "seed", "must be an integer of 64 bits (or None for a random seed), got '7'"),
]


@pytest.mark.parametrize(("values", "option", "reason"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_an_option_out_of_range_is_named_with_its_reason(values: dict, option: str, reason: str) -> None:
    with pytest.raises(InvalidOption) as caught:
        SamplingOptions(**{"max_new_tokens": 8, **values})
    assert isinstance(caught.value, ScratchlmError)  # the command line's one-line errors
    assert (caught.value.option, caught.value.reason) == (option, reason)
    assert str(caught.value) == f"{option} {reason}"


def test_the_first_bad_option_in_declaration_order_is_named() -> None:
    with pytest.raises(InvalidOption) as caught:
        SamplingOptions(max_new_tokens=-1, temperature=-1.0, seed="x")
    assert caught.value.option == "max_new_tokens"
    with pytest.raises(InvalidOption) as caught:
        SamplingOptions(max_new_tokens=1, top_k=0, top_p=0.0)
    assert caught.value.option == "top_p"


def test_valid_options_are_normalised_and_hashable() -> None:
    options = SamplingOptions(5, temperature=0, top_p=1, top_k=3, stop="\n", seed=-1)
    assert options.temperature == 0.0 and isinstance(options.temperature, float)
    assert options.top_p == 1.0 and isinstance(options.top_p, float)
    assert options.stop == ("\n",)  # one string is one stop string, not one per character
    same = SamplingOptions(5, temperature=0.0, top_p=1.0, top_k=3, stop=["\n"], seed=-1)
    assert options == same and hash(options) == hash(same)
    defaults = SamplingOptions(16)
    # generate's defaults, and OpenAI's
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 1.0, None)
    assert defaults.stop == () and defaults.seed is None
    with pytest.raises(AttributeError):
        options.top_k = 4  # frozen: checked once, valid for good


def test_the_distribution_is_what_temperature_top_p_and_top_k_set() -> None:
    """Rows whose `distribution` is equal share one computation in the server's batch: it must differ
    exactly when a setting of the distribution does."""
    base = SamplingOptions(10, temperature=0.7, top_p=0.9, top_k=5)
    others = SamplingOptions(99, temperature=0.7, top_p=0.9, top_k=5, stop=["x"], seed=3)
    assert base.distribution == others.distribution
    for change in ({"temperature": 0.8}, {"top_p": 0.8}, {"top_k": 6}, {"top_k": None}):
        changed = SamplingOptions(10, **{"temperature": 0.7, "top_p": 0.9, "top_k": 5, **change})
        assert changed.distribution != base.distribution


def test_the_generator_is_seeded_as_manual_seed_would() -> None:
    for seed in (0, 7, 2**64 - 1, -1, -(2**63)):
        got = SamplingOptions(1, seed=seed).generator()
        expected = torch.Generator().manual_seed(seed)
        assert torch.equal(torch.rand(8, generator=got), torch.rand(8, generator=expected))
    # torch reads a seed modulo 2**64, which the server relies on to give choice i the seed `seed + i`.
    wrapped, expected = SamplingOptions(1, seed=-1).generator(), torch.Generator().manual_seed(2**64 - 1)
    assert torch.equal(torch.rand(8, generator=wrapped), torch.rand(8, generator=expected))
    unseeded = [SamplingOptions(1).generator().initial_seed() for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # fresh entropy


def test_top_k_of_one_samples_the_argmax_at_any_temperature() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    options = SamplingOptions(1, temperature=5.0, top_k=1)
    assert torch.equal(options.sample(logits, options.generator()), logits.argmax(-1))
    probs = options.probs(logits)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
