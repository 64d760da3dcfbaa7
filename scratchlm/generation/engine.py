"""The batched decoding engine: many sequences decoded together, a token at a time, each joining and leaving the
batch on its own. It runs in the caller's thread: `generate_batch` decodes a list of prompts to the end (reinforcement
learning's rollouts), and the server's scheduler thread (`scratchlm.serving.engine`) calls `Batch.advance` in a loop,
admitting the sequences its clients queue.

Each `Batch.advance`

    admit:  prefill each admitted sequence alone (batch 1, a fresh `KVCache`: the same computation as `generate`),
            sample its first token, copy its keys and values into a free row of the `PaddedKVCache`; sequences
            admitted together with the same prompt (a request's `n` choices, a group of RL replies) share one
            prefill;
    step:   one forward pass over the newest token of every row (`(rows, 1)` token ids), each row at its own
            position and attending to its own keys only; sample each row's next token with its own
            `SamplingOptions` and `torch.Generator`;
    leave:  a sequence that sampled end-of-text (or another stop id: a chat model's end of turn), reached its
            token budget or was cancelled leaves, and the last row moves into its place, so the rows in use are
            always 0 .. batch - 1.

So a sequence joins the running batch at the next token and leaves it when it is done; a decode step costs a few
times as much for 16 rows as for 1 on a CPU (the weights are read once per step either way; the TinyStories shape
on one thread: about 25 ms against 9.4 ms), which is where the throughput of many sequences comes from. The steps
run through a `Decoder` (`scratchlm.generation.decode`): eager, or compiled at the batch sizes 1, 2, 4, 8, 16 (the
rows in use rounded up) and the windows the rows' lengths need, each compiled when the traffic first needs it, in
the background, while the steps run eagerly (`scratchlm.generation.on_demand`).

What a sequence produces goes to its `emit`, in order: `PromptLogprobs` (if asked), then one `Token` per sampled
token, then `Finished`. Each row draws with its own generator, so a seed gives the same tokens whoever shares the
batch. A sequence never outgrows the context: the budget of a prompt of `p` tokens is capped at
`context_length - p` new tokens (`Batch.budget`), so every token is predicted from the whole sequence, exactly as
`generate` does within the context.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from scratchlm.generation.decode import Decoder
from scratchlm.generation.generate import stopping_ids
from scratchlm.generation.on_demand import OnDemandDecoder
from scratchlm.generation.sampling import SamplingOptions, draw
from scratchlm.model.transformer import TransformerLM


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: the prompt's token ids, how to sample after it, and what to report. The engine
    reads the budget, the distribution and the seed of `options`; stop strings are found in the text, which
    is the caller's."""

    prompt_ids: list[int]
    options: SamplingOptions  # `max_new_tokens` at most `Engine.budget(len(prompt_ids))`
    top_logprobs: int | None = None  # report each token's log-probability and this many alternatives
    prompt_logprobs: bool = False  # report the prompt's tokens' log-probabilities too


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (the raw logits, before temperature, top-k and top-p), and
    the `top` most likely tokens at its position with theirs."""

    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class PromptLogprobs:
    """The log-probability of each prompt token after the first, given the tokens before it."""

    tokens: list[TokenLogprob]


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end-of-text, or another of the engine's stop ids) or "length" (the token budget)


@dataclass(frozen=True)
class Failed:
    message: str


Event = PromptLogprobs | Token | Finished | Failed


@dataclass(eq=False)
class Sequence:
    """A sequence waiting for a row or in the batch; what it produces goes to `emit`, called in the thread that
    advances the batch."""

    request: SequenceRequest
    generator: torch.Generator  # its draws: seeded with the request's seed, on the batch's device
    emit: Callable[[Event], None]
    cancelled: bool = False  # read before each step: the sequence leaves the batch
    generated: int = 0
    last_token: int = -1
    done: bool = False


def token_logprobs(logits: Float[Tensor, "... vocab"], token_ids: Tensor, top: int) -> list[TokenLogprob]:
    """The log-softmax of each row of `logits` at `token_ids`, and its `top` largest entries."""
    logprobs = logits.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    chosen = logprobs.gather(-1, token_ids[..., None])[..., 0].tolist()
    best = torch.topk(logprobs, top, dim=-1) if top else None
    tops = (
        [
            dict(zip(i, v, strict=True))
            for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
        if best is not None
        else [{} for _ in chosen]
    )
    return [TokenLogprob(lp, t) for lp, t in zip(chosen, tops, strict=True)]


def token_budget(model: TransformerLM, prompt_tokens: int) -> int:
    """How many tokens can follow a prompt of `prompt_tokens` tokens within `model`'s context."""
    return max(0, model.config.context_length - prompt_tokens)


