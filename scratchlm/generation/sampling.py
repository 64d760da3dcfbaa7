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

import torch
from jaxtyping import Bool, Float, Int
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


# How many of the most likely tokens `top_p_filter` looks at first, then next, before sorting whole rows, and
# by how much more than p their mass must be for the nucleus to be found among them.
NUCLEUS_CANDIDATES = (64, 1024)
NUCLEUS_MARGIN = 1e-5
# A row's least likely 1 / TAIL_SHARE tokens are where `top_p_filter` looks for the nucleus's end when the
# nucleus is most of the row (a flat distribution), in rows of at least TAIL_SHARE times the candidates.
TAIL_SHARE = 4
# How far from p the mass ahead of a token summed in two orders must be to decide it the same way in both:
# ten times float32's spacing near 1 (both sums are within a few spacings of the exact one: PyTorch sums
# and cumulates float32 on a CPU with wider accumulators). Closer rows are sorted whole.
TAIL_MARGIN = 1e-6


def top_p_filter(probs: Float[Tensor, "... vocab"], p: float) -> Float[Tensor, "... vocab"]:
    """Keep the smallest set of most likely tokens whose probability sum reaches `p`; renormalise.

    A trained model's nucleus is a few dozen tokens of thousands, so the rows are not sorted whole at first:
    the tokens at least as likely as the k-th most likely (`NUCLEUS_CANDIDATES`, ties included) are the first
    tokens of the sorted row, and where their mass reaches p the nucleus lies among them (a row of 10,000
    tokens on a Zen 4 EPYC: 0.19 ms for a nucleus of 2 tokens, 0.37 for one of 478, against 0.65 for the whole
    sort). A flat row's nucleus is most of it (an untrained model's, or a high temperature's): there the end
    of one row's nucleus is looked for among the quarter of least likely tokens (`TAIL_SHARE`), after the
    mass of all the others (a row of 10,000 tokens, p = 0.9, on a 2-core Zen 3 EPYC: 0.90 ms for the filter against
    1.12 with the whole sort at 2 threads, 1.27 against 1.37 at 1).
    Otherwise whole rows are sorted. Either way the result is that of a stable sort of each row, ties
    included (bit for bit on a CPU, tested)."""
    if p >= 1.0:
        return probs
    vocab = probs.shape[-1]
    by_row = probs.reshape(-1, vocab)
    largest = by_row.amax(dim=-1)
    for k, more in zip(NUCLEUS_CANDIDATES, (*NUCLEUS_CANDIDATES[1:], vocab), strict=True):
        if k >= vocab:
            break
        if not bool((k * largest >= p + NUCLEUS_MARGIN).all()):
            continue  # k tokens hold at most k times the largest probability: too little
        kth = torch.topk(by_row, k, dim=-1).values[:, -1:]
        candidate = by_row >= kth
        mass = by_row.where(candidate, 0.0).sum(dim=-1)
        if bool((mass >= p + NUCLEUS_MARGIN).all()):
            kept = _nucleus_among(by_row, candidate, p)
            if kept is not None:
                return _normalised(kept.view(probs.shape))
        # The next tokens are each at most the k-th's probability: if even `more` of them cannot reach p,
        # no candidate set short of the whole row does.
        if not bool((mass + (more - candidate.sum(dim=-1)) * kth[:, 0] >= p).all()):
            break
    if by_row.shape[0] == 1 and vocab >= TAIL_SHARE * NUCLEUS_CANDIDATES[-1]:
        # The nucleus may end among the row's least likely tokens. One row only (`generate`'s): several rows
        # (a server's batch) are sorted at once as integers faster than they are searched row by row (16 rows
        # of 10,000 tokens on the Zen 3: 3.2 ms against 5.8).
        kth_least = torch.kthvalue(by_row, vocab // TAIL_SHARE, dim=-1).values[:, None]
        kept = _nucleus_ending_among(by_row, by_row <= kth_least, p)
        if kept is not None:
            return _normalised(kept.view(probs.shape))
    if probs.dtype != torch.float32:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        return _normalised(torch.zeros_like(probs).scatter(-1, order, _keep_nucleus(sorted_probs, p)))
    # The same order as the stable descending sort of each row, from one stable sort of all rows' entries
    # as integers (a radix sort on a CPU, a few times faster than sorting the rows as floats): a
    # non-negative float32's bits, read as an integer, order as its value does, so the key of an entry is
    # its row (the high bits) and its bits counted down from the largest integer of 31 bits.
    rows, vocab = probs.shape[:-1].numel(), probs.shape[-1]
    flat = probs.reshape(-1)
    row = torch.arange(rows, device=probs.device).repeat_interleave(vocab)
    order = torch.sort((row << 31) + (0x7FFFFFFF - flat.view(torch.int32).long()), stable=True).indices
    kept = torch.empty_like(flat)
    kept[order] = _keep_nucleus(flat[order].view(rows, vocab), p).reshape(-1)
    return _normalised(kept.view(probs.shape))


def _normalised(kept: Float[Tensor, "... vocab"]) -> Float[Tensor, "... vocab"]:
    return kept / kept.sum(dim=-1, keepdim=True)


def _sorted_candidates(
    probs: Float[Tensor, "rows vocab"], candidate: Bool[Tensor, "rows vocab"]
) -> tuple[Float[Tensor, "rows width"], Int[Tensor, "rows width"]]:
    """The `candidate` tokens of each row in the order of the stable descending sort of the row (they come in
    increasing token order, then are sorted stably), left-aligned: their probabilities (0 past a row's
    candidates) and their token ids (0 there)."""
    rows = probs.shape[0]
    row, token = candidate.nonzero(as_tuple=True)  # in increasing token order within each row
    counts = candidate.sum(dim=-1)
    place = torch.arange(len(row), device=probs.device) - (counts.cumsum(0) - counts)[row]
    # Each row's candidates left-aligned in a (rows, most candidates) block; -1 pads, and sorts last.
    width = int(counts.max())
    values = probs.new_full((rows, width), -1.0).index_put_((row, place), probs[row, token])
    tokens = torch.zeros((rows, width), dtype=torch.long, device=probs.device).index_put_((row, place), token)
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values.clamp_min(0.0), tokens.gather(-1, order)


def _nucleus_among(
    probs: Float[Tensor, "rows vocab"], candidate: Bool[Tensor, "rows vocab"], p: float
) -> Float[Tensor, "rows vocab"] | None:
    """The rows with the tokens outside each nucleus set to 0, found among the `candidate` tokens (those at
    least as likely as a row's k-th most likely); None where some row's nucleus may reach beyond them.
    The candidates, sorted, are the first tokens of the row's stable sort, and a running sum over them is that
    sort's running sum. So where it reaches p, every later token has at least p ahead of it and is out of the
    nucleus."""
    sorted_values, tokens = _sorted_candidates(probs, candidate)
    # Reached with room to spare: the sort of the whole row computes the mass ahead of the next token as its
    # running sum less its probability, which may round below a sum that reaches p by a hair.
    if not bool((sorted_values.cumsum(dim=-1)[:, -1] >= p + NUCLEUS_MARGIN).all()):
        return None
    # Adding (not writing) puts each kept probability in place: the pads all add 0 to token 0.
    return torch.zeros_like(probs).scatter_add_(-1, tokens, _keep_nucleus(sorted_values, p))


def _nucleus_ending_among(
    probs: Float[Tensor, "rows vocab"], candidate: Bool[Tensor, "rows vocab"], p: float
) -> Float[Tensor, "rows vocab"] | None:
    """The rows with the tokens outside each nucleus set to 0, where the nucleus ends among the `candidate`
    tokens (those at most as likely as a row's k-th least likely, ties included); None where it may not.
    Every other token is more likely than every candidate, so it comes first in the row's sorted order, and
    the mass ahead of the i-th candidate is theirs plus that of the candidates before it. Each token's fate
    is decided only where that mass is clear of p by `TAIL_MARGIN`, since it is summed in another order than
    the whole row's sort sums it."""
    others = probs.where(~candidate, 0.0)
    mass = others.sum(dim=-1, keepdim=True)
    if not bool((mass < p - NUCLEUS_MARGIN).all()):
        return None  # the nucleus ends before the candidates
    sorted_values, tokens = _sorted_candidates(probs, candidate)
    ahead = mass + sorted_values.cumsum(dim=-1) - sorted_values
    if bool(((ahead - p).abs() < TAIL_MARGIN).any()):
        return None  # too close to call
    return others.scatter_add_(-1, tokens, sorted_values.masked_fill(ahead >= p, 0.0))


def _keep_nucleus(sorted_probs: Float[Tensor, "... vocab"], p: float) -> Float[Tensor, "... vocab"]:
    """Rows sorted in decreasing order, with the tokens outside each row's nucleus set to 0."""
    # Probability mass strictly ahead of each token in the sorted order: the first token has 0 ahead, so it
    # always stays, and the token whose own mass makes the sum reach p is the last one kept.
    mass_ahead = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return sorted_probs.masked_fill(mass_ahead >= p, 0.0)


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


def draw(probs: Float[Tensor, "... vocab"], generator: torch.Generator | None = None) -> Int[Tensor, "..."]:
    """One token id per row of `probs` (a distribution from `next_token_probs`), drawn with `generator` by
    inverting the cumulative distribution: a uniform u in [0, 1) picks the first token whose cumulative
    probability exceeds u times the row's total. A token of probability 0 adds nothing to the cumulative sum,
    so no u picks it. (`torch.multinomial` draws the same distribution about 10x slower on a CPU: 220 µs for a
    row of 10,000 tokens against 18, and 3.4 ms against 0.11 for 16 rows.)"""
    flat = probs.reshape(-1, probs.shape[-1])
    cumulative = flat.cumsum(dim=-1)
    total = cumulative[:, -1:]
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=cumulative.dtype)
    # u < 1, but u · total can round up to total: kept just below it, the last token with mass is picked.
    below = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, below, right=True).reshape(probs.shape[:-1])
