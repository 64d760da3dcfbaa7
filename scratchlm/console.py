"""Terminal output shared by the commands: one rich console, progress bars, peak memory, number formats.

A console that goes away never ends a command. Writing to a pipe whose reader has exited fails with EPIPE
(`scratchlm train ... | tee log`, then Ctrl-C, which ends `tee` too), to a terminal that has hung up (ssh
dropped) with EIO, to a closed stream with ValueError. While a command runs, stdout and stderr are
`GuardedStream`s: the first such failure marks the stream gone and later writes are dropped, as `nohup` would
have them, so a training run goes on to its end (or to its checkpoint, when a signal stops it). A run's
`log.txt` (`ConsoleLog`) keeps a copy of the console's lines and notes when the console went away.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import math
import os
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Lines are never wrapped: logs and summaries stay one line each in files and pipes (width 80 there).
# Markup is off: messages carry file names, URLs and run names that the user chose, and `data[bold].txt` or
# `runs/a[/]b` must print as written, not be parsed as style tags (or crash). Colour is asked for with `style=`
# or `rich.text.Text`; the few messages built only from numbers may pass `markup=True`.
console_settings: dict[str, Any] = {"highlight": False, "soft_wrap": True, "markup": False}


class GuardedStream:
    """A text stream (stdout, stderr, a log file) that outlives its reader: the first write or flush that fails
    (OSError: EPIPE, EIO, a full disk; ValueError: the stream is closed) marks it gone and calls
    `on_gone(reason)`; every later write is dropped. Anything else is the stream's own (`fileno`, `encoding`).

    The stream's file descriptor is then pointed at /dev/null: Python flushes what its buffer still holds once
    more at exit, which would otherwise print "Exception ignored ... BrokenPipeError" and fail the exit status.
    """

    def __init__(self, stream: TextIO, on_gone: Callable[[str], None]) -> None:
        self.stream, self.on_gone = stream, on_gone
        self.gone: str | None = None  # why it went away: "EPIPE: Broken pipe"

    def write(self, text: str) -> int:
        if self.gone is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as e:
                self._went_away(e)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.gone is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                self._went_away(e)

    def isatty(self) -> bool:
        try:
            return self.gone is None and self.stream.isatty()
        except ValueError:  # closed
            return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def _went_away(self, error: OSError | ValueError) -> None:
        self.gone = _reason(error)
        with contextlib.suppress(OSError, ValueError):  # no descriptor (closed, or not a file): nothing held
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        self.on_gone(self.gone)


def _reason(error: OSError | ValueError) -> str:
    """What went wrong: "EPIPE: Broken pipe", "EIO: Input/output error", "I/O operation on closed file"."""
    code = getattr(error, "errno", None)
    return f"{errno.errorcode[code]}: {error.strerror}" if code in errno.errorcode else str(error)


@contextlib.contextmanager
def guarded_standard_streams() -> Iterator[None]:
    """stdout and stderr as `GuardedStream`s inside: a console that goes away is noted in the open
    `ConsoleLog`s and the command goes on without it."""
    _fill_closed_descriptors()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _guarded(sys.stdout, "stdout"), _guarded(sys.stderr, "stderr")
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        sys.stdout, sys.stderr = saved


def _fill_closed_descriptors() -> None:
    """Point stdout's and stderr's descriptors at /dev/null when they were closed at start (`2>&-`; Python then
    has no sys.stderr): the next file opened would get the descriptor, and a library's stray write to "stderr"
    would land in it (a checkpoint, the run's lock)."""
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: fd itself, or stdin's
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)


def _guarded(stream: TextIO | None, name: str) -> TextIO | None:
    if stream is None or isinstance(stream, GuardedStream):  # None: Python started with it closed
        return stream
    return GuardedStream(stream, lambda reason: _note_in_logs(_went_away_note(name, reason)))  # type: ignore[return-value]


def _went_away_note(name: str, reason: str) -> str:
    return f"{name} went away ({reason}): nothing more is written to it; this log goes on"


