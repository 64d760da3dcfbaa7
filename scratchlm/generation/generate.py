"""Autoregressive generation: repeatedly sample the next token from the logits of the last position.

With a KV cache (the default) the prompt is run through the model once (prefill), keeping every layer's keys and
values; each later step runs only the newest token, attending to the cached keys and values, so a step costs one
position instead of the whole prefix.

Past `context_length` the model sees a sliding window: the next token is predicted from the last
`context_length` tokens, as if the text began there — the situation the model was trained on. A cached key of
layer 2 and above depends on every token its position attended to in layer 1, including tokens that have since
left the window, so dropping the oldest entries of a cache would not give the same logits as a model run on the
window. Generation therefore uses the cache while the whole sequence fits the context and, once it is longer,
runs the model on the last `context_length` tokens at every step: the tokens are exactly those of full
recomputation (`use_cache=False`) at any length, and the cache's speed-up applies to the first `context_length`
positions.

A batch of prompts (a 2-D tensor; rows of equal length) is generated together. A row that produces `eos_id`
stops growing: its later positions are still computed with the batch but never sampled into the output, and the
loop ends as soon as every row has finished or the token budget is spent.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.generation.sampling import check_sampling_options, sample_next_token
from scratchlm.model.transformer import TransformerLM


def _prepare(
    model: TransformerLM,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
) -> Int[Tensor, "batch seq"]:
    """Check the options; the prompt(s) as a (batch, seq) int64 tensor on the model's device."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ScratchlmError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_sampling_options(temperature, top_p, top_k)
    try:
        prompts = torch.as_tensor(prompt_ids)
    except (ValueError, TypeError) as e:  # ragged rows, or something that is not numbers
        raise ScratchlmError(f"prompt_ids must be token ids in rows of equal length: {e}") from None
    if prompts.dim() == 1:
        prompts = prompts.unsqueeze(0)
    if prompts.dim() != 2:
        raise ScratchlmError(
            f"prompt_ids must be a list of ids, a 1-D tensor or a 2-D (batch, seq) tensor; got shape "
            f"{tuple(prompts.shape)}"
        )
    if prompts.numel() == 0:
        raise ScratchlmError("the prompt is empty: generation needs at least one token to start from")
    if prompts.is_floating_point() or prompts.is_complex() or prompts.dtype == torch.bool:
        raise ScratchlmError(f"prompt_ids must be integer token ids, got dtype {prompts.dtype}")
    vocab_size = model.config.vocab_size
    low, high = int(prompts.min()), int(prompts.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ScratchlmError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return prompts.to(device=next(model.parameters()).device, dtype=torch.long)


@torch.no_grad()
def _generation_steps(
    model: TransformerLM,
    prompts: Int[Tensor, "batch seq"],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    eos_id: int | None,
    generator: torch.Generator | None,
    use_cache: bool,
) -> Iterator[tuple[Int[Tensor, " batch"], Tensor]]:
    """Yield `(next_tokens, active)` per step: the sampled ids and which rows were still generating."""
    context_length = model.config.context_length
    tokens = prompts
    active = torch.ones(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    cache = model.new_kv_cache(prompts.shape[0]) if use_cache else None
    for _ in range(max_new_tokens):
        if cache is not None and tokens.shape[1] <= context_length:
            # Prefill on the first step (every prompt token), then one new position per step.
            logits = model(tokens[:, cache.length :], kv_cache=cache)
        else:
            cache = None  # the sequence outgrew the context: recompute on the sliding window from now on
            logits = model(tokens[:, -context_length:])
        next_tokens = sample_next_token(logits[:, -1], temperature, top_p, top_k, generator)
        yield next_tokens, active.clone()
        if eos_id is not None:
            active &= next_tokens != eos_id
            if not active.any():
                return
        tokens = torch.cat([tokens, next_tokens.unsqueeze(1)], dim=1)


def generate(
    model: TransformerLM,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> list[int] | list[list[int]]:
    """Generate up to `max_new_tokens` new token ids after `prompt_ids`; return only the new ids.

    `prompt_ids` is one prompt (a list of ids or a 1-D tensor; returns `list[int]`) or a batch of prompts of
    equal length (a 2-D tensor; returns one `list[int]` per row, of different lengths when rows stop at
    `eos_id`). A row that produces `eos_id` ends with it. `temperature=0` is greedy decoding; `top_p` and
    `top_k` filter the distribution (see `scratchlm.generation.sampling`); `generator` makes sampling
    reproducible. `use_cache=False` recomputes the model over the last `context_length` tokens at every step
    (same tokens, much slower; kept as the reference the cached path is tested and benchmarked against).
    """
    prompts = _prepare(model, prompt_ids, max_new_tokens, temperature, top_p, top_k)
    outputs: list[list[int]] = [[] for _ in range(prompts.shape[0])]
    steps = _generation_steps(
        model, prompts, max_new_tokens, temperature, top_p, top_k, eos_id, generator, use_cache
    )
    for next_tokens, active in steps:
        for row, (token, is_active) in enumerate(zip(next_tokens.tolist(), active.tolist(), strict=True)):
            if is_active:
                outputs[row].append(token)
    single = torch.as_tensor(prompt_ids).dim() == 1
    return outputs[0] if single else outputs


def generate_stream(
    model: TransformerLM, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int, **options: Any
) -> Iterator[int]:
    """Like `generate` for one prompt, with the same keyword options (temperature, top_p, top_k, eos_id,
    generator, use_cache), but yield each new token id as soon as it is sampled."""
    for name in options:
        if name not in _OPTIONS:
            raise ScratchlmError(
                f"generate_stream got an unknown option {name!r}; known: {', '.join(_OPTIONS)}"
            )
    settings = {**_OPTIONS, **options}
    prompts = _prepare(
        model, prompt_ids, max_new_tokens, settings["temperature"], settings["top_p"], settings["top_k"]
    )
    if prompts.shape[0] != 1:
        raise ScratchlmError(f"generate_stream takes one prompt, got a batch of {prompts.shape[0]}")
    for next_tokens, _ in _generation_steps(model, prompts, max_new_tokens, **settings):
        yield int(next_tokens[0])


# The keyword options of `generate` with their defaults: `generate_stream` takes the same ones.
_OPTIONS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(generate).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}
