"""The accounting formulas against real models: parameter counts against `sum(p.numel())`, forward FLOPs
against torch's FLOP counter, and the GPT-2 XL figures of the CS336 assignment-1 handout, computed by hand."""

import argparse

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scratchlm import ModelConfig, TransformerLM
from scratchlm.cli import accounting as accounting_cli
from scratchlm.model import accounting as acc

SHAPES = [
    ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48),
    ModelConfig(
        vocab_size=50, context_length=24, d_model=48, num_layers=3, num_heads=6, d_ff=80, norm="post"
    ),
    ModelConfig(
        vocab_size=64, context_length=8, d_model=16, num_layers=1, num_heads=2, norm="none", ffn="silu"
    ),
    ModelConfig(vocab_size=80, context_length=12, d_model=24, num_layers=2, num_heads=3, tie_embeddings=True),
]


def shape_id(config: ModelConfig) -> str:
    return f"d{config.d_model}-{config.norm}-{config.ffn}{'-tied' if config.tie_embeddings else ''}"


@pytest.mark.parametrize("config", SHAPES, ids=shape_id)
def test_parameter_count_equals_the_model(config):
    model = TransformerLM.from_config(config, device="meta")
    assert acc.num_parameters(config) == sum(p.numel() for p in model.parameters()) == model.num_parameters()


def test_parameter_count_of_gpt2_xl_on_the_meta_device():
    gpt2_xl = acc.GPT2_PRESETS["gpt2-xl"]
    model = TransformerLM.from_config(gpt2_xl, device="meta")
    assert acc.num_parameters(gpt2_xl) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", SHAPES, ids=shape_id)
@pytest.mark.parametrize(("batch", "seq"), [(1, None), (3, 5)])
def test_forward_flops_equal_torch_flop_counter(config, batch, seq):
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    length = config.context_length if seq is None else seq
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)
    assert acc.forward_flops(config, seq, batch) == counter.get_total_flops()


def test_causal_attention_skips_exactly_the_hidden_score_blocks():
    """The formulas count the whole score matrix; the model computes it by blocks of 64 queries, each against
    the keys up to its last query. With 150 tokens: 64 x 64, 64 x 128 and 22 x 150 (query, key) pairs."""
    config = ModelConfig(vocab_size=97, context_length=160, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    batch, seq = 2, 150
    model = TransformerLM.from_config(config)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (batch, seq)))
    skipped_pairs = seq * seq - (64 * 64 + 64 * 128 + 22 * 150)
    # Q Kᵀ and P V each cost 2 · d_k FLOPs per (query, key) pair and head: 2 · d_model over the heads.
    skipped = config.num_layers * batch * 2 * (2 * config.d_model) * skipped_pairs
    assert counter.get_total_flops() == acc.forward_flops(config, seq, batch) - skipped


