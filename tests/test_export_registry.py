"""The registry of export formats (scratchlm/interop/formats.py) is the command line's one list of them: a
format registered there is offered by `scratchlm export --format`, described in its help, and called with the
model the command loaded; hf, gguf and checkpoint (a single-file checkpoint) are registered, each building the public function that writes it."""

from __future__ import annotations

import os
from pathlib import Path

from interop_helpers import make_run, run_cli, scratch_model, small_tokenizer

import scratchlm
from scratchlm import ModelConfig
from scratchlm.interop import LLAMA
from scratchlm.interop.checkpoint import export_checkpoint
from scratchlm.interop.formats import EXPORT_FORMATS, ExportFormat, ExportResult
from scratchlm.run.load import TrainedModel

TINY = ModelConfig(vocab_size=610, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
TOY = ExportFormat("toy", f"{__name__}:export_toy", "a toy reader", "file", ".toy")


def export_toy(trained: TrainedModel, out: str | os.PathLike, dtype: str) -> ExportResult:
    """A format of one text file: the dtype, then each tensor's name and sum."""
    sums = [f"{key} {value.double().sum().item():.6e}" for key, value in trained.model.state_dict().items()]
    Path(out).write_text("\n".join([dtype, *sums]) + "\n")
    return ExportResult(Path(out), LLAMA, 0.0, loaded_as="toy architecture")


def test_the_registry_lists_hf_gguf_peft_and_checkpoint_building_their_exporters():
    from scratchlm.interop.peft import export_peft

    assert list(EXPORT_FORMATS) == ["hf", "gguf", "peft", "checkpoint"]
    assert EXPORT_FORMATS["peft"].build() is export_peft
    assert EXPORT_FORMATS["hf"].build() is scratchlm.export_hf
    assert EXPORT_FORMATS["gguf"].build() is scratchlm.export_gguf
    assert EXPORT_FORMATS["checkpoint"].build() is export_checkpoint


def test_a_registered_format_is_offered_and_called_by_the_command(tmp_path, capsys, monkeypatch):
    model = scratch_model(TINY)
    make_run(tmp_path / "run", model, small_tokenizer())
    argv = ["export", "--run", str(tmp_path / "run"), "--format", "toy", "--out", str(tmp_path / "m.toy")]
    status, _, err = run_cli([*argv, "--dtype", "f16"], capsys)
    assert status == 2 and "invalid choice: 'toy'" in err  # not registered: not offered

    monkeypatch.setitem(EXPORT_FORMATS, TOY.name, TOY)
    status, out, _ = run_cli(["export", "--help"], capsys)
    assert status == 0
    help_text = " ".join(out.split())  # argparse wraps lines
    assert "--format {hf,gguf,peft,checkpoint,toy}" in help_text
    assert (
        "gguf: a file; peft: a directory; checkpoint: a file; toy: a file" in help_text
        and "or .toy file to write" in help_text
    )
    status, _, err = run_cli([*argv, "--dtype", "f16"], capsys)
    assert status == 0, err
    assert f"wrote {tmp_path / 'm.toy'} (toy architecture, f16)" in " ".join(err.split())
    written = (tmp_path / "m.toy").read_text().splitlines()
    expected = [f"{k} {v.double().sum().item():.6e}" for k, v in model.state_dict().items()]
    assert written == ["f16", *expected]  # the model the run holds, as the command loaded it
