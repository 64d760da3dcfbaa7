"""Every output goes to a place of its own: nothing a user had there is deleted or overwritten, and no
output is written over an input (scratchlm.io's output checks, and the commands that use them).

Before the checks, `train-tokenizer --out DIR` replaced a folder of other files (deleting them), `--out .`
crashed after training, `encode IN IN` overwrote its input, and `quickstart`, `sweep`, `train` and `plot`
wrote into whatever directory or over whatever file they were given.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import fixture_path
from test_trainer import small_config

from scratchlm.cli import main
from scratchlm.errors import ScratchlmError
from scratchlm.experiments.sweep import run_sweep
from scratchlm.io import (
    OUTPUT_MARKER,
    atomic_directory,
    check_output_dir,
    check_output_file,
    claim_output_dir,
)
from scratchlm.quickstart import quickstart
from scratchlm.tokenizer import CHAT_TOKENS
from scratchlm.training.trainer import train


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().err


# --- the checks -----------------------------------------------------------------------------------------------


def test_a_directory_output_may_be_missing_empty_or_an_earlier_output_of_its_kind(tmp_path):
    check_output_dir(tmp_path / "new", "tokenizer")
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", "tokenizer")
    claim_output_dir(tmp_path / "mine", "tokenizer")
    (tmp_path / "mine" / "vocab.json").write_text("{}")
    check_output_dir(tmp_path / "mine", "tokenizer")
    assert (tmp_path / "mine" / OUTPUT_MARKER).read_text() == "tokenizer\n"


def test_a_directory_of_other_files_is_refused_by_name(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (out / name).write_text(name)
    with pytest.raises(ScratchlmError, match=r"already holds a\.txt, b\.txt, c\.txt, \.\.\. \(4 entries\)"):
        check_output_dir(out, "tokenizer")
    claim_output_dir(tmp_path / "run", "run")
    with pytest.raises(ScratchlmError, match="holds a scratchlm run output, not a tokenizer"):
        check_output_dir(tmp_path / "run", "tokenizer")
    # an output written before the marker existed is recognised by its caller's test
    check_output_dir(out, "tokenizer", previous=lambda d: (d / "a.txt").exists())


def test_a_directory_output_may_not_hold_an_input_or_the_current_directory(tmp_path, monkeypatch):
    out = claim_output_dir(tmp_path / "out", "tokenizer")
    (out / "text.txt").write_text("input")
    with pytest.raises(ScratchlmError, match="contains the input"):
        check_output_dir(out, "tokenizer", inputs=[out / "text.txt"])
    monkeypatch.chdir(out)
    for path in (".", "..", str(tmp_path)):
        with pytest.raises(ScratchlmError, match="is the current directory or contains it"):
            check_output_dir(path, "tokenizer")


def test_atomic_directory_replaces_only_its_own_kind(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ScratchlmError, match="keep.txt"), atomic_directory(out, "tokenizer"):
        pass
    assert (out / "keep.txt").read_text() == "mine"


def test_a_file_output_may_not_be_an_input_or_a_file_of_another_kind(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("text")
    (tmp_path / "link").symlink_to(source)
    os.link(source, tmp_path / "hard")
    for out in (source, tmp_path / "link", tmp_path / "hard"):
        with pytest.raises(ScratchlmError, match="is the input"):
            check_output_file(out, [source])
    np.save(tmp_path / "ids.npy", np.zeros(3, dtype=np.uint16))
    is_npy = lambda p: p.read_bytes()[:6] == b"\x93NUMPY"  # noqa: E731
    check_output_file(tmp_path / "ids.npy", [source], previous=is_npy, what="a .npy file")
    with pytest.raises(ScratchlmError, match="already exists and is not a .npy file"):
        check_output_file(source, [], previous=is_npy, what="a .npy file")
    assert source.read_text() == "text"


# --- the commands ---------------------------------------------------------------------------------------------


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(fixture_path("tinystories_sample.txt").read_bytes())
    return path


def test_train_tokenizer_leaves_a_folder_of_other_files_alone(tmp_path, text, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    status, err = run_cli(capsys, "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(out))
    assert status == 2 and "notes.txt" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_train_tokenizer_refuses_the_current_directory_before_training(tmp_path, text, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(capsys, "train-tokenizer", "text.txt", "--vocab-size", "300", "--out", ".")
    assert status == 2 and "current directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_train_tokenizer_replaces_its_own_earlier_output(tmp_path, text, capsys):
    out = tmp_path / "tok"
    for vocab_size in ("300", "310"):
        status, err = run_cli(
            capsys, "train-tokenizer", str(text), "--vocab-size", vocab_size, "--out", str(out)
        )
        assert status == 0, err
    # the version line, then the merges of the second run: 310 less the 256 bytes and the 4 reserved chat tokens
    assert len((out / "merges.txt").read_text().splitlines()) == 1 + 310 - 256 - len(CHAT_TOKENS)


def test_encode_refuses_to_write_over_its_input(tmp_path, text, capsys):
    tok = tmp_path / "tok"
    assert run_cli(capsys, "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(tok))[0] == 0
    before = text.read_bytes()
    status, err = run_cli(capsys, "encode", str(text), str(text), "--tokenizer", str(tok))
    assert status == 2 and "is the input" in err
    assert text.read_bytes() == before


def test_quickstart_and_sweep_refuse_a_folder_of_other_files(tmp_path):
    out = tmp_path / "project"
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.npy").write_bytes(b"the user's data")
    with pytest.raises(ScratchlmError, match="already holds data"):
        quickstart(out, small=True, device="cpu")
    config = small_config(tmp_path)
    (tmp_path / "base.toml").write_text(config.to_toml())
    with pytest.raises(ScratchlmError, match="already holds data"):
        run_sweep(tmp_path / "base.toml", ["optimizer.lr=1e-3,1e-2"], out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["data", "data/train.npy"]


def test_training_refuses_a_run_directory_that_holds_other_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("# the user's own config, kept beside nothing else of a run")
    with pytest.raises(ScratchlmError, match="already holds config.toml"):
        train(small_config(tmp_path))
    assert [p.name for p in run.iterdir()] == ["config.toml"]


def test_plot_refuses_to_overwrite_a_file_that_is_not_an_image(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1, "time": 0.1, "tokens": 8, "train_loss": 4.0}\n')
    status, err = run_cli(capsys, "plot", str(run), "--out", str(metrics))
    assert status == 2 and "a plot is written as .png, .svg, .pdf" in err and "'.jsonl'" in err
    assert metrics.read_text().startswith('{"step": 1')
    notes = run / "notes.png"  # an image's name, another file's content
    notes.write_text("not a picture\n")
    status, err = run_cli(capsys, "plot", str(run), "--out", str(notes))
    assert status == 2 and "not a PNG image" in err
    assert notes.read_text() == "not a picture\n"
