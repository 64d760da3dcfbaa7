"""Terminal output shared by the commands: one rich console, progress bars, peak memory, number formats."""

from __future__ import annotations

import resource
import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True, highlight=False)


def progress(transient: bool = False, counter: bool = False) -> Progress:
    """A progress display for long work: description, bar, percentage (or done/total), elapsed, remaining."""
    middle = MofNCompleteColumn() if counter else TaskProgressColumn()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        middle,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
        # Drawn on a terminal only: in CI logs and pipes a redrawn bar is noise.
        disable=not console.is_terminal,
    )


def peak_memory_mb() -> float:
    """Peak resident memory of this process plus that of its largest finished child, in MiB.

    Linux reports `ru_maxrss` in KiB, macOS in bytes.
    """
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 1024 / 1024
    return (own + children) * scale


def format_seconds(seconds: float) -> str:
    """`75.3` -> `1m15.3s`; `3.2` -> `3.20s`."""
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m{seconds:04.1f}s"
    hours, minutes = divmod(minutes, 60)
    return f"{int(hours)}h{int(minutes):02d}m{seconds:02.0f}s"
