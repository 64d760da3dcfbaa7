"""`scratchlm train-tokenizer`: the saved tokenizer, the summary, and a one-line error for every bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fixture_path

from scratchlm import train_bpe
from scratchlm.cli import main
from scratchlm.tokenizer import CHAT_TOKENS
from scratchlm.tokenizer.serialization import load_tokenizer_files

EOT = "<|endoftext|>"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of `scratchlm train-tokenizer ARGV` run in this process."""
    try:
        status = main(["train-tokenizer", *argv])
    except SystemExit as e:  # argparse rejects a malformed command line with status 2
        status = e.code if isinstance(e.code, int) else 1
    return status, capsys.readouterr().err


def assert_one_line_error(status: int, err: str, fragment: str) -> None:
    assert status == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert fragment in err


@pytest.mark.parametrize("chat_tokens", [True, False])
def test_trains_and_saves_the_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chat_tokens: bool
) -> None:
    """The chat template's tokens are reserved unless --no-chat-tokens; either way the vocabulary and merges are
    `train_bpe`'s with those special tokens."""
    corpus = fixture_path("corpus.en")
    out = tmp_path / "tokenizer"
    argv = [str(corpus), "--vocab-size", "400", "--special-token", EOT, "--out", str(out), "--workers", "2"]
    status, err = run_cli(argv + ([] if chat_tokens else ["--no-chat-tokens"]), capsys)
    assert status == 0, err
    vocab, merges, special_tokens = load_tokenizer_files(out)
    expected_special = [EOT, *CHAT_TOKENS] if chat_tokens else [EOT]
    assert (vocab, merges) == train_bpe(corpus, 400, expected_special, workers=1)
    assert special_tokens == expected_special
    special_bytes = {t.encode() for t in expected_special}
    longest = max((t for t in vocab.values() if t not in special_bytes), key=len)
    merged = 400 - 256 - len(expected_special)
    assert f"trained 400 tokens (256 bytes + {merged} merges + {len(expected_special)} special)" in err
    assert "peak memory" in err and " MiB" in err
    assert f"longest token: {longest.decode()!r} ({len(longest)} bytes)" in err
    assert "stopped early" not in err


def test_says_when_it_stopped_early(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(f"ab ab{EOT}ab")
    status, err = run_cli(
        [str(corpus), "--vocab-size", "1000", "--special-token", EOT, "--out", str(tmp_path / "t")], capsys
    )
    assert status == 0, err
    # 256 bytes, 2 merges (a+b, " "+ab), <|endoftext|> and the 4 chat tokens
    assert "stopped early" in err and "vocabulary has 263 tokens instead of 1,000" in err
    assert len(load_tokenizer_files(tmp_path / "t")[0]) == 263


def test_runs_as_a_module_without_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scratchlm", "train-tokenizer", str(tmp_path / "missing.txt")]
        + ["--vocab-size", "300", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: input file not found: {tmp_path / 'missing.txt'}"]


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("missing file", "input file not found"),
        ("directory given", "is not a regular file"),
        ("vocab below 256 + specials", "at least 256 bytes + 6 special token(s) = 262"),
        ("output is a file", "exists and is not a directory"),
        ("output under a file", "is not a directory"),
        ("invalid UTF-8", "not valid UTF-8 at byte offset 9"),
        ("one-byte special token", "special token '|' is a single byte"),
        ("zero workers", "workers must be at least 1"),
    ],
)
def test_bad_input_is_one_line(
    case: str, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.txt"
    good.write_text("some text to train on")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"some text\xff and more")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    out = tmp_path / "out"
    argv = {
        "missing file": [str(tmp_path / "missing.txt"), "--vocab-size", "300", "--out", str(out)],
        "directory given": [str(tmp_path), "--vocab-size", "300", "--out", str(out)],
        "vocab below 256 + specials": [str(good), "--vocab-size", "257", "--special-token", EOT]
        + ["--special-token", "<|pad|>", "--out", str(out)],
        "output is a file": [str(good), "--vocab-size", "300", "--out", str(a_file)],
        "output under a file": [str(good), "--vocab-size", "300", "--out", str(a_file / "sub" / "dir")],
        "invalid UTF-8": [str(bad), "--vocab-size", "300", "--out", str(out)],
        "one-byte special token": [
            str(good),
            "--vocab-size",
            "300",
            "--special-token",
            "|",
            "--out",
            str(out),
        ],
        "zero workers": [str(good), "--vocab-size", "300", "--out", str(out), "--workers", "0"],
    }[case]
    status, err = run_cli(argv, capsys)
    assert_one_line_error(status, err, fragment)
    assert not out.exists()  # nothing half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "bad.txt", "good.txt"]


def test_failed_run_leaves_an_existing_tokenizer_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.txt"
    good.write_text("some text to train on")
    out = tmp_path / "tok"
    assert run_cli([str(good), "--vocab-size", "270", "--out", str(out)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xc3(")
    status, err = run_cli([str(bad), "--vocab-size", "300", "--out", str(out)], capsys)
    assert_one_line_error(status, err, "not valid UTF-8 at byte offset 0")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_non_integer_vocab_size_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run_cli([str(tmp_path), "--vocab-size", "lots", "--out", str(tmp_path / "o")], capsys)
    assert status == 2
    assert "Traceback" not in err and "invalid int value: 'lots'" in err
