"""Faults and mistakes a user meets, tried on the command line the way a user meets them.

Each case runs `python -m scratchlm ...` in a subprocess with one fault injected: a mistaken argument, a
signal, a worker process killed, a damaged file, or a local HTTP server on 127.0.0.1 that answers with the
wrong body. Every case checks the same three things:

1. the exit status (2 for a refused mistake or a reported fault, 130 / 143 for SIGINT / SIGTERM);
2. no traceback is printed (a fault is a message, never a crash);
3. every input, and every output a previous command completed, is byte-identical afterwards.

The inputs are tiny (a fixture text, a 64-token model), so the whole driver takes well under a minute; the
cases that kill worker processes find them through /proc and run on Linux only.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import fixture_path
from test_checkpoint_integrity import damage_a_tensor

from scratchlm.training.config import TrainConfig
from scratchlm.training.trainer import train

LINUX_PROC = Path("/proc/self/stat").exists()
TIMEOUT = 60  # no case may hang: a hang fails the test instead of the suite


# --- running the command line and checking what it left -------------------------------------------------------


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """The command as a terminal's foreground job: SIGINT at its default action, even where these tests run
    as a background job of a non-interactive shell, which ignores it (an ignored signal stays ignored across
    exec, and Python then leaves Ctrl-C ignored too)."""
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "scratchlm", *args],  # a hang shows where it hangs
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, so that a hung command goes with all its workers
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a started command."""
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # faulthandler prints the stack of every thread
        time.sleep(2)
        os.killpg(process.pid, signal.SIGKILL)  # and its workers, which hold its output pipes open
        out, err = process.communicate()
        raise AssertionError(f"the command hung:\n{out}{err}") from None
    return process.returncode, out + err


