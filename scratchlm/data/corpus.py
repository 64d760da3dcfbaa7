"""Corpora for the quickstart: the Python standard library's own source files (no download), or the user's text.

Every Python installation carries several megabytes of carefully written English-and-code text in its standard
library (about 11 MB without the test suites, about 31 MB with them, for CPython 3.11). Each source file is one
document; documents are joined with `<|endoftext|>`, the convention of the datasets of the CS336 assignment-1 handout.
Held-out validation documents are whole files, chosen by a hash of their path, so the split is the same on every
machine with the same Python version and never cuts a file in two.

`build_text_corpus` does the same for text files the user names (`scratchlm quickstart --text PATH`): each
file's documents are its parts between `<|endoftext|>` markers, or the whole file when it has none, and a
document goes to validation when the CRC-32 of its text says so (identical documents land on the same side).
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scratchlm.errors import ScratchlmError
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


def text_files(paths: list[str | Path]) -> list[Path]:
    """The files `paths` names: each file itself, each directory's files (recursively, sorted, hidden ones
    skipped); a clear error for a path that does not exist or a directory without files."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                f
                for f in path.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
            )
            if not found:
                raise ScratchlmError(f"text directory {path} has no files")
            files.extend(found)
        else:
            raise ScratchlmError(f"text file {path} not found")
    return files


def read_text_file(path: Path) -> str:
    """The file's UTF-8 text; a one-line error naming the file when it is empty, binary or not UTF-8."""
    data = path.read_bytes()
    if b"\0" in data:  # text never holds NUL bytes; images, archives and executables nearly always do
        raise ScratchlmError(f"text file {path} looks binary (it contains NUL bytes); expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScratchlmError(f"text file {path} is not UTF-8 (invalid byte at offset {e.start})") from None
    if not text.strip():
        raise ScratchlmError(f"text file {path} is empty")
    return text


def build_text_corpus(
    paths: list[str | Path], out_dir: str | Path, *, valid_percent: int = 5, max_bytes: int | None = None
) -> Corpus:
    """Write `train.txt` and `valid.txt` (documents joined by `<|endoftext|>`) from the user's text files.

    About `valid_percent` of the documents, chosen by the CRC-32 of their text, are held out. When that leaves
    either side empty (a handful of documents), the last `valid_percent` of the text, cut at a line break, is
    held out instead. `max_bytes` caps both sides as in `build_corpus`."""
    documents = []
    for path in text_files(paths):
        parts = read_text_file(path).split(END_OF_TEXT)
        documents += [part for part in parts if part.strip()]
    train_docs = [d for d in documents if zlib.crc32(d.encode()) % 100 >= valid_percent]
    valid_docs = [d for d in documents if zlib.crc32(d.encode()) % 100 < valid_percent]
    if not train_docs or not valid_docs:
        joined = END_OF_TEXT.join(documents)
        cut = int(len(joined) * (100 - valid_percent) / 100)
        cut = joined.rfind("\n", 0, cut) + 1 or cut  # at a line break, if there is one before it
        train_docs, valid_docs = [joined[:cut]], [joined[cut:]]
        if not train_docs[0].strip() or not valid_docs[0].strip():
            raise ScratchlmError("the text is too short to hold out a validation part; give more text")
    if max_bytes is not None:
        train_docs = _capped(train_docs, max_bytes)
        valid_docs = _capped(valid_docs, max(1, max_bytes * valid_percent // 100))
    for name, docs in (("train.txt", train_docs), ("valid.txt", valid_docs)):
        with atomic_write(Path(out_dir) / name, "w") as f:
            f.write(END_OF_TEXT.join(docs))
    return Corpus(Path(out_dir) / "train.txt", Path(out_dir) / "valid.txt", len(train_docs), len(valid_docs))


def _capped(documents: list[str], max_bytes: int) -> list[str]:
    """The leading documents that fit in `max_bytes` with their separators; at least the first, cut to fit."""
    kept, size = [], 0
    for document in documents:
        added = len(document.encode()) + (len(END_OF_TEXT.encode()) if kept else 0)
        if size + added > max_bytes:
            break
        kept.append(document)
        size += added
    return kept or [documents[0].encode()[:max_bytes].decode("utf-8", errors="ignore")]
