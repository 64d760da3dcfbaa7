"""The whole language model against an independent torch.nn reference (tests/reference_lm.py) loaded with the
same state dict: logits and gradients, every ablation, causality, training, torch.compile and bf16 autocast."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from reference_lm import assert_matches_reference

from scratchlm import ModelConfig, TransformerBlock, TransformerLM
from scratchlm.errors import ScratchlmError

TINY = ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
ABLATIONS = {
    "default": {},
    "post-norm": {"norm": "post"},
    "no-norm": {"norm": "none"},
    "nope": {"positions": "none"},
    "silu-ffn": {"ffn": "silu", "d_ff": 128},
    "tied": {"tie_embeddings": True},
}


def tiny_model(seed: int = 0, **changes) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM.from_config(dataclasses.replace(TINY, **changes))


def ids(*shape: int, seed: int = 1, vocab: int = TINY.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_state_dict_keys_are_the_reference_names():
    model = TransformerLM(10_000, 256, 512, 4, 16, 1344, 10_000.0, device="meta")
    expected = ["token_embeddings.weight"]
    for i in range(4):
        expected += [f"layers.{i}.ln1.weight"]
        expected += [f"layers.{i}.attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "output_proj")]
        expected += [f"layers.{i}.ln2.weight"] + [f"layers.{i}.ffn.{w}.weight" for w in ("w1", "w2", "w3")]
    expected += ["ln_final.weight", "lm_head.weight"]
    assert list(model.state_dict()) == expected
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["token_embeddings.weight"] == (10_000, 512) and shapes["lm_head.weight"] == (10_000, 512)
    assert shapes["layers.0.ffn.w1.weight"] == (1344, 512) and shapes["layers.0.ffn.w2.weight"] == (512, 1344)
    # The spec's TinyStories model: about 17M non-embedding parameters.
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) == 22_696_448
    assert model.num_parameters(non_embedding=True) == 22_696_448 - 10_000 * 512


def test_from_config_keeps_the_config():
    config = dataclasses.replace(TINY, norm="post", ffn="silu", d_ff=None)
    model = TransformerLM.from_config(config)
    assert model.config == config and model.config.d_ff == 4 * 32
    assert isinstance(model.layers[0], TransformerBlock)


# Every ablation on 11 tokens; the default model also on 150, where causal attention runs in several blocks of
# queries (the last one partial).
@pytest.mark.parametrize(("name", "seq"), [(name, 11) for name in ABLATIONS] + [("default", 150)])
def test_logits_and_gradients_match_reference(name, seq):
    model = tiny_model(context_length=160, **ABLATIONS[name])
    assert_matches_reference(model, ids(3, seq), ids(3, seq, seed=2))


def test_ablations_change_the_state_dict_as_expected():
    keys = {name: set(tiny_model(**changes).state_dict()) for name, changes in ABLATIONS.items()}
    assert "ln_final.weight" not in keys["post-norm"] and "layers.0.ln1.weight" in keys["post-norm"]
    assert not any("ln" in k for k in keys["no-norm"])
    assert not any("w3" in k for k in keys["silu-ffn"])
    tied = tiny_model(tie_embeddings=True)
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert tied.num_parameters() == tiny_model().num_parameters() - 97 * 32
    assert tied.num_parameters(non_embedding=True) == tied.num_parameters()


def test_extra_batch_dimensions_and_shorter_sequences():
    model = tiny_model()
    tokens = ids(2, 3, 5)
    logits = model(tokens)
    assert logits.shape == (2, 3, 5, 97)
    torch.testing.assert_close(logits[1, 2], model(tokens[1, 2]), atol=1e-5, rtol=1e-5)


def test_longer_than_context_is_a_clear_error():
    model = tiny_model()
    model(ids(1, 16))
    with pytest.raises(ScratchlmError, match="context_length"):
        model(ids(1, 17))


@pytest.mark.parametrize("name", ["default", "no-norm", "nope"])
def test_changing_a_later_token_never_changes_earlier_logits(name):
    model = tiny_model(**ABLATIONS[name])
    tokens = ids(1, 12)
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 97
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("name", ABLATIONS)
def test_every_ablation_trains(name):
    model = tiny_model(**ABLATIONS[name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = ids(4, 17, seed=3)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_initial_loss_is_close_to_uniform():
    # Small initial logits: the untrained model predicts about uniformly, loss ≈ log(vocab).
    for changes in ({}, {"tie_embeddings": True}):
        model = tiny_model(**changes)
        loss = F.cross_entropy(model(ids(4, 16)).flatten(0, 1), ids(4, 16, seed=5).flatten())
        assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.6


@pytest.mark.parametrize("seq", [8, 150])
def test_compiles_without_graph_breaks_and_matches_eager(seq):
    model = tiny_model(num_layers=1, context_length=160)
    compiled = torch.compile(model, fullgraph=True)
    tokens = ids(2, seq)
    logits, expected = compiled(tokens), model(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    (grads,) = torch.autograd.grad(logits.square().mean(), [model.layers[0].attn.k_proj.weight])
    (expected_grads,) = torch.autograd.grad(expected.square().mean(), [model.layers[0].attn.k_proj.weight])
    torch.testing.assert_close(grads, expected_grads, atol=1e-6, rtol=1e-4)


def test_bf16_autocast_runs_close_to_float32_with_float32_statistics():
    model = tiny_model()
    tokens, targets = ids(2, 16), ids(2, 16, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(logits.float(), model(tokens), atol=0.1, rtol=0.05)


def test_rmsnorm_and_softmax_stay_float32_inside_autocast():
    from scratchlm import RMSNorm, softmax

    norm = RMSNorm(64)
    x = torch.randn(3, 64).to(torch.bfloat16) * 20
    scores = torch.randn(3, 300).to(torch.bfloat16) * 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        normed, probs = norm(x), softmax(scores, -1)
    exact = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(normed, exact.to(torch.bfloat16))
    assert torch.equal(probs, torch.softmax(scores.float(), -1).to(torch.bfloat16))


def test_norm_eps_reaches_every_rmsnorm_and_is_left_out_of_configs_at_its_default():
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.layers import RMSNorm

    config = ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=2, num_heads=2, qk_norm=True)
    assert "norm_eps" not in config.to_dict()  # configs and checkpoints written before it read the same
    assert ModelConfig.from_dict(config.to_dict()).norm_eps == 1e-5
    changed = ModelConfig.from_dict({**config.to_dict(), "norm_eps": 1e-6})
    assert changed.to_dict()["norm_eps"] == 1e-6
    norms = [m for m in TransformerLM.from_config(changed).modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # two per block, QK-norm's two per block, the final one
    assert {m.eps for m in norms} == {1e-6}


def test_one_constructor_takes_the_config_and_the_handouts_signatures_build_it():
    import inspect

    from scratchlm import MultiHeadSelfAttention

    config = ModelConfig(vocab_size=40, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    for cls in (TransformerLM, TransformerBlock, MultiHeadSelfAttention):
        assert list(inspect.signature(cls).parameters) == ["config", "device", "dtype"]
    torch.manual_seed(0)
    loose = TransformerLM(40, 16, 32, 2, 4, 64)
    torch.manual_seed(0)
    by_config = TransformerLM(config)
    torch.manual_seed(0)
    by_keyword = TransformerLM(config=config)
    assert loose.config == by_config.config == by_keyword.config == config
    theirs = by_config.state_dict()
    for other in (loose, by_keyword):
        assert other.state_dict().keys() == theirs.keys()
        assert all(torch.equal(value, theirs[key]) for key, value in other.state_dict().items())
    # The CS336 assignment-1 handout's names for the block and attention: max_seq_len is the context, theta RoPE's.
    block = TransformerBlock(32, 4, 64, 16, theta=100.0, norm="post")
    assert (block.attn.d_model, block.norm, block.attn.positions.theta) == (32, "post", 100.0)
    assert block.attn.positions.max_seq_len == 16
    assert TransformerBlock(config).attn.num_heads == 4
    assert type(TransformerBlock(32, 4, 64, 16, theta=None).attn.positions).__name__ == "NoPositionEncoding"
    assert MultiHeadSelfAttention(config).q_proj.weight.shape == (32, 32)
    assert TransformerLM(40, 16, 32, 2, 4, 64, device="meta").lm_head.weight.is_meta
    for both in (
        lambda: TransformerLM(40, 16, 32, 2, 4, 64, config=config),
        lambda: TransformerBlock(32, 4, 64, 16, config=config),
        lambda: MultiHeadSelfAttention(32, 4, config=config),
        lambda: TransformerLM(40, 16),  # the handout's required arguments missing
    ):
        with pytest.raises(TypeError):
            both()
