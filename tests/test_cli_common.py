"""The command line as a user meets it: the flags every command shares (docs/cli.md) and their old spellings,
time budgets checked before any work starts, hints that name what the user typed, and one-line errors for the
usual mistakes (text where token ids belong, empty inputs, a port in use). Each command runs in this process
through `scratchlm.cli.main`, or as a real process where a signal or a terminal is involved."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from test_cli import assert_one_line_error, run_cli

from scratchlm.cli import build_parser, main
from scratchlm.console import format_seconds

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = PROJECT_ROOT / "configs"
TINY = str(CONFIGS / "tiny.toml")
RUN_FIXTURE = str(PROJECT_ROOT / "tests" / "fixtures" / "run-main")
DEVICE_PROFILES = PROJECT_ROOT / "tests" / "fixtures" / "device"


# Time budgets: infinite, huge, zero, negative and NaN are refused by the flag or key the user typed, before
# anything is written.
@pytest.mark.parametrize("minutes", ["inf", "1e12", "0", "-1", "nan"])
def test_quickstart_refuses_a_budget_that_is_no_budget_before_any_work(minutes, tmp_path, capsys) -> None:
    out = tmp_path / "q"
    status, _, err = run_cli(["quickstart", "--small", "--out", str(out), "--minutes", minutes], capsys)
    assert_one_line_error(status, err, "--minutes must be a number of minutes above 0 and at most 525,600")
    assert not out.exists()


def test_a_huge_budget_says_how_long_it_is(tmp_path, capsys) -> None:
    status, _, err = run_cli(
        ["quickstart", "--small", "--out", str(tmp_path / "q"), "--minutes", "1e12"], capsys
    )
    assert_one_line_error(status, err, "got 1e+12 (694,444,444.4 days)")  # 1e12 min / 1,440 min a day


def test_quickstart_checks_the_chat_stage_before_the_base_training(tmp_path, capsys) -> None:
    out = tmp_path / "q"
    argv = ["quickstart", "--small", "--out", str(out), "--chat", "--chat-minutes", "inf"]
    status, _, err = run_cli(argv, capsys)
    assert_one_line_error(status, err, "--chat-minutes must be a number of minutes", "got inf")
    assert "--set" not in err and not out.exists()
    status, _, err = run_cli(["quickstart", "--out", str(out), "--chat-minutes", "2"], capsys)
    assert_one_line_error(status, err, "--chat-minutes is the fine-tuning time of --chat")


@pytest.mark.parametrize("command", ["train", "sft"])
def test_train_and_sft_name_the_minutes_flag(command, tmp_path, capsys) -> None:
    argv = [command, "--minutes", "inf", "--out", str(tmp_path / "r")]
    argv += ["--config", TINY] if command == "train" else ["--base", RUN_FIXTURE, "--data", "x.jsonl"]
    status, _, err = run_cli(argv, capsys)
    assert_one_line_error(status, err, "--minutes must be a number of minutes", "leave --minutes out")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("inf", "got inf"),
        ("1e12", "got 1000000000000.0 (11,574,074.1 days)"),
        ("nan", "must be >= 0, got nan"),
    ],
)
def test_the_time_budget_key_is_refused_by_name(value, fragment, capsys) -> None:
    status, _, err = run_cli(["train", "--config", TINY, "--set", f"training.max_time_s={value}"], capsys)
    assert_one_line_error(status, err, "with --set overrides: training.max_time_s", fragment)


def test_format_seconds_takes_any_float() -> None:
    assert format_seconds(float("inf")) == "inf s" and format_seconds(float("nan")) == "nan s"
    assert format_seconds(97_200) == "27h00m00s"
    assert format_seconds(1e12 * 60) == "694,444,444.4 days"


# One command line: the shared flags and their old spellings.
def test_download_takes_out_and_keeps_dir_as_its_old_spelling() -> None:
    parser = build_parser()
    for flag in ("--out", "--dir"):
        assert parser.parse_args(["download", "tinystories", flag, "d"]).out == "d"


def test_sweep_takes_its_config_as_a_flag_too(tmp_path, capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["sweep", "--config", "c.toml", "--out", "o"]).config_option == "c.toml"
    assert parser.parse_args(["sweep", "c.toml", "--out", "o"]).config == "c.toml"
    status, _, err = run_cli(["sweep", "a.toml", "--config", "b.toml", "--out", str(tmp_path)], capsys)
    assert_one_line_error(status, err, "give the base config once")


def test_train_flags_set_their_config_keys_and_set_overrides_them(monkeypatch, tmp_path) -> None:
    trained = []
    monkeypatch.setattr("scratchlm.training.trainer.train", lambda config, **kw: trained.append(config))
    argv = ["train", "--config", TINY, "--out", str(tmp_path / "r"), "--minutes", "1.5", "--device", "cpu"]
    assert main([*argv, "--precision", "fp32", "--init-from", "runs/base"]) == 0
    t = trained[-1].training
    assert (trained[-1].logging.run_dir, t.max_time_s, t.device, t.precision, t.init_from) == (
        str(tmp_path / "r"), 90.0, "cpu", "fp32", "runs/base",
    )  # fmt: skip
    assert main([*argv, "--set", "training.device=auto"]) == 0
    assert trained[-1].training.device == "auto"


def test_sft_help_shows_where_it_writes() -> None:
    from scratchlm.chat.sft import SFT_DEFAULTS

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["sft"].format_help().split())
    assert f"else {SFT_DEFAULTS['logging']['run_dir']})" in help_text


# Hints that name what the user typed.
def test_sft_names_its_missing_flags(capsys) -> None:
    status, _, err = run_cli(["sft", "--data", "chat.jsonl"], capsys)
    assert_one_line_error(status, err, "--base is required")
    assert "--set" not in err
    status, _, err = run_cli(["sft", "--base", RUN_FIXTURE], capsys)
    assert_one_line_error(status, err, "--data is required")
    assert "data.train" not in err and "--set" not in err


@pytest.mark.parametrize(("profile", "auto"), [("cpu-native-bf16", "bf16"), ("cpu-no-native-bf16", "fp32")])
def test_a_slow_explicit_precision_names_what_auto_chooses_here(profile, auto, monkeypatch) -> None:
    from scratchlm.device import plan

    monkeypatch.setenv("SCRATCHLM_DEVICE_PROFILE", str(DEVICE_PROFILES / f"{profile}.json"))
    choices = plan(torch.device("cpu"), "fp16", threads=1, option="--precision")
    assert choices.precision.value == "fp16"
    assert plan(torch.device("cpu"), "auto", threads=1).precision.value == auto
    (warning,) = choices.warnings
    assert warning.endswith(f'"auto" would choose {auto}')


def test_serve_on_a_port_in_use_says_so_before_anything_else(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, out, err = run_cli(["serve", "--run", RUN_FIXTURE, "--port", str(port)], capsys)
    assert_one_line_error(status, err, f"cannot listen on 127.0.0.1:{port}: address already in use")
    assert out == "" and "page" not in err and "Ctrl-C" not in err


def test_an_interrupted_quickstart_says_to_rerun_the_same_command(tmp_path) -> None:
    """A real process, stopped by SIGINT while it trains: the hint is the command as typed, which resumes."""
    out = tmp_path / "q"
    # Training that lasts until the signal: the small quickstart with a step limit too far to reach.
    script = (
        "import sys, scratchlm.quickstart.stages as q; real = q.train; "
        "q.train = lambda config, resume=False: real(config.replace(training={'max_steps': 10**6}), resume); "
        "from scratchlm.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = ["quickstart", "--small", "--device", "cpu", "--minutes", "10", "--out", str(out)]
    env = {**os.environ, "COLUMNS": "300"}
    process = subprocess.Popen(
        [sys.executable, "-c", script, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    deadline = time.monotonic() + 120
    for line in process.stdout:
        lines.append(line)
        if line.startswith("step ") or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=120)
    output = "".join(lines) + rest
    assert process.returncode == 130, output
    assert f"rerun `scratchlm {' '.join(argv)}` to continue" in output
    assert "--resume" not in output


# One-line errors for the usual mistakes.
@pytest.mark.parametrize(
    ("content", "fragment"),
    [("hello world\n", "is not a .npy file"), ("", "is an empty file")],
)
def test_eval_on_a_text_file_says_what_it_expected(content, fragment, tmp_path, capsys) -> None:
    text = tmp_path / "x.txt"
    text.write_text(content)
    status, _, err = run_cli(["eval", "--run", RUN_FIXTURE, "--data", str(text)], capsys)
    assert_one_line_error(status, err, fragment, "`scratchlm encode` or `scratchlm prepare`")
    assert "pickle" not in err


def test_eval_names_its_flags(capsys) -> None:
    status, _, err = run_cli(["eval", "--run", RUN_FIXTURE, "--data", "x.npy", "--batch-size", "0"], capsys)
    assert_one_line_error(status, err, "--batch-size must be at least 1, got 0")
    status, _, err = run_cli(["eval", "--run", RUN_FIXTURE, "--tasks", "x", "--limit", "0"], capsys)
    assert_one_line_error(status, err, "--limit must be positive")


def test_train_tokenizer_refuses_an_empty_file(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = ["train-tokenizer", str(empty), "--vocab-size", "300", "--out", str(tmp_path / "tok")]
    status, _, err = run_cli(argv, capsys)
    assert_one_line_error(status, err, "is empty: there is no text to learn merges from")
    assert not (tmp_path / "tok").exists()


# Every shipped config names its tokenizer, so that its runs can generate.
@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_names_its_tokenizer(config: Path) -> None:
    tables = tomllib.loads(config.read_text())
    for stage in ("sft", "rl"):  # a fine-tuning or RL run's tokenizer is its base's, with the chat template
        if stage in tables:
            assert tables[stage]["base"]
            return
    data = tables["data"]
    # Where `scratchlm prepare` writes it: beside the token files.
    assert data["tokenizer"] == str(Path(data["train"]).parent / "tokenizer")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A directory laid out as `scratchlm prepare tinystories` leaves it, for configs/tiny.toml."""
    root = tmp_path_factory.mktemp("tiny")
    story = "Once upon a time, a little fox named Pip lived in a green forest. Pip liked to run. "
    (root / "train.txt").write_text("<|endoftext|>".join(f"{story}Story {i}." for i in range(60)))
    (root / "valid.txt").write_text("<|endoftext|>".join(f"{story}Tale {i}." for i in range(8)))
    data = root / "data" / "tinystories"
    assert main(["prepare", str(root / "train.txt"), str(root / "valid.txt"), "--out", str(data)]) == 0
    return root


