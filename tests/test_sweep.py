"""Sweeps: the grid, a sweep of two tiny runs (one diverging) with its table and plot, resuming, bad keys."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from scratchlm.cli import main
from scratchlm.errors import ScratchlmError
from scratchlm.experiments import sweep
from scratchlm.experiments.sweep import SweepRun, _row, build_grid, results_table, run_sweep, split_values

TINY_CONFIG = """
[data]
train = "{dir}/train.npy"
valid = "{dir}/valid.npy"
[model]
vocab_size = 64
context_length = 16
d_model = 32
num_layers = 1
num_heads = 2
[optimizer]
name = "sgd"
grad_clip = 0.0
[schedule]
warmup_iters = 2
[training]
batch_size = 4
max_steps = 8
device = "cpu"
[eval]
interval = 4
iters = 2
[checkpoint]
interval = 0
[logging]
log_interval = 2
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    tokens = np.tile(np.arange(40, dtype=np.uint16), 50)
    np.save(tmp_path / "train.npy", tokens)
    np.save(tmp_path / "valid.npy", tokens[:500])
    path = tmp_path / "base.toml"
    path.write_text(TINY_CONFIG.format(dir=tmp_path.as_posix()))
    return path


def test_split_values_keeps_brackets_and_quotes_together() -> None:
    assert split_values("1e-3,3e-3, 1e-2") == ["1e-3", "3e-3", "1e-2"]
    assert split_values("[0.9,0.95],[0.9, 0.99]") == ["[0.9,0.95]", "[0.9, 0.99]"]
    assert split_values('"a,b",c') == ['"a,b"', "c"]


def test_grid_names_and_fixed_settings() -> None:
    runs = build_grid(["optimizer.lr=1e-3,1e-2", "training.batch_size=8,32", "model.norm=none"], name="g")
    assert [r.name for r in runs] == [
        "g_lr=1e-3_batch_size=8",
        "g_lr=1e-3_batch_size=32",
        "g_lr=1e-2_batch_size=8",
        "g_lr=1e-2_batch_size=32",
    ]
    assert runs[1].overrides == ["model.norm=none", "optimizer.lr=1e-3", "training.batch_size=32"]
    assert dict(runs[1].varied) == {"optimizer.lr": "1e-3", "training.batch_size": "32"}
    # Two varied keys that end alike keep their full names.
    names = [r.name for r in build_grid(["optimizer.name=sgd,adamw", "logging.name=a,b"])]
    assert names[0] == "optimizer.name=sgd_logging.name=a"
    assert [r.name for r in build_grid(["optimizer.betas=[0.9,0.95],[0.9,0.99]"])] == [
        "betas=0.9-0.95",
        "betas=0.9-0.99",
    ]
    zipped = build_grid(["training.batch_size=4,16", "eval.interval=80,20", "model.norm=none"], mode="zip")
    assert [r.name for r in zipped] == ["batch_size=4", "batch_size=16"]
    assert zipped[1].overrides == ["model.norm=none", "training.batch_size=16", "eval.interval=20"]
    assert dict(zipped[1].varied) == {"training.batch_size": "16", "eval.interval": "20"}
    with pytest.raises(ScratchlmError, match="same number"):
        build_grid(["training.batch_size=4,16", "eval.interval=80,20,5"], mode="zip")
    ablations = build_grid(["model.norm=none,post", "model.ffn=silu"], mode="one-at-a-time")
    assert [r.name for r in ablations] == ["base", "norm=none", "norm=post", "ffn=silu"]
    assert [r.overrides for r in ablations] == [
        [],
        ["model.norm=none"],
        ["model.norm=post"],
        ["model.ffn=silu"],
    ]
    for bad in (
        ["lr=1e-3"],
        ["optimizer.lr=1e-3,"],
        ["optimizer.lr=1,1"],
        ["optimizer.lr=1", "optimizer.lr=2"],
    ):
        with pytest.raises(ScratchlmError):
            build_grid(bad)


