"""A run stopped by a signal, or whose console went away, loses nothing.

Each case starts the command line as a real process and holds it inside step 5 until the test has done its
part: the reader of its output pipe exits (as `tee` does when Ctrl-C reaches it too) and/or SIGINT, SIGTERM or
SIGHUP arrives. A stopped run must exit with 128 + the signal's number, having saved a checkpoint at step 5,
and `--resume` must end exactly where the uninterrupted run ends. A console that went away with no signal must
not stop the run at all. Either way the run's `log.txt` says what happened.

Before: writing to the dead pipe ended the run with exit status 1 and no checkpoint, SIGHUP killed it with no
checkpoint, and there was no log.txt.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same_state
from test_faults import TIMEOUT, wait_for
from test_trainer import final_state, small_config

from scratchlm.cli import main
from scratchlm.console import ConsoleLog, GuardedStream, console
from scratchlm.experiments.sweep import run_sweep
from scratchlm.run import RunDirectory, StopReason
from scratchlm.training.config import TrainConfig
from scratchlm.training.trainer import train

STEP = 5  # the step inside which each case is held

# `python -m scratchlm ARGS`, held inside step STEP (the first time it is reached) until the file GO exists,
# having created READY: the test acts while the process is known to be training. Only the timing is added.
HELD = """
import sys, time
from pathlib import Path
from scratchlm.training.step import TrainStep

step, ready, go = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
gradients = TrainStep.gradients

def held(self, at, *args, **kwargs):
    if at == step and not ready.exists():
        ready.touch()
        while not go.exists():
            time.sleep(0.01)
    return gradients(self, at, *args, **kwargs)

TrainStep.gradients = held
from scratchlm.cli import main
from scratchlm.console import ConsoleLog, GuardedStream, console
sys.exit(main(sys.argv[4:]))
"""

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


class Held:
    """A command held inside step STEP, its stdout and stderr one pipe (`2>&1 | tee`), read by the test."""

    def __init__(self, tmp_path: Path, *args: str, launcher: tuple[str, ...] = ()) -> None:
        self.ready, self.go = tmp_path / "ready", tmp_path / "go"
        script = tmp_path / "held.py"
        script.write_text(HELD)
        self.read, write = os.pipe()
        self.process = subprocess.Popen(
            [*(launcher or (sys.executable,)), str(script), str(STEP), str(self.ready), str(self.go), *args],
            cwd=tmp_path,
            stdout=write,
            stderr=write,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: Ctrl-C is sent to the group, as a terminal does
            # SIGINT and SIGHUP at their default actions, as in a terminal, even where these tests run as a
            # background job (which ignores SIGINT) or under nohup (which ignores SIGHUP)
            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)],
        )
        os.close(write)
        wait_for(lambda: self.ready.exists() or self.process.poll() is not None, "training to start")
        assert self.process.poll() is None, self.output()

    def close_console(self) -> None:
        """The reader of the pipe exits: every later write of the command fails with EPIPE."""
        os.close(self.read)
        self.read = -1

    def signal(self, signum: int) -> None:
        if signum == signal.SIGINT:  # Ctrl-C: the terminal signals the whole foreground process group
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)

    def finish(self) -> tuple[int, str]:
        """Let it go on; its exit status and what it wrote to the console (nothing once that went away)."""
        self.go.touch()
        try:
            status = self.process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError(f"the command hung:\n{self.output()}") from None
        return status, self.output()

    def output(self) -> str:
        if self.read < 0:
            return ""
        with os.fdopen(self.read, "rb") as pipe:
            self.read = -1
            return pipe.read().decode(errors="replace")


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run of `small_config` (12 steps)."""
    tmp_path = tmp_path_factory.mktemp("straight")
    train(small_config(tmp_path, "straight"))
    return tmp_path / "straight"


def assert_resumes_exactly(config: TrainConfig, straight: Path) -> None:
    """`--resume` of the stopped run ends exactly where the uninterrupted run ended."""
    resumed = train(config, resume=True)
    assert resumed.stopped is StopReason.FINISHED
    expected = RunDirectory(straight).summary()
    assert (resumed.final_train_loss, resumed.final_val_loss) == (
        expected.final_train_loss,
        expected.final_val_loss,
    )
    assert_same_state(final_state(straight), final_state(Path(config.logging.run_dir)))


