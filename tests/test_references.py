"""Every document a comment cites can be found: the code speaks of "the handout" or "the specification" only in
files that name it once in full (the public CS336 assignment-1 handout, spring 2025), and of no section numbers
of a document the repository does not hold."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("scratchlm", "benchmarks", "tests") for p in (ROOT / folder).rglob("*.py"))
FULL_NAME = "CS336 assignment-1 handout"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_citations_name_the_document(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    if path.name == Path(__file__).name:
        return
    assert not re.search(r"\bSPEC\b", text), "cites SPEC, which is not in the repository"
    if re.search(r"\b(handout|specification)\b", text, re.IGNORECASE):
        assert FULL_NAME in text, f"speaks of the handout or specification without naming the {FULL_NAME}"
