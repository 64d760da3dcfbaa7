"""The one exception type for mistakes a user can fix (bad files, bad flags, bad configs).

Library code raises `ScratchlmError` with a message that names the problem (file, line, value, what was
expected). The CLI prints such errors as one line and exits with status 2, so a user mistake never ends in a
traceback; any other exception is a bug and keeps its traceback.
"""

import signal


class ScratchlmError(Exception):
    """A user-facing error: bad input, bad configuration, missing or malformed files."""


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
    """A run stopped by a signal: Ctrl-C (SIGINT) or a termination request (SIGTERM, sent by `kill`,
    `timeout`, `docker stop` and cluster schedulers). The command line exits with 128 + `signum`, the shells'
    convention: 130 and 143. A KeyboardInterrupt, so that code which cleans up after Ctrl-C does so here too."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(signum).name)
