"""Fine-tuning's optimizer from the base's recipe, and its rate measured on held-out conversations
(scratchlm.chat.sft's `follow_base` and `at_rate`, scratchlm.chat.rate, `scratchlm sft`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import scratchlm_command
from interop_helpers import make_run
from serve_helpers import small_tokenizer, tiny_config

from scratchlm.chat.conversations import write_conversations
from scratchlm.chat.tasks import build_tasks
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import save_checkpoint
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import load_trained
from scratchlm.training.config import TrainConfig
from scratchlm.training.optimizers import OptimizerConfig, build_optimizer
from scratchlm.training.recipes import FAST

CONTEXT = 96
FAST_OPTIMIZER = FAST["optimizer"]  # muon: lr 0.01, muon_lr 0.03, embedding_lr 0.5, head_lr 0.008


@pytest.fixture(scope="module")
def bases_and_data(tmp_path_factory):
    """Two tiny bases, one without a recorded recipe and one trained (its checkpoint says) with the fast
    recipe's optimizer, and built-in conversations."""
    root = tmp_path_factory.mktemp("sft-rate")
    tokenizer = small_tokenizer()
    plain = make_run(root / "plain", _model(tokenizer), tokenizer)
    muon = root / "muon"
    model = _model(tokenizer)
    optimizer = build_optimizer(OptimizerConfig(), model)
    RunDirectory(muon).checkpoints_dir.mkdir(parents=True)
    save_checkpoint(
        model,
        optimizer,
        0,
        RunDirectory(muon).checkpoint(0),
        tokenizer_fingerprint=tokenizer.fingerprint,
        train_config={"optimizer": dict(FAST_OPTIMIZER)},
    )
    tokenizer.save(muon / "tokenizer")
    train_set, test_set = build_tasks(200, 16, seed=2)
    write_conversations(root / "train.jsonl", train_set)
    write_conversations(root / "valid.jsonl", test_set)
    return root, plain, muon


def _model(tokenizer) -> TransformerLM:
    import torch

    torch.manual_seed(0)
    return TransformerLM(tiny_config(tokenizer, CONTEXT))


def overrides(root, base, run: str, *extra: str) -> list[str]:
    return [
        f"sft.base={json.dumps(str(base))}",
        f"sft.train={json.dumps(str(root / 'train.jsonl'))}",
        f"logging.run_dir={json.dumps(str(root / run))}",
        "training.device='cpu'",
        "training.precision='fp32'",
        "training.batch_size=8",
        "training.max_steps=48",
        "eval.iters=2",
        "logging.log_interval=4",
        *extra,
    ]


def test_the_base_recipe_sets_the_optimizer_and_its_groups_proportions():
    from scratchlm.chat.sft import SFT_DEFAULTS, at_rate, follow_base

    sft = SFT_DEFAULTS["optimizer"] | {"embedding_lr": 0.0, "head_lr": 0.0, "muon_lr": 0.02}
    followed = follow_base(sft, dict(FAST_OPTIMIZER), given=set())
    # The base's lr is 0.01 and fine-tuning's 1e-3: every group's rate a tenth of the base's.
    assert followed["name"] == "muon" and followed["betas"] == [0.8, 0.95]
    assert followed["muon_lr"] == pytest.approx(3e-3)
    assert followed["embedding_lr"] == pytest.approx(0.05)
    assert followed["head_lr"] == pytest.approx(8e-4)
    assert (followed["lr"], followed["weight_decay"]) == (1e-3, 0.0)  # fine-tuning's own
    # What the user sets stays: a named optimizer takes nothing from the base, a group's rate is kept.
    assert follow_base(sft, dict(FAST_OPTIMIZER), given={"optimizer.name"}) == sft
    assert follow_base(sft, dict(FAST_OPTIMIZER), given={"optimizer.head_lr"})["head_lr"] == 0.0
    assert follow_base(sft, {}, given=set()) == sft  # an imported base has no recipe
    moved = at_rate(followed, 2e-2)
    assert (moved["lr"], moved["min_lr"]) == (2e-2, pytest.approx(2e-3))
    assert moved["muon_lr"] == pytest.approx(6e-2) and moved["embedding_lr"] == pytest.approx(1.0)
    assert at_rate(followed, 2e-2, given={"optimizer.min_lr"})["min_lr"] == followed["min_lr"]