class Batch:
    """The sequences decoded together: `max_batch` rows of one padded KV cache, a row a sequence."""

    def __init__(
        self,
        model: TransformerLM,
        eos_id: int | None,
        max_batch: int = 16,
        stop_ids: Collection[int] = (),
        compiled: bool = False,
        background: bool = True,
        announce: Callable[[str], None] | None = None,
    ):
        """`model` computes in the dtype its weights are held in, and so do its caches. A sequence ends at `eos_id`
        or any of `stop_ids` (a chat model's end of turn). `compiled`: decode steps compiled as the sequences
        first need them, in the `background` (else at once), said through `announce`."""
        self.model, self.eos_id = model, eos_id
        self.stop_ids = stopping_ids(eos_id, stop_ids)
        self.max_batch = max_batch
        self.device = next(model.parameters()).device
        self.decoder = (
            OnDemandDecoder(model, max_batch, background, announce)
            if compiled
            else Decoder(model, max_batch, compiled=False)
        )
        self.cache = self.decoder.cache
        self.peak_batch = 0  # the most rows one step has run, since the start
        self.active: list[Sequence] = []  # row i of the cache is sequence i

    def budget(self, prompt_tokens: int) -> int:
        """How many tokens can follow a prompt of `prompt_tokens` tokens within the context."""
        return token_budget(self.model, prompt_tokens)

    def compiling(self) -> list[str]:
        """The decode steps being compiled (see `OnDemandDecoder.compiling`)."""
        return self.decoder.compiling() if isinstance(self.decoder, OnDemandDecoder) else []

    @property
    def room(self) -> int:
        """How many more sequences the batch can take."""
        return self.max_batch - len(self.active)

    def advance(self, admitted: list[Sequence]) -> None:
        """Give each of `admitted` (at most `room`) a row, then one decode step of every row; the sequences that
        are done or cancelled leave. Call under `torch.inference_mode()`."""
        for sharing in _by_prompt(admitted):
            self._prefill(sharing)
        self.leave()
        if self.active:
            self._step()
            self.leave()

    def _prefill(self, sequences: list[Sequence]) -> None:
        """Prefill the prompt that `sequences` share once, alone (batch 1, a fresh `KVCache`), then give each
        sequence its own row, a copy of the prompt's keys and values, and its first token, drawn with its own
        generator: a group of replies to one prompt (`n` choices, reinforcement learning's rollouts) costs
        one prefill, and each reply is what it would be alone."""
        sequences = [sequence for sequence in sequences if not sequence.cancelled]
        if not any(s.request.options.max_new_tokens or s.request.prompt_logprobs for s in sequences):
            for sequence in sequences:  # none needs the prompt's logits
                sequence.emit(Finished("length"))
            return
        prompt = torch.tensor([sequences[0].request.prompt_ids], device=self.device)
        cache = self.model.new_kv_cache(1)
        # The prompt's own logits only where a sequence reports their log-probabilities.
        every_position = any(sequence.request.prompt_logprobs for sequence in sequences)
        logits = self.model(prompt, kv_cache=cache, last_only=not every_position)[0]
        starting = []
        for sequence in sequences:
            request = sequence.request
            if request.prompt_logprobs:
                top = request.top_logprobs or 0
                sequence.emit(PromptLogprobs(token_logprobs(logits[:-1], prompt[0, 1:], top)))
            if request.options.max_new_tokens == 0:
                sequence.emit(Finished("length"))
                continue
            self.cache.store(len(self.active), cache)
            self.active.append(sequence)
            starting.append(sequence)
        if starting:
            self._sample(starting, logits[-1:].expand(len(starting), -1))

    def _step(self) -> None:
        self.cache.batch_size = len(self.active)
        self.peak_batch = max(self.peak_batch, len(self.active))
        tokens = torch.tensor([sequence.last_token for sequence in self.active], device=self.device)
        self._sample(self.active, self.decoder.step(tokens))

    def _sample(self, sequences: list[Sequence], logits: Float[Tensor, "batch vocab"]) -> None:
        """Draw each sequence's next token from its row of logits, report it, and mark the sequence done at
        a stop id (end-of-text, a chat model's end of turn) or at its budget. Rows with the same
        `SamplingOptions.distribution` get their distributions computed together (one sort for all their rows'
        top-p), then each row draws with its own generator, so a seed gives the same tokens whoever shares the
        batch; the token ids come back to Python in one transfer."""
        groups: dict[tuple, list[int]] = {}
        for row, sequence in enumerate(sequences):
            groups.setdefault(sequence.request.options.distribution, []).append(row)
        drawn: list[Tensor] = [logits] * len(sequences)  # each row's token id, shape (1,)
        for rows in groups.values():
            options = sequences[rows[0]].request.options  # the group's distribution settings
            group_logits = logits if len(rows) == len(sequences) else logits[rows]
            if options.temperature == 0:  # an argmax: no distribution to compute, nothing drawn
                greedy = options.sample(group_logits)
                for i, row in enumerate(rows):
                    drawn[row] = greedy[i : i + 1]
                continue
            group_drawn = draw(options.probs(group_logits), [sequences[row].generator for row in rows])
            for i, row in enumerate(rows):
                drawn[row] = group_drawn[i : i + 1]
        tokens = torch.cat(drawn)
        for row, (sequence, token_id) in enumerate(zip(sequences, tokens.tolist(), strict=True)):
            request = sequence.request
            logprob = None
            if request.top_logprobs is not None:
                logprob = token_logprobs(logits[row : row + 1], tokens[row : row + 1], request.top_logprobs)[
                    0
                ]
            sequence.generated += 1
            sequence.last_token = token_id
            sequence.emit(Token(token_id, logprob))
            if token_id in self.stop_ids or sequence.generated >= request.options.max_new_tokens:
                sequence.done = True
                sequence.emit(Finished("stop" if token_id in self.stop_ids else "length"))

    def leave(self) -> None:
        """Take the finished and cancelled sequences out of the batch, moving the last rows into their places."""
        row = 0
        while row < len(self.active):
            if self.active[row].done or self.active[row].cancelled:
                last = len(self.active) - 1
                if row != last:
                    self.cache.move(last, row)
                self.active[row] = self.active[last]
                self.active.pop()
            else:
                row += 1
        self.cache.batch_size = len(self.active)


