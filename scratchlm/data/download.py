"""The datasets of the CS336 assignment-1 handout over HTTP: resumable, size-checked, decompressed, written atomically.

A download streams into `NAME.part` beside its destination. If it is interrupted (network error, Ctrl-C), the
next attempt asks the server for the rest with an HTTP `Range: bytes=N-` header and appends; a server that
answers `200` instead of `206` (it ignores ranges) sends the whole file again, so the `.part` file is started
afresh. The expected size comes from `Content-Length` (200) or the total of `Content-Range` (206); only a
`.part` file of exactly that size is renamed to its final name, so a file under the final name is always
complete. A `.gz` download is decompressed in a stream (the gzip trailer's CRC-32 and length check the
content) into the final name, again atomically, and the compressed file is removed.

What arrives is checked before it is kept: a status other than 200 or 206, an HTML page (a login wall, a
mirror's error page served with status 200), an empty body, a `.gz` file that does not start with the gzip
magic bytes, or fewer bytes than the server announced are refused with one line, and none of it is renamed
into place.

Each file is skipped once its final name exists, so running the command again finishes what is missing.
The base URL defaults to `$HF_ENDPOINT` or `https://huggingface.co`, so a mirror works unchanged.
"""

from __future__ import annotations

import gzip
import http.client
import os
import re
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlparse

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from scratchlm.console import console, progress
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write

DEFAULT_BASE_URL = "https://huggingface.co"
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    path: str  # URL path below the base URL
    filename: str  # final (decompressed) file name in the dataset directory

    @property
    def compressed(self) -> bool:
        return self.path.endswith(".gz")


DATASETS: dict[str, tuple[RemoteFile, ...]] = {
    "tinystories": tuple(
        RemoteFile(f"datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-{split}.txt", name)
        for split, name in (
            ("train", "TinyStoriesV2-GPT4-train.txt"),
            ("valid", "TinyStoriesV2-GPT4-valid.txt"),
        )
    ),
    "owt-sample": tuple(
        RemoteFile(f"datasets/stanford-cs336/owt-sample/resolve/main/owt_{split}.txt.gz", f"owt_{split}.txt")
        for split in ("train", "valid")
    ),
}


def default_base_url() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_BASE_URL)


def download_dataset(
    name: str, out_dir: str | Path, *, base_url: str | None = None, attempts: int = 3, timeout: float = 60.0
) -> list[Path]:
    """Fetch dataset `name` (a key of `DATASETS`) into `out_dir`; returns the final file paths."""
    if name not in DATASETS:
        raise ScratchlmError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    base = (base_url or default_base_url()).rstrip("/")
    out_dir = Path(out_dir)
    paths = []
    for remote in DATASETS[name]:
        final = out_dir / remote.filename
        if final.exists():
            console.print(f"{final} is already there")
        else:
            fetched = out_dir / Path(remote.path).name
            if not fetched.exists():
                download_file(f"{base}/{remote.path}", fetched, attempts=attempts, timeout=timeout)
            if remote.compressed:
                decompress_gzip(fetched, final)
        paths.append(final)
    return paths


def download_file(url: str, dest: str | Path, *, attempts: int = 3, timeout: float = 60.0) -> Path:
    """Download `url` to `dest` through `dest.part`, resuming it if present; retries a dropped connection
    `attempts` times in all, each time from where it stopped."""
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ScratchlmError(f"cannot create directory {part.parent}: {e.strerror}") from None
    for attempt in range(1, attempts + 1):
        try:
            _fetch_into(url, part, timeout)
            break
        except _Interrupted as e:
            if attempt == attempts:
                raise ScratchlmError(
                    f"download of {url} stopped ({e}); run the command again to resume from {part}"
                ) from None
            console.print(f"{e}; resuming ({attempt}/{attempts - 1})", style="yellow")
    os.replace(part, dest)
    return dest


class _Interrupted(Exception):
    """A transfer that ended early; the `.part` file holds what arrived and can be resumed."""


