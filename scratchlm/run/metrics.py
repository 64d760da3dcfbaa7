"""`RUN/metrics.jsonl`: one JSON object per line, appended and flushed as training goes.

Every record has "step", "time" (seconds of training wall-clock, continuing across resumes) and "tokens", plus
either the train fields (train_loss, lr, grad_norm, tokens_per_s, mfu; loss_scale and skipped_steps in fp16),
the eval fields (val_loss, val_ppl), or
"setup": what each training session ran with (device, device_name, precision as "auto" resolved it, threads,
compile), written when it starts.
An unterminated last line is a record still being written by a running training (or torn by a crash) and is
skipped, so a run can be read while it trains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """The records of `RUN/metrics.jsonl` (or of a metrics file given directly), in file order."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ScratchlmError(f"no metrics file at {path} (is {run_dir_or_file} a training run directory?)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ScratchlmError(f"cannot read metrics file {path}: {e}") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: a record still being appended
                break
            raise ScratchlmError(f"{path}:{number}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ScratchlmError(f"{path}:{number}: expected a JSON object with an integer step")
        records.append(record)
    return records


def drop_records_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` (the part of the curve a resumed checkpoint has seen) and drop
    a torn last line."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    kept = []
    for line in lines:
        try:
            if line.strip() and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass  # a torn record from a crash
    if len(kept) != len([line for line in lines if line.strip()]) or (lines and lines[-1]):
        with atomic_write(path, "w") as f:
            f.write("".join(line + "\n" for line in kept))
