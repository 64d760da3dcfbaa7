"""Helpers shared by the tests: where the public fixtures live, and comparing two training states.

The fixtures ship with the project in `tests/fixtures/` (their origins and licences are in its README.md) and
are read from there only. A missing fixture is a plain test failure, never a skip: a fresh clone has them all.
"""

from __future__ import annotations

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
