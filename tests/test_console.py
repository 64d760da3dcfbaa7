"""Console output prints user-supplied strings (file names, URLs, run names) as written. (Before, they were
parsed as rich markup: `a[bold]b.txt` lost its brackets, and `a[/]b.txt` crashed with a MarkupError.)"""

from __future__ import annotations

import pytest

from scratchlm.cli import main
from scratchlm.console import LineProgress, console, progress


@pytest.mark.parametrize("name", ["a[/]b.toml", "run[bold].toml", "x[link=https:e.com]y.toml"])
def test_an_error_naming_a_file_prints_the_name_as_written(tmp_path, capsys, name):
    status = main(["train", "--config", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"config file {tmp_path / name} not found" in err


def test_messages_and_progress_descriptions_print_brackets_as_written(capsys):
    console.print("wrote runs/a[/]b and runs/[red]c")
    with progress() as bars:
        bars.add_task("encoding [bold]x.txt", total=1)
    assert "wrote runs/a[/]b and runs/[red]c" in capsys.readouterr().err


def test_off_a_terminal_long_work_prints_a_line_every_30_seconds(capsys):
    """In a pipe or a log (pytest's stderr is neither a terminal) a bar is not drawn; a line every 30 s of
    a task says how far it has come, so that `| tee` or `nohup` never watches a silent wait."""
    bar = progress()
    assert isinstance(bar, LineProgress)
    now = [0.0]
    bar.get_time = lambda: now[0]
    with bar:
        task = bar.add_task("encoding train.txt", total=100)
        for _ in range(10):  # 10 units every 10 s
            now[0] += 10
            bar.advance(task, 10)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert [line.split(", about")[0] for line in lines] == [
        "encoding train.txt: 30% (30 of 100), 30.00s",
        "encoding train.txt: 60% (60 of 100), 1m00.0s",
        "encoding train.txt: 90% (90 of 100), 1m30.0s",
    ]
    assert lines[0].endswith("left")  # 70 more at the measured speed


def test_no_lines_where_the_work_logs_its_own_and_a_bar_on_a_terminal(capsys, monkeypatch):
    bar = progress(every=None)
    now = [0.0]
    bar.get_time = lambda: now[0]
    with bar:
        task = bar.add_task("training", total=10)
        now[0] = 100.0
        bar.update(task, completed=5)
    assert capsys.readouterr().err.strip() == ""
    monkeypatch.setattr(console, "_force_terminal", True)
    drawn = progress()
    assert not isinstance(drawn, LineProgress) and not drawn.disable
