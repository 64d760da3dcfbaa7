"""Encoding throughput: scratchlm's GPT-2 tokenizer against tiktoken, on the same ~30 MB of real text.

The text is the standard library corpus (`build_corpus(include_tests=True)`: every stdlib source file as a
document, joined by `<|endoftext|>`). Both tokenizers load the GPT-2 files from the fixtures; the benchmark
checks that they produce identical ids, then prints throughput and ratios for

- `Tokenizer.encode` in this process (one core, cold cache) vs tiktoken's single-threaded `encode`;
- `scratchlm encode` (the command, all cores, timed from start to exit) vs the same tiktoken figure,
  with the command's peak memory (its own peak plus each worker's).

Targets: `Tokenizer.encode` >= 0.5x tiktoken; `scratchlm encode` >= 1.0x; peak memory < 500 MB.

    python benchmarks/bench_encode.py                       # corpus built (or reused) in /tmp/scratchlm-bench-encode
    python benchmarks/bench_encode.py --fixtures tests/fixtures --workers 2
    python benchmarks/bench_encode.py --text big.txt             # any UTF-8 file, e.g. to see start-up amortised
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tiktoken

from scratchlm.data.corpus import build_corpus
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.serialization import load_vocab
from scratchlm.tokenizer.tokenizer import Tokenizer

END_OF_TEXT = "<|endoftext|>"
# Sizes of the datasets of the CS336 assignment-1 handout, for the time estimates.
DATASETS = {"TinyStories train (2.1 GB)": 2.1e9, "OpenWebText sample (11 GB)": 11e9}


def tiktoken_gpt2(vocab_path: Path) -> tiktoken.Encoding:
    """tiktoken's `gpt2` encoding built offline from the same vocabulary (rank = id)."""
    vocab = load_vocab(vocab_path)
    eot = next(i for i, token in vocab.items() if token == END_OF_TEXT.encode())
    ranks = {token: i for i, token in vocab.items() if i != eot}
    return tiktoken.Encoding(
        "gpt2", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={END_OF_TEXT: eot}
    )


def timed(function, *args):
    """(result, wall seconds, CPU seconds of this process and of the child processes it waited for)."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = function(*args)
    return result, time.perf_counter() - wall, _cpu_seconds() - cpu


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/scratchlm-bench-encode"))
    parser.add_argument(
        "--fixtures", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="workers of `scratchlm encode` (default: all)"
    )
    parser.add_argument(
        "--text", type=Path, default=None, help="a UTF-8 text file to encode instead of the stdlib corpus"
    )
    args = parser.parse_args()

    if args.text is not None and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    corpus = args.text or args.out / "corpus" / "train.txt"
    if not corpus.exists():
        build_corpus(args.out / "corpus", include_tests=True)
    text = corpus.read_bytes().decode("utf-8")
    size_mb = len(text.encode("utf-8")) / 1e6
    vocab_path, merges_path = args.fixtures / "gpt2_vocab.json", args.fixtures / "gpt2_merges.txt"
    tokenizer = Tokenizer.from_files(vocab_path, merges_path, [END_OF_TEXT])
    tokenizer.save(args.out / "gpt2")
    encoding = tiktoken_gpt2(vocab_path)
    print(f"corpus: {corpus} ({size_mb:.1f} MB), {os.cpu_count()} cores")

    reference, tiktoken_s, tiktoken_cpu = timed(lambda: encoding.encode(text, allowed_special="all"))
    ids, scratchlm_s, scratchlm_cpu = timed(tokenizer.encode, text)
    if ids != reference:
        first = next(i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b)
        sys.exit(f"MISMATCH: scratchlm and tiktoken differ at token {first} (or in length)")
    print(f"ids identical: {len(ids):,} tokens, {size_mb * 1e6 / len(ids):.2f} bytes/token")
    print("                                      wall clock            CPU time (robust to a busy machine)")
    tiktoken_rate, tiktoken_cpu_rate = size_mb / tiktoken_s, size_mb / tiktoken_cpu
    print(
        f"tiktoken encode (1 thread)           {tiktoken_rate:6.2f} MB/s              {tiktoken_cpu_rate:6.2f} MB/s per core"
    )
    report(
        "scratchlm Tokenizer.encode (1 core)",
        size_mb / scratchlm_s,
        size_mb / scratchlm_cpu,
        tiktoken_rate,
        tiktoken_cpu_rate,
        "0.5",
    )
    del ids

    output = args.out / "train.npy"
    command = [
        sys.executable,
        "-m",
        "scratchlm",
        "encode",
        str(corpus),
        str(output),
        "--tokenizer",
        str(args.out / "gpt2"),
    ]
    if args.workers:
        command += ["--workers", str(args.workers)]
    finished, file_s, file_cpu = timed(lambda: subprocess.run(command, capture_output=True, text=True))
    if finished.returncode != 0:
        sys.exit(f"scratchlm encode failed:\n{finished.stderr}")
    if np.load(output, mmap_mode="r").tolist() != reference:
        sys.exit("MISMATCH: the ids of `scratchlm encode` differ from tiktoken's")
    peak = float(re.search(r"peak memory ([\d,]+)\s+MB", finished.stderr).group(1).replace(",", ""))
    workers = int(re.search(r"(\d+) worker", finished.stderr).group(1))
    file_rate = size_mb / file_s
    # With the machine to itself the command would take about its CPU time spread over its workers.
    idle_rate = size_mb / (file_cpu / min(workers, os.cpu_count() or 1))
    report(
        f"scratchlm encode (file, {workers} workers)",
        file_rate,
        idle_rate,
        tiktoken_rate,
        tiktoken_cpu_rate,
        "1.0",
    )
    print(f"  (CPU column: {file_cpu:.1f} CPU-s in all its processes, spread over {workers} cores)")
    print(f"  ids identical; peak memory {peak:.0f} MB, parent + workers (target < 500 MB)")
    for name, size in DATASETS.items():
        print(
            f"estimated `scratchlm encode` time for {name}: {size / 1e6 / file_rate / 60:.0f} min at the measured "
            f"rate, {size / 1e6 / idle_rate / 60:.0f} min on these cores unshared"
        )


def report(name: str, rate: float, cpu_rate: float, anchor: float, anchor_cpu: float, target: str) -> None:
    print(
        f"{name:37s}{rate:6.2f} MB/s {rate / anchor:5.2f}x      {cpu_rate:6.2f} MB/s {cpu_rate / anchor_cpu:5.2f}x"
        f"   (target >= {target}x)"
    )


if __name__ == "__main__":
    main()