def test_a_base_trained_with_muon_is_fine_tuned_with_muon(bases_and_data):
    from scratchlm.chat.sft import sft_config

    root, plain, muon = bases_and_data
    assert load_trained(muon).train_config["optimizer"]["name"] == "muon"
    config = sft_config(None, overrides(root, muon, "m"))
    assert config.optimizer.name == "muon" and config.sft.lr_chosen == ""  # to be measured
    assert config.optimizer.muon_lr == pytest.approx(3 * config.optimizer.lr)
    assert sft_config(None, overrides(root, plain, "p")).optimizer.name == "adamw"
    given = sft_config(None, overrides(root, muon, "g", "optimizer.lr=0.004"))
    assert given.sft.lr_chosen == "given" and given.optimizer.muon_lr == pytest.approx(0.012)
    named = sft_config(None, overrides(root, muon, "n", "optimizer.name='adamw'"))
    assert named.optimizer.name == "adamw" and named.optimizer.betas == (0.9, 0.95)
    assert sft_config(None, overrides(root, muon, "d", "sft.lr_sweep_fraction=0")).sft.lr_chosen == "default"


def test_the_rate_is_the_one_of_the_lowest_held_out_loss(bases_and_data):
    """A rate too small to move the base, one that fine-tunes it and one that blows it up: the sweep keeps
    the middle one, and the run trains at the rate it chose."""
    from scratchlm.chat.rate import choose_rate
    from scratchlm.chat.sft import sft_config
    from scratchlm.training.trainer import train

    root, plain, _ = bases_and_data
    extra = ("sft.lr_candidates=[1e-7, 1e-2, 10.0]", "sft.lr_sweep_fraction=0.75")
    config = choose_rate(sft_config(None, overrides(root, plain, "swept", *extra)))
    sweep = json.loads((root / "swept" / "lr-sweep" / "sweep.json").read_text())
    losses = sweep["losses"]
    assert sweep["chosen"] == 1e-2 and losses["0.01"] < losses["1e-07"] and losses["0.01"] < losses["10"]
    for lr, loss in sweep["losses"].items():
        run = RunDirectory(root / "swept" / "lr-sweep" / f"lr-{lr}")
        assert not run.checkpoints()  # deleted once scored
        summary = run.summary()  # the short run's own: 12 steps (0.75 x 48 / 3)
        assert summary.steps == 12 and summary.final_val_loss == loss
    assert config.optimizer.lr == 1e-2 and config.optimizer.min_lr == pytest.approx(1e-3)
    assert config.training.max_steps == 24  # the steps left (48 - 3 x 12), but at least half
    assert config.sft.lr_chosen.startswith("the lowest held-out loss of a sweep (1e-07: ")
    train(config)
    recorded = TrainConfig.load(root / "swept" / "config.toml")
    assert recorded.optimizer.lr == 1e-2 and recorded.sft.lr_chosen == config.sft.lr_chosen
    # Resumed, the run keeps its rate and measures nothing again.
    resumed = choose_rate(sft_config(None, overrides(root, plain, "swept", *extra)), resume=True)
    assert resumed.optimizer == recorded.optimizer and resumed.sft == recorded.sft


