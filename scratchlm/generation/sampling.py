"""Choosing the next token from the logits of the last position: temperature, top-k, top-p, sampling.

The next-token distribution is built in three steps, applied in this order (the order of the common
implementations, so that settings carry over):

1. temperature τ: `softmax(v / τ)`. τ < 1 sharpens the distribution, τ > 1 flattens it; τ = 0 is the limit
   τ → 0, greedy decoding: all the probability on the most likely token (the first one on ties, as `argmax`).
2. top-k: only the k largest logits stay; the others get probability 0. Tokens tied with the k-th largest logit
   all stay, so the result does not depend on how a sort orders equal values.
3. top-p (nucleus): sort the probabilities in decreasing order and keep the smallest prefix whose sum reaches p
   — a token stays if the probability of the tokens strictly ahead of it is still below p, so the most likely
   token always stays — then renormalise to sum 1.

`sample_next_token` draws from that distribution with an optional `torch.Generator`, so a seed reproduces the
draw; greedy decoding draws nothing and leaves the generator untouched. `draw` is its last step alone, for
rows whose distributions are computed together but drawn with generators of their own (the server's).

`SamplingOptions` is the one declaration of a sequence's settings (token budget, temperature, top-p, top-k,
stop strings, seed) and of their valid ranges: `generate`, the server's engine and API and `scratchlm generate`
all take it, so an option is added here and reaches each of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.model.attention import softmax


class InvalidOption(ScratchlmError):
    """A sampling option outside its range. The message is `"{option} {reason}"` with the option named as a
    `SamplingOptions` field; a caller that names it otherwise (the command line's `--top-p`, the API's
    `max_tokens`) says `f"{its own name} {reason}"` and keeps the rest of the message."""

    def __init__(self, option: str, reason: str) -> None:
        super().__init__(f"{option} {reason}")
        self.option, self.reason = option, reason


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_distribution(temperature: float, top_p: float, top_k: int | None) -> None:
    """Raise `InvalidOption` for settings of the distribution outside their ranges."""
    if not (_is_number(temperature) and 0 <= temperature < math.inf):  # NaN fails the comparison too
        raise InvalidOption("temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise InvalidOption("top_p", f"must be in (0, 1], got {top_p!r}")
    if top_k is not None and not (_is_integer(top_k) and top_k >= 1):
        raise InvalidOption("top_k", f"must be a positive integer (or None for no limit), got {top_k!r}")


@dataclass(frozen=True)
class SamplingOptions:
    """How one sequence is generated: at most `max_new_tokens` new tokens, each drawn from the distribution
    that `temperature`, `top_p` and `top_k` make of the logits (`next_token_probs`), with a `torch.Generator`
    seeded with `seed` (None: fresh entropy); the text ends before the first of the `stop` strings.

    Stop strings are found in text, so only a caller that decodes applies them (the server); `generate` works
    on token ids and refuses them. Construction checks every field (`InvalidOption`, naming the first one out
    of range), so a `SamplingOptions` that exists is valid; numbers are stored as floats and `stop` as a tuple
    (one string is one stop string), which keeps the options hashable.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: Sequence[str] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (_is_integer(self.max_new_tokens) and self.max_new_tokens >= 0):
            raise InvalidOption("max_new_tokens", f"must be an integer >= 0, got {self.max_new_tokens!r}")
        _check_distribution(self.temperature, self.top_p, self.top_k)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not (isinstance(stop, list | tuple) and all(isinstance(s, str) and s for s in stop)):
            raise InvalidOption("stop", f"must be non-empty strings, got {self.stop!r}")
        # The range `torch.Generator.manual_seed` takes (it reads a seed modulo 2**64).
        if self.seed is not None and not (_is_integer(self.seed) and -(2**63) <= self.seed < 2**64):
            raise InvalidOption(
                "seed", f"must be an integer of 64 bits (or None for a random seed), got {self.seed!r}"
            )
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def distribution(self) -> tuple[float, float, int | None]:
        """The fields the next-token distribution depends on: rows with equal ones share its computation."""
        return self.temperature, self.top_p, self.top_k

    def probs(self, logits: Float[Tensor, "... vocab"]) -> Float[Tensor, "... vocab"]:
        """`next_token_probs` with these options."""
        return next_token_probs(logits, self.temperature, self.top_p, self.top_k)

    def sample(
        self, logits: Float[Tensor, "... vocab"], generator: torch.Generator | None = None
    ) -> Int[Tensor, "..."]:
        """`sample_next_token` with these options."""
        return sample_next_token(logits, self.temperature, self.top_p, self.top_k, generator)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on `device` for this sequence's draws: seeded with `seed`, else from fresh entropy."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def top_k_filter(logits: Float[Tensor, "... vocab"], k: int) -> Float[Tensor, "... vocab"]:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th largest stay)."""
    if k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(probs: Float[Tensor, "... vocab"], p: float) -> Float[Tensor, "... vocab"]:
    """Keep the smallest set of most likely tokens whose probability sum reaches `p`; renormalise.

    The nucleus is a prefix of each row sorted in decreasing order, ties in token order (a stable sort):
    every token more likely than the prefix's last value t, then the first tokens equal to t. Only the
    sorted *values* are needed to find t and the prefix's length, and a CPU sorts float32 values without
    their indices several times faster than with them (NumPy's vectorised sort: a row of 10,000 on a Zen 3
    EPYC, 1 thread, 0.05 ms against 0.8 for `torch.sort` with indices). So there float32 rows are sorted by
    value only and the tokens kept are picked by comparing with t; elsewhere (another device or dtype) each
    row is sorted with its indices. Either way the result is that of a stable sort of each row, ties
    included, bit for bit (tested): the running sums are taken in torch over the same sorted values."""
    if p >= 1.0:
        return probs
    if probs.device.type == "cpu" and probs.dtype == torch.float32:
        by_row = probs.reshape(-1, probs.shape[-1])
        return _normalised(_nucleus_by_threshold(by_row, p).view(probs.shape))
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kept_sorted = sorted_probs.masked_fill(_mass_ahead(sorted_probs) >= p, 0.0)
    return _normalised(torch.zeros_like(probs).scatter(-1, order, kept_sorted))


