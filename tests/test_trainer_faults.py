"""Training under a termination signal, and resuming with a changed config.

Before: SIGTERM (what `kill`, `timeout`, `docker stop` and schedulers send) ended training on the spot with no
checkpoint, and `--resume` with a changed hyperparameter went on without a word.
"""

from __future__ import annotations

import signal

import pytest
from test_trainer import assert_same_state, final_state, small_config

from scratchlm.cli import main
from scratchlm.errors import Interrupted, ScratchlmError
from scratchlm.run import StopReason
from scratchlm.training import schedule, trainer
from scratchlm.training.config import TrainConfig
from scratchlm.training.start import config_changes
from scratchlm.training.trainer import train


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    train(small_config(tmp_path, "straight"))
    cosine = schedule.cosine_lr_schedule

    def sigterm_at_step_7(it, *args):
        if it == 7:
            signal.raise_signal(signal.SIGTERM)
        return cosine(it, *args)

    def unhandled(signum, frame):  # what SIGTERM did before: end the run with nothing saved
        raise AssertionError("SIGTERM was not handled by the training loop")

    monkeypatch.setattr(schedule, "cosine_lr_schedule", sigterm_at_step_7)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(Interrupted) as stopped:
            train(small_config(tmp_path, "stopped"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.signum == signal.SIGTERM
    assert (tmp_path / "stopped" / "checkpoints" / "step_00000007.pt").exists()
    summary = (tmp_path / "stopped" / "summary.json").read_text()
    assert f'"stopped": "{StopReason.INTERRUPTED.value}"' in summary
    monkeypatch.setattr(schedule, "cosine_lr_schedule", cosine)
    train(small_config(tmp_path, "stopped"), resume=True)
    assert_same_state(final_state(tmp_path / "straight"), final_state(tmp_path / "stopped"))


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_exit_status_says_which_signal_interrupted(monkeypatch, signum, status, capsys):
    def interrupted(config, **kwargs):
        raise Interrupted(signum)

    monkeypatch.setattr(trainer, "train", interrupted)
    config = ["data.train=a.npy", "data.valid=b.npy", "training.max_steps=1"]
    assert main(["train", *(arg for key in config for arg in ("--set", key))]) == status
    assert "interrupted" in capsys.readouterr().err


def test_resuming_with_a_changed_config_lists_each_difference_and_is_refused(tmp_path):
    train(small_config(tmp_path, training={"max_steps": 4}))
    files = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"}
    changed = small_config(tmp_path, optimizer={"lr": 0.5, "min_lr": 1e-3}, model={"rope_theta": 500.0})
    with pytest.raises(ScratchlmError) as refused:
        train(changed, resume=True)
    message = str(refused.value)
    assert "optimizer.lr: 0.01 -> 0.5" in message and "model.rope_theta: 10000.0 -> 500.0" in message
    assert "--allow-config-change" in message and "max_steps" not in message  # 4 -> 12 may change
    assert {
        p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"
    } == files


def test_an_allowed_config_change_is_named_and_the_run_goes_on(tmp_path, capsys):
    train(small_config(tmp_path, training={"max_steps": 4}))
    changed = small_config(tmp_path, optimizer={"lr": 0.5, "min_lr": 1e-3})
    capsys.readouterr()
    summary = train(changed, resume=True, allow_config_change=True)
    assert summary.steps == 12
    assert "resuming with a changed config: optimizer.lr: 0.01 -> 0.5" in capsys.readouterr().err
    recorded = TrainConfig.load(tmp_path / "run" / "config.toml")
    assert recorded.optimizer.lr == 0.5  # the run records the config it goes on with


def test_budget_and_bookkeeping_keys_may_change_on_resume(tmp_path):
    config = small_config(tmp_path)
    changed = config.replace(
        training={"max_steps": 100, "max_time_s": 60.0, "device": "auto", "compile": True},
        eval={"interval": 1, "iters": 7},
        checkpoint={"interval": 1, "keep": 9},
        logging={"run_dir": str(tmp_path / "moved"), "log_interval": 3},
    )
    assert config_changes(config.to_dict(), changed) == []
    assert config_changes(config.to_dict(), config.replace(training={"seed": 1})) == ["training.seed: 0 -> 1"]
