"""Replies sampled by the batched decoding engine: rollouts cost what serving costs, in the training thread.

`sample_replies` decodes one `SequenceRequest` per prompt with `scratchlm.generation.engine.generate_batch` over
the model being trained: up to `MAX_ROWS` sequences together, a token at a time, each at its own position of a
padded KV cache, each row drawing its tokens with its own generator seeded from `seeds`. The same seeds give the
same replies whoever shares the batch, which is what lets a resumed run sample exactly what the uninterrupted one
did.
"""

from __future__ import annotations

from collections.abc import Collection

from scratchlm.generation.engine import SequenceRequest, generate_batch, token_budget
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.transformer import TransformerLM

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
    requests = [
        SequenceRequest(
            ids,
            SamplingOptions(
                min(max_new_tokens, token_budget(model, len(ids))),
                temperature=temperature,
                seed=None if seeds is None else seeds[i],
            ),
        )
        for i, ids in enumerate(prompts)
    ]
    return generate_batch(model, requests, eos_id, stop_ids, max_batch=MAX_ROWS)