class ConsoleLog:
    """A copy of the console's lines in a file while the log is open (`with ConsoleLog(path) as log:`): a run's
    `log.txt`. Appended to, so that the sessions of a resumed run follow each other; line-buffered, so that
    `tail -f` follows it; without colours or progress bars. The lines are held in memory until `keep()` says
    that the work goes ahead, so that a command refused (or with nothing to do) leaves the file as it was. It
    notes, with the time, when stdout or stderr went away, and a log that cannot be written (a full disk) is
    given up with a warning on the console, as the console would be."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.held: list[str] | None = []  # None once kept
        self.file: GuardedStream | None = None
        self.copy = Console(file=self, color_system=None, force_terminal=False, width=80, **console_settings)  # type: ignore[arg-type]

    def __enter__(self) -> ConsoleLog:
        _LOGS.append(self)
        for name in ("stdout", "stderr"):  # gone before the log opened
            stream = getattr(sys, name)
            if isinstance(stream, GuardedStream) and stream.gone is not None:
                self.note(_went_away_note(name, stream.gone))
        return self

    def __exit__(self, *exc: object) -> None:
        _LOGS.remove(self)
        if self.file is not None:
            self.file.flush()
            with contextlib.suppress(OSError):
                self.file.stream.close()

    def keep(self) -> None:
        """Write the lines so far to the file, and every later one as it comes."""
        held, self.held = self.held or [], None
        try:
            file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by __exit__)
        except OSError as e:
            self._cannot_write(_reason(e))
            return
        self.file = GuardedStream(file, self._cannot_write)
        self.file.writelines(held)

    def note(self, line: str) -> None:
        """A line for the log alone, with the time."""
        self.copy.print(f"{datetime.datetime.now().isoformat(sep=' ', timespec='seconds')}  {line}")

    def write(self, text: str) -> int:
        if self.held is not None:
            self.held.append(text)
        elif self.file is not None:
            self.file.write(text)
        return len(text)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def _cannot_write(self, reason: str) -> None:
        failed, self.file = self.file, None  # first: the warning below is copied to this log too
        if failed is not None:
            with contextlib.suppress(OSError):
                failed.stream.close()
        console.print(f"warning: cannot write {self.path} ({reason}): going on without it", style="yellow")


_LOGS: list[ConsoleLog] = []  # the logs open now, innermost last


def _note_in_logs(line: str) -> None:
    for log in _LOGS:
        log.note(line)


class _Console(Console):
    """rich's Console, each line of which is also written to the open `ConsoleLog`s."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*objects, **kwargs)
        for log in _LOGS:
            log.copy.print(*objects, **kwargs)

    def out(self, *objects: Any, **kwargs: Any) -> None:
        super().out(*objects, **kwargs)
        for log in _LOGS:
            log.copy.out(*objects, **kwargs)

    def rule(self, *args: Any, **kwargs: Any) -> None:
        super().rule(*args, **kwargs)
        for log in _LOGS:
            log.copy.rule(*args, **kwargs)


console = _Console(stderr=True, **console_settings)


def progress(
    transient: bool = False, counter: bool = False, every: float | None = 30.0, columns: tuple[Any, ...] = ()
) -> Progress:
    """A progress display for long work: description, bar, percentage (or done/total), elapsed, remaining.

    The bar is drawn on a terminal only: in a pipe, a log file or CI a redrawn bar is noise. There, a line
    every `every` seconds says how far each task has come instead (`LineProgress`), so that long work through
    `| tee` or under `nohup` is never silent; None prints nothing (work that logs lines of its own).
    `columns` replace the bar's usual ones (a download's bytes and speed)."""
    middle = MofNCompleteColumn() if counter else TaskProgressColumn()
    columns = columns or (
        TextColumn("{task.description}", style="bold", markup=False),  # descriptions name files
        BarColumn(),
        middle,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    if console.is_terminal:
        return Progress(*columns, console=console, transient=transient)
    return LineProgress(*columns, console=console, every=every)


class LineProgress(Progress):
    """A `Progress` that draws nothing and prints, at most every `every` seconds of a task, one line of how far
    it has come: `encoding train.txt: 41% (12.3 of 30.0 MB), 1m02.0s, about 1m29.2s left`."""

    def __init__(self, *columns: Any, every: float | None, **kwargs: Any) -> None:
        super().__init__(*columns, disable=True, **kwargs)
        self.every = every
        self.printed: dict[TaskID, float] = {}  # when each task last printed (or started)

    def add_task(self, *args: Any, **kwargs: Any) -> TaskID:
        task_id = super().add_task(*args, **kwargs)
        self.printed[task_id] = self.get_time()
        return task_id

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._report(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._report(task_id)

    def _report(self, task_id: TaskID) -> None:
        now = self.get_time()
        if self.every is None or now - self.printed.get(task_id, now) < self.every:
            return
        self.printed[task_id] = now
        task = self._tasks[task_id]
        if task.total:
            done = f"{task.percentage:.0f}% ({task.completed:,.0f} of {task.total:,.0f})"
        else:
            done = f"{task.completed:,.0f}"
        left = "" if task.time_remaining is None else f", about {format_seconds(task.time_remaining)} left"
        self.console.print(f"{task.description}: {done}, {format_seconds(task.elapsed or 0.0)}{left}")


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
