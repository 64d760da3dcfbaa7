"""Pools of worker processes that fail loudly: a worker that dies ends the work with an error, never a hang.

`multiprocessing.Pool` replaces a worker that dies (killed by the out-of-memory killer or by hand, a crash in C
code) and waits forever for the task it held. `concurrent.futures.ProcessPoolExecutor` notices instead: every
result still to come raises `BrokenProcessPool`. `worker_pool` wraps one so that

- a dead worker becomes a one-line `ScratchlmError` that says how it died (the signal or exit status);
- on any error (a task's own exception, Ctrl-C, SIGTERM) the workers are stopped at once rather than left to
  finish their tasks, so the caller's cleanup (removing a partial output) runs promptly and no worker outlives
  the command;
- workers ignore Ctrl-C and SIGHUP, which a terminal sends to the whole process group (the parent decides
  what happens), and take the default action on SIGTERM: they never print tracebacks of their own;
- a signal that reaches the parent while it forks the workers is held and delivered right after, rather than
  lost (see `_signals_deferred`).

Workers are forked on Linux (they start at once and share the parent's memory); elsewhere they are spawned,
which re-imports the calling script, so call from under `if __name__ == "__main__":` there.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from scratchlm.errors import ScratchlmError

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def worker_pool(
    workers: int, initializer: Callable[..., None], initargs: tuple[Any, ...], what: str
) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` processes, each set up by `initializer(*initargs)`. `what` begins the error raised
    when a worker dies: "encoding data.txt failed" + ": a worker process was killed by SIGKILL"."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else None)
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(initializer, initargs)
    )
    try:
        # Start the workers now (a fork starts all of them at the first task): a fork copies the memory of
        # threads the caller starts later, such as a progress display's, in whatever state they are.
        with _signals_deferred():
            started = pool.submit(int)
        started.result()
        yield pool
    except BrokenProcessPool:
        processes = _workers(pool)
        how = _how_one_died(_exit_codes(processes))
        _kill(pool, processes)
        raise ScratchlmError(f"{what}: a worker process {how}") from None
    except BaseException:
        _kill(pool, _workers(pool))
        raise
    pool.shutdown(wait=True)


def _start_worker(initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    _worker_signals()
    initializer(*initargs)


def _worker_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while the workers are forked, and deliver them afterwards.

    Python runs a signal's handler at the main thread's next bytecode, which during a fork can be inside the
    fork's hooks (`os.register_at_fork`, e.g. logging's), and those swallow what the handler raises: a SIGTERM
    was seen to vanish that way, the command going on to the end. A worker that gets a signal before its
    setup acts as it would after it."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    parent, caught = os.getpid(), []

    def defer(signum: int, frame: Any) -> None:
        if os.getpid() == parent:
            caught.append(signum)
        else:
            _worker_signals()
            os.kill(os.getpid(), signum)

    held = [signum for signum in SIGNALS if signal.getsignal(signum) is not signal.SIG_IGN]  # nohup: ignored
    previous = {signum: signal.signal(signum, defer) for signum in held}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            signal.raise_signal(caught[0])  # now, to the caller's own handler


def _workers(pool: ProcessPoolExecutor) -> list[multiprocessing.Process]:
    """The pool's worker processes: its own record of them (there is no public one before Python 3.14)."""
    return list((pool._processes or {}).values())


def _exit_codes(processes: list[multiprocessing.Process], seconds: float = 5.0) -> list[int | None]:
    """The workers' exit codes once a broken pool has stopped them (it sends SIGTERM), waiting at most
    `seconds`; None for a worker still running. (The pool's thread reaps them, so a code can be missing for
    a moment after its worker ended.)"""
    deadline = time.monotonic() + seconds
    while any(process.exitcode is None for process in processes) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [process.exitcode for process in processes]


def _kill(pool: ProcessPoolExecutor, processes: list[multiprocessing.Process]) -> None:
    """Stop the workers at once, dropping the tasks not done. SIGKILL, because they hold nothing to clean up
    and because a worker forked at a bad moment (a lock held by another thread of the parent) may never get
    as far as answering SIGTERM, which is what the pool itself sends when it breaks. Then the pool, seeing
    them gone, winds up; waiting for it keeps its thread from racing the interpreter's exit (which prints a
    traceback from a closed pipe)."""
    for process in processes:
        process.kill()
    for process in processes:
        process.join()
    pool.shutdown(wait=True, cancel_futures=True)


def _how_one_died(exit_codes: list[int | None]) -> str:
    """How the worker that broke the pool died ("was killed by SIGKILL (out of memory?)", "exited with
    status 3"), from the workers' exit codes; the pool stops the others with SIGTERM."""
    codes = [code for code in exit_codes if code not in (None, 0)]
    code = next((c for c in codes if c != -signal.SIGTERM), codes[0] if codes else None)
    if code is None:
        return "died unexpectedly"
    if code < 0:
        name = signal.Signals(-code).name
        return f"was killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with status {code}"
