"""A signal during training: finish the step, save a checkpoint, stop.

A terminal sends SIGINT (Ctrl-C) and, when it closes or ssh drops, SIGHUP; `kill`, `timeout`, `docker stop` and
cluster schedulers (SLURM, before its SIGKILL) send SIGTERM. Each asks the loop to stop at the next step
boundary; the loop then saves a checkpoint and raises `Interrupted`, whose signal number the command line
turns into its exit status (130, 143, 129), and `--resume` continues exactly where it stopped. A SIGHUP that was
ignored when the run started (`nohup`) stays ignored: the run goes on. A console that went away with the
terminal is no reason to stop either (see `scratchlm.console`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch

from scratchlm.console import console
from scratchlm.errors import Interrupted
from scratchlm.training.distributed import all_reduce


class StopRequest:
    """A signal asks the loop to stop at the next step boundary (it then saves a checkpoint). In a
    single-process run a second Ctrl-C or SIGTERM aborts at once; a second SIGHUP does not, since a hangup
    reaches a job twice (from the terminal and from its shell). Under torchrun every process gets the signal
    (or one of them does), and the processes agree to stop at the next log step, so that all of them leave
    together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, distributed: bool) -> None:
        self.signum: int | None = None  # the signal that asked to stop
        self.distributed = distributed
        self.announced = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        # Nothing is printed here: a handler runs wherever the main thread is, which may be inside a write to
        # the same stream, and a buffered stream raises on such a reentrant call ("reentrant call inside
        # <_io.BufferedWriter>"). `announce` prints at the step boundary instead.
        if self.requested and not self.distributed and signum != signal.SIGHUP:
            raise Interrupted(signum)
        if not self.requested:
            self.signum = signum

    def announce(self) -> None:
        """Say, once, that a signal asked to stop (called at step boundaries)."""
        if self.signum is None or self.announced:
            return
        self.announced = True
        when = "at the next log step" if self.distributed else "now"
        again = "" if self.distributed or self.signum == signal.SIGHUP else " (again to abort)"
        name = signal.Signals(self.signum).name
        console.print(f"{name}: stopping {when} to save a checkpoint{again}", style="yellow")

    def agreed(self, over_budget: bool, device: torch.device) -> tuple[int, bool]:
        """The signal that asks to stop (0: none) and whether the time budget is spent, as every process sees
        them: under torchrun a signal that reached any process stops them all, and so does a budget one
        process found spent (a collective: every process calls it at the same steps)."""
        signum = self.signum or 0
        if not self.distributed:
            return signum, over_budget
        agreed = all_reduce(torch.tensor([signum, over_budget], dtype=torch.float32, device=device), "max")
        signum, spent = (int(value) for value in agreed.tolist())
        return signum, bool(spent)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield self
            return
        handled = [s for s in self.SIGNALS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN]
        previous = {signum: signal.signal(signum, self._handle) for signum in handled}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
