"""KV-cache generation against full forward passes and against sliding-window attention in the torch.nn
reference (tests/reference_lm.py)."""

import dataclasses

import pytest
import torch
from reference_lm import reference_from

from scratchlm import ModelConfig, TransformerLM
from scratchlm.errors import ScratchlmError

TINY = ModelConfig(vocab_size=61, context_length=12, d_model=32, num_layers=2, num_heads=4, d_ff=48)


def tiny_model(**changes) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM.from_config(dataclasses.replace(TINY, **changes)).eval()


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", ["pre", "post", "none"])
@pytest.mark.parametrize("positions", ["rope", "none"])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(norm, positions):
    model = tiny_model(norm=norm, positions=positions)
    tokens = ids(3, 12)  # a batch of three prompts
    cache = model.new_kv_cache(batch_size=3)
    pieces = [model(tokens[:, :5], kv_cache=cache)]  # prefill
    pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]  # decode
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(tokens), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_chunks_of_any_size_equal_full_forward():
    model = tiny_model()
    tokens = ids(2, 12, seed=2)
    cache = model.new_kv_cache(2)
    pieces = [model(tokens[:, a:b], kv_cache=cache) for a, b in ((0, 1), (1, 4), (4, 9), (9, 12))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(tokens), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_one_layer_past_context_equals_forward_on_last_context_tokens():
    model = tiny_model(num_layers=1)
    tokens = ids(2, 30, seed=3)
    cache = model.new_kv_cache(2)
    model(tokens[:, :12], kv_cache=cache)
    for t in range(12, 30):
        logits = model(tokens[:, t : t + 1], kv_cache=cache)
        window = tokens[:, t - 11 : t + 1]
        torch.testing.assert_close(logits[:, 0], model(window)[:, -1], atol=1e-5, rtol=1e-4)
    assert cache.length == 30 and cache.layers[0].keys.shape[-2] == 12


@pytest.mark.parametrize("positions", ["rope", "none"])
@torch.no_grad()
def test_decoding_past_context_is_sliding_window_attention(positions):
    # Deeper layers' cached keys remember tokens that have left the window: the oracle is the reference model
    # over the whole sequence with a banded mask (each token sees itself and the 11 tokens before it).
    model = tiny_model(num_layers=3, positions=positions)
    reference = reference_from(model)
    tokens = ids(2, 40, seed=4)
    query, key = torch.arange(40)[:, None], torch.arange(40)[None, :]
    band = (key <= query) & (key > query - 12)
    expected = reference(tokens, mask=band)
    cache = model.new_kv_cache(2)
    pieces = [model(tokens[:, :12], kv_cache=cache)]
    pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(12, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=2e-5, rtol=1e-4)


def test_misuse_is_a_clear_error():
    model = tiny_model()
    cache = model.new_kv_cache(2)
    with pytest.raises(ScratchlmError, match="batch=2"):
        model(ids(3, 4), kv_cache=cache)
    with pytest.raises(ScratchlmError, match="context_length"):
        model(ids(2, 13), kv_cache=cache)
    assert cache.length == 0