def _normalised(kept: Float[Tensor, "... vocab"]) -> Float[Tensor, "... vocab"]:
    return kept / kept.sum(dim=-1, keepdim=True)


def _mass_ahead(sorted_probs: Float[Tensor, "... vocab"]) -> Float[Tensor, "... vocab"]:
    """The probability mass strictly ahead of each token of rows sorted in decreasing order: a token is in
    the nucleus while that mass is below p, so the first token always is, and the token whose own mass makes
    the sum reach p is the last one."""
    return torch.cumsum(sorted_probs, dim=-1) - sorted_probs


# The most likely tokens of a row the nucleus is looked for among first (`_largest_sorted`).
CANDIDATES = 2048


def _largest_sorted(rows: np.ndarray, k: int) -> np.ndarray:
    """The `k` largest values of each row, in increasing order: a partition (linear time) and a sort of the
    `k` values, which is the last `k` of a sort of the whole row, value for value."""
    vocab = rows.shape[-1]
    return np.sort(rows if k >= vocab else np.partition(rows, vocab - k, axis=-1)[:, vocab - k :], axis=-1)


def _nucleus_by_threshold(probs: Float[Tensor, "rows vocab"], p: float) -> Float[Tensor, "rows vocab"]:
    """The rows with the tokens outside each nucleus set to 0, from each row's values sorted without their
    indices. The mass ahead of the sorted tokens never decreases along a row, even rounded, so the nucleus's
    length is where p would be inserted in it: with the running sums S (each the exact sum rounded, or a
    sum rounded step by step, as a CPU cumulates), v_i ≤ v_(i-1) and S_i ≥ S_(i-1) give
    S_i - v_i ≥ S_(i-1) - v_(i-1), and rounding keeps the order.

    Only the values down to the nucleus's end are needed, and a nucleus is mostly far shorter than the row
    (a trained model's: a few dozen tokens). So the `CANDIDATES` largest values of each row are sorted first:
    their running sums are the first ones of the whole row's, bit for bit (a cumulative sum adds left to
    right), so where p is reached among them, the length found is the whole row's. A row of 10,000 on a Zen 3
    EPYC: 16 rows in 0.53 ms against 1.3 for sorting them whole. Only where some row's nucleus is longer are
    the rows sorted whole."""
    rows = probs.detach().numpy()
    for k in (CANDIDATES, rows.shape[-1]):
        values = torch.from_numpy(_largest_sorted(rows, k)).flip(-1)  # in decreasing order
        length = torch.searchsorted(_mass_ahead(values), values.new_full((values.shape[0], 1), p))
        if k >= rows.shape[-1] or bool((length < k).all()):
            break
    last = values.gather(-1, length - 1)  # t, the smallest value kept (the first token always is)
    keep = probs >= last
    if not torch.equal(keep.sum(dim=-1, keepdim=True), length):
        # Some ties with t are past the prefix: only the first of them in token order fill it.
        above = probs > last
        tied = probs == last
        keep = above | (tied & (tied.cumsum(dim=-1) <= length - above.sum(dim=-1, keepdim=True)))
    return probs.where(keep, 0.0)