def scratchlm(*args: str, cwd: Path) -> tuple[int, str]:
    return finish(start(*args, cwd=cwd))


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under `roots` (or the file itself) with its bytes; a run's lock file, which names the
    process that last trained in the run, aside."""
    files: dict[str, bytes] = {}
    for root in roots:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            if path.name != ".lock":
                files[str(path)] = path.read_bytes()
    return files


def held(status: int, output: str, expected_status: int, before: dict[str, bytes], *fragments: str) -> None:
    """The three checks of every case, plus the fragments the message must contain."""
    assert status == expected_status, output
    assert "Traceback" not in output, output
    assert snapshot(*map(Path, before)) == before
    for fragment in fragments:
        assert fragment in output, output


def children(pid: int) -> list[int]:
    """The process ids whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wait_for(condition: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + TIMEOUT
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(fixture_path("tinystories_sample.txt").read_bytes())
    return path


@pytest.fixture
def big_text(tmp_path: Path) -> Path:
    """About 8 MB of text: long enough to encode that a worker can be killed while it works."""
    sample = fixture_path("tinystories_sample.txt").read_bytes()
    path = tmp_path / "big.txt"
    path.write_bytes(sample * (8_000_000 // len(sample)))
    return path


@pytest.fixture
def tokenizer(tmp_path: Path, text: Path) -> Path:
    out = tmp_path / "tok"
    status, output = scratchlm(
        "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(out), cwd=tmp_path
    )
    assert status == 0, output
    return out


# --- outputs that would destroy something ---------------------------------------------------------------------


def test_train_tokenizer_into_a_folder_of_other_files(tmp_path, text):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    before = snapshot(text, out)
    status, output = scratchlm(
        "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(out), cwd=tmp_path
    )
    held(status, output, 2, before, "notes.txt")


def test_train_tokenizer_into_the_current_directory(tmp_path, text):
    before = snapshot(tmp_path)
    status, output = scratchlm(
        "train-tokenizer", "text.txt", "--vocab-size", "300", "--out", ".", cwd=tmp_path
    )
    held(status, output, 2, before, "current directory")


def test_train_tokenizer_into_the_folder_of_its_input(tmp_path, tokenizer):
    # an earlier tokenizer's directory may be replaced, but not when the input lies inside it
    source = tokenizer / "vocab.json"
    before = snapshot(tokenizer)
    status, output = scratchlm(
        "train-tokenizer", str(source), "--vocab-size", "300", "--out", str(tokenizer), cwd=tmp_path
    )
    held(status, output, 2, before, "contains the input")


@pytest.mark.parametrize("name", ["same", "symlink", "hard link", "other text"])
def test_encode_over_its_input_or_another_file(tmp_path, text, tokenizer, name):
    out = {
        "same": text,
        "symlink": tmp_path / "link.npy",
        "hard link": tmp_path / "hard.npy",
        "other text": tmp_path / "other.txt",
    }[name]
    if name == "symlink":
        out.symlink_to(text)
    elif name == "hard link":
        os.link(text, out)
    elif name == "other text":
        out.write_text("the user's other text, named by mistake")
    before = snapshot(text, out, tokenizer)
    status, output = scratchlm("encode", str(text), str(out), "--tokenizer", str(tokenizer), cwd=tmp_path)
    held(status, output, 2, before, str(out))


def test_plot_over_a_metrics_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "time": 0.1, "tokens": 8, "train_loss": 4.0}\n')
    before = snapshot(run)
    status, output = scratchlm("plot", str(run), "--out", str(run / "metrics.jsonl"), cwd=tmp_path)
    held(status, output, 2, before, "a plot is written as .png, .svg, .pdf")


def test_quickstart_into_a_folder_of_other_files(tmp_path):
    out = tmp_path / "project"
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.npy").write_bytes(b"the user's data")
    before = snapshot(out)
    status, output = scratchlm("quickstart", "--small", "--out", str(out), cwd=tmp_path)
    held(status, output, 2, before, "data")


# --- files that name themselves as markup, configs that are not files ---------------------------------------


def test_file_names_with_square_brackets_print_as_written(tmp_path, text, tokenizer):
    (tmp_path / "a[").mkdir()
    missing = "a[/]b.txt"  # a closing tag with nothing to close: rich raised MarkupError on it
    status, output = scratchlm("encode", missing, "o.npy", "--tokenizer", str(tokenizer), cwd=tmp_path)
    held(status, output, 2, snapshot(text, tokenizer), f"input file not found: {missing}")
    status, output = scratchlm(
        "encode", str(text), "ids[bold].npy", "--tokenizer", str(tokenizer), cwd=tmp_path
    )
    held(status, output, 0, snapshot(text, tokenizer), "-> ids[bold].npy")


@pytest.mark.parametrize("config", ["a directory", "not UTF-8"])
def test_config_that_is_not_a_text_file(tmp_path, config):
    path = tmp_path / "config.toml"
    if config == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"[training]\nmax_steps = 1 # \xff\xfe\n")
    before = snapshot(tmp_path)
    status, output = scratchlm("train", "--config", str(path), cwd=tmp_path)
    held(status, output, 2, before, str(path))


# --- worker processes that die, signals to commands with workers -----------------------------------------------


@pytest.mark.skipif(not LINUX_PROC, reason="finds worker processes through /proc")
@pytest.mark.parametrize("command", ["encode", "train-tokenizer"])
def test_a_killed_worker_ends_the_command_with_an_error(tmp_path, big_text, tokenizer, command):
    out = tmp_path / ("ids.npy" if command == "encode" else "tok2")
    args = (
        ["encode", str(big_text), str(out), "--tokenizer", str(tokenizer)]
        if command == "encode"
        else ["train-tokenizer", str(big_text), "--vocab-size", "300", "--out", str(out)]
    )
    before = snapshot(big_text, tokenizer)
    process = start(*args, "--workers", "2", cwd=tmp_path)
    workers = wait_for(lambda: children(process.pid), "the worker processes")
    os.kill(workers[0], signal.SIGKILL)
    status, output = finish(process)
    held(status, output, 2, before, "worker process was killed by SIGKILL")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "text.txt", "tok"]  # nothing partial
    assert not any(alive(pid) for pid in workers)


