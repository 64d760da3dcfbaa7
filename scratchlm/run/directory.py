"""`RunDirectory`: the paths of a run directory, the checkpoints in it, and the one way a run is laid out
(`create`), whether training starts it or `import-hf` makes it from imported weights."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.io import atomic_write, claim_output_dir
from scratchlm.run.lock import RunLock
from scratchlm.run.metrics import METRICS_FILE
from scratchlm.run.summary import RunSummary

if TYPE_CHECKING:
    from scratchlm.run.checkpoint import Checkpoint
    from scratchlm.tokenizer.tokenizer import Tokenizer

# A checkpoint: a file, or (without .pt) a sharded checkpoint's directory (`scratchlm.run.sharded`)
CHECKPOINT_NAME = re.compile(r"step_(\d+)(\.pt)?")
# A sharded checkpoint being written (`scratchlm.run.sharded`); one left behind was cut short by a crash
PARTIAL_CHECKPOINT_NAME = re.compile(r"step_\d+\.tmp-.+")
TOKENIZER_DIR = "tokenizer"  # the run directory's copy of its tokenizer
RUN_KIND = "run"  # the output marker of a run directory (scratchlm.io)


@dataclass(frozen=True)
class RunDirectory:
    path: Path

    def __init__(self, path: str | os.PathLike) -> None:
        object.__setattr__(self, "path", Path(path))

    def __str__(self) -> str:
        return str(self.path)

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def log(self) -> Path:
        """The run's log: the console's lines of every session (`scratchlm.console.ConsoleLog`)."""
        return self.path / "log.txt"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int, sharded: bool = False) -> Path:
        """The checkpoint of `step`: a file, or the directory of a sharded one."""
        name = f"step_{step:08d}"
        return self.checkpoints_dir / (name if sharded else f"{name}.pt")

    def checkpoints(self) -> list[Path]:
        """The run's checkpoints, files and sharded ones' directories, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.checkpoints_dir.iterdir()
            if (m := CHECKPOINT_NAME.fullmatch(p.name)) and (p.is_dir() != bool(m.group(2)))
        ]
        return [p for _, p in sorted(found)]

    @property
    def tokenizer_dir(self) -> Path:
        """The run's own copy of the tokenizer it trains with (see `create`)."""
        return self.path / TOKENIZER_DIR

    def latest_checkpoint(self) -> Path | None:
        """The most recent checkpoint, or None when the run has none."""
        found = self.checkpoints()
        return found[-1] if found else None

    def set_aside(self, checkpoint: Path) -> Path:
        """Rename a damaged checkpoint to `NAME.damaged`, where no reader of checkpoints looks; returns it."""
        aside = checkpoint.with_name(checkpoint.name + ".damaged")
        os.replace(checkpoint, aside)
        return aside

    def prune_checkpoints(self, keep: int) -> None:
        """Delete all but the `keep` most recent checkpoints, and what a crash left of sharded checkpoints
        being written (the caller holds the run's lock: no other process is writing one)."""
        for old in self.checkpoints()[:-keep] if keep > 0 else []:
            _remove(old)
        for partial in self.checkpoints_dir.iterdir() if self.checkpoints_dir.is_dir() else []:
            if PARTIAL_CHECKPOINT_NAME.fullmatch(partial.name):
                _remove(partial)

    def create(
        self, config_toml: str, tokenizer: Tokenizer | None = None, checkpoint: Checkpoint | None = None
    ) -> None:
        """Lay the run out: its `config.toml`; its own copy of its tokenizer, so that the run alone is enough
        to generate (a copy already there is kept: a resumed run never changes it); and, for a run made from
        imported weights, its first checkpoint (with no optimizer state: there is none to import). Each file
        is written atomically."""
        self.path.mkdir(parents=True, exist_ok=True)
        with atomic_write(self.config, "w") as f:
            f.write(config_toml)
        if tokenizer is not None and not self.tokenizer_dir.is_dir():
            tokenizer.save(self.tokenizer_dir)
        if checkpoint is not None:
            checkpoint.save(self.checkpoint(checkpoint.step))

    def lock(self) -> RunLock:
        """Claim the directory for a training process and lock it (`with run.lock(): ...`).

        The directory is created and marked when new; one that holds anything but a run is refused, as is one
        that another process is training in (see `scratchlm.run.lock`)."""
        claim_output_dir(self.path, RUN_KIND)
        return RunLock(self.path)

    def summary(self) -> RunSummary | None:
        """The summary the run wrote when it last stopped, or None when it has not stopped yet."""
        return RunSummary.read(self.summary_file) if self.summary_file.exists() else None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