def test_a_run_of_the_tiny_config_generates(prepared, monkeypatch, capsys) -> None:
    monkeypatch.chdir(prepared)  # the config's paths are relative to where the command runs
    argv = ["train", "--config", TINY, "--out", "runs/tiny", "--device", "cpu", "--precision", "fp32"]
    assert main([*argv, "--set", "training.max_steps=2", "--set", "eval.iters=1"]) == 0
    captured = capsys.readouterr()
    assert "no tokenizer" not in captured.out + captured.err
    status, out, err = run_cli(
        ["generate", "--run", "runs/tiny", "--max-new-tokens", "3", "--seed", "0"], capsys
    )
    assert status == 0, err
    assert "3 tokens in" in out + err


def test_a_run_without_a_tokenizer_says_so_at_its_start(prepared, monkeypatch, capsys) -> None:
    monkeypatch.chdir(prepared)
    argv = ["train", "--config", TINY, "--out", "runs/bare", "--device", "cpu", "--precision", "fp32"]
    argv += ["--set", "training.max_steps=1", "--set", "eval.iters=1", "--set", 'data.tokenizer=""']
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert "warning: no tokenizer (data.tokenizer is not set): generate, chat, serve and export" in out
    status, _, err = run_cli(["train", "--config", TINY, "--set", "data.tokenizer=nowhere"], capsys)
    assert_one_line_error(status, err, "data.tokenizer nowhere is not a directory")
