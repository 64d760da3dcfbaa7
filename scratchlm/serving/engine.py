"""The batching scheduler: one thread runs the model for every sequence in flight, a token at a time.

Requests put sequences in a queue (`submit`); the scheduler thread loops over

    admit:  while the batch has room, take a queued sequence and prefill it alone (batch 1, a fresh
            `KVCache`: the same computation as `generate`), sample its first token, copy its keys and
            values into a free row of the `PaddedKVCache`; sequences admitted together with the same
            prompt (a request's `n` choices, a group of RL replies) share one prefill;
    step:   one forward pass over the newest token of every row (`(rows, 1)` token ids), each row at its own
            position and attending to its own keys only; sample each row's next token with its own
            `SamplingOptions` and `torch.Generator`;
    leave:  a sequence that sampled end-of-text (or another stop id: a chat model's end of turn), reached
            its token budget or was cancelled leaves, and the last row moves into its place, so the rows in
            use are always 0 .. batch - 1.

So a request joins the running batch at the next token and leaves it when it is done; a decode step costs a
few times as much for 16 rows as for 1 on a CPU (the weights are read once per step either way; the TinyStories
shape on one thread: about 25 ms against 9.4 ms), which is where the throughput of serving many clients comes
from. The steps run through a `Decoder` (`scratchlm.generation.decode`): eager, or compiled at the batch sizes
1, 2, 4, 8, 16 (the rows in use rounded up), each compiled by `warm_up` before the server takes requests.

The scheduler talks to the asyncio side of the server through each sequence's `asyncio.Queue`, filled with
`loop.call_soon_threadsafe`: `PromptLogprobs`, then one `Token` per sampled token, then `Finished` or
`Failed`. Cancelling (a client that went away, a stop string found) sets a flag that the scheduler reads
before the next step, so the row is free for the next queued sequence within one token.

A sequence never outgrows the context: the budget of a prompt of `p` tokens is capped at
`context_length - p` new tokens (see `Engine.budget`), so every token is predicted from the whole sequence,
exactly as `generate` does within the context.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor

from scratchlm.device.decode_timings import record_timings
from scratchlm.generation.decode import Decoder, bucket, model_timings_key
from scratchlm.generation.generate import stopping_ids
from scratchlm.generation.sampling import SamplingOptions, draw
from scratchlm.model.transformer import TransformerLM


class QueueFull(Exception):
    """The queue of sequences waiting for a place in the batch has no room for a request's sequences."""


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
    """A sequence in the queue or in the batch; its events arrive in `events`."""

    request: SequenceRequest
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator  # its draws: seeded with the request's seed, on the engine's device
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the asyncio side; read by the scheduler before each step
    generated: int = 0
    last_token: int = -1
    done: bool = False

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


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


