"""A corpus of real text that needs no download: the Python standard library's own source files.

Every Python installation carries several megabytes of carefully written English-and-code text in its standard
library (about 11 MB without the test suites, about 31 MB with them, for CPython 3.11). Each source file is one
document; documents are joined with `<|endoftext|>`, the convention of the datasets the specification trains on.
Held-out validation documents are whole files, chosen by a hash of their path, so the split is the same on every
machine with the same Python version and never cuts a file in two.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scratchlm.io import atomic_write
from scratchlm.tokenizer import END_OF_TEXT

# Parts of the standard library that are test suites or vendored code rather than library source.
TEST_DIRS = {"test", "tests", "idle_test", "lib2to3", "idlelib", "site-packages"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(include_tests: bool = False) -> Iterator[tuple[str, str]]:
    """`(relative path, text)` of every non-empty UTF-8 `.py` file of the standard library, in a fixed order."""
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        parts = set(relative.split("/")[:-1])
        if "site-packages" in parts or (not include_tests and parts & TEST_DIRS):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a few test files are deliberately not UTF-8
        if text.strip() and END_OF_TEXT not in text:  # empty files (many `__init__.py`) are no documents
            yield relative, text


def is_validation(relative_path: str, valid_percent: int) -> bool:
    """Deterministic held-out choice: the file's CRC-32 decides, independent of file order or count."""
    return zlib.crc32(relative_path.encode()) % 100 < valid_percent


@dataclass(frozen=True)
class Corpus:
    train: Path
    valid: Path
    train_documents: int
    valid_documents: int


def build_corpus(
    out_dir: str | Path,
    *,
    include_tests: bool = False,
    valid_percent: int = 5,
    max_bytes: int | None = None,
) -> Corpus:
    """Write `train.txt` and `valid.txt` (documents joined by `<|endoftext|>`) into `out_dir`.

    `max_bytes` caps the training file (validation is capped at the same share of it), for small runs.
    """
    out_dir = Path(out_dir)
    train_docs: list[str] = []
    valid_docs: list[str] = []
    train_bytes = valid_bytes = 0
    valid_cap = None if max_bytes is None else max(1, max_bytes * valid_percent // 100)
    separator = len(END_OF_TEXT.encode("utf-8"))
    for relative, text in stdlib_documents(include_tests):
        size = len(text.encode("utf-8"))
        if is_validation(relative, valid_percent):
            added = size + (separator if valid_docs else 0)
            if valid_cap is None or valid_bytes + added <= valid_cap:
                valid_docs.append(text)
                valid_bytes += added
        else:
            added = size + (separator if train_docs else 0)
            if max_bytes is None or train_bytes + added <= max_bytes:
                train_docs.append(text)
                train_bytes += added
    for name, docs in (("train.txt", train_docs), ("valid.txt", valid_docs)):
        with atomic_write(out_dir / name, "w") as f:
            f.write(END_OF_TEXT.join(docs))
    return Corpus(out_dir / "train.txt", out_dir / "valid.txt", len(train_docs), len(valid_docs))
