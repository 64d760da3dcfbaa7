"""The fast recipe's switches: the model with QK-norm, ReLU², logit soft-capping, value embeddings and U-net skips
against a torch.nn.functional oracle, zero-initialised output projections, the KV cache, exact accounting, the WSD schedule by hand, and
training with Muon + WSD: exact resume, and two DDP processes equal to one."""

import dataclasses
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_state, last_checkpoint, run_metrics, torchrun_train
from reference_lm import complex_rope
from torch.utils.flop_counter import FlopCounterMode

from scratchlm import ModelConfig, TransformerLM, train, wsd_lr_schedule
from scratchlm.errors import ScratchlmError
from scratchlm.model import accounting
from scratchlm.training import recipes
from scratchlm.training.config import TrainConfig

TINY = ModelConfig(vocab_size=61, context_length=24, d_model=32, num_layers=2, num_heads=4)
RECIPE = {
    "qk_norm": True, "ffn": "relu2", "zero_init": True, "logit_softcap": 5.0, "value_embeddings": 1,
    "unet_skips": True,
}  # fmt: skip
SWITCHES = {
    "qk-norm": {"qk_norm": True},
    "relu2": {"ffn": "relu2"},
    "softcap": {"logit_softcap": 3.0},
    "value-embeddings": {"num_layers": 5, "value_embeddings": 2},  # blocks 0, 3 share table 0; 1, 4 table 1
    "value-embeddings-gqa": {"num_layers": 2, "value_embeddings": 1, "num_kv_heads": 2},
    "unet-skips": {"num_layers": 5, "unet_skips": True},  # 4 reads 0, 3 reads 1, the middle block reads none
    "all": {**RECIPE, "zero_init": False},  # zero_init would make most gradients trivially zero
}


def tiny_model(seed: int = 0, **changes) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM.from_config(dataclasses.replace(TINY, **changes))