class Engine:
    """Runs `model` for the sequences of every request, `max_batch` at a time, `max_queue` more waiting."""

    def __init__(
        self,
        model: TransformerLM,
        eos_id: int | None,
        max_batch: int = 16,
        max_queue: int = 64,
        stop_ids: Collection[int] = (),
        compiled: bool = False,
    ):
        """`model` computes in the dtype its weights are held in (`Plan.for_inference`), and so do its caches.
        A sequence ends at `eos_id` or any of `stop_ids` (a chat model's end of turn). `compiled`: decode
        steps compiled (call `warm_up` before `start`)."""
        self.model, self.eos_id = model, eos_id
        self.stop_ids = stopping_ids(eos_id, stop_ids)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.device = next(model.parameters()).device
        self.decoder = Decoder(model, max_batch, compiled)
        self.cache = self.decoder.cache
        self.peak_batch = 0  # the most rows one step has run, since the start
        self._active: list[Sequence] = []  # row i of the cache is sequence i
        self._pending: deque[Sequence] = deque()
        self._lock = threading.Condition()
        self._stopping: str | None = None
        self._thread = threading.Thread(target=self._run, name="scratchlm-engine", daemon=True)

    def budget(self, prompt_tokens: int) -> int:
        """How many tokens can follow a prompt of `prompt_tokens` tokens within the context."""
        return max(0, self.model.config.context_length - prompt_tokens)

    def buckets(self) -> list[int]:
        """The batch sizes a compiled step runs at: 1, 2, 4, ... up to `max_batch`."""
        return sorted({bucket(rows, self.max_batch) for rows in range(1, self.max_batch + 1)})

    def warm_up(self, announce: Callable[[str], None] = lambda line: None) -> None:
        """Compile the decode step at every bucket now, before any request waits for it, and time it against
        the eager step: a bucket where compiling does not pay runs eagerly (nothing to do when not
        `compiled`). The timings are recorded for this machine (`scratchlm doctor` shows them)."""
        if not self.decoder.compiled:
            return
        self.decoder.announce = announce
        with torch.inference_mode():
            for rows in self.buckets():
                timings = self.decoder.measure(rows)
                record_timings(model_timings_key(self.model, rows), timings)
                way = "eager" if rows in self.decoder.eager_buckets else "compiled"
                announce(f"  {rows} sequence{'' if rows == 1 else 's'}: {way}; {timings.describe()}")

    def start(self) -> None:
        self._thread.start()

    def stop(self, message: str = "the server is shutting down", wait: bool = True) -> None:
        """Fail every sequence in flight with `message` and end the scheduler thread (`wait`: until it has)."""
        with self._lock:
            self._stopping = message
            self._lock.notify()
        if wait and self._thread.is_alive():
            self._thread.join()

    def submit(self, requests: list[SequenceRequest]) -> list[Sequence]:
        """Queue the sequences of one request, all or none (`QueueFull`). Call from the event loop."""
        loop = asyncio.get_running_loop()
        sequences = [Sequence(request, loop, request.options.generator(self.device)) for request in requests]
        with self._lock:
            if self._stopping is not None:
                raise QueueFull(self._stopping)
            if len(self._pending) + len(sequences) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} sequences waiting); retry later")
            self._pending.extend(sequences)
            self._lock.notify()
        return sequences

    def cancel(self, sequence: Sequence) -> None:
        """Stop generating `sequence`: it leaves the queue now, or the batch before the next step."""
        with self._lock:
            sequence.cancelled = True
            if sequence in self._pending:
                self._pending.remove(sequence)

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while self._stopping is None and not self._pending and not self._active:
                        self._lock.wait()
                    if self._stopping is not None:
                        break
                    room = self.max_batch - len(self._active)
                    admitted = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
                try:
                    for sharing in _by_prompt(admitted):
                        self._prefill(sharing)
                    self._leave()
                    if self._active:
                        self._step()
                        self._leave()
                except Exception as e:  # a bug: fail the sequences it touched, keep serving the others
                    for sequence in [*admitted, *self._active]:
                        sequence.done = True
                        sequence.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                    self._leave()
        with self._lock:
            for sequence in [*self._active, *self._pending]:
                sequence.emit(Failed(self._stopping))
            self._active.clear()
            self._pending.clear()

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
            self.cache.store(len(self._active), cache)
            with self._lock:
                self._active.append(sequence)
            starting.append(sequence)
        if starting:
            self._sample(starting, logits[-1:].expand(len(starting), -1))

    def _step(self) -> None:
        self.cache.batch_size = len(self._active)
        self.peak_batch = max(self.peak_batch, len(self._active))
        tokens = torch.tensor([sequence.last_token for sequence in self._active], device=self.device)
        self._sample(self._active, self.decoder.step(tokens))

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

    def _leave(self) -> None:
        """Take the finished and cancelled sequences out of the batch, moving the last rows into their places."""
        with self._lock:
            row = 0
            while row < len(self._active):
                if self._active[row].done or self._active[row].cancelled:
                    last = len(self._active) - 1
                    if row != last:
                        self.cache.move(last, row)
                    self._active[row] = self._active[last]
                    self._active.pop()
                else:
                    row += 1
            self.cache.batch_size = len(self._active)


def _by_prompt(sequences: list[Sequence]) -> list[list[Sequence]]:
    """`sequences` grouped by their prompts' token ids, in the order each prompt first comes."""
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for sequence in sequences:
        groups.setdefault(tuple(sequence.request.prompt_ids), []).append(sequence)
    return list(groups.values())
