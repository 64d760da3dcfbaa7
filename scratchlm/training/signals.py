"""Ctrl-C (SIGINT) and SIGTERM during training: finish the step, save a checkpoint, stop.

`kill`, `timeout`, `docker stop` and cluster schedulers send SIGTERM; a terminal sends SIGINT. Either asks the
loop to stop after the current step; the loop then saves a checkpoint and raises `Interrupted`, whose signal
number the command line turns into its exit status (130, 143).
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
    """Ctrl-C or SIGTERM asks the loop to stop after the current step (it then saves a checkpoint); a second
    signal in a single-process run aborts at once. Under torchrun every process gets the signal (or one of them
    does), and the processes agree to stop at the next log step, so that all of them leave together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, distributed: bool) -> None:
        self.signum: int | None = None  # the signal that asked to stop
        self.distributed = distributed

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and not self.distributed:
            raise Interrupted(signum)
        self.signum = signum
        console.print(
            f"{signal.Signals(signum).name}: stopping after this step to save a checkpoint (again to abort)",
            style="yellow",
        )

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
        previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
