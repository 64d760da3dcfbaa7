"""`RUN/summary.json`: how a run ended, written when it stops (finished, out of time, interrupted or diverged)."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write


class StopReason(enum.Enum):
    """Why a training session ended. Only `FINISHED` means the run has no steps left."""

    FINISHED = "finished"  # the schedule's last step was taken
    TIME_BUDGET = "time budget"  # training.max_time_s ran out
    INTERRUPTED = "interrupted"  # Ctrl-C or a termination signal: continue with --resume
    DIVERGED = "diverged"  # the loss or gradient norm became non-finite (DivergedError)


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int
    tokens: int
    wall_time_s: float  # seconds of training over all sessions of the run
    final_train_loss: float | None
    final_val_loss: float | None
    tokens_per_s: float | None  # of the last session; None when it trained nothing
    parameters: int
    stopped: StopReason

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stopped": self.stopped.value}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "summary") -> RunSummary:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in names if name not in values]
        if missing:
            raise ScratchlmError(f"{source} is not a run summary: no {', '.join(missing)}")
        try:
            stopped = StopReason(values["stopped"])
        except ValueError:
            known = ", ".join(reason.value for reason in StopReason)
            raise ScratchlmError(
                f"{source}: stopped is {values['stopped']!r}, expected one of {known}"
            ) from None
        return cls(**{**{name: values[name] for name in names}, "stopped": stopped})

    def write(self, path: Path) -> None:
        with atomic_write(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def read(cls, path: Path) -> RunSummary:
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ScratchlmError(f"cannot read run summary {path}: {e}") from None
        if not isinstance(values, dict):
            raise ScratchlmError(f"run summary {path} is not a JSON object")
        return cls.from_dict(values, str(path))
