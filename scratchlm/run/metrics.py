"""`RUN/metrics.jsonl`: one JSON object per line, appended and flushed as training goes.

Every record has "step", "time" (seconds of training wall-clock, continuing across resumes) and "tokens", plus
either the train fields (train_loss, lr, grad_norm, tokens_per_s, mfu; loss_scale and skipped_steps in fp16;
reward, uniform_groups, kl, clip_fraction, reply_tokens and entropy in reinforcement learning), the eval fields
(val_loss, val_ppl; val_pass1 in reinforcement learning, instead), or
"setup": what each training session ran with (device, device_name, precision as "auto" resolved it, threads,
compile), written when it starts, or "time_budget": the time budget's decision. Each kind is a dataclass here
(`TrainRecord`, `EvalRecord`, `SetupRecord`, `BudgetRecord`), which the trainer writes and readers read
(`read_records`).
An unterminated last line is a record still being written by a running training (or torn by a crash) and is
skipped, so a run can be read while it trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every record has: the step, seconds of training (over all sessions) and tokens seen."""

    step: int
    time: float = 0.0
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the file."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class TrainRecord(Record):
    """One log interval of training. `grad_norm` is None when fp16 skipped every step of the interval;
    `loss_scale` and `skipped_steps` (so far in the run) are fp16's alone; `mfu` is None where the peak is
    unknown. The fields after them are reinforcement learning's (`scratchlm rl`), means over the interval's
    batches of replies: the reward, the share of groups whose rewards were all equal, the KL estimate to the
    starting model, the share of reply tokens whose ratio the clip cut, the reply's length in tokens, and the
    policy's entropy per reply token."""

    train_loss: float
    lr: float | None = None
    grad_norm: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    loss_scale: float | None = None
    skipped_steps: int | None = None
    reward: float | None = None
    uniform_groups: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    reply_tokens: float | None = None
    entropy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        values = super().to_dict()
        if self.loss_scale is None:  # not fp16: the fields are left out of the file
            del values["loss_scale"], values["skipped_steps"]
        if self.reward is None:  # not reinforcement learning: neither are these
            for name in ("reward", "uniform_groups", "kl", "clip_fraction", "reply_tokens", "entropy"):
                del values[name]
        return values


@dataclass(frozen=True, kw_only=True)
class EvalRecord(Record):
    """A validation estimate: the loss (and perplexity) of held-out data, or, in reinforcement learning, the
    share of held-out prompts whose greedy reply gets the full reward (pass@1)."""

    val_loss: float | None = None
    val_ppl: float | None = None
    val_pass1: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {name: value for name, value in super().to_dict().items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class SetupRecord(Record):
    """What a training session ran with: device, device_name, precision ("auto" resolved), threads, compile."""

    setup: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class BudgetRecord(Record):
    """The time budget's decision (`scratchlm.training.budget.BudgetDecision.to_dict()`)."""

    time_budget: dict[str, Any]


# Each kind of record by the key only it has.
RECORD_KINDS: dict[str, type[Record]] = {
    "train_loss": TrainRecord,
    "val_loss": EvalRecord,
    "val_pass1": EvalRecord,
    "setup": SetupRecord,
    "time_budget": BudgetRecord,
}


def typed(record: dict[str, Any]) -> Record:
    """A record of the file as its dataclass (a kind this version does not know stays a plain `Record`; a
    field an older file lacks takes its default)."""
    kind = next((kind for key, kind in RECORD_KINDS.items() if key in record), Record)
    names = {f.name for f in fields(kind)}
    return kind(**{key: value for key, value in record.items() if key in names})


def read_records(run_dir_or_file: str | Path) -> list[Record]:
    """`read_metrics`, each record as its dataclass."""
    return [typed(record) for record in read_metrics(run_dir_or_file)]


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