def _fetch_into(url: str, part: Path, timeout: float) -> None:
    offset = part.stat().st_size if part.exists() else 0
    # The installed distribution's version (pyproject.toml), read here rather than from the package's face.
    request = urllib.request.Request(url, headers={"User-Agent": f"scratchlm/{version('scratchlm')}"})
    if offset:
        request.add_header("Range", f"bytes={offset}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:  # Range Not Satisfiable: nothing left to send, or a stale .part file
            total = _content_range_total(e.headers.get("Content-Range", ""))
            if total == offset:
                return
            part.unlink()  # longer than the file on the server: not a prefix of it, so start again
            return _fetch_into(url, part, timeout)
        raise ScratchlmError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise ScratchlmError(
            f"cannot reach {urlparse(url).netloc}: {e.reason} "
            f"(no network? a mirror can be set with HF_ENDPOINT or --base-url)"
        ) from None
    except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise _Interrupted(f"connection failed: {e!r}") from None
    name = part.name.removesuffix(".part")
    with response:
        _check_response(url, response, name)
        if response.status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range", ""), url)
            if start != offset:
                raise ScratchlmError(f"{url}: asked for bytes from {offset}, the server sent from {start}")
            mode = "ab"
        else:  # 200: the whole file, whatever we asked for
            if offset:
                console.print(
                    f"{urlparse(url).netloc} ignored the resume request; downloading from the start",
                    style="yellow",
                )
            offset = 0
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
            mode = "wb"
        received = offset
        with _byte_progress() as bar:
            task = bar.add_task(name, total=total, completed=offset)
            try:
                chunk = response.read(CHUNK_BYTES)
                if not offset:
                    _check_start(url, chunk, name)  # before anything is written
                with open(part, mode) as f:
                    while chunk:
                        f.write(chunk)
                        received += len(chunk)
                        bar.update(task, completed=received)
                        chunk = response.read(CHUNK_BYTES)
            except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
                raise _Interrupted(f"connection lost: {e!r}") from None
    if total is not None and received != total:
        raise _Interrupted(f"received {received:,} of {total:,} bytes")
    if received == 0:
        part.unlink()
        raise ScratchlmError(f"{url}: the server sent an empty file; nothing was saved")
    if not console.is_terminal:
        console.print(f"downloaded {url} ({received:,} bytes)")


def _check_response(url: str, response: http.client.HTTPResponse, name: str) -> None:
    """Refuse, before anything is written, an answer that cannot be the file `name`."""
    if response.status not in (200, 206):
        raise ScratchlmError(
            f"{url}: HTTP {response.status} {response.reason}, expected the file; nothing was saved"
        )
    content_type = response.headers.get("Content-Type", "")
    if content_type.split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml"):
        raise ScratchlmError(
            f"{url}: the server sent a web page ({content_type}), not {name}; nothing was saved "
            "(check the address, --base-url or HF_ENDPOINT)"
        )


def _check_start(url: str, first: bytes, name: str) -> None:
    """Refuse a body whose first bytes cannot begin the file `name`: an HTML page served as another type, or
    a `.gz` file without the gzip magic bytes."""
    head = first[:64].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        raise ScratchlmError(
            f"{url}: the server sent a web page, not {name}; nothing was saved "
            "(check the address, --base-url or HF_ENDPOINT)"
        )
    if name.endswith(".gz") and not first.startswith(b"\x1f\x8b"):
        raise ScratchlmError(
            f"{url}: the body does not start like a gzip file, so it is not {name}; nothing was saved"
        )


def _parse_content_range(value: str, url: str) -> tuple[int, int | None]:
    """`bytes START-END/TOTAL` (TOTAL may be `*`) -> (START, TOTAL or None)."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", value.strip())
    if not match:
        raise ScratchlmError(f"{url}: unexpected Content-Range header {value!r}")
    total = match.group(3)
    return int(match.group(1)), None if total == "*" else int(total)


def _content_range_total(value: str) -> int | None:
    """The TOTAL of `bytes */TOTAL`, the form a 416 answer carries."""
    match = re.fullmatch(r"bytes \*/(\d+)", value.strip())
    return int(match.group(1)) if match else None


def decompress_gzip(source: Path, dest: Path) -> Path:
    """Stream `source` (.gz) into `dest` atomically, then remove `source`. A corrupt or truncated archive
    is removed too, so that the next run downloads it again."""
    size = source.stat().st_size
    try:
        with (
            open(source, "rb") as raw,
            gzip.open(raw) as unzipped,
            atomic_write(dest) as out,
            _byte_progress() as bar,
        ):
            task = bar.add_task(f"decompressing {source.name}", total=size)
            while chunk := unzipped.read(CHUNK_BYTES):
                out.write(chunk)
                bar.update(task, completed=raw.tell())
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # bad magic or CRC; truncated; corrupt data
        source.unlink()
        raise ScratchlmError(
            f"{source} is not a valid gzip file ({e}); removed it, run again to re-download"
        ) from None
    source.unlink()
    if not console.is_terminal:
        console.print(f"decompressed {source.name} -> {dest} ({dest.stat().st_size:,} bytes)")
    return dest


def _byte_progress() -> Progress:
    return progress(
        columns=(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
    )
