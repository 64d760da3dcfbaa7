"""Encoding a text file of any size into a flat `.npy` array of token ids, on all cores, in bounded memory.

The file is read in blocks and regrouped into chunks of about `CHUNK_CHARS` characters that end where the
text can be cut without changing its encoding (`Tokenizer.safe_chunks`: after a special token such as
`<|endoftext|>`, or between two characters where no pre-token can span), so the ids are exactly
`Tokenizer.encode` of the whole file. A pool of worker processes encodes the chunks; the parent keeps only a
few chunks in flight and appends the ids, in order, to the output as they come back. Memory therefore depends
on the chunk size and the number of workers, never on the file size.

The output is a standard `.npy` file (`uint16` ids when the vocabulary fits, else `uint32`): a 128-byte header
(written last, once the number of ids is known) followed by the raw ids, so `np.load(path, mmap_mode="r")` maps
it without reading it. It is written under a temporary name and renamed when complete.

The file is read as UTF-8 exactly as stored (no newline translation), i.e. the text is
`path.read_bytes().decode("utf-8")`.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scratchlm.console import process_peak_memory_mb, progress
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write, check_output_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.workers import worker_pool

# Bytes read from the file at a time, and characters per chunk sent to a worker: large enough that sending
# text and ids between processes costs little next to encoding them, small enough to keep memory low.
READ_BYTES = 1 << 20
CHUNK_CHARS = 1 << 18
# `np.lib.format` pads a version 1.0 header to a multiple of 64 bytes; for a 1-D array it always fits in 128.
HEADER_BYTES = 128


@dataclass(frozen=True)
class EncodeSummary:
    path: Path
    num_tokens: int
    num_bytes: int
    seconds: float
    dtype: str
    workers: int
    # The parent's peak plus each worker's: memory a forked worker still shares with the parent counts in both,
    # so this is an upper bound on what the machine needed at once.
    peak_memory_mb: float

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / max(self.num_tokens, 1)


def token_dtype(vocab_size: int) -> np.dtype:
    """`uint16` when every id fits in 16 bits, else `uint32`."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_file(
    tokenizer: Tokenizer,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    workers: int | None = None,
    show_progress: bool = True,
) -> EncodeSummary:
    """Encode the UTF-8 text file `input_path` into the `.npy` file `output_path`; `workers` processes
    (default: all cores) share the work."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise ScratchlmError(
            f"input {input_path} is a directory, expected a text file"
            if input_path.is_dir()
            else f"input file not found: {input_path}"
        )
    check_output_file(output_path, [input_path], previous=_is_npy, what="a .npy file")
    if workers is None:
        workers = os.cpu_count() or 1
    if workers < 1:
        raise ScratchlmError(f"workers must be at least 1, got {workers}")
    dtype = token_dtype(tokenizer.vocab_size)
    num_bytes = input_path.stat().st_size

    start = time.perf_counter()
    num_tokens = 0
    worker_peaks: dict[int, float] = {}
    # The workers start before the progress display, whose refresh thread a fork should not copy.
    what = f"encoding {input_path} failed, so {output_path} was not written"
    with (
        _chunk_encoder(tokenizer, dtype, workers, what) as encode_chunks,
        atomic_write(output_path, "wb") as out,
    ):
        out.write(b"\0" * HEADER_BYTES)  # replaced by the real header once the length is known
        with progress() as bar:
            task = bar.add_task(f"encoding {input_path.name}", total=num_bytes, visible=show_progress)
            text = _read_text(input_path, lambda n: bar.advance(task, n))
            for ids, (pid, peak_mb) in encode_chunks(tokenizer.safe_chunks(text, CHUNK_CHARS)):
                out.write(ids.tobytes())
                num_tokens += len(ids)
                worker_peaks[pid] = peak_mb
        out.seek(0)
        header = {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": (num_tokens,),
        }
        np.lib.format.write_array_header_1_0(out, header)
        if out.tell() != HEADER_BYTES:  # numpy leaves room for 21-digit lengths; never write a corrupt file
            raise AssertionError(f".npy header is {out.tell()} bytes, expected {HEADER_BYTES}")
    seconds = time.perf_counter() - start
    own_peak = process_peak_memory_mb()
    return EncodeSummary(
        path=output_path,
        num_tokens=num_tokens,
        num_bytes=num_bytes,
        seconds=seconds,
        dtype=dtype.name,
        workers=workers,
        peak_memory_mb=own_peak + sum(peak for pid, peak in worker_peaks.items() if pid != os.getpid()),
    )


def _is_npy(path: Path) -> bool:
    """Whether `path` is a `.npy` array (an earlier output, which may be replaced) rather than other data."""
    with open(path, "rb") as f:
        return f.read(6) == b"\x93NUMPY"


def _read_text(path: Path, on_bytes: Callable[[int], object]) -> Iterator[str]:
    """The file's text in blocks, decoded as strict UTF-8; a decoding error names the byte offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read before this block
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            held = len(decoder.getstate()[0])  # the start of a character cut by the previous block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ScratchlmError(
                    f"{path}: not valid UTF-8 at byte {offset - held + e.start:,} ({e.reason})"
                ) from None
            if text:
                yield text
            on_bytes(len(block))
            offset += len(block)
            if not block:
                return


@contextlib.contextmanager
def _chunk_encoder(
    tokenizer: Tokenizer, dtype: np.dtype, workers: int, what: str
) -> Iterator[Callable[[Iterable[str]], Iterator[tuple[np.ndarray, tuple[int, float]]]]]:
    """A function from chunks of text to `(ids, (process id, its peak memory))` per chunk, in order. A worker
    that dies ends the encoding with an error naming `what` (see `scratchlm.workers`)."""
    if workers == 1:
        _init_worker(tokenizer, dtype)
        yield lambda chunks: map(_encode_chunk, chunks)
        return
    with worker_pool(workers, _init_worker, (tokenizer, dtype), what) as pool:

        def encode_chunks(chunks: Iterable[str]) -> Iterator[tuple[np.ndarray, tuple[int, float]]]:
            # A bounded window of chunks in flight: enough to keep every worker busy, and it stops the file
            # being read faster than it is encoded (mapping over the chunks would queue the whole file).
            pending: deque = deque()
            for chunk in chunks:
                pending.append(pool.submit(_encode_chunk, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

        yield encode_chunks


_worker_tokenizer: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    global _worker_tokenizer, _worker_dtype
    _worker_tokenizer, _worker_dtype = tokenizer, dtype


def _encode_chunk(text: str) -> tuple[np.ndarray, tuple[int, float]]:
    ids = np.array(_worker_tokenizer.encode(text), dtype=_worker_dtype)
    return ids, (os.getpid(), process_peak_memory_mb())