def test_a_short_run_that_diverges_is_not_chosen(bases_and_data, monkeypatch):
    from scratchlm.chat import rate
    from scratchlm.chat.sft import sft_config
    from scratchlm.errors import DivergedError

    real_train = rate.train

    def diverging(config, resume=False):
        if config.optimizer.lr > 1:
            raise DivergedError("loss", 3, None)
        return real_train(config, resume)

    monkeypatch.setattr(rate, "train", diverging)
    root, plain, _ = bases_and_data
    extra = ("sft.lr_candidates=[1e-2, 100.0]", "training.max_steps=8")
    config = rate.choose_rate(sft_config(None, overrides(root, plain, "diverging", *extra)))
    sweep = json.loads((root / "diverging" / "lr-sweep" / "sweep.json").read_text())
    assert sweep == {"losses": {"0.01": pytest.approx(sweep["losses"]["0.01"]), "100": None}, "chosen": 1e-2}
    assert config.optimizer.lr == 1e-2 and "100: diverged" in config.sft.lr_chosen


def test_a_short_run_stopped_before_its_evaluation_is_run_again(bases_and_data, monkeypatch):
    """A signal after a short run's last step leaves it with no held-out loss: resumed, it has nothing left to
    train, so it is run again rather than scored as diverged."""
    from scratchlm.chat import rate
    from scratchlm.chat.sft import sft_config

    real_train, calls = rate.train, []

    def unscored_once(config, resume=False):
        calls.append(resume)
        summary = real_train(config, resume)
        return dataclasses.replace(summary, final_val_loss=None) if len(calls) == 1 else summary

    monkeypatch.setattr(rate, "train", unscored_once)
    root, plain, _ = bases_and_data
    extra = ("sft.lr_candidates=[1e-2]", "training.max_steps=8")
    config = rate.choose_rate(sft_config(None, overrides(root, plain, "unscored", *extra)))
    sweep = json.loads((root / "unscored" / "lr-sweep" / "sweep.json").read_text())
    assert calls == [False, False] and sweep["losses"]["0.01"] is not None and config.optimizer.lr == 1e-2


def test_the_command_says_what_it_chose_and_why(bases_and_data):
    root, _, muon = bases_and_data
    out = root / "cli"
    sets = [
        "--set",
        "training.max_steps=8",
        "--set",
        "sft.lr_candidates=[1e-3, 1e-2]",
        "--set",
        "eval.iters=1",
    ]
    result = scratchlm_command(
        "sft",
        "--base",
        str(muon),
        "--data",
        str(root / "train.jsonl"),
        "--out",
        str(out),
        "--precision",
        "fp32",
        *sets,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    assert "choosing the rate: a short run at each of 0.001, 0.01" in text
    sweep = json.loads((out / "lr-sweep" / "sweep.json").read_text())
    chosen = sweep["chosen"]
    assert chosen == float(min(sweep["losses"], key=sweep["losses"].get))
    assert f"-> lr {chosen:g}" in text and "optimizer: muon, peak rates" in text
    assert TrainConfig.load(out / "config.toml").optimizer.lr == chosen


def test_a_lora_run_measures_its_rate_with_lora_short_runs(bases_and_data):
    """`sft --lora`: the short runs train adapters, as the run will, so the rate chosen is the adapters' own."""
    from scratchlm.chat.rate import choose_rate
    from scratchlm.chat.sft import sft_config

    root, _, muon = bases_and_data
    extra = ("lora.rank=4", "sft.lr_candidates=[1e-3, 3e-2]", "training.max_steps=16")
    config = choose_rate(sft_config(None, overrides(root, muon, "lora-swept", *extra)))
    sweep = json.loads((root / "lora-swept" / "lr-sweep" / "sweep.json").read_text())
    for lr in ("0.001", "0.03"):
        short = TrainConfig.load(root / "lora-swept" / "lr-sweep" / f"lr-{lr}" / "config.toml")
        assert short.lora.rank == 4 and short.optimizer.lr == float(lr)
    assert config.lora.rank == 4 and config.optimizer.lr == sweep["chosen"]
    assert sweep["chosen"] == float(min(sweep["losses"], key=sweep["losses"].get))
