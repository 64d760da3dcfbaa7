"""Replies sampled through the serving engine: rollouts cost what serving costs.

`sample_replies` queues one `SequenceRequest` per prompt on a fresh `scratchlm.serving.engine.Engine` over the
model being trained, and collects each sequence's tokens until it finishes. The engine decodes up to
`MAX_ROWS` sequences together, a token at a time, each at its own position of a padded KV cache, and draws
each row's tokens with its own generator seeded from `seeds`: the same seeds give the same replies whoever
shares the batch, which is what lets a resumed run sample exactly what the uninterrupted one did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from scratchlm.errors import ScratchlmError
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.transformer import TransformerLM
from scratchlm.serving.engine import Engine, Failed, Finished, Sequence, SequenceRequest, Token

MAX_ROWS = 64  # sequences decoded together: a decode step reads the weights once for all of them


def sample_replies(
    model: TransformerLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seeds: list[int] | None,
    eos_id: int,
    stop_ids: Collection[int],
) -> list[list[int]]:
    """The token ids of a reply to each prompt, at most `max_new_tokens` (and what the context leaves), ending
    with the stop id that ended it, if one did. `temperature` 0 decodes greedily; else each reply draws with
    the seed of `seeds` at its index."""
    engine = Engine(
        model, eos_id, max_batch=min(len(prompts), MAX_ROWS), max_queue=len(prompts), stop_ids=stop_ids
    )
    requests = [
        SequenceRequest(
            ids,
            SamplingOptions(
                min(max_new_tokens, engine.budget(len(ids))),
                temperature=temperature,
                seed=None if seeds is None else seeds[i],
            ),
        )
        for i, ids in enumerate(prompts)
    ]
    engine.start()
    try:
        return asyncio.run(_collect(engine, requests))
    finally:
        engine.stop()


async def _collect(engine: Engine, requests: list[SequenceRequest]) -> list[list[int]]:
    sequences = engine.submit(requests)
    return [await _tokens(sequence) for sequence in sequences]


async def _tokens(sequence: Sequence) -> list[int]:
    tokens: list[int] = []
    while True:
        event = await sequence.events.get()
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, Finished):
            return tokens
        elif isinstance(event, Failed):
            raise ScratchlmError(f"sampling replies failed: {event.message}")