@pytest.mark.skipif(not LINUX_PROC, reason="finds worker processes through /proc")
def test_sigterm_stops_encode_and_its_workers(tmp_path, big_text, tokenizer):
    before = snapshot(big_text, tokenizer)
    process = start(
        "encode", str(big_text), str(tmp_path / "ids.npy"), "--tokenizer", str(tokenizer), cwd=tmp_path
    )
    workers = wait_for(lambda: children(process.pid), "the worker processes")
    process.send_signal(signal.SIGTERM)
    status, output = finish(process)
    held(status, output, 143, before, "interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["big.txt", "text.txt", "tok"])
    wait_for(lambda: not any(alive(pid) for pid in workers), "the workers to end")


@pytest.mark.skipif(not LINUX_PROC, reason="finds worker processes through /proc")
def test_ctrl_c_in_a_terminal_stops_encode_and_its_workers_quietly(tmp_path, big_text, tokenizer):
    before = snapshot(big_text, tokenizer)
    process = start(
        "encode", str(big_text), str(tmp_path / "ids.npy"), "--tokenizer", str(tokenizer), cwd=tmp_path
    )
    workers = wait_for(lambda: children(process.pid), "the worker processes")
    os.killpg(process.pid, signal.SIGINT)  # a terminal sends Ctrl-C to every process of the foreground group
    status, output = finish(process)
    held(status, output, 130, before, "interrupted")  # and no worker prints a KeyboardInterrupt traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "text.txt", "tok"]
    wait_for(lambda: not any(alive(pid) for pid in workers), "the workers to end")


@pytest.mark.skipif(not LINUX_PROC, reason="finds worker processes through /proc")
def test_sigterm_during_train_tokenizer_leaves_the_earlier_tokenizer(tmp_path, big_text, tokenizer):
    before = snapshot(big_text, tokenizer)
    args = (
        "train-tokenizer",
        str(big_text),
        "--vocab-size",
        "400",
        "--out",
        str(tokenizer),
        "--workers",
        "2",
    )
    process = start(*args, cwd=tmp_path)
    wait_for(lambda: children(process.pid), "the worker processes")
    process.send_signal(signal.SIGTERM)
    status, output = finish(process)
    held(status, output, 143, before, "interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", "text.txt", "tok"]


# --- training: signals, a second process, damaged checkpoints, changed configs --------------------------------

TRAIN_CONFIG = """
[data]
train = "train.npy"
valid = "valid.npy"
[model]
vocab_size = 64
context_length = 16
d_model = 32
num_layers = 2
num_heads = 4
[optimizer]
lr = 1e-2
min_lr = 1e-3
[schedule]
warmup_iters = 2
[training]
batch_size = 8
max_steps = {steps}
device = "cpu"
[eval]
interval = 4
iters = 2
[checkpoint]
interval = 4
keep = 2
[logging]
run_dir = "run"
log_interval = 1
"""


def write_training_inputs(tmp_path: Path, steps: int) -> Path:
    pattern = np.tile(np.arange(64, dtype=np.uint16), 80)
    np.save(tmp_path / "train.npy", pattern)
    np.save(tmp_path / "valid.npy", pattern[:1000])
    config = tmp_path / "config.toml"
    config.write_text(TRAIN_CONFIG.format(steps=steps))
    return config


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 12-step run trained in this process (checkpoints at steps 8 and 12); returns its directory."""
    config = write_training_inputs(tmp_path, steps=12)
    monkeypatch.chdir(tmp_path)
    train(TrainConfig.load(config))
    return tmp_path / "run"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_a_second_trainer_is_refused(tmp_path, signum):
    config = write_training_inputs(tmp_path, steps=1_000_000)
    inputs = snapshot(config, tmp_path / "train.npy", tmp_path / "valid.npy")
    first = start("train", "--config", "config.toml", cwd=tmp_path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, "training to start")

    if signum == signal.SIGTERM:  # once is enough: a second trainer costs seconds of importing torch
        lock = (tmp_path / "run" / ".lock").read_bytes()
        before = {**inputs, **snapshot(tmp_path / "run" / "config.toml")}
        status, output = scratchlm("train", "--config", "config.toml", "--resume", cwd=tmp_path)
        held(status, output, 2, before, f"process {first.pid} on {socket.gethostname()}")
        assert (tmp_path / "run" / ".lock").read_bytes() == lock

    first.send_signal(signum)
    status, output = finish(first)
    held(status, output, 128 + signum, inputs, "interrupted at step")
    step = int(output.split("interrupted at step")[1].split()[0])
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}.pt").is_file()  # the step it stopped at


def test_resume_falls_back_from_a_damaged_checkpoint(finished_run):
    tmp_path = finished_run.parent
    latest = finished_run / "checkpoints" / "step_00000012.pt"
    damage_a_tensor(latest)
    damaged = latest.read_bytes()
    before = snapshot(
        tmp_path / "config.toml", tmp_path / "train.npy", finished_run / "checkpoints" / "step_00000008.pt"
    )
    status, output = scratchlm("train", "--config", "config.toml", "--resume", cwd=tmp_path)
    held(
        status,
        output,
        0,
        before,
        f"checkpoint {Path('run/checkpoints/step_00000012.pt')} is damaged",
        "falling back",
    )
    assert (finished_run / "checkpoints" / "step_00000012.pt.damaged").read_bytes() == damaged  # kept, aside
    assert "finished at step 12" in output


def test_resume_with_a_changed_config_lists_the_difference(finished_run):
    tmp_path = finished_run.parent
    before = snapshot(tmp_path)
    status, output = scratchlm(
        "train", "--config", "config.toml", "--resume", "--set", "optimizer.lr=0.5",
        "--set", "training.max_steps=16", cwd=tmp_path,
    )  # fmt: skip
    held(status, output, 2, before, "optimizer.lr: 0.01 -> 0.5", "--allow-config-change")
    assert "max_steps" not in output  # a longer run is what --resume is for


# --- downloads that bring back the wrong thing ----------------------------------------------------------------


class WrongServer(http.server.BaseHTTPRequestHandler):
    """Answers every request with `body` and `headers` (set on a subclass), whatever was asked."""

    body: bytes = b""
    headers_to_send: dict[str, str] = {}

    def do_GET(self) -> None:
        self.send_response(200)
        for key, value in {"Content-Length": str(len(self.body)), **self.headers_to_send}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Callable[[bytes, dict[str, str]], str]]:
    servers = []

    def serve(body: bytes, headers: dict[str, str]) -> str:
        handler = type("Handler", (WrongServer,), {"body": body, "headers_to_send": headers})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield serve
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


HTML = b"<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n"


@pytest.mark.parametrize(
    ("dataset", "body", "headers", "message"),
    [
        ("tinystories", HTML, {"Content-Type": "text/html; charset=utf-8"}, "sent a web page"),
        ("tinystories", HTML, {"Content-Type": "text/plain"}, "sent a web page"),
        ("owt-sample", b"plain text, not gzip" * 10, {"Content-Type": "application/octet-stream"}, "gzip"),
        ("tinystories", b"", {}, "empty file"),
    ],
    ids=["html", "html as text", "not gzip", "empty"],
)
def test_download_of_the_wrong_body(tmp_path, serve, dataset, body, headers, message):
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("already here")
    before = snapshot(data)
    url = serve(body, headers)
    status, output = scratchlm("download", dataset, "--dir", str(data), "--base-url", url, cwd=tmp_path)
    held(status, output, 2, before, message, "nothing was saved")
    assert sorted(os.listdir(data)) == ["notes.txt"]