def next_token_probs(
    logits: Float[Tensor, "... vocab"],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
) -> Float[Tensor, "... vocab"]:
    """The distribution the next token is drawn from (float32), after temperature, top-k and top-p."""
    _check_distribution(temperature, top_p, top_k)
    logits = logits.float()
    if temperature == 0:
        # The τ → 0 limit of softmax(v / τ): a point mass on the argmax (top-k and top-p keep it unchanged).
        greedy = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits).scatter(-1, greedy, 1.0)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    return top_p_filter(softmax(logits, dim=-1), top_p)


def sample_next_token(
    logits: Float[Tensor, "... vocab"],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "..."]:
    """Draw one token id per row of `logits`; `temperature=0` is greedy (argmax, no randomness used)."""
    if temperature == 0:
        _check_distribution(temperature, top_p, top_k)
        return logits.argmax(dim=-1)
    return draw(next_token_probs(logits, temperature, top_p, top_k), generator)


def draw(
    probs: Float[Tensor, "... vocab"],
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> Int[Tensor, "..."]:
    """One token id per row of `probs` (a distribution from `next_token_probs`), drawn with `generator` by
    inverting the cumulative distribution: a uniform u in [0, 1) picks the first token whose cumulative
    probability exceeds u times the row's total. A token of probability 0 adds nothing to the cumulative sum,
    so no u picks it. (`torch.multinomial` draws the same distribution about 10x slower on a CPU: 220 µs for a
    row of 10,000 tokens against 18, and 3.4 ms against 0.11 for 16 rows.) A sequence of generators, one a
    row, draws each row's u with its own: the tokens of drawing the rows one by one, in one pass."""
    flat = probs.reshape(-1, probs.shape[-1])
    cumulative = flat.cumsum(dim=-1)
    total = cumulative[:, -1:]
    uniform = {"device": flat.device, "dtype": cumulative.dtype}
    if generator is None or isinstance(generator, torch.Generator):
        u = torch.rand(flat.shape[0], 1, generator=generator, **uniform)
    else:
        u = torch.cat([torch.rand(1, 1, generator=each, **uniform) for each in generator])
    # u < 1, but u · total can round up to total: kept just below it, the last token with mass is picked.
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, below, right=True).reshape(probs.shape[:-1])
