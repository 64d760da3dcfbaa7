"""BPE training speed: scratchlm against HF `tokenizers`' Rust `BpeTrainer`, side by side, on the same corpus.

The corpus is the Python standard library's own source, test suites included (about 30 MB for CPython 3.11),
joined with `<|endoftext|>`: real text present on every machine with Python, no download. Both trainers learn
a 10,000-token vocabulary with `<|endoftext|>` as special token, the same GPT-2 pre-tokenization pattern and the
256-byte alphabet; HF is given the documents between the special tokens, so both learn from the same
pre-tokens. Each trainer runs in a fresh child process, one after the other; the time is that of the training
call alone (reading the file included), the CPU time that of the whole child, and the memory the peak of the
child's process tree (workers included), summed as proportional set size (PSS: pages shared after fork() are
divided among the processes sharing them), sampled every 20 ms.

    python benchmarks/bench_train_bpe.py [--vocab-size 10000] [--workers K] [--runs 3] [--corpus FILE ...]

`--corpus FILE` (repeatable) trains on any UTF-8 text instead, documents joined by `<|endoftext|>`:
benchmarks/corpora.py makes prose, manual pages and other languages, on which pre-tokens repeat far less than
in code, and training costs more. Several corpora are run one after the other, and the range of the ratios is
printed at the end.

Prints both times, the ratio scratchlm / HF (the target is <= 1.0) and how similar the two merge lists are: HF
breaks ties between equally frequent pairs its own way rather than by the rule of the CS336 assignment-1 handout, after which the lists
drift apart a little.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

EOT = "<|endoftext|>"


def train_scratchlm(corpus: Path, vocab_size: int, workers: int | None, out: Path) -> None:
    # The two phases of `train_bpe`, timed apart.
    from scratchlm.tokenizer.train import count_pretokens, learn_merges

    start = time.perf_counter()
    counts = count_pretokens(corpus, [EOT], workers=workers)
    middle = time.perf_counter()
    merges = learn_merges(counts, vocab_size - 256 - 1)
    end = time.perf_counter()
    phases = f"pre-tokenization {middle - start:.2f} s + merging {end - middle:.2f} s"
    out.write_text(
        json.dumps(
            {"seconds": end - start, "phases": phases, "merges": [[a.hex(), b.hex()] for a, b in merges]}
        )
    )


def train_hf(corpus: Path, vocab_size: int, workers: int | None, out: Path) -> None:
    if workers:
        os.environ["RAYON_NUM_THREADS"] = str(workers)  # read when the thread pool starts, i.e. below
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
    from scratchlm.tokenizer.serialization import text_to_token

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    # Documents, not `tokenizer.train([file])`: that reads the file line by line (a whitespace run cannot span a
    # newline) and counts the special token's text like any other, so it would learn from other pre-tokens.
    with open(corpus, encoding="utf-8", newline="") as f:
        documents = f.read().split(EOT)
    tokenizer.train_from_iterator(documents, trainer)
    seconds = time.perf_counter() - start
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m.split(" ") if isinstance(m, str) else m for m in merges]  # "a b" in older versions
    pairs = [[text_to_token(a).hex(), text_to_token(b).hex()] for a, b in merges]
    out.write_text(json.dumps({"seconds": seconds, "merges": pairs}))


TRAINERS = {"scratchlm": train_scratchlm, "hf": train_hf}


def process_tree_pss_mib(pid: int) -> float:
    """Summed PSS of `pid` and all its descendants, in MiB (0 for processes that vanished meanwhile)."""
    total_kib = 0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kib += int(line.split()[1])
                    break
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total_kib / 1024


def run_child(name: str, corpus: Path, vocab_size: int, workers: int | None) -> dict:
    """Run one trainer in a fresh interpreter; returns its time, merges and peak process-tree memory."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "result.json"
        command = [
            sys.executable,
            __file__,
            "--child",
            name,
            str(corpus),
            str(vocab_size),
            str(workers or 0),
            str(out),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = subprocess.Popen(command)
        peak = 0.0
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, process_tree_pss_mib(child.pid))
                stop.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        status = child.wait()
        stop.set()
        sampler.join()
        if status != 0:
            raise SystemExit(f"{name} training failed with exit status {status}")
        result = json.loads(out.read_text())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time of the whole child (its workers and threads included, interpreter start-up too): unlike the wall
    # time it barely changes when other work shares the machine.
    result["cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    result["merges"] = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in result["merges"]]
    result["peak_mib"] = peak
    return result


def build_or_reuse_corpus(cache_dir: Path) -> Path:
    from scratchlm.data.corpus import build_corpus

    corpus = cache_dir / "train.txt"
    if not corpus.exists():
        print(f"building the standard-library corpus in {cache_dir} ...", flush=True)
        build_corpus(cache_dir, include_tests=True)
    size = corpus.stat().st_size
    if size < 25_000_000:
        raise SystemExit(f"{corpus} has only {size / 1e6:.1f} MB; the benchmark wants at least 25 MB")
    return corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=10_000)
    parser.add_argument("--workers", type=int, help="processes / threads for both (default: all cores)")
    parser.add_argument(
        "--runs", type=int, default=1, help="runs of each trainer, alternating; medians reported"
    )
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        help="a UTF-8 text file to train on (repeatable; default: the standard library's sources)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir())
        / f"scratchlm-bench-corpus-py{sys.version_info[0]}{sys.version_info[1]}",
    )
    args = parser.parse_args()

    corpora = args.corpus or [build_or_reuse_corpus(args.cache_dir)]
    print(f"cores: {len(os.sched_getaffinity(0))}, workers: {args.workers or 'all'}", flush=True)
    ratios = {corpus: compare(corpus, args.vocab_size, args.workers, args.runs) for corpus in corpora}
    if len(ratios) > 1:
        print("\nratio scratchlm / HF (time) per corpus:")
        for corpus, ratio in ratios.items():
            print(f"  {ratio:5.2f}  {corpus}")
        print(f"  range {min(ratios.values()):.2f} to {max(ratios.values()):.2f}")


