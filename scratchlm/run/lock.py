"""`RUN/.lock`: one training process per run directory at a time.

Two processes training in one directory would write over each other's checkpoints and metrics. So a training
process holds an exclusive `flock` on `RUN/.lock` for as long as it runs, and writes `pid@host` into the file
so that a second process can say who is in the way. The lock belongs to the open file, not to the file's
existence: when the process ends, however it ends (a crash, `kill -9`, the machine's power), the operating
system releases it, so there is never a stale lock to delete by hand. The file itself stays; its content only
means something while the lock is held.

`flock` is advisory and local to the machine (on NFS, Linux emulates it with POSIX locks, which the server
shares). Under torchrun only rank 0 takes it: the processes of one run share the directory by design.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from scratchlm.errors import ScratchlmError, os_fault

LOCK_FILE = ".lock"


class RunLock:
    """The lock of one run directory; a context manager that raises `ScratchlmError` when it is held."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.file: IO[str] | None = None

    def __enter__(self) -> RunLock:
        try:
            file = open(self.path, "a+", encoding="utf-8")  # never truncated before the lock is ours
        except OSError as e:  # a read-only or unwritable run directory: training could save nothing there
            raise os_fault(self.path, e) or e from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            pid, _, host = file.read().strip().partition("@")
            file.close()
            holder = f"process {pid} on {host}" if host else "another process"
            raise ScratchlmError(
                f"run directory {self.path.parent} is in use: {holder} is training in it (lock {self.path}); "
                "wait for it to end or stop it, or choose another logging.run_dir"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}@{socket.gethostname()}\n")
        file.flush()
        self.file = file
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None
