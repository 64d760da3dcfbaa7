"""The export formats, one line each in `EXPORT_FORMATS`: `scratchlm export --format` takes its choices and
its help from here, and calls what the line's `build` returns.

A format is one module of this package holding all of it: its `StateDictAdapter` subclass (the format's names
for scratchlm's tensors, their layouts, the architectures it writes) and its export function,
`export(trained, out, dtype) -> ExportResult`. The line here is the format's config (after torchtitan's
`Config.build`): what the command line says about the format, and where its export function is, as
"module:function". `build` imports that module only when the format is used, so the command line's parser,
which reads this registry, imports neither torch nor a format's libraries and `scratchlm --help` answers at
once.

Adding a format: its module, and its line below.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from scratchlm.interop import Architecture

if TYPE_CHECKING:
    from scratchlm.run.load import TrainedModel


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote, for the command to report: the command knows no format, so the format names
    what its reader will see (`loaded_as`)."""

    path: Path
    architecture: Architecture | None  # None: scratchlm's own format, which holds any model as it is
    max_logit_difference: float | None  # None: transformers is not installed, nothing was compared
    loaded_as: str  # what the target reads it as: transformers' class, llama.cpp's architecture
    checked_by: str = "transformers"  # what loaded it back for the comparison of logits


Exporter = Callable[["TrainedModel", str | os.PathLike, str], ExportResult]  # (trained, out, dtype)


@dataclass(frozen=True)
class ExportFormat:
    """One export format, its registry line: `--format NAME` writes, with the function `exporter` names, an
    `output` (a directory or a file) that `target` reads."""

    name: str
    exporter: str  # "module:function", imported by `build`
    target: str  # the program that reads it, for the command's help
    output: Literal["directory", "file"]
    suffix: str = ""  # a file's conventional ending, naming it in `--out`'s help
    adapters: bool = False  # writes a LoRA run's adapters alone (the others write whole models: `--merge`)

    def build(self) -> Exporter:
        module, _, function = self.exporter.partition(":")
        return getattr(importlib.import_module(module), function)


EXPORT_FORMATS: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        ExportFormat("hf", "scratchlm.interop.hf:export_hf", "Hugging Face transformers", "directory"),
        ExportFormat("gguf", "scratchlm.interop.gguf:export_gguf", "llama.cpp", "file", ".gguf"),
        ExportFormat("peft", "scratchlm.interop.peft:export_peft", "peft", "directory", adapters=True),
        ExportFormat(
            "checkpoint", "scratchlm.interop.checkpoint:export_checkpoint", "scratchlm", "file", ".pt"
        ),
    )
}
