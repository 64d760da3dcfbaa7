"""Atomic file output: a reader never sees a half-written file or directory.

Everything the project writes for later use (tokenizers, token arrays, checkpoints, metrics summaries,
plots) goes through these helpers: the content is written to a temporary name in the same directory and then
renamed over the destination with `os.replace`, which is atomic on POSIX file systems. An interrupted write
leaves at most a stray `*.tmp-*` file, never a truncated output under the real name. A write the file system
refuses (a full disk, a read-only mount, missing permission) removes its temporary file and ends as one
`ScratchlmError` naming the output and the fault (`scratchlm.errors.os_fault`).

Every output also goes to a place of its own. A directory output (a tokenizer, a run, a quickstart or sweep
directory) is created, replaced or added to only when it is missing, empty, or recognisably an earlier output
of the same kind: it holds the marker file `.scratchlm-output` naming that kind, written with the output.
Anything else in the way is refused with one line naming it, before any work is done. No output may be, or
contain, an input of the same command (`check_output_file`, `check_output_dir`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from scratchlm.errors import ScratchlmError, os_fault


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
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        raise os_fault(path, e) or e from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here, or on close
        os.chmod(tmp, _default_mode(0o666))
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        # A fault of the output itself (its file has no name in the error, or the temporary one) names the
        # output; one of another file the body touched (an input it reads) is that file's to report.
        if isinstance(e, OSError) and e.filename in (None, tmp, str(path)):
            raise os_fault(path, e) or e from None
        raise


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, kind: str = "output", previous: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it replaces `path`, which may exist only as an earlier
    output of the same `kind` (see `check_output_dir`); the new directory carries the marker of `kind`."""
    path = Path(path)
    check_output_dir(path, kind, previous=previous)
    _check_parent_writable(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        _write_marker(tmp, kind)
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


OUTPUT_MARKER = ".scratchlm-output"  # in a directory output: the kind of output it is, one line


def check_output_dir(
    path: str | os.PathLike,
    kind: str,
    inputs: Iterable[str | os.PathLike] = (),
    previous: Callable[[Path], bool] | None = None,
) -> None:
    """Refuse, with one line, to write the directory output `path` where that would destroy something else.

    `path` may be missing, empty, or an earlier output of `kind`: marked so, or, for outputs written before
    the marker existed, one that `previous(path)` recognises. It may neither be nor contain one of `inputs`,
    nor the current directory, which replacing it would pull from under the user's shell."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ScratchlmError(f"output {path} exists and is not a directory")
    real = Path(os.path.realpath(path))
    if Path(os.path.realpath(os.curdir)).is_relative_to(real):
        raise ScratchlmError(
            f"output directory {path} is the current directory or contains it; name a new directory instead"
        )
    for source in inputs:
        if Path(os.path.realpath(source)).is_relative_to(real):
            raise ScratchlmError(
                f"output directory {path} contains the input {source}; write the output somewhere else"
            )
    entries = sorted(os.listdir(path)) if path.is_dir() else []
    if not entries or _marker(path) == kind or (previous is not None and previous(path)):
        return
    other = _marker(path)
    if other:
        raise ScratchlmError(
            f"output directory {path} holds a scratchlm {other} output, not a {kind}; choose another directory"
        )
    shown = ", ".join(entries[:3]) + (f", ... ({len(entries)} entries)" if len(entries) > 3 else "")
    raise ScratchlmError(
        f"output directory {path} already holds {shown}, which is not an earlier {kind} output; "
        "choose a new or empty directory (nothing was changed)"
    )


def claim_output_dir(path: str | os.PathLike, kind: str, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """`check_output_dir`, then create the directory (if needed) and mark it as a `kind` output, for
    directories that are written file by file rather than replaced whole."""
    path = Path(path)
    check_output_dir(path, kind, inputs)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScratchlmError(f"cannot create directory {path}: {e.strerror}") from None
    if _marker(path) != kind:
        _write_marker(path, kind)
    return path


def check_output_file(
    path: str | os.PathLike,
    inputs: Iterable[str | os.PathLike] = (),
    previous: Callable[[Path], bool] | None = None,
    what: str = "output",
) -> None:
    """Refuse, with one line, to write the file output `path` over one of `inputs` (by any name: a link
    counts) or, when `previous` is given, over an existing file it does not recognise as an earlier `what`."""
    path = Path(path)
    if path.is_dir():
        raise ScratchlmError(f"output {path} is a directory, expected a file path")
    for source in inputs:
        if os.path.realpath(source) == os.path.realpath(path) or (
            path.exists() and Path(source).exists() and os.path.samefile(source, path)
        ):
            raise ScratchlmError(f"output {path} is the input {source}; writing it would destroy the input")
    if previous is not None and path.exists() and not previous(path):
        raise ScratchlmError(
            f"output {path} already exists and is not {what}; refusing to overwrite it (choose another name)"
        )


def _marker(path: Path) -> str:
    """The kind of output the marker in `path` names; "" when there is none (or it cannot be read)."""
    try:
        return (path / OUTPUT_MARKER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _write_marker(path: Path, kind: str) -> None:
    with atomic_write(path / OUTPUT_MARKER, "w") as f:
        f.write(kind + "\n")


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(values: dict[str, dict[str, Any]], notes: dict[str, str] | None = None) -> str:
    """Write `{section: {key: value}}` as TOML; keys whose value is None are left out (TOML has no null).
    `notes` ("section.key" -> one line of text) are written as comments after their keys."""
    notes = notes or {}
    lines = []
    for section, entries in values.items():
        lines.append(f"[{section}]")
        for key, value in entries.items():
            if value is not None:
                note = notes.get(f"{section}.{key}")
                comment = "  # " + " ".join(note.split()) if note else ""
                lines.append(f"{key} = {toml_value(value)}{comment}")
        lines.append("")
    return "\n".join(lines)


def read_json(path: Path) -> Any:
    """A JSON file's value; a one-line error naming the file when it is missing, not UTF-8 or not JSON."""
    if not path.is_file():
        raise ScratchlmError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ScratchlmError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ScratchlmError(f"{path}, line {e.lineno}: malformed JSON ({e.msg})") from None