def compare(corpus: Path, vocab_size: int, workers: int | None, runs: int) -> float:
    """Run both trainers `runs` times on `corpus`, print the medians; returns the ratio of the median times."""
    print(
        f"\ncorpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB), vocab {vocab_size:,}, {EOT}", flush=True
    )
    results: dict[str, list[dict]] = {name: [] for name in TRAINERS}
    for run in range(runs):
        for name in TRAINERS:
            result = run_child(name, corpus, vocab_size, workers)
            results[name].append(result)
            print(
                f"  run {run + 1}: {name:9s} {result['seconds']:6.2f} s, CPU {result['cpu_s']:6.2f} s, "
                f"peak {result['peak_mib']:4.0f} MiB"
                + (f"  ({result['phases']})" if "phases" in result else ""),
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    ours, theirs = results["scratchlm"][0]["merges"], results["hf"][0]["merges"]
    same_prefix = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )
    overlap = len(set(ours) & set(theirs)) / max(len(ours), 1)

    print(f"medians of {runs} run(s)            time      CPU   peak memory (process tree, PSS)")
    for name, label in (("scratchlm", "scratchlm train_bpe"), ("hf", "HF tokenizers BpeTrainer")):
        peak = max(r["peak_mib"] for r in results[name])
        print(
            f"{label:28s} {median(name, 'seconds'):7.2f} s {median(name, 'cpu_s'):6.2f} s   {peak:,.0f} MiB"
        )
    ratio = median("scratchlm", "seconds") / median("hf", "seconds")
    print(f"ratio scratchlm / HF (time)  {ratio:7.2f}     target <= 1.0 with peak memory <= 1 GiB")
    print(
        f"merges: {len(ours):,} vs {len(theirs):,}; identical for the first {same_prefix:,}; "
        f"{overlap:.1%} of scratchlm's merges are also HF's"
    )
    return ratio


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, corpus, vocab_size, workers, out = sys.argv[2:]
        TRAINERS[name](Path(corpus), int(vocab_size), int(workers) or None, Path(out))
    else:
        main()
