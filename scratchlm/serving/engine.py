"""The server's scheduler: one thread advances the batched decoding engine (`scratchlm.generation.engine.Batch`)
for every sequence the clients' requests queue, and hands each sequence's events to the asyncio side.

Requests put sequences in a queue (`submit`, from the event loop); the scheduler thread loops: take as many queued
sequences as the batch has room for, `Batch.advance` (prefill them, one decode step of every row, the finished
ones leave), again. So a request joins the running batch at the next token and leaves it when it is done.

Each sequence's events (`PromptLogprobs`, a `Token` per sampled token, then `Finished` or `Failed`) reach its
`asyncio.Queue` through `loop.call_soon_threadsafe`. Cancelling (a client that went away, a stop string found)
sets a flag that the scheduler reads before the next step, so the row is free for the next queued sequence within
one token. A bug while advancing fails the sequences it touched and the scheduler goes on serving the others.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from scratchlm.generation import engine as decoding
from scratchlm.generation.engine import Batch, Failed, SequenceRequest
from scratchlm.model.transformer import TransformerLM


class QueueFull(Exception):
    """The queue of sequences waiting for a place in the batch has no room for a request's sequences."""


@dataclass(eq=False)
class Sequence(decoding.Sequence):
    """A sequence of a client's request; its events arrive in `events`, on the event loop that submitted it."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)


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
        background: bool = True,
        announce: Callable[[str], None] | None = None,
    ):
        """`model` and the rest as `Batch` takes them: where `compiled`, each decode step compiles when the
        traffic first needs it (in the `background`, serving eagerly meanwhile), said through `announce`."""
        self.batch = Batch(model, eos_id, max_batch, stop_ids, compiled, background, announce)
        self.model, self.stop_ids, self.max_queue = model, self.batch.stop_ids, max_queue
        self._pending: deque[Sequence] = deque()
        self._lock = threading.Condition()
        self._stopping: str | None = None
        self._held = 0  # the sequences the scheduler has taken and not finished: counted under the lock
        self._thread = threading.Thread(target=self._run, name="scratchlm-engine", daemon=True)

    def budget(self, prompt_tokens: int) -> int:
        """How many tokens can follow a prompt of `prompt_tokens` tokens within the context."""
        return self.batch.budget(prompt_tokens)

    def in_flight(self) -> int:
        """The sequences queued or in the batch."""
        with self._lock:
            return self._held + len(self._pending)

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
        sequences = [self._sequence(request, asyncio.get_running_loop()) for request in requests]
        with self._lock:
            if self._stopping is not None:
                raise QueueFull(self._stopping)
            if len(self._pending) + len(sequences) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} sequences waiting); retry later")
            self._pending.extend(sequences)
            self._lock.notify()
        return sequences

    def _sequence(self, request: SequenceRequest, loop: asyncio.AbstractEventLoop) -> Sequence:
        events: asyncio.Queue = asyncio.Queue()
        generator = request.options.generator(self.batch.device)
        return Sequence(
            request,
            generator,
            lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
            events=events,
        )

    def cancel(self, sequence: Sequence) -> None:
        """Stop generating `sequence`: it leaves the queue now, or the batch before the next step."""
        with self._lock:
            sequence.cancelled = True
            if sequence in self._pending:
                self._pending.remove(sequence)

    def _run(self) -> None:
        batch = self.batch
        with torch.inference_mode():
            while True:
                with self._lock:
                    while self._stopping is None and not self._pending and not batch.active:
                        self._lock.wait()
                    if self._stopping is not None:
                        break
                    admitted = [self._pending.popleft() for _ in range(min(batch.room, len(self._pending)))]
                    self._held = len(batch.active) + len(admitted)
                try:
                    batch.advance(admitted)
                except Exception as e:  # a bug: fail the sequences it touched, keep serving the others
                    for sequence in [*admitted, *batch.active]:
                        sequence.done = True
                        sequence.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
                    batch.leave()
                with self._lock:
                    self._held = len(batch.active)
        with self._lock:
            for sequence in [*batch.active, *self._pending]:
                sequence.emit(Failed(self._stopping))
            batch.active.clear()
            self._pending.clear()
            self._held = 0
