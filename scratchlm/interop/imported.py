"""A model read from another format, written as a scratchlm run directory: what `import-hf` and `import-gguf`
share. Each format's module reads its files into a scratchlm model and tokenizer; this module checks the output
first, before any reading, and lays the run out in a temporary directory beside it that takes its name only when
everything is written, so that no import leaves half a run behind:

    RUN/checkpoints/step_00000000.pt   the weights (float32), model_config, tokenizer_fingerprint, imported_from
    RUN/tokenizer/                     the tokenizer, as `Tokenizer.save` writes it (the chat template too)
    RUN/config.toml                    a training config to fine-tune from: [data] tokenizer, [model],
                                       [training] init_from (add data.train, data.valid and a budget)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_directory, to_toml
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import Checkpoint
from scratchlm.run.directory import RUN_KIND, RunDirectory
from scratchlm.tokenizer.tokenizer import Tokenizer

Reader = Callable[[Path], tuple[TransformerLM, Tokenizer | None]]


def import_run(source: str | os.PathLike, out: str | os.PathLike, read: Reader, command: str) -> Path:
    """Read `source` with `read` (a format's reader: the model, in eval mode, and its tokenizer or None) and
    write it as the run directory `out` (new, or empty); returns `out`. `command` names the import in the
    run's config.toml."""
    source, out = Path(source), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # not even an earlier run: it would be lost
        raise ScratchlmError(f"output {out} exists and is not empty; choose a new run directory")
    model, tokenizer = read(source)
    if tokenizer is None:
        console.print(f"warning: {source} has no tokenizer; give generate a --tokenizer DIR")
    final = out.resolve()
    # A run directory as training leaves one, at step 0, with no optimizer state: there is none to import,
    # and `training.init_from` starts a fresh one anyway.
    checkpoint = Checkpoint.of(
        model,
        0,
        tokenizer_fingerprint=None if tokenizer is None else tokenizer.fingerprint,
        imported_from=str(source.resolve()),
    )
    settings: dict[str, dict[str, Any]] = {
        "model": model.config.to_dict(),
        "training": {"init_from": str(final)},
    }
    if tokenizer is not None:
        settings = {"data": {"tokenizer": str(RunDirectory(final).tokenizer_dir)}, **settings}
    header = (
        f"# Imported from {source.resolve()} by `scratchlm {command}`. To fine-tune, add the\n"
        "# data and a budget: --set data.train=... --set data.valid=... --set training.max_steps=...\n"
    )
    with atomic_directory(out, RUN_KIND) as tmp:
        RunDirectory(tmp).create(header + to_toml(settings), tokenizer, checkpoint)
    return out
