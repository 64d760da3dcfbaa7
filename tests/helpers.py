"""Helpers shared by the tests: where the public fixtures live.

The fixtures ship with the project in `tests/fixtures/` (their origins and licences are in its README.md) and
are read from there only. A missing fixture is a plain test failure, never a skip: a fresh clone has them all.
"""

from __future__ import annotations

from pathlib import Path

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
