"""Loss-curve plots: the PNG exists with the requested pixel size, and what is drawn is the runs' metrics."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from scratchlm.cli import main
from scratchlm.errors import ScratchlmError
from scratchlm.experiments.plot import plot_runs
from scratchlm.run import read_metrics


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header (signature, then the IHDR chunk)."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_run(run_dir: Path, scale: float, partial_last_line: bool = False) -> list[dict]:
    """A metrics.jsonl in the trainer's format: train records every 10 steps, eval records every 50."""
    run_dir.mkdir(parents=True)
    records = []
    for step in range(10, 201, 10):
        time = 1.5 * step + 0.25
        records.append(
            {
                "step": step,
                "time": time,
                "tokens": 512 * step,
                "train_loss": scale * (5 + 100 / step),
                "lr": 1e-3,
            }
        )
        if step % 50 == 0:
            loss = scale * (5.2 + 100 / step)
            records.append({"step": step, "time": time + 0.1, "tokens": 512 * step, "val_loss": loss})
    text = "".join(json.dumps(r) + "\n" for r in records)
    if partial_last_line:
        text += '{"step": 210, "time": 31'  # a record being written by a running training
    (run_dir / "metrics.jsonl").write_text(text)
    return records


def test_png_size_and_plotted_data_come_from_metrics(tmp_path: Path) -> None:
    runs = {"lr=1e-3": write_run(tmp_path / "a", 1.0), "lr=3e-3": write_run(tmp_path / "b", 0.8, True)}
    out = tmp_path / "plots" / "curves.png"
    drawn = plot_runs([tmp_path / "a", tmp_path / "b"], out, labels=list(runs), size=(8.0, 3.0), dpi=50)
    assert png_size(out) == (400, 150)
    assert set(drawn) == set(runs)
    for label, records in runs.items():
        for key, name in (("train_loss", "train"), ("val_loss", "val")):
            points = [r for r in records if key in r]
            assert drawn[label][name]["step"] == [r["step"] for r in points]
            assert drawn[label][name]["loss"] == [r[key] for r in points]
            assert drawn[label][name]["minutes"] == pytest.approx([r["time"] / 60 for r in points])


def test_default_size_labels_and_non_finite_points(tmp_path: Path) -> None:
    write_run(tmp_path / "good", 1.0)
    bad = tmp_path / "blew-up"
    bad.mkdir()
    lines = [
        {"step": 10, "time": 1.0, "train_loss": 9.0},
        {"step": 20, "time": 2.0, "train_loss": 6.0},
        {"step": 20, "time": 2.1, "val_loss": 6.5},
        {"step": 30, "time": 3.0, "train_loss": math.nan},
        {"step": 40, "time": 4.0, "train_loss": math.inf},
    ]
    (bad / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "curves.png"
    drawn = plot_runs([tmp_path / "good", bad], out)
    assert png_size(out) == (1200, 450)
    assert drawn["blew-up"]["train"]["step"] == [10, 20]  # the NaN and inf points are left out
    assert drawn["blew-up"]["val"]["loss"] == [6.5]


def test_cli_plot(tmp_path: Path) -> None:
    write_run(tmp_path / "a", 1.0)
    write_run(tmp_path / "b", 1.1)
    out = tmp_path / "c.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--title", "x"]) == 0
    assert png_size(out) == (1200, 450)
    assert main(["plot", str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_malformed_metrics_name_the_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 2.0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ScratchlmError, match=r"metrics.jsonl:2"):
        read_metrics(run)
    with pytest.raises(ScratchlmError, match="no metrics file"):
        read_metrics(tmp_path / "nowhere")
    with pytest.raises(ScratchlmError, match="labels"):
        plot_runs([run], tmp_path / "x.png", labels=["a", "b"])


def test_the_image_format_follows_the_suffix_and_another_suffix_is_refused(tmp_path: Path, capsys) -> None:
    """`--out a.txt` wrote a PNG named a.txt: the suffix chooses PNG, SVG or PDF (each file starts with its
    format's signature), and any other suffix is a one-line error naming the file, with nothing written."""
    write_run(tmp_path / "a", 1.0)
    signatures = {"svg": b"<?xml", "pdf": b"%PDF-", "PNG": b"\x89PNG\r\n\x1a\n"}
    for suffix, signature in signatures.items():
        out = tmp_path / f"curves.{suffix}"
        assert main(["plot", str(tmp_path / "a"), "--out", str(out)]) == 0
        assert out.read_bytes().startswith(signature)
        assert main(["plot", str(tmp_path / "a"), "--out", str(out)]) == 0  # an earlier plot is replaced
    capsys.readouterr()
    for name in ("a.txt", "curves"):
        assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / name)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and name in error and ".png, .svg, .pdf" in error
        assert not (tmp_path / name).exists()
    (tmp_path / "notes.svg").write_text("my notes\n")  # not an image of its suffix's format: kept
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "notes.svg")]) == 2
    assert (tmp_path / "notes.svg").read_text() == "my notes\n"
