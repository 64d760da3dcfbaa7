"""Helpers shared by the tests: where the public fixtures live, comparing two training states, and training
runs under torchrun and what they wrote.

The fixtures ship with the project in `tests/fixtures/` (their origins and licences are in its README.md) and
are read from there only. A missing fixture is a plain test failure, never a skip: a fresh clone has them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = PROJECT_ROOT / "tests" / "fixtures"


def fixtures_dir() -> Path:
    return FIXTURES_DIR


def fixture_path(name: str) -> Path:
    """The path of fixture `name` in `tests/fixtures/`; a missing file fails the test that asked for it."""
    path = FIXTURES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"fixture {name} is missing from {FIXTURES_DIR} (the project ships it there)")
    return path


def assert_same_state(a: dict, b: dict) -> None:
    assert a["iteration"] == b["iteration"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            other = b["optimizer"]["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def assert_same_gradients(a: torch.nn.Module, b: torch.nn.Module, atol: float, rtol: float) -> None:
    """Every parameter of `a` has the gradient of the same parameter of `b` (the same architecture)."""
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=name)


def torchrun_command(
    config_path: Path,
    run_dir: Path,
    *sets: str,
    processes: int = 2,
    resume: bool = False,
    launcher: tuple[str, ...] = ("--standalone",),
) -> list[str]:
    """`torchrun LAUNCHER --nproc_per_node PROCESSES -m scratchlm train --config CONFIG_PATH [--resume]`,
    training into `run_dir` with `section.key=value` overrides `sets`, as users launch it (`launcher`: the
    rendezvous flags, one machine by default)."""
    return [
        sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc_per_node", str(processes),
        "-m", "scratchlm", "train", "--config", str(config_path), "--set", f"logging.run_dir={run_dir}",
        *(arg for value in sets for arg in ("--set", value)), *(["--resume"] if resume else []),
    ]  # fmt: skip


# One thread a process: the tests' processes share two cores.
TORCHRUN_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun_train(
    config_path: Path, run_dir: Path, *sets: str, processes: int = 2, resume: bool = False
) -> str:
    """`torchrun_command` run on this machine's CPU (Gloo) to its end. Fails the test if it fails; returns its
    stderr (the console)."""
    command = torchrun_command(config_path, run_dir, *sets, processes=processes, resume=resume)
    result = subprocess.run(command, env=TORCHRUN_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def run_metrics(run_dir: Path, key: str) -> list[float]:
    """The values of `key` in the records of `run_dir/metrics.jsonl`, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r[key] for r in map(json.loads, lines) if key in r]


def sft_test_config(root: Path, base: Path, run: str, *overrides: str):
    """A fine-tuning config of `base` on ROOT/train.jsonl and ROOT/valid.jsonl, trained in ROOT/RUN on the CPU
    in fp32 with a record every step, then `overrides` (`section.key=value`)."""
    from scratchlm.chat.sft import sft_config

    settings = [
        f"sft.base={json.dumps(str(base))}",
        f"sft.train={json.dumps(str(root / 'train.jsonl'))}",
        f"sft.valid={json.dumps(str(root / 'valid.jsonl'))}",
        f"logging.run_dir={json.dumps(str(root / run))}",
        "training.device='cpu'",
        "training.precision='fp32'",
        "logging.log_interval=1",
    ]
    return sft_config(None, [*settings, *overrides])


def last_checkpoint(run_dir: Path) -> dict:
    """The newest checkpoint of `run_dir` as the dict a single file holds; a sharded one (a directory, as
    `training.parallel = "fsdp"` writes) consolidated in this process."""
    from scratchlm.run.load import read_any

    path = sorted((run_dir / "checkpoints").iterdir())[-1]
    if path.is_dir():
        return read_any(path).to_dict()
    return torch.load(path, weights_only=True)


def scratchlm_command(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m scratchlm ARGS` as a user runs it, without standard input; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "scratchlm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def settled(disagreements: Callable[[], list], rounds: int = 3) -> list:
    """What `disagreements()` (a measurement against an independent timing) finds, measured again, up to
    `rounds` times in all, while it finds something: a neighbour's burst of work (the suite runs on two
    workers) skews one round, a wrong formula every round."""
    found = disagreements()
    for _ in range(rounds - 1):
        if not found:
            break
        found = disagreements()
    return found


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
