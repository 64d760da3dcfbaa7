"""The command line: every sub-command's --help, a fast top-level parser, and one-line errors for bad input to
quickstart, download and prepare (each other command's own errors are tested beside that command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scratchlm.cli import COMMANDS, main


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `scratchlm ARGV` run in this process."""
    try:
        status = main(argv)
    except SystemExit as e:  # argparse: --help exits 0, a malformed command line exits 2
        status = e.code if isinstance(e.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli([command, "--help"], capsys)
    assert status == 0
    assert out.startswith(f"usage: scratchlm {command}")
    assert len(out.splitlines()) > 2  # a description and the options, not just the usage line


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["--help"], capsys)
    assert status == 0
    for command in COMMANDS:
        assert command in out


def test_building_the_parser_imports_neither_torch_nor_numpy() -> None:
    """`scratchlm --help` must answer at once: command modules import heavy libraries inside `run`."""
    code = "import sys; from scratchlm.cli import build_parser; build_parser(); print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["no-such-command"], capsys)
    assert status == 2
    assert "invalid choice: 'no-such-command'" in err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:")
    for fragment in fragments:
        assert fragment in lines[0]


def assert_usage_error(status: int, err: str, *fragments: str) -> None:
    """argparse's form: the usage line(s), then one `scratchlm CMD: error: ...` line."""
    assert status == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last
    for fragment in fragments:
        assert fragment in last


def test_quickstart_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run_cli(["quickstart", "--minutes", "five"], capsys)
    assert_usage_error(status, err, "invalid float value: 'five'")
    status, _, err = run_cli(["quickstart", "--minutes", "0", "--out", str(tmp_path)], capsys)
    assert_one_line_error(status, err, "--minutes must be a number of minutes above 0", "got 0")
    assert list(tmp_path.iterdir()) == []  # nothing started


def test_train_without_a_config_says_what_to_pass(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run_cli(["train", "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, "scratchlm train needs --config FILE", "configs/tiny.toml")
    assert Path(__file__).parent.parent.joinpath("configs", "tiny.toml").is_file()  # the example exists
    assert not (tmp_path / "run").exists()


def test_download_errors(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["download", "wikipedia"], capsys)
    assert_usage_error(status, err, "invalid choice: 'wikipedia'", "tinystories", "owt-sample")


def test_prepare_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, _, err = run_cli(["prepare", "tinystories", "--dir", str(tmp_path)], capsys)
    assert_one_line_error(
        status, err, "TinyStoriesV2-GPT4-train.txt not found", "scratchlm download tinystories"
    )

    status, _, err = run_cli(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], capsys)
    assert_one_line_error(status, err, f"text file {tmp_path / 'a.txt'} not found")

    status, _, err = run_cli(["prepare", str(tmp_path)], capsys)  # a directory without train.txt
    assert_one_line_error(status, err, f"text file {tmp_path / 'train.txt'} not found")

    status, _, err = run_cli(["prepare", "x", "y", "z"], capsys)
    assert_one_line_error(status, err, "cannot prepare x y z")

    (tmp_path / "train.txt").write_text("some text")
    (tmp_path / "valid.txt").write_text("more text")
    status, _, err = run_cli(["prepare", str(tmp_path), "--vocab-size", "100"], capsys)
    assert_one_line_error(status, err, "--vocab-size must be at least 257", "got 100")

    status, _, err = run_cli(["prepare", str(tmp_path), "--vocab-size", "lots"], capsys)
    assert_usage_error(status, err, "invalid int value: 'lots'")
