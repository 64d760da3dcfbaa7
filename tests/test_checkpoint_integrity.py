"""Checkpoints carry a checksum of their content, checked when read; `--resume` falls back from a damaged
latest checkpoint to the newest intact one. (Before, damaged tensor bytes loaded without a word and training
went on from garbage.)"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import assert_same_state, final_state, small_config

from scratchlm.errors import ScratchlmError
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.checkpoint import CHECKSUM_KEY, read_checkpoint, save_checkpoint
from scratchlm.run.load import load_trained
from scratchlm.training.optim import AdamW
from scratchlm.training.trainer import train


def damage_a_tensor(checkpoint: Path) -> None:
    """Flip bytes in the middle of the largest tensor's data, leaving the file's structure (the zip archive,
    the pickled index) intact: what a bad disk block or a bit flip in transit does."""
    with zipfile.ZipFile(checkpoint) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(checkpoint, "r+b") as f:
        f.seek(info.header_offset + 26)  # the local header's name and extra-field lengths
        name_length, extra_length = np.frombuffer(f.read(4), dtype="<u2")
        f.seek(info.header_offset + 30 + int(name_length) + int(extra_length) + info.file_size // 2)
        data = f.read(8)
        f.seek(-8, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def tiny_checkpoint(path: Path) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM.from_config(
        ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    save_checkpoint(model, AdamW(model.parameters()), 3, path, note=["plain", 1.5, (2, 3)])
    return model


def test_damaged_tensor_bytes_are_reported_by_name(tmp_path):
    path = tmp_path / "c.pt"
    tiny_checkpoint(path)
    assert read_checkpoint(path)["iteration"] == 3
    damage_a_tensor(path)
    torch.load(path, weights_only=True)  # the damage is invisible to the file format...
    with pytest.raises(ScratchlmError, match=f"checkpoint {path} is damaged"):
        read_checkpoint(path)  # ...but not to the checksum


def test_the_checksum_covers_plain_values_and_survives_a_round_trip_through_memory(tmp_path):
    buffer = io.BytesIO()
    torch.manual_seed(0)
    model = TransformerLM.from_config(
        ModelConfig(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2)
    )
    save_checkpoint(model, AdamW(model.parameters()), 7, buffer, note="x")
    state = read_checkpoint(io.BytesIO(buffer.getvalue()))
    assert state["iteration"] == 7 and CHECKSUM_KEY not in state  # checked and removed
    raw = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    raw["iteration"] = 8  # a changed plain value...
    tampered = io.BytesIO()
    torch.save(raw, tampered)
    with pytest.raises(ScratchlmError, match="is damaged"):  # ...is caught as well as a changed tensor
        read_checkpoint(io.BytesIO(tampered.getvalue()))


def test_a_checkpoint_written_before_checksums_still_loads(tmp_path):
    path = tmp_path / "old.pt"
    model = tiny_checkpoint(path)
    state = torch.load(path, weights_only=True)
    del state[CHECKSUM_KEY]
    torch.save(state, path)
    loaded = read_checkpoint(path)
    assert torch.equal(loaded["model"]["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_generate_reports_a_damaged_checkpoint(tmp_path):
    train(small_config(tmp_path, training={"max_steps": 4}))
    latest = tmp_path / "run" / "checkpoints" / "step_00000004.pt"
    damage_a_tensor(latest)
    with pytest.raises(ScratchlmError, match="step_00000004.pt is damaged"):
        load_trained(tmp_path / "run")


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_continues_exactly(tmp_path, capsys):
    train(small_config(tmp_path, "straight"))
    config = small_config(tmp_path, "damaged", training={"max_steps": 10})
    train(config)  # checkpoints at steps 8 and 10
    checkpoints = tmp_path / "damaged" / "checkpoints"
    damage_a_tensor(checkpoints / "step_00000010.pt")
    damaged = (checkpoints / "step_00000010.pt").read_bytes()
    capsys.readouterr()
    train(small_config(tmp_path, "damaged"), resume=True)  # 12 steps: a longer run may always resume
    err = capsys.readouterr().err
    assert f"checkpoint {checkpoints / 'step_00000010.pt'} is damaged" in err
    assert "falling back to the newest intact checkpoint" in err and "resuming from" in err
    assert (checkpoints / "step_00000010.pt.damaged").read_bytes() == damaged  # set aside, not lost
    assert_same_state(final_state(tmp_path / "straight"), final_state(tmp_path / "damaged"))


def test_resume_with_every_checkpoint_damaged_is_refused(tmp_path):
    train(small_config(tmp_path, training={"max_steps": 8}))
    for path in (tmp_path / "run" / "checkpoints").iterdir():
        damage_a_tensor(path)
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(
        ScratchlmError, match=r"no intact checkpoint .* \(2 damaged, the newest step_00000008.pt\)"
    ):
        train(small_config(tmp_path), resume=True)
    assert {
        p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"
    } == before


def test_a_refused_resume_leaves_even_a_damaged_checkpoint_where_it_was(tmp_path):
    train(small_config(tmp_path, training={"max_steps": 8}))
    damage_a_tensor(tmp_path / "run" / "checkpoints" / "step_00000008.pt")
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ScratchlmError, match="optimizer.lr"):
        train(small_config(tmp_path, optimizer={"lr": 0.5}), resume=True)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == names
