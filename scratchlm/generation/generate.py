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

A batch of prompts (a 2-D tensor; rows of equal length) is generated together. A row that produces `eos_id` (or one of `stop_ids`)
stops growing: its later positions are still computed with the batch but never sampled into the output, and the
loop ends as soon as every row has finished or the token budget is spent.

The sampling settings come as keywords (`temperature=0.8, top_p=0.9`) or as one `SamplingOptions` (`options=`),
the type the server and the command line hold them in; either way they are checked by `SamplingOptions`.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from scratchlm.errors import ScratchlmError
from scratchlm.generation.compile_policy import CompiledSwitch
from scratchlm.generation.decode import Decoder
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.transformer import TransformerLM


def _prepare(model: TransformerLM, prompt_ids: Sequence[int] | Tensor) -> Int[Tensor, "batch seq"]:
    """The prompt(s) as a (batch, seq) int64 tensor on the model's device, checked."""
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


def _sampling_options(
    max_new_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int | None,
    options: SamplingOptions | None,
) -> SamplingOptions:
    """The settings of a call: `options`, or the keywords made into `SamplingOptions` (never both)."""
    keywords = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    if options is None:
        if max_new_tokens is None:
            raise ScratchlmError("generation needs max_new_tokens (or options=SamplingOptions(...))")
        return SamplingOptions(**keywords)
    if any(value != _DEFAULTS[name] for name, value in keywords.items()):
        raise ScratchlmError(
            "give the sampling settings as options=SamplingOptions(...) or as keywords, not both"
        )
    if options.stop:
        raise ScratchlmError(
            "generation works on token ids and cannot apply stop strings, which are found in text "
            "(the server applies them); leave SamplingOptions.stop empty here"
        )
    return options


@torch.no_grad()
def _generation_steps(
    model: TransformerLM,
    prompts: Int[Tensor, "batch seq"],
    options: SamplingOptions,
    stops: frozenset[int],
    generator: torch.Generator | None,
    use_cache: bool,
    compile: bool | None = None,
) -> Iterator[tuple[Int[Tensor, " batch"], Tensor]]:
    """Yield `(next_tokens, active)` per step: the sampled ids and which rows were still generating."""
    if generator is None and options.seed is not None:
        generator = options.generator(prompts.device)
    context_length = model.config.context_length
    tokens = prompts
    active = torch.ones(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    cache = model.new_kv_cache(prompts.shape[0]) if use_cache else None
    switch = CompiledSwitch(model, prompts.shape[0], compile) if use_cache else None
    decoder: Decoder | None = None
    try:
        for step in range(options.max_new_tokens):
            if tokens.shape[1] > context_length:
                # The sequence outgrew the context: recompute on the sliding window from now on.
                cache = decoder = None
                logits = model(tokens[:, -context_length:], last_only=True)[:, -1]
            elif decoder is not None:
                logits = decoder.step(tokens[:, -1])
            elif cache is not None:
                # Prefill on the first step (every prompt token), then one new position per step.
                logits = model(tokens[:, cache.length :], kv_cache=cache, last_only=True)[:, -1]
                steps_left = min(options.max_new_tokens - step - 1, context_length - tokens.shape[1])
                if switch is not None and (decoder := switch.decoder(cache, steps_left)) is not None:
                    cache = None
            else:
                logits = model(tokens[:, -context_length:], last_only=True)[:, -1]
            next_tokens = options.sample(logits, generator)
            yield next_tokens, active.clone()
            if stops:
                active &= ~torch.isin(next_tokens, torch.tensor(sorted(stops), device=next_tokens.device))
                if not active.any():
                    break
            # Past the context only the window is read: keep it alone (one more token than the context, which
            # keeps the sliding branch taken), so that a budget of any length runs in constant memory.
            tokens = torch.cat([tokens[:, -context_length:], next_tokens.unsqueeze(1)], dim=1)
    finally:
        if switch is not None:
            switch.finish()


def generate(
    model: TransformerLM,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    options: SamplingOptions | None = None,
    stop_ids: Collection[int] = (),
    compile: bool | None = None,
) -> list[int] | list[list[int]]:
    """Generate up to `max_new_tokens` new token ids after `prompt_ids`; return only the new ids.

    `prompt_ids` is one prompt (a list of ids or a 1-D tensor; returns `list[int]`) or a batch of prompts of
    equal length (a 2-D tensor; returns one `list[int]` per row, of different lengths when rows stop at
    `eos_id`). A row that produces `eos_id` ends with it. `temperature=0` is greedy decoding; `top_p` and
    `top_k` filter the distribution (see `scratchlm.generation.sampling`); `stop_ids` are more ids that end a
    row as `eos_id` does (a chat model's end of turn, `scratchlm.chat`); `generator` makes sampling
    reproducible. `use_cache=False` recomputes the model over the last `context_length` tokens at every step
    (same tokens, much slower; kept as the reference the cached path is tested and benchmarked against).

    `options` gives the budget and sampling settings instead of `max_new_tokens`, `temperature`, `top_p` and
    `top_k`; its `seed` seeds a generator for the call, unless `generator` is given (one whose state carries
    on from an earlier call, as `scratchlm generate --num-samples` uses it).

    `compile` runs the decode steps compiled (`scratchlm.generation.decode`): None (the default) where the
    model's plan allows it (`prepare_for_inference`) and the tokens left pay for the compilation, True at
    once, False never. The tokens are the same either way, up to floating-point rounding at a near-tie.
    """
    options = _sampling_options(max_new_tokens, temperature, top_p, top_k, options)
    prompts = _prepare(model, prompt_ids)
    outputs: list[list[int]] = [[] for _ in range(prompts.shape[0])]
    stops = stopping_ids(eos_id, stop_ids)
    steps = _generation_steps(model, prompts, options, stops, generator, use_cache, compile)
    for next_tokens, active in steps:
        for row, (token, is_active) in enumerate(zip(next_tokens.tolist(), active.tolist(), strict=True)):
            if is_active:
                outputs[row].append(token)
    single = torch.as_tensor(prompt_ids).dim() == 1
    return outputs[0] if single else outputs


def generate_stream(
    model: TransformerLM,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int | None = None,
    **keywords: Any,
) -> Iterator[int]:
    """Like `generate` for one prompt, with the same keywords (temperature, top_p, top_k, eos_id, generator,
    use_cache, options, stop_ids, compile), but yield each new token id as soon as it is sampled."""
    for name in keywords:
        if name not in _DEFAULTS:
            raise ScratchlmError(
                f"generate_stream got an unknown option {name!r}; known: {', '.join(_DEFAULTS)}"
            )
    settings = {**_DEFAULTS, **keywords}
    options = _sampling_options(
        max_new_tokens, settings["temperature"], settings["top_p"], settings["top_k"], settings["options"]
    )
    prompts = _prepare(model, prompt_ids)
    if prompts.shape[0] != 1:
        raise ScratchlmError(f"generate_stream takes one prompt, got a batch of {prompts.shape[0]}")
    stops = stopping_ids(settings["eos_id"], settings["stop_ids"])
    steps = _generation_steps(
        model, prompts, options, stops, settings["generator"], settings["use_cache"], settings["compile"]
    )
    for next_tokens, _ in steps:
        yield int(next_tokens[0])


def stopping_ids(eos_id: int | None, stop_ids: Collection[int] = ()) -> frozenset[int]:
    """The ids that end a sequence: `eos_id` (None: none) and `stop_ids`."""
    return frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())


# The keyword arguments of `generate` with their defaults: `generate_stream` takes the same ones.
_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(generate).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}
