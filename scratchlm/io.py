"""Atomic file output: a reader never sees a half-written file or directory.

Everything the project writes for later use (tokenizers, token arrays, checkpoints, metrics summaries,
plots) goes through these helpers: the content is written to a temporary name in the same directory and then
renamed over the destination with `os.replace`, which is atomic on POSIX file systems. An interrupted write
leaves at most a stray `*.tmp-*` file, never a truncated output under the real name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from scratchlm.errors import ScratchlmError


def _check_parent_writable(path: Path) -> None:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScratchlmError(f"cannot create directory {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise ScratchlmError(f"cannot write to {parent}: permission denied")


def _default_mode(kind: int) -> int:
    """Permissions a plain `open()` / `mkdir()` would give (0o666 / 0o777 less the umask): `mkstemp` and
    `mkdtemp` create private 0o600 / 0o700 entries, which would make saved outputs unreadable to others."""
    umask = os.umask(0)
    os.umask(umask)
    return kind & ~umask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it is renamed to `path`, on error removed."""
    path = Path(path)
    _check_parent_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _default_mode(0o666))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `path` (which may already exist)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ScratchlmError(f"output {path} exists and is not a directory")
    _check_parent_writable(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, _default_mode(0o777))
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