def test_gpt2_xl_by_hand():
    xl = acc.GPT2_PRESETS["gpt2-xl"]
    V, L, d, n, d_ff, h = 50_257, 1_024, 1_600, 48, 6_400, 25
    params = 2 * V * d + n * (4 * d * d + 3 * d * d_ff + 2 * d) + d
    assert acc.num_parameters(xl) == params == 2_127_057_600
    flops = n * (8 * L * d * d + 4 * L * L * d + 6 * L * d * d_ff) + 2 * L * d * V
    assert acc.forward_flops(xl) == flops
    by_component = acc.flops_by_component(xl)
    assert max(by_component, key=by_component.get) == acc.FEED_FORWARD
    # At context 16,384 the quadratic attention terms dominate.
    long = acc.flops_by_component(ModelConfig(**{**xl.to_dict(), "context_length": 16_384}))
    assert max(long, key=long.get) == acc.ATTENTION_SCORES

    memory = acc.training_memory(xl)
    assert memory.fixed == 16 * params
    activations = n * (8 * L * d + 4 * L * d_ff + 2 * h * L * L) + L * d + 2 * L * V
    assert memory.activations_per_sequence == 4 * activations
    assert memory.max_batch_size(80e9) == int((80e9 - 16 * params) // (4 * activations)) == 2
    assert acc.train_step_flops(xl, 1_024) == 3 * 1_024 * flops
    assert acc.flops_per_token(xl) == 3 * flops // L  # the MFU numerator: a full-context sequence's share
    days = acc.training_days(400_000 * 3 * 1_024 * flops, 19.5e12, 0.5)
    assert days == pytest.approx(400_000 * 3 * 1_024 * flops / 9.75e12 / 86_400)


def test_activations_grow_linearly_with_batch():
    config = SHAPES[0]
    one, four = acc.activation_elements(config, 1), acc.activation_elements(config, 4)
    assert {k: 4 * v for k, v in one.items()} == four


def run_cli(*argv: str) -> None:
    parser = argparse.ArgumentParser()
    accounting_cli.add_arguments(parser)
    accounting_cli.run(parser.parse_args(list(argv)))


def test_cli_prints_every_table(capsys):
    run_cli("--preset", "gpt2-xl")
    out = capsys.readouterr().out
    for expected in ("2,127,057,600", "feed-forward", "LM head", "optimizer state", "largest batch", "days"):
        assert expected in out
    assert "4.51 TFLOP" in out  # forward pass of one 1,024-token sequence


def test_cli_shape_flags_and_compare(capsys):
    run_cli(
        "--d-model", "64", "--num-layers", "2", "--num-heads", "4", "--vocab-size", "100", "--d-ff", "128"
    )
    out = capsys.readouterr().out
    expected = ModelConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    assert f"{acc.num_parameters(expected):,}" in out
    run_cli("--compare", "--context-length", "16384")
    out = capsys.readouterr().out
    assert all(name in out for name in acc.GPT2_PRESETS) and "16,384" in out


def test_cli_rejects_bad_budget():
    from scratchlm.errors import ScratchlmError

    with pytest.raises(ScratchlmError, match="--mfu"):
        run_cli("--mfu", "1.5")


def test_the_experiments_doc_states_the_numbers_the_code_computes():
    """docs/experiments.md quotes the base model's d_ff and parameter counts and compares the SiLU ablation's
    size with SwiGLU's; each figure must be what `scratchlm.model.accounting` computes for experiments/base.toml."""
    import dataclasses
    from pathlib import Path

    from scratchlm.training.config import TrainConfig

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "experiments.md").read_text(encoding="utf-8")
    base = TrainConfig.load(root / "experiments" / "base.toml").model
    silu = dataclasses.replace(base, ffn="silu", d_ff=None)
    per_layer = {c.ffn: acc.parameter_counts(c)["feed-forward"] // c.num_layers for c in (base, silu)}
    assert f"SwiGLU d_ff {base.d_ff}, RoPE" in doc
    assert f"{acc.num_parameters(base):,} parameters" in doc
    assert (
        f"the SiLU MLP has {per_layer['silu']:,} parameters per layer against SwiGLU's {per_layer['swiglu']:,}"
        in " ".join(doc.split())
    )
    more = round(100 * (per_layer["silu"] / per_layer["swiglu"] - 1))
    assert f"({more} % *more*;" in doc and per_layer["silu"] > per_layer["swiglu"]
    assert f"the whole model {acc.num_parameters(silu):,} against {acc.num_parameters(base):,}" in " ".join(
        doc.split()
    )


@pytest.mark.parametrize("ffn", ["swiglu", "silu", "relu2"])
def test_cli_takes_every_feed_forward_of_the_model(capsys, ffn):
    run_cli("--d-model", "64", "--num-layers", "2", "--num-heads", "4", "--vocab-size", "100", "--ffn", ffn)
    model = TransformerLM.from_config(
        ModelConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4, ffn=ffn, context_length=256)
    )
    assert f"{sum(p.numel() for p in model.parameters()):,}" in capsys.readouterr().out
