"""A worker process that dies ends `encode` and BPE training with an error that says how it died, never a
hang, and leaves no partial output. (With `multiprocessing.Pool` both waited forever for the dead worker's
task; an alarm turns such a hang into a failure here.)"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import fixture_path

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import encode_file as encode_module
from scratchlm.tokenizer import train as train_module
from scratchlm.tokenizer.encode_file import encode_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import count_pretokens, train_bpe


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    def hung(signum, frame):
        raise AssertionError(f"still waiting after {seconds} s: a dead worker hung the pool")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def killed(*args: object) -> None:
    """A worker's task that dies as the out-of-memory killer would end it."""
    os.kill(os.getpid(), signal.SIGKILL)


def exits(*args: object) -> None:
    os._exit(3)


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(fixture_path("tinystories_sample.txt").read_bytes() * 20)
    return path


@pytest.mark.parametrize(
    ("task", "how"), [(killed, "was killed by SIGKILL"), (exits, "exited with status 3")]
)
def test_encode_with_a_dead_worker_fails_and_writes_nothing(tmp_path, text, monkeypatch, task, how):
    vocab, merges = train_bpe(text, 300, ["<|endoftext|>"], workers=1)
    tokenizer = Tokenizer(vocab, merges, ["<|endoftext|>"])
    monkeypatch.setattr(encode_module, "_encode_chunk", task)  # forked workers see the patched module
    with (
        no_hang(),
        pytest.raises(ScratchlmError, match=f"encoding .*text.txt failed, .* a worker process {how}"),
    ):
        encode_file(tokenizer, text, tmp_path / "ids.npy", workers=2, show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_bpe_training_with_a_dead_worker_fails(text, monkeypatch):
    monkeypatch.setattr(train_module, "_count_task_in_worker", killed)
    with (
        no_hang(),
        pytest.raises(ScratchlmError, match="pre-tokenizing .* failed: a worker process was killed"),
    ):
        count_pretokens(text, ["<|endoftext|>"], workers=2, chunk_size=4096)


def test_an_error_in_a_worker_still_reaches_the_caller(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good text " * 1000 + b"\xff" + b" more" * 1000)
    with no_hang(), pytest.raises(ScratchlmError, match="not valid UTF-8 at byte offset 10000"):
        count_pretokens(path, [], workers=2, chunk_size=1024)
