"""Byte-level BPE training: learn `vocab_size - 256 - len(special_tokens)` merges from a text file.

The algorithm (that of the CS336 assignment-1 handout, in the spirit of minbpe) has two phases.

1. Pre-token counting. The file is cut into chunks, each read, decoded and counted by a worker process: the
   text is split on the special tokens (which are never counted or merged), then cut into pre-tokens by GPT-2's
   regular expression (each distinct whitespace-led segment of text only once, see `pretokenize`), giving the
   count of each pre-token, as UTF-8 bytes. A cut is placed only where it cannot change the result: at the start of a
   special token (documents are delimited by `<|endoftext|>`), or, failing that, right after an ASCII letter
   that is followed by an ASCII non-letter, where the regex always ends a match (it has no look-behind, and the
   letter run it is in stops there). Either way no special token may straddle the cut. So the counts are the
   same for any number of workers, and no process ever holds more than one chunk of the file plus its counts:
   memory grows with the number of distinct pre-tokens, not with the file.

2. Merging (`scratchlm.tokenizer.merges`, whose docstring tells how): each distinct pre-token becomes a word
   weighted by its count, and the most frequent adjacent pair of tokens is merged, again and again, the pair
   counts kept up to date by visiting only the places where the merged pair occurs.

Text with many distinct pre-tokens (prose, languages other than English) gives every step many more keys than
code does, where pre-tokens repeat a great deal. So the work per key is left to C wherever it can be: the
workers encode their counts to bytes themselves, counts are added together by `add_counts` (`Counter.update`
with a mapping loops in Python), and the merges that visit many places do so with numpy.

Ids: 0..255 are the single bytes, then the merges in creation order, then the special tokens. Training stops
early, with a smaller vocabulary, when no pair of tokens is left to merge.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import regex

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer.merges import learn_merges
from scratchlm.tokenizer.pretokenize import (
    ASCII_LETTER_CUT_PATTERN,
    add_counts,
    pretoken_counts,
    special_tokens_regex,
    whitespace,
)
from scratchlm.workers import worker_pool

# Bytes each worker reads and pre-tokenizes at a time: bounds a worker's memory apart from its counts.
DEFAULT_CHUNK_SIZE = 1 << 20
# How far past a chunk's nominal end to look for a special token before settling for a letter boundary.
_CUT_SEARCH_WINDOW = 1 << 16
# Where a chunk of bytes may end (`pretokenize.ASCII_LETTER_CUT_PATTERN`).
_LETTER_CUT_RE = regex.compile(ASCII_LETTER_CUT_PATTERN)


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: Iterable[str] | None = None,
    *,
    workers: int | None = None,
    progress: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on the UTF-8 text file `input_path`.

    `vocab_size` counts the 256 bytes, the merges and the special tokens. `workers` is the number of
    pre-tokenizing processes (default: every available core); the result does not depend on it. `progress`
    draws progress bars on the terminal. Returns `(vocab, merges)`: `vocab` maps ids 0..n-1 to token bytes,
    `merges` lists the merged pairs in creation order (fewer than asked when the corpus runs out of pairs).

    Workers are forked on Linux; elsewhere they are spawned, which re-imports the calling script, so call this
    from under `if __name__ == "__main__":` there.
    """
    path = Path(input_path)
    special_tokens = list(dict.fromkeys(special_tokens or []))
    if not all(isinstance(t, str) and t for t in special_tokens):
        raise ScratchlmError(f"special tokens must be non-empty strings, got {special_tokens!r}")
    minimum = 256 + len(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ScratchlmError(
            f"vocab size {vocab_size!r} is too small: it must be at least 256 bytes + "
            f"{len(special_tokens)} special token(s) = {minimum}"
        )
    if not path.exists():
        raise ScratchlmError(f"input file not found: {path}")
    if not path.is_file():
        raise ScratchlmError(f"input {path} is not a regular file")
    if workers is not None and workers < 1:
        raise ScratchlmError(f"workers must be at least 1, got {workers}")
    if chunk_size < 1:
        raise ScratchlmError(f"chunk size must be at least 1 byte, got {chunk_size}")

    with _Progress(progress) as bars:
        counts = count_pretokens(
            path, special_tokens, workers=workers, chunk_size=chunk_size, on_bytes=bars.task("pre-tokenizing")
        )
        num_merges = vocab_size - minimum
        merges = learn_merges(counts, num_merges, on_merge=bars.task("merging", num_merges))

    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    return vocab, merges


# --- phase 1: pre-token counts -------------------------------------------------------------------------------


def count_pretokens(
    path: str | os.PathLike,
    special_tokens: list[str],
    *,
    workers: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    on_bytes: Callable[[int, int], None] | None = None,
) -> Counter[bytes]:
    """How often each pre-token (as UTF-8 bytes) occurs in the file; special tokens are not counted.

    `on_bytes(done, total)` is called as the file is read.
    """
    path = Path(path)
    total = path.stat().st_size
    chunks = list(pairwise(chunk_boundaries(path, special_tokens, chunk_size)))
    workers = min(workers or _available_cores(), len(chunks)) or 1
    # A few tasks per worker balance the load; each task is a run of chunks counted into one dict, so the
    # parent adds up a few dicts rather than one per chunk.
    per_task = math.ceil(len(chunks) / (workers * 4)) or 1
    tasks = [(str(path), chunks[i : i + per_task], special_tokens) for i in range(0, len(chunks), per_task)]
    whitespace()  # computed once here rather than in every worker

    counts: Counter[bytes] = Counter()
    if workers == 1:
        done = 0

        def report(n: int) -> None:
            nonlocal done
            done += n
            if on_bytes:
                on_bytes(done, total)

        for task in tasks:
            add_counts(counts, _count_task(task, report))
    else:
        # The workers start at once, before the progress display's thread starts on its first update. A worker
        # that dies ends the training with an error (see scratchlm.workers).
        bytes_read = multiprocessing.Value("q", 0)
        with worker_pool(workers, _start_worker, (bytes_read,), f"pre-tokenizing {path} failed") as pool:
            # In file order, so that of several encoding errors the first is the one raised.
            for future in [pool.submit(_count_task_in_worker, task) for task in tasks]:
                while True:
                    try:
                        task_counts = future.result(timeout=0.2)
                        break
                    except TimeoutError:
                        if on_bytes:
                            on_bytes(bytes_read.value, total)
                add_counts(counts, task_counts)
    if on_bytes:
        on_bytes(total, total)
    return counts


def _count_task(
    task: tuple[str, list[tuple[int, int]], list[str]], report: Callable[[int], None]
) -> dict[bytes, int]:
    path, chunks, special_tokens = task
    counts = pretoken_counts(_read_pieces(path, chunks, special_tokens_regex(special_tokens), report))
    # Encoded here, in the worker, and in C: a dict comprehension would loop over the keys in Python.
    return dict(zip(map(str.encode, counts), counts.values(), strict=True))


# In a worker process: the count of bytes read by all workers, shared with the parent for its progress display.
_bytes_read: Any = None


def _start_worker(bytes_read: Any) -> None:
    global _bytes_read
    _bytes_read = bytes_read


def _count_task_in_worker(task: tuple[str, list[tuple[int, int]], list[str]]) -> dict[bytes, int]:
    return _count_task(task, _report_to_parent)


def _report_to_parent(n: int) -> None:
    with _bytes_read.get_lock():
        _bytes_read.value += n


def _read_pieces(
    path: str, chunks: list[tuple[int, int]], special_re: regex.Pattern | None, report: Callable[[int], None]
) -> Iterator[str]:
    """The text between special tokens in the chunks `[(start, end), ...]` of the file, one chunk at a time."""
    with open(path, "rb") as f:
        for start, end in chunks:
            f.seek(start)
            data = f.read(end - start)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ScratchlmError(
                    f"{path}: not valid UTF-8 at byte offset {start + e.start} ({e.reason})"
                ) from None
            yield from special_re.split(text) if special_re else (text,)
            report(end - start)


def chunk_boundaries(
    path: str | os.PathLike, special_tokens: list[str], chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[int]:
    """Byte offsets `[0, ..., file size]` cutting the file into chunks of about `chunk_size` bytes, each cut
    where pre-tokenizing the pieces separately gives the same pre-tokens as the whole (see module docstring)."""
    size = os.path.getsize(path)
    specials = sorted((t.encode("utf-8") for t in special_tokens), key=len, reverse=True)
    # Every start of a special token, with the longest special token there (alternatives are tried longest
    # first): the one that reaches furthest across a cut.
    special_re = regex.compile(b"(?=(" + b"|".join(map(regex.escape, specials)) + b"))") if specials else None
    margin = len(specials[0]) if specials else 0
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_size < size:
            cut = _find_cut(f, bounds[-1] + chunk_size, special_re, margin)
            if cut is None:
                break
            bounds.append(cut)
    bounds.append(size)
    return bounds


def _find_cut(f: BinaryIO, target: int, special_re: regex.Pattern | None, margin: int) -> int | None:
    """The first safe cut at or after byte `target`, preferring the start of a special token within a search
    window; None when there is none before the end of the file. `margin` is the longest special token's length."""
    position = target
    while True:
        start = max(0, position - margin)
        f.seek(start)
        block = f.read(position - start + _CUT_SEARCH_WINDOW + margin)
        lo, hi = position - start, min(len(block), position - start + _CUT_SEARCH_WINDOW)
        if lo >= hi:
            return None
        specials = (m.start() for m in special_re.finditer(block, lo)) if special_re else iter(())
        letters = (m.end() for m in _LETTER_CUT_RE.finditer(block, max(lo - 1, 0)))
        for candidates in (specials, letters):
            for cut in candidates:
                if cut >= hi:
                    break
                if cut >= lo and not _straddled(block, cut, special_re, margin):
                    return start + cut
        position = start + hi


def _straddled(block: bytes, cut: int, special_re: regex.Pattern | None, margin: int) -> bool:
    """Whether a special token starts before `cut` and ends after it."""
    if special_re is None:
        return False
    for m in special_re.finditer(block, max(cut - margin + 1, 0)):
        if m.start() >= cut:
            return False
        if m.end(1) > cut:
            return True
    return False


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# --- progress display -----------------------------------------------------------------------------------------


class _Progress:
    """Progress bars when asked for, else callbacks that do nothing."""

    def __init__(self, enabled: bool) -> None:
        self.bars = None
        if enabled:
            from scratchlm.console import progress

            self.bars = progress()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def task(self, description: str, total: int | None = None) -> Callable[[int, int], None] | None:
        if self.bars is None:
            return None
        bars = self.bars
        task_id = bars.add_task(description, total=total, start=False)

        def update(done: int, total: int) -> None:
            # Started on the first update, so that no display thread runs while worker processes are forked.
            if not bars.live.is_started:
                bars.start()
            bars.start_task(task_id)
            bars.update(task_id, completed=done, total=total)

        return update
