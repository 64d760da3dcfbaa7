"""One training process per run directory: a second one is refused with the holder's pid and host, and a
crashed holder leaves no stale lock. (Before the lock, two trainers in one directory both ran, writing over
each other's checkpoints and metrics.)"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer import small_config

from scratchlm.errors import ScratchlmError
from scratchlm.io import OUTPUT_MARKER
from scratchlm.run import RunDirectory
from scratchlm.run.lock import LOCK_FILE, RunLock
from scratchlm.training.trainer import train

HOLD = """
import sys, time
from scratchlm.run import RunDirectory
with RunDirectory(sys.argv[1]).lock():
    print("locked", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding the lock of `tmp_path / "run"` (killed with SIGKILL at the end)."""
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "locked\n"
    yield process
    process.kill()
    process.wait()


def test_a_second_process_is_refused_with_the_holders_pid_and_host(tmp_path, holder):
    message = f"in use: process {holder.pid} on {socket.gethostname()}"
    with pytest.raises(ScratchlmError, match=message), RunLock(tmp_path / "run"):
        pass


def test_training_in_a_locked_run_directory_is_refused_and_changes_nothing(tmp_path, holder):
    with pytest.raises(ScratchlmError, match=f"process {holder.pid}"):
        train(small_config(tmp_path))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_FILE, OUTPUT_MARKER]


def test_a_killed_holder_leaves_no_stale_lock(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "run" / LOCK_FILE).read_text().startswith(f"{holder.pid}@")  # the file stays...
    with RunLock(tmp_path / "run"):  # ...but the lock went with the process
        pass
    summary = train(small_config(tmp_path, training={"max_steps": 2}))
    assert summary.steps == 2


def test_the_lock_is_released_when_training_ends(tmp_path):
    train(small_config(tmp_path, training={"max_steps": 1}))
    with RunDirectory(tmp_path / "run").lock():
        pass
