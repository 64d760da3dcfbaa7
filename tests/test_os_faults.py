"""Faults the operating system reports while a command writes: a full disk, a read-only file system, a
directory the user may not write. Each is injected as the OSError the kernel would give, at the call that
would meet it, and each must end the command with exit status 2 and one line that names the path and the
fault: never a traceback, never a partial file under a name that could pass for a complete one, and nothing
that an earlier command completed is lost."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from test_trainer import small_config

from scratchlm.cli import main
from scratchlm.data import tokens as tokens_module
from scratchlm.errors import DivergedError, ScratchlmError
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.run import Checkpoint, RunDirectory, StopReason
from scratchlm.run import lock as lock_module
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.trainer import train

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc")

MESSAGES = {
    errno.ENOSPC: "no space left on device",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}


class _FullFile:
    """A file on a disk that fills up after `room` bytes: the write that would pass it fails with ENOSPC."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, name_prefix: str, room: int = 1000) -> None:
    """Files opened with `os.fdopen` whose (temporary) name starts with `name_prefix` meet a full disk."""
    real_fdopen = os.fdopen

    def fdopen(fd, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        return _FullFile(file, room) if name.startswith(name_prefix) else file

    monkeypatch.setattr(os, "fdopen", fdopen)


def one_line_error(capsys: pytest.CaptureFixture, status: int) -> str:
    out, err = capsys.readouterr()
    text = (out + err).strip()
    assert status == 2, text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors == [text.splitlines()[-1]], text  # the command's progress, then one line of error
    return errors[0]


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_full_disk_while_encode_writes_leaves_the_earlier_output(tmp_path, monkeypatch, capsys):
    tokenizer = tmp_path / "tok"
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tokenizer)
    text = tmp_path / "input.txt"
    text.write_text("Once upon a time there was a cat. " * 2000)
    output = tmp_path / "out.npy"
    np.save(output, np.arange(5, dtype=np.uint16))  # an earlier output: a failed run must not lose it
    before = files_under(tmp_path)

    fill_disk(monkeypatch, ".out.npy.tmp-")
    status = main(["encode", str(text), str(output), "--tokenizer", str(tokenizer), "--workers", "1"])
    message = one_line_error(capsys, status)
    assert f"cannot write {output}: no space left on device" in message
    assert files_under(tmp_path) == before  # no partial output, no temporary file


def test_a_full_disk_while_a_checkpoint_is_written_keeps_the_earlier_ones(tmp_path, monkeypatch, capsys):
    config = small_config(tmp_path, eval={"interval": 0, "iters": 0})
    (tmp_path / "config.toml").write_text(config.to_toml())
    run = RunDirectory(tmp_path / "run")
    real_save = Checkpoint.save

    def save_then_fill_the_disk(checkpoint, path):  # the step-4 checkpoint fits; the disk is full after it
        real_save(checkpoint, path)
        fill_disk(monkeypatch, ".step_")

    monkeypatch.setattr(Checkpoint, "save", save_then_fill_the_disk)
    status = main(["train", "--config", str(tmp_path / "config.toml")])
    message = one_line_error(capsys, status)
    assert f"cannot write {run.checkpoint(8)}: no space left on device" in message
    assert os.listdir(run.checkpoints_dir) == ["step_00000004.pt"]  # nothing partial beside it
    assert Checkpoint.read(run.checkpoint(4)).step == 4


def test_a_full_disk_reported_by_torch_save_is_the_same_one_line_error(tmp_path, monkeypatch):
    # torch.save hides the OSError of a failed write inside a RuntimeError; the message must not.

    checkpoint = Checkpoint.of(TransformerLM.from_config(small_config(tmp_path).model), 3)
    fill_disk(monkeypatch, ".ck.pt.tmp-", room=200)
    with pytest.raises(ScratchlmError, match=r"^cannot write .*ck\.pt: no space left on device$"):
        checkpoint.save(tmp_path / "ck.pt")
    assert sorted(os.listdir(tmp_path)) == ["train.npy", "valid.npy"]


@pytest.mark.parametrize("fault", [errno.EROFS, errno.EACCES])
def test_resume_into_an_unwritable_run_directory(tmp_path, monkeypatch, capsys, fault):
    config = small_config(tmp_path, eval={"interval": 0, "iters": 0}, training={"max_steps": 4})
    train(config)
    (tmp_path / "config.toml").write_text(config.to_toml())
    run = tmp_path / "run"
    before = files_under(run)
    real_open = open

    def open_on_a_readonly_mount(path, *args, **kwargs):
        if str(path).startswith(str(run)):
            raise OSError(fault, os.strerror(fault), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(lock_module, "open", open_on_a_readonly_mount, raising=False)
    status = main(
        ["train", "--config", str(tmp_path / "config.toml"), "--resume", "--set", "training.max_steps=8"]
    )
    message = one_line_error(capsys, status)
    assert f"cannot write {run / '.lock'}: {MESSAGES[fault]}" in message
    assert files_under(run) == before


def test_a_resumed_run_that_diverges_says_so_in_its_summary(tmp_path, monkeypatch):
    config = small_config(tmp_path, eval={"interval": 0, "iters": 0}, training={"max_steps": 4})
    assert train(config).stopped is StopReason.FINISHED
    assert RunDirectory(tmp_path / "run").summary().stopped is StopReason.FINISHED

    monkeypatch.setattr(
        tokens_module,
        "cross_entropy",
        lambda logits, targets, ignore=None: cross_entropy(logits, targets, ignore) * np.nan,
    )
    longer = small_config(tmp_path, eval={"interval": 0, "iters": 0}, training={"max_steps": 8})
    with pytest.raises(DivergedError):
        train(longer, resume=True)
    summary = RunDirectory(tmp_path / "run").summary()
    assert summary.stopped is StopReason.DIVERGED and summary.steps > 4


def test_train_refused_for_bad_data_leaves_no_run_directory(tmp_path, capsys):
    config = small_config(tmp_path, model={"vocab_size": 32})  # the data holds ids up to 63
    (tmp_path / "config.toml").write_text(config.to_toml())
    message = one_line_error(capsys, main(["train", "--config", str(tmp_path / "config.toml")]))
    assert "the model's vocabulary is 0..31" in message
    assert not (tmp_path / "run").exists()
