"""Grouped-query attention (`ModelConfig.num_kv_heads`): the model against the torch.nn reference, whose
attention is `F.scaled_dot_product_attention(enable_gqa=True)` (logits and gradients); the KV cache keeps only
the key/value heads and still equals full forward passes; the accounting formulas against real models and
torch's FLOP counter; the config's checks and its backward-compatible serialisation."""

import dataclasses

import pytest
import torch
from reference_lm import assert_matches_reference
from torch.utils.flop_counter import FlopCounterMode

from scratchlm import ModelConfig, TransformerLM, generate
from scratchlm.errors import ScratchlmError
from scratchlm.model import accounting as acc

TINY = ModelConfig(vocab_size=97, context_length=80, d_model=48, num_layers=2, num_heads=6, d_ff=64)


def tiny_model(**changes) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM.from_config(dataclasses.replace(TINY, **changes))


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize("seq", [11, 75])  # 75: several blocks of queries in causal_attention
def test_logits_and_gradients_match_torch_gqa(kv_heads, seq):
    assert_matches_reference(tiny_model(num_kv_heads=kv_heads), ids(2, seq), ids(2, seq, seed=2))


def test_key_and_value_projections_have_kv_heads_rows():
    shapes = {k: tuple(v.shape) for k, v in tiny_model(num_kv_heads=2).state_dict().items()}
    assert shapes["layers.0.attn.q_proj.weight"] == (48, 48)
    assert shapes["layers.0.attn.k_proj.weight"] == shapes["layers.0.attn.v_proj.weight"] == (2 * 8, 48)
    assert shapes["layers.0.attn.output_proj.weight"] == (48, 48)


def test_one_kv_head_per_query_head_is_plain_multi_head_attention():
    """num_kv_heads == num_heads is the model without grouping: the same weights give the same logits."""
    plain, explicit = tiny_model(), tiny_model(num_kv_heads=6)
    assert explicit.config == plain.config
    explicit.load_state_dict(plain.state_dict())
    tokens = ids(2, 9)
    torch.testing.assert_close(explicit(tokens), plain(tokens), atol=0, rtol=0)


@torch.no_grad()
def test_kv_cache_stores_only_the_kv_heads_and_equals_full_forward():
    model = tiny_model(num_kv_heads=2).eval()
    tokens = ids(3, 20)
    cache = model.new_kv_cache(batch_size=3)
    pieces = [model(tokens[:, :7], kv_cache=cache)]
    pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(7, 20)]
    layer = cache.layers[0]  # the whole window, preallocated, 20 positions of it filled: 2 heads, not 4
    assert (
        layer.keys.shape == layer.values.shape == (3, 2, model.config.context_length, 8) and layer.seen == 20
    )
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(tokens), atol=1e-5, rtol=1e-4)


def test_generation_with_the_cache_equals_recomputation():
    model = tiny_model(num_kv_heads=3).eval()
    prompt = ids(12).tolist()
    cached = generate(model, prompt, 30, temperature=0.0)
    assert cached == generate(model, prompt, 30, temperature=0.0, use_cache=False)


SHAPES = [
    dataclasses.replace(TINY, num_kv_heads=2),
    ModelConfig(vocab_size=50, context_length=24, d_model=64, num_layers=3, num_heads=8, num_kv_heads=1),
]


@pytest.mark.parametrize("config", SHAPES, ids=["kv2", "kv1"])
def test_accounting_counts_the_smaller_projections(config):
    model = TransformerLM.from_config(config, device="meta")
    assert acc.num_parameters(config) == sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)
    assert acc.forward_flops(config, 9, 2) == counter.get_total_flops()
    memory = acc.activation_elements(config, 1)
    d_kv = config.kv_heads * config.head_dim
    assert memory["Q, K, V projections"] == config.num_layers * config.context_length * (
        config.d_model + 2 * d_kv
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 4}, r"model.num_heads \(6\) must be divisible by model.num_kv_heads \(4\)"),
        ({"num_kv_heads": 12}, r"model.num_heads \(6\) must be divisible by model.num_kv_heads \(12\)"),
        ({"num_kv_heads": 0}, "model.num_kv_heads must be a positive integer, got 0"),
        ({"num_kv_heads": 2.0}, "model.num_kv_heads must be a positive integer, got 2.0"),
    ],
)
def test_bad_kv_heads_are_refused(changes, message):
    with pytest.raises(ScratchlmError, match=message):
        dataclasses.replace(TINY, **changes)


def test_serialisation_is_backward_compatible():
    """A config without grouping writes no num_kv_heads (the dict of checkpoints from before it existed, which
    load unchanged); one with grouping writes it and reads back equal."""
    assert "num_kv_heads" not in TINY.to_dict()
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    grouped = dataclasses.replace(TINY, num_kv_heads=2)
    assert grouped.to_dict()["num_kv_heads"] == 2
    assert ModelConfig.from_dict(grouped.to_dict()) == grouped
    # Changing num_heads alone keeps plain multi-head attention (no stale key/value head count).
    assert dataclasses.replace(TINY, num_heads=4).kv_heads == 4