def ids(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def oracle_logits(p: dict[str, torch.Tensor], c: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The pre-norm model written with torch.nn.functional from the switches' definitions, on the parameters `p`."""
    batch, seq = tokens.shape
    h, dk, kv, n, L = c.num_heads, c.head_dim, c.kv_heads, c.value_embeddings, c.num_layers
    positions = torch.arange(seq)
    x = F.embedding(tokens, p["token_embeddings.weight"])
    outputs = []  # of every block, for the U-net skips
    for i in range(L):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        mirror = L - 1 - i
        if c.unet_skips and mirror < L // 2:
            x = x + p["skip_weights"][mirror] * outputs[mirror]
        a = F.rms_norm(x, (c.d_model,), w["ln1.weight"], eps=1e-5)
        q = F.linear(a, w["attn.q_proj.weight"]).view(batch, seq, h, dk).transpose(1, 2)
        k = F.linear(a, w["attn.k_proj.weight"]).view(batch, seq, kv, dk).transpose(1, 2)
        values = F.linear(a, w["attn.v_proj.weight"])
        if i < n or i >= L - n:  # first n blocks use tables 0 … n-1, and so do the last n
            values = values + F.embedding(tokens, p[f"value_embeddings.{i if i < n else i - (L - n)}.weight"])
        v = values.view(batch, seq, kv, dk).transpose(1, 2)
        if c.qk_norm:
            q = F.rms_norm(q, (dk,), w["attn.q_norm.weight"], eps=1e-5)
            k = F.rms_norm(k, (dk,), w["attn.k_norm.weight"], eps=1e-5)
        q, k = complex_rope(q, positions, c.rope_theta), complex_rope(k, positions, c.rope_theta)
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv < h)
        x = x + F.linear(heads.transpose(1, 2).reshape(batch, seq, c.d_model), w["attn.output_proj.weight"])
        a = F.rms_norm(x, (c.d_model,), w["ln2.weight"], eps=1e-5)
        if c.ffn == "relu2":
            hidden = F.relu(F.linear(a, w["ffn.w1.weight"])) ** 2
        else:
            hidden = F.silu(F.linear(a, w["ffn.w1.weight"])) * F.linear(a, w["ffn.w3.weight"])
        x = x + F.linear(hidden, w["ffn.w2.weight"])
        outputs.append(x)
    logits = F.linear(F.rms_norm(x, (c.d_model,), p["ln_final.weight"], eps=1e-5), p["lm_head.weight"])
    return c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap else logits


@pytest.mark.parametrize("name", SWITCHES)
def test_logits_and_gradients_equal_the_oracle(name):
    model = tiny_model(**SWITCHES[name])
    with torch.no_grad():  # gains away from 1, so that using them (or not) shows
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    oracle_params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    tokens, targets = ids(3, 20), ids(3, 20, seed=2)
    logits, expected = model(tokens), oracle_logits(oracle_params, model.config, tokens)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(expected.flatten(0, 1), targets.flatten()).backward()
    for key, param in model.named_parameters():
        torch.testing.assert_close(param.grad, oracle_params[key].grad, atol=2e-5, rtol=1e-3, msg=key)


def test_switches_add_only_their_own_state_dict_keys():
    default, recipe = tiny_model().state_dict(), tiny_model(**RECIPE).state_dict()
    assert set(recipe) - set(default) == {
        f"layers.{i}.attn.{n}_norm.weight" for i in range(2) for n in "qk"
    } | {
        "value_embeddings.0.weight",
        "skip_weights",
    }
    assert recipe["value_embeddings.0.weight"].shape == (TINY.vocab_size, TINY.d_model)
    assert recipe["skip_weights"].shape == (1,)
    assert set(default) - set(recipe) == {"layers.0.ffn.w3.weight", "layers.1.ffn.w3.weight"}
    assert recipe["layers.0.attn.q_norm.weight"].shape == (TINY.head_dim,)
    assert tiny_model(ffn="relu2", d_ff=None).config.d_ff == 4 * TINY.d_model


def test_zero_init_zeroes_the_output_projections_and_keeps_every_other_weight():
    plain, zero = tiny_model(seed=3), tiny_model(seed=3, zero_init=True)
    for (key, a), b in zip(plain.state_dict().items(), zero.state_dict().values(), strict=True):
        if key.endswith(("output_proj.weight", "ffn.w2.weight")):
            assert not b.any(), key
        else:
            assert torch.equal(a, b), key
    # every block starts as the identity: the logits are those of the head on the normalised embeddings
    tokens = ids(2, 10)
    with torch.no_grad():
        expected = zero.lm_head(zero.ln_final(zero.token_embeddings(tokens)))
        torch.testing.assert_close(zero(tokens), expected)


def test_soft_capped_logits_are_the_raw_ones_through_c_tanh():
    raw, capped = tiny_model(seed=4), tiny_model(seed=4, logit_softcap=2.0)
    with torch.no_grad():
        raw.lm_head.weight.mul_(10)  # large logits
        capped.lm_head.weight.copy_(raw.lm_head.weight)
        z, c = raw(ids(2, 10)), capped(ids(2, 10))
    assert z.abs().max() > 4 and c.abs().max() <= 2
    torch.testing.assert_close(c, 2.0 * torch.tanh(z / 2.0), atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("changes", [RECIPE, {**RECIPE, "zero_init": False}], ids=["recipe", "random-init"])
def test_kv_cache_equals_the_full_forward_with_every_switch(changes):
    model = tiny_model(**changes).eval()
    if changes["zero_init"]:  # trained a little, in effect: nonzero output projections
        for block in model.layers:
            block.attn.output_proj.weight.normal_(0, 0.1)
            block.ffn.w2.weight.normal_(0, 0.1)
    tokens = ids(2, 20)
    cache = model.new_kv_cache(batch_size=2)
    pieces = [model(tokens[:, :7], kv_cache=cache)]
    pieces += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(tokens), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("changes", [RECIPE, {"qk_norm": True, "norm": "post"}, {"ffn": "relu2", "d_ff": 40}])
def test_accounting_is_exact_with_the_switches(changes):
    config = dataclasses.replace(TINY, **changes)
    model = TransformerLM.from_config(config)
    assert accounting.num_parameters(config) == model.num_parameters()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(ids(2, 24))
    assert accounting.forward_flops(config, batch_size=2) == counter.get_total_flops()


def test_wsd_schedule_by_hand():
    # peak 1, final 0.1, 3 warm-up steps, 20 steps, the last 5 decaying: 1 until step 15, then -0.18 a step
    lrs = [wsd_lr_schedule(t, 1.0, 0.1, 3, 20, 0.25) for t in range(23)]
    assert lrs[:4] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert lrs[3:16] == [1.0] * 13
    assert lrs[16:21] == pytest.approx([0.82, 0.64, 0.46, 0.28, 0.1])
    assert lrs[21:] == [0.1, 0.1]
    # a decay longer than what follows the warm-up starts right after it
    assert wsd_lr_schedule(4, 1.0, 0.0, 4, 8, 1.0) == 1.0 and wsd_lr_schedule(6, 1.0, 0.0, 4, 8, 1.0) == 0.5


def token_files(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    pattern = np.tile(np.arange(64, dtype=np.uint16), 80)
    noise = rng.random(pattern.shape) < 0.1
    pattern[noise] = rng.integers(0, 64, noise.sum())
    np.save(tmp_path / "train.npy", pattern)
    np.save(tmp_path / "valid.npy", pattern[:1000])
    return tmp_path / "train.npy", tmp_path / "valid.npy"


def recipe_config(tmp_path: Path, run: str, **training) -> TrainConfig:
    train_file, valid_file = token_files(tmp_path)
    return TrainConfig.from_dict(
        {
            "data": {"train": str(train_file), "valid": str(valid_file)},
            "model": {
                "vocab_size": 64,
                "context_length": 16,
                "d_model": 32,
                "num_layers": 2,
                "num_heads": 4,
                **RECIPE,
            },  # fmt: skip
            "optimizer": {
                "name": "muon",
                "lr": 1e-2,
                "min_lr": 1e-3,
                "muon_lr": 0.05,
                "embedding_lr": 0.1,
                "head_lr": 5e-3,
                "weight_decay": 0.0,
            },  # fmt: skip
            "schedule": {"kind": "wsd", "warmup_iters": 2, "cosine_cycle_iters": 12, "decay_fraction": 0.5},
            "training": {"batch_size": 8, "max_steps": 12, "device": "cpu", "precision": "fp32", **training},
            "eval": {"interval": 4, "iters": 2},
            "checkpoint": {"interval": 4, "keep": 2},
            "logging": {"run_dir": str(tmp_path / run), "log_interval": 1},
        }
    )


def test_muon_wsd_recipe_learns_and_resumes_bit_for_bit(tmp_path):
    straight = train(recipe_config(tmp_path, "straight"))
    losses = run_metrics(tmp_path / "straight", "train_loss")
    assert losses[-1] < 0.6 * losses[0] and math.isfinite(straight.final_val_loss)
    lrs = run_metrics(tmp_path / "straight", "lr")  # the Muon group's rate: warm-up, stable, linear decay
    assert lrs[:2] == pytest.approx([0.025, 0.05]) and lrs[5] == pytest.approx(0.05)
    assert lrs[-1] == pytest.approx(0.005)

    train(recipe_config(tmp_path, "resumed", max_steps=6))
    train(recipe_config(tmp_path, "resumed"), resume=True)
    a, b = last_checkpoint(tmp_path / "straight"), last_checkpoint(tmp_path / "resumed")
    assert a["iteration"] == b["iteration"] == 12
    assert_same_state(a, b)
    assert run_metrics(tmp_path / "straight", "train_loss") == run_metrics(tmp_path / "resumed", "train_loss")


def test_two_ddp_processes_with_muon_match_one(tmp_path):
    # Newton–Schulz in float32: in bfloat16 it would turn the all-reduce's rounding (1e-7) into differences
    # of 1e-4 in the update, and the runs would agree only to that. AdamW's eps at 1e-6 for the same reason:
    # a value-embedding row whose gradient is nearly all rounding (its token barely used yet) would otherwise
    # be stepped by ±lr, in a direction the rounding picks.
    optimizer = {"muon_bf16": False, "eps": 1e-6}
    config = recipe_config(tmp_path, "one", grad_accum=2, max_steps=6).replace(optimizer=optimizer)
    config_path = tmp_path / "config.toml"
    config_path.write_text(config.to_toml())
    train(config.replace(training={"grad_accum": 1}))
    torchrun_train(config_path, tmp_path / "two")
    np.testing.assert_allclose(
        run_metrics(tmp_path / "two", "train_loss"), run_metrics(tmp_path / "one", "train_loss"), rtol=1e-5
    )
    one, two = last_checkpoint(tmp_path / "one"), last_checkpoint(tmp_path / "two")
    for key in one["model"]:
        torch.testing.assert_close(two["model"][key], one["model"][key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("schedule", "decay_fraction", 0.0, "decay_fraction must lie in"),
        ("schedule", "kind", "exponential", "schedule.kind must be one of"),
        ("optimizer", "name", "lion", "optimizer.name must be one of"),
        ("optimizer", "muon_momentum", 1.0, "muon_momentum must lie in"),
        ("optimizer", "muon_lr", 0.0, "muon_lr must be positive"),
        ("optimizer", "embedding_lr", -1.0, "embedding_lr must be >= 0"),
        ("model", "logit_softcap", -1.0, "logit_softcap must be >= 0"),
        ("model", "ffn", "relu", "model.ffn must be one of"),
    ],
)
def test_bad_recipe_settings_are_clear_errors(tmp_path, section, key, value, message):
    values = recipe_config(tmp_path, "bad").to_dict()
    values[section][key] = value
    with pytest.raises(ScratchlmError, match=message):
        TrainConfig.from_dict(values)


PROJECT_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["tinystories-fast.toml", "owt-leaderboard.toml"])
def test_the_fast_configs_train_a_few_steps_on_cpu(tmp_path, name):
    """The ready configs as written, with a tiny model and data in place of the real ones."""
    config = TrainConfig.load(PROJECT_ROOT / "configs" / name)
    assert (config.optimizer.name, config.schedule.kind) == ("muon", "wsd")
    assert config.model.qk_norm and config.model.zero_init and config.model.ffn == "relu2"
    assert config.model.logit_softcap > 0 and config.model.value_embeddings > 0
    train_file, valid_file = token_files(tmp_path)
    tiny = [
        f"data.train={train_file}", f"data.valid={valid_file}", "data.tokenizer=''", "model.vocab_size=64",
        "model.d_model=32", "model.num_layers=2", "model.value_embeddings=1", "model.num_heads=4",
        "model.context_length=16",
        "model.d_ff=64", "training.batch_size=4", "training.max_tokens=0", "training.max_steps=3",
        "training.device=cpu", "training.precision=fp32", "training.compile=false", "schedule.warmup_iters=1",
        "eval.interval=0", "eval.iters=1", f"logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    summary = train(TrainConfig.load(PROJECT_ROOT / "configs" / name, tiny))
    assert summary.steps == 3 and math.isfinite(summary.final_val_loss)


def recipe_differences(recipe: dict, config: dict) -> list[str]:
    """`["section.key: recipe V, config W", ...]`: the keys `recipe` sets that `config` sets otherwise."""
    return [
        f"{section}.{key}: recipe {value!r}, config {config.get(section, {}).get(key, '(unset)')!r}"
        for section, values in recipe.items()
        for key, value in values.items()
        if config.get(section, {}).get(key) != value
    ]


@pytest.mark.parametrize("name", ["tinystories-fast.toml", "owt-leaderboard.toml"])
def test_the_fast_configs_follow_the_one_fast_recipe(name):
    """Every key the fast recipe sets has the recipe's value in the shipped configs (the keys of a model's
    shape, which the recipe leaves to each config, are theirs to choose)."""
    values = tomllib.loads((PROJECT_ROOT / "configs" / name).read_text())
    assert recipe_differences(recipes.FAST, values) == []
    # and the comparison sees a config that strays from the recipe
    values["optimizer"]["muon_lr"] = 0.05
    assert recipe_differences(recipes.FAST, values) == ["optimizer.muon_lr: recipe 0.03, config 0.05"]


def test_the_quickstart_and_the_benchmark_take_the_fast_recipe_from_one_place():
    from scratchlm.quickstart import RECIPES

    fast = RECIPES["fast"]
    assert recipe_differences(recipes.FAST, fast) == []
    # what the quickstart adds is its shape only: the size of the model, the warm-up and the batch
    shape = {(s, k) for s, values in fast.items() for k in values} - {
        (s, k) for s, values in recipes.FAST.items() for k in values
    }
    assert shape == {
        ("model", "num_layers"), ("model", "value_embeddings"), ("schedule", "warmup_iters"),
        ("training", "batch_size"),
    }  # fmt: skip
    source = (PROJECT_ROOT / "benchmarks" / "bench_recipe.py").read_text()
    assert '"muon_lr"' not in source and "from scratchlm.training.recipes import" in source