def assert_stopped_at_step(run: Path, signum: int) -> str:
    """The run saved step STEP and says so in its summary and its log; returns the log."""
    assert RunDirectory(run).latest_checkpoint() == RunDirectory(run).checkpoint(STEP)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (STEP, StopReason.INTERRUPTED.value)
    log = (run / "log.txt").read_text()
    assert f"{signal.Signals(signum).name}: stopping " in log
    assert f"interrupted at step {STEP}" in log
    return log


@pytest.mark.parametrize("console", ["open", "gone"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_saves_the_step_and_resume_ends_at_the_uninterrupted_loss(
    tmp_path, straight, signum, console
):
    config = small_config(tmp_path)
    (tmp_path / "config.toml").write_text(config.to_toml())
    held = Held(tmp_path, "train", "--config", "config.toml")
    if console == "gone":
        held.close_console()
    held.signal(signum)
    status, output = held.finish()
    assert status == 128 + signum, output
    assert "Traceback" not in output
    if console == "open":
        assert "interrupted" in output.splitlines()[-1]
    log = assert_stopped_at_step(tmp_path / "run", signum)
    assert ("stderr went away (EPIPE: Broken pipe)" in log) == (console == "gone")
    assert_resumes_exactly(config, straight)


def test_a_console_that_went_away_does_not_stop_the_run(tmp_path, straight):
    config = small_config(tmp_path)
    (tmp_path / "config.toml").write_text(config.to_toml())
    held = Held(tmp_path, "train", "--config", "config.toml")
    held.close_console()
    status, _ = held.finish()
    assert status == 0  # and no "Exception ignored ... BrokenPipeError" at exit, which would make it 120
    assert RunDirectory(tmp_path / "run").summary().stopped is StopReason.FINISHED
    assert_same_state(final_state(straight), final_state(tmp_path / "run"))
    log = (tmp_path / "run" / "log.txt").read_text().splitlines()
    gone = next(i for i, line in enumerate(log) if "stderr went away (EPIPE: Broken pipe)" in line)
    assert log[gone + 1].startswith(f"step  {STEP}/12 │ loss")  # the lines go on in the log
    assert log[-1].startswith("finished at step 12")


def test_a_hangup_ignored_from_the_start_is_ignored(tmp_path, straight):
    """`nohup scratchlm train ...`: the run outlives the terminal."""
    config = small_config(tmp_path)
    (tmp_path / "config.toml").write_text(config.to_toml())
    held = Held(tmp_path, "train", "--config", "config.toml", launcher=("nohup", sys.executable))
    held.close_console()
    held.signal(signal.SIGHUP)
    status, _ = held.finish()
    assert status == 0
    assert_same_state(final_state(straight), final_state(tmp_path / "run"))


def test_sweep_stops_at_the_step_and_its_rerun_ends_where_an_uninterrupted_sweep_ends(tmp_path):
    config = small_config(tmp_path)
    base = tmp_path / "base.toml"
    base.write_text(config.to_toml())
    axes = ["optimizer.lr=1e-2,3e-2"]
    held = Held(tmp_path, "sweep", str(base), "--set", axes[0], "--out", "sweep")
    held.close_console()
    held.signal(signal.SIGHUP)
    status, _ = held.finish()
    assert status == 128 + signal.SIGHUP
    assert_stopped_at_step(tmp_path / "sweep" / "lr=1e-2", signal.SIGHUP)
    assert not (tmp_path / "sweep" / "lr=3e-2").exists()  # the sweep stopped with its run
    outcome = ("run", "status", "steps", "final_train_loss", "final_val_loss")
    rerun, uninterrupted = (run_sweep(base, axes, tmp_path / out) for out in ("sweep", "straight"))
    assert [[row[key] for key in outcome] for row in rerun] == [
        [row[key] for key in outcome] for row in uninterrupted
    ]


def test_sft_stops_at_the_step_and_resumes_exactly(tmp_path):
    from serve_helpers import tiny_run

    from scratchlm.chat.conversations import write_conversations
    from scratchlm.chat.sft import sft_config
    from scratchlm.chat.tasks import build_tasks

    base = tiny_run(tmp_path / "base", context=96, seed=0)
    train_set, test_set = build_tasks(60, 10, seed=1)
    write_conversations(tmp_path / "train.jsonl", train_set)
    write_conversations(tmp_path / "valid.jsonl", test_set)
    settings = [
        "training.device='cpu'", "training.precision='fp32'", "training.batch_size=4", "training.max_steps=8",
        "eval.interval=4", "eval.iters=1", "checkpoint.interval=4", "logging.log_interval=1",
        "optimizer.lr=1e-3",  # given: no short runs to measure it before the run that is stopped
    ]  # fmt: skip
    files = {"base": base, "train": tmp_path / "train.jsonl", "valid": tmp_path / "valid.jsonl"}
    args = ["--base", str(base), "--data", str(files["train"]), "--valid", str(files["valid"])]
    out = ["--out", str(tmp_path / "sft")]
    held = Held(tmp_path, "sft", *args, *out, *(a for s in settings for a in ("--set", s)))
    held.close_console()
    held.signal(signal.SIGTERM)
    status, _ = held.finish()
    assert status == 128 + signal.SIGTERM
    assert_stopped_at_step(tmp_path / "sft", signal.SIGTERM)

    def config(run: str) -> TrainConfig:
        paths = [f"sft.{key}={json.dumps(str(path))}" for key, path in files.items()]
        return sft_config(None, [*paths, f"logging.run_dir={json.dumps(str(tmp_path / run))}", *settings])

    train(config("straight"))
    assert_resumes_exactly(config("sft"), tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("console", ["open", "gone"])
def test_torchrun_forwards_a_sigterm_and_every_process_stops_at_the_step(tmp_path, straight, console):
    """SLURM's SIGTERM reaches the launcher, which forwards it to the processes (and kills them 30 s later):
    they stop together at the step, rank 0 saves it, and a resumed run ends where one process ends (to float32
    rounding: two processes sum the gradients in another order, see test_ddp.py)."""
    config = small_config(tmp_path)
    (tmp_path / "config.toml").write_text(config.to_toml())
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    held = Held(tmp_path, "train", "--config", "config.toml", launcher=torchrun)
    if console == "gone":
        held.close_console()
    held.signal(signal.SIGTERM)
    status, output = held.finish()
    assert status != 0, output  # the launcher's own status (torch's), not the processes'
    if console == "open":
        assert output.splitlines().count("interrupted") == 2, output  # each process left as a command does
        assert output.count("Traceback") == 1 and output.rstrip().endswith("got signal: 15")  # the launcher's
    log = assert_stopped_at_step(tmp_path / "run", signal.SIGTERM)
    assert ("stderr went away (EPIPE: Broken pipe)" in log) == (console == "gone")
    resume = [*torchrun, "-m", "scratchlm", "train", "--config", "config.toml", "--resume"]
    result = subprocess.run(resume, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT * 3)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = final_state(straight), final_state(tmp_path / "run")
    assert two["iteration"] == one["iteration"] == 12
    for key in one["model"]:
        torch.testing.assert_close(two["model"][key], one["model"][key], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_quickstart_stops_at_the_step_and_its_rerun_finishes(tmp_path):
    held = Held(tmp_path, "quickstart", "--small", "--out", str(tmp_path / "qs"))
    held.close_console()
    held.signal(signal.SIGHUP)
    status, _ = held.finish()
    assert status == 128 + signal.SIGHUP
    assert_stopped_at_step(tmp_path / "qs" / "run", signal.SIGHUP)
    assert main(["quickstart", "--small", "--out", str(tmp_path / "qs")]) == 0  # running it again resumes
    summary = RunDirectory(tmp_path / "qs" / "run").summary()
    assert summary.stopped is StopReason.FINISHED and summary.steps > STEP
    assert (
        f"resuming from {RunDirectory(tmp_path / 'qs' / 'run').checkpoint(STEP)}"
        in (tmp_path / "qs" / "run" / "log.txt").read_text()
    )


def test_a_closed_stream_and_an_unwritable_log_are_given_up_and_the_command_goes_on(tmp_path, capsys):
    closed = io.StringIO()
    closed.close()
    reasons: list[str] = []
    stream = GuardedStream(closed, reasons.append)
    assert stream.write("a line\n") == 7 and not stream.isatty()
    stream.flush()
    assert reasons == ["I/O operation on closed file"]  # once
    (tmp_path / "log.txt").mkdir()  # where the log would go: it cannot be opened
    with ConsoleLog(tmp_path / "log.txt") as log:
        console.print("held")
        log.keep()
        console.print("after")
    assert "warning: cannot write" in capsys.readouterr().err
