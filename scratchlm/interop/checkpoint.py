"""`scratchlm export --format checkpoint`: a trained model's checkpoint as one scratchlm checkpoint file.

The checkpoint the model was loaded from, a file or a sharded one's directory (consolidated,
`scratchlm.run.load.read_any`), is written again as a single file with every entry kept, so that it resumes,
fine-tunes and loads anywhere a single-file checkpoint does (a machine without the processes that sharded it,
a tool that reads one file). A LoRA run's (`--merge`) is written with its adapters merged into its base's
weights, without the adapters' optimizer state: a whole model, to fine-tune or load anywhere. Like every export, the file is read back and its model must compute the logits of
the model that was loaded (`scratchlm.interop.verify.check_logits`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from scratchlm.errors import ScratchlmError
from scratchlm.interop.formats import ExportResult
from scratchlm.interop.verify import check_logits
from scratchlm.io import check_output_file
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import Checkpoint, read_checkpoint
from scratchlm.run.load import TrainedModel, load_checkpoint, merged, read_any


def export_checkpoint(trained: TrainedModel, out: str | os.PathLike, dtype: str = "f32") -> ExportResult:
    """Write the checkpoint `trained` was loaded from as the single file `out` (see the module docstring)."""
    if dtype != "f32":
        raise ScratchlmError(
            f"--format checkpoint keeps the weights as trained (f32); --dtype {dtype} does not apply"
        )
    out = Path(out)
    check_output_file(out, inputs=[trained.checkpoint], previous=_is_checkpoint_file, what="a checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = read_any(trained.checkpoint)
    if checkpoint.lora is not None:  # --merge: whole weights; the adapters' optimizer state fits them no more
        checkpoint = dataclasses.replace(merged(checkpoint, trained.checkpoint), optimizer=None)
    checkpoint.save(out)
    written = Checkpoint.read(out)
    model = TransformerLM(written.model_config)
    load_checkpoint(written, model)
    difference = check_logits(trained.model.cpu(), model.eval(), f"the model of {out}")
    return ExportResult(out, None, difference, loaded_as="a scratchlm checkpoint", checked_by="scratchlm")


def _is_checkpoint_file(path: Path) -> bool:
    """Whether `path` is a checkpoint file, which an export may replace."""
    try:
        read_checkpoint(path)
    except ScratchlmError:
        return False
    return True
