"""KV-cache forward passes against full forward passes."""

import dataclasses

import pytest
import torch

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


@pytest.mark.parametrize("softcap", [0.0, 15.0])
@torch.no_grad()
def test_the_last_positions_logits_alone_equal_the_full_forwards(softcap):
    """`last_only`: the logits of the last position, with a cache and without, one row of the full pass's."""
    model = tiny_model(logit_softcap=softcap)
    tokens = ids(3, 9, seed=3)
    full = model(tokens)
    last = model(tokens, last_only=True)
    assert last.shape == (3, 1, TINY.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-5)
    cache = model.new_kv_cache(3)
    model(tokens[:, :4], kv_cache=cache, last_only=True)
    torch.testing.assert_close(
        model(tokens[:, 4:], kv_cache=cache, last_only=True), full[:, -1:], atol=1e-5, rtol=1e-4
    )
    assert cache.length == 9


@torch.no_grad()
def test_the_cache_holds_the_context_and_refuses_more():
    model = tiny_model()
    tokens = ids(2, 13, seed=3)
    cache = model.new_kv_cache(2)
    model(tokens[:, :12], kv_cache=cache)
    assert cache.length == 12 and all(layer.keys.shape[-2] == 12 for layer in cache.layers)
    with pytest.raises(ScratchlmError, match="at most 12 tokens a sequence"):
        model(tokens[:, 12:], kv_cache=cache)
    assert cache.length == 12 and all(layer.seen == 12 for layer in cache.layers)


@torch.no_grad()
def test_a_padded_row_holds_the_context_and_refuses_more():
    from scratchlm.model.kv_cache import PaddedKVCache

    model = tiny_model()
    c = model.config
    padded = PaddedKVCache(c.num_layers, c.context_length, 2, c.kv_heads, c.head_dim, torch.float32)
    tokens = ids(2, 12, seed=5)
    for row, length in ((0, 11), (1, 6)):
        cache = model.new_kv_cache(1)
        model(tokens[row : row + 1, :length], kv_cache=cache)
        padded.store(row, cache)
    padded.batch_size = 2
    last = model(tokens[:, 11:12], kv_cache=padded)  # row 0 reaches the context; row 1 goes on
    torch.testing.assert_close(last[0, -1], model(tokens[:1])[0, -1], atol=1e-5, rtol=1e-4)
    assert padded.room() == 0
    with pytest.raises(ScratchlmError, match="at most 12 tokens a sequence"):
        model(tokens[:, :1], kv_cache=padded)
    assert padded.lengths == [12, 7]


def test_misuse_is_a_clear_error():
    model = tiny_model()
    cache = model.new_kv_cache(2)
    with pytest.raises(ScratchlmError, match="batch=2"):
        model(ids(3, 4), kv_cache=cache)
    with pytest.raises(ScratchlmError, match="context_length"):
        model(ids(2, 13), kv_cache=cache)
    assert cache.length == 0