def _by_prompt(sequences: list[Sequence]) -> list[list[Sequence]]:
    """`sequences` grouped by their prompts' token ids, in the order each prompt first comes."""
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for sequence in sequences:
        groups.setdefault(tuple(sequence.request.prompt_ids), []).append(sequence)
    return list(groups.values())


def generate_batch(
    model: TransformerLM,
    requests: list[SequenceRequest],
    eos_id: int | None,
    stop_ids: Collection[int] = (),
    max_batch: int = 16,
) -> list[list[int]]:
    """The token ids sampled after each request's prompt, at most its `max_new_tokens` (capped by the caller at
    `Batch.budget`), ending with the stop id that ended it, if one did: the requests decoded `max_batch` at a time
    in this thread, each joining the batch as soon as a row is free."""
    batch = Batch(model, eos_id, max_batch=max(1, min(len(requests), max_batch)), stop_ids=stop_ids)
    tokens: list[list[int]] = [[] for _ in requests]

    def collect(into: list[int]) -> Callable[[Event], None]:
        return lambda event: into.append(event.token_id) if isinstance(event, Token) else None

    waiting = deque(
        Sequence(request, request.options.generator(batch.device), collect(into))
        for request, into in zip(requests, tokens, strict=True)
    )
    with torch.inference_mode():
        while waiting or batch.active:
            batch.advance([waiting.popleft() for _ in range(min(batch.room, len(waiting)))])
    return tokens
