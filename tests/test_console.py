"""Console output prints user-supplied strings (file names, URLs, run names) as written. (Before, they were
parsed as rich markup: `a[bold]b.txt` lost its brackets, and `a[/]b.txt` crashed with a MarkupError.)"""

from __future__ import annotations

import pytest

from scratchlm.cli import main
from scratchlm.console import console, progress


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