def test_sweep_of_two_runs_writes_table_and_plot_and_survives_divergence(
    tmp_path: Path, config: Path
) -> None:
    out = tmp_path / "sweep"
    rows = run_sweep(config, ["optimizer.lr=1e-2,1e30"], out, name="lr")
    assert [r["run"] for r in rows] == ["lr_lr=1e-2", "lr_lr=1e30"]
    assert rows[0]["status"] == "finished" and rows[1]["status"] == "diverged"

    summary = json.loads((out / "lr_lr=1e-2" / "summary.json").read_text())
    assert summary["steps"] == 8
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("| run | optimizer.lr |") and len(table) == 4
    good = table[2].split(" | ")
    assert good[0] == "| lr_lr=1e-2" and good[1] == "1e-2" and good[2] == "8"
    assert good[3] == f"{summary['final_train_loss']:.4f}"
    assert good[4] == f"**{summary['final_val_loss']:.4f}**"  # the best (only) validation loss
    assert "diverged" in table[3] and "lr_lr=1e30" in table[3]

    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1200, 450)
    assert json.loads((out / "sweep.json").read_text())["lr_lr=1e30"]["status"] == "diverged"
    diverged = json.loads((out / "lr_lr=1e30" / "summary.json").read_text())
    assert diverged["stopped"] == "diverged"  # the run's own summary says so too


def test_sweep_resumes_without_retraining(
    tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    axes = ["optimizer.lr=1e-2,3e-2", "checkpoint.interval=4"]
    first = run_sweep(config, axes, out)
    from scratchlm.training import trainer

    calls: list[tuple[str, bool]] = []
    real_train = trainer.train

    def counting_train(cfg, resume=False):
        calls.append((Path(cfg.logging.run_dir).name, resume))
        return real_train(cfg, resume=resume)

    monkeypatch.setattr(trainer, "train", counting_train)
    assert run_sweep(config, axes, out) == first
    assert calls == []  # both runs are finished
    # A run interrupted after its step-4 checkpoint continues from there and ends where it ended before.
    (out / "lr=3e-2" / "summary.json").unlink()
    (out / "lr=3e-2" / "checkpoints" / "step_00000008.pt").unlink()
    again = run_sweep(config, axes, out)
    assert calls == [("lr=3e-2", True)]
    assert again[1]["steps"] == 8
    assert again[1]["final_train_loss"] == first[1]["final_train_loss"]


def test_bad_key_fails_before_any_run(tmp_path: Path, config: Path) -> None:
    with pytest.raises(ScratchlmError, match="optimizer.lrr"):
        run_sweep(config, ["optimizer.lr=1e-2,3e-2", "optimizer.lrr=1"], tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()


def test_cli_sweep(tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[tuple] = []
    monkeypatch.setattr(sweep, "run_sweep", lambda *args, **kwargs: called.append((args, kwargs)))
    out = str(tmp_path / "o")
    argv = ["sweep", str(config), "--set", "optimizer.lr=1e-3,1e-2", "--set", "model.norm=pre,none"]
    assert main([*argv, "--name", "n", "--out", out]) == 0
    axes = ["optimizer.lr=1e-3,1e-2", "model.norm=pre,none"]
    assert called == [((str(config), axes, out), {"name": "n", "mode": "grid"})]
    assert main(["sweep", str(config), "--set", "optimizer.lr", "--out", out]) == 0  # the stub ran
    monkeypatch.undo()
    assert main(["sweep", str(config), "--set", "optimizer.lr", "--out", out]) == 2


def test_a_run_ending_above_the_uniform_loss_is_flagged() -> None:
    run = SweepRun("lr=10", (("optimizer.lr", "10"),), (("optimizer.lr", "10"),))
    summary = {"steps": 9, "tokens": 90, "wall_time_s": 1.0, "tokens_per_s": 90.0, "final_train_loss": 5.0}
    # ln 100 = 4.605: a final validation loss of 4.7 is worse than predicting every token with probability 1/100.
    bad = _row(run, {"status": "finished", "summary": {**summary, "final_val_loss": 4.7}}, vocab_size=100)
    good = _row(run, {"status": "finished", "summary": {**summary, "final_val_loss": 4.5}}, vocab_size=100)
    table = results_table([good, bad]).splitlines()
    assert table[2].endswith("| **4.5000** | 1.00s | 90 | finished |")
    assert table[3].endswith(
        "| 4.7000 | 1.00s | 90 | finished (ended above ln 100 = 4.61: no better than uniform) |"
    )
