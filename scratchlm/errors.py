"""The one exception type for mistakes a user can fix (bad files, bad flags, bad configs).

Library code raises `ScratchlmError` with a message that names the problem (file, line, value, what was
expected). The CLI prints such errors as one line and exits with status 2, so a user mistake never ends in a
traceback; any other exception is a bug and keeps its traceback.
"""

import errno
import os
import signal

# Faults of the file system a user can act on (free space, mount it writable, fix the permissions), worded
# the way `df`, `mount` and `ls -l` would make them plain. Any other OSError is unexpected and keeps its traceback.
_OS_FAULTS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "no space left on device (disk quota exceeded)",
    errno.EFBIG: "file too large for the file system",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class ScratchlmError(Exception):
    """A user-facing error: bad input, bad configuration, missing or malformed files."""


def os_fault(path: str | os.PathLike, error: OSError, doing: str = "cannot write") -> ScratchlmError | None:
    """The one-line `ScratchlmError` for an OSError the file system reported while writing `path`: "cannot
    write PATH: no space left on device", "...: read-only file system", "...: permission denied". None when
    the error is not such a fault (a bug, or a fault of some other file), which the caller then re-raises.

    Writers turn OSError into ScratchlmError here and nowhere else (`scratchlm.io.atomic_write`, the run's
    lock), so that the same fault reads the same whichever command met it."""
    reason = _OS_FAULTS.get(error.errno)
    if reason is None:
        return None
    return ScratchlmError(f"{doing} {path}: {reason}")


class DivergedError(ScratchlmError):
    """Training stopped because the loss or the gradient norm became non-finite (NaN or infinite).

    `quantity` is "loss" or "gradient norm", `step` the step by which it happened, `checkpoint` the newest
    checkpoint written before it (None when there is none): a sweep records the run as diverged and goes on.
    """

    def __init__(self, quantity: str, step: int, checkpoint: str | None) -> None:
        self.quantity, self.step, self.checkpoint = quantity, step, checkpoint
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
        super().__init__(
            f"training diverged: the {quantity} became non-finite by step {step}; {kept} "
            "(try a lower optimizer.lr or a longer schedule.warmup_iters)"
        )


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal: Ctrl-C (SIGINT), a termination request (SIGTERM, sent by `kill`,
    `timeout`, `docker stop` and cluster schedulers) or a hangup (SIGHUP: the terminal closed). The command line
    exits with 128 + `signum`, the shells' convention: 130, 143 and 129. A KeyboardInterrupt, so that code which cleans up after Ctrl-C does so here too."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(signum).name)
