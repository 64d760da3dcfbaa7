"""Terminal output shared by the commands: one rich console, progress bars, peak memory, number formats."""

from __future__ import annotations

import math
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

# Lines are never wrapped: logs and summaries stay one line each in files and pipes (width 80 there).
# Markup is off: messages carry file names, URLs and run names that the user chose, and `data[bold].txt` or
# `runs/a[/]b` must print as written, not be parsed as style tags (or crash). Colour is asked for with `style=`
# or `rich.text.Text`; the few messages built only from numbers may pass `markup=True`.
console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def progress(transient: bool = False, counter: bool = False) -> Progress:
    """A progress display for long work: description, bar, percentage (or done/total), elapsed, remaining."""
    middle = MofNCompleteColumn() if counter else TaskProgressColumn()
    return Progress(
        TextColumn("{task.description}", style="bold", markup=False),  # descriptions name files
        BarColumn(),
        middle,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
        # Drawn on a terminal only: in CI logs and pipes a redrawn bar is noise.
        disable=not console.is_terminal,
    )


def process_peak_memory_mb() -> float:
    """Peak resident memory of this process alone, in MiB.

    Linux's `VmHWM` belongs to the process's current memory map; `ru_maxrss` survives `exec`, so a command
    started by a large process would report that process's size.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 1024 if sys.platform != "darwin" else peak / 1024 / 1024


def peak_memory_mb() -> float:
    """Peak resident memory of this process plus that of its largest finished child process, in MiB."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 1024 / 1024
    return process_peak_memory_mb() + children * scale


def format_seconds(seconds: float) -> str:
    """`75.3` -> `1m15.3s`; `3.2` -> `3.20s`; `97200` -> `27h00m00s`; beyond 100 hours in days (`12.5 days`);
    a value that is no length of time (infinite, NaN) as itself (`inf s`), never an exception."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds < 60:
        return f"{seconds:.2f}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m{seconds:04.1f}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 100:
        return f"{int(hours)}h{int(minutes):02d}m{seconds:02.0f}s"
    return f"{(hours + minutes / 60) / 24:,.1f} days"
