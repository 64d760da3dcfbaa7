"""Helpers shared by the tests: where the public fixtures live.

Fixtures are read in place from `$SCRATCHLM_FIXTURES` or `../shared/fixtures` beside the project. Outside CI a
missing fixture skips the test that needs it (a user's fresh clone has none); under `CI=true` it is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def fixtures_dir() -> Path:
    env = os.environ.get("SCRATCHLM_FIXTURES")
    return Path(env) if env else PROJECT_ROOT.parent / "shared" / "fixtures"


def fixture_path(name: str) -> Path:
    """The path of fixture `name`; skips the test (fails under CI) when it is absent."""
    path = fixtures_dir() / name
    if not path.exists():
        message = f"fixture {name} not found in {fixtures_dir()} (set SCRATCHLM_FIXTURES)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path
