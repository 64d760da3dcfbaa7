"""Tokenizer experiments (the figures of docs/answers.md): compression and encoding throughput.

Tokenizers: GPT-2's 50K vocabulary (the fixture files) and byte-level BPE tokenizers trained here on the
embedded corpus (the Python standard library's sources, `scratchlm quickstart`'s corpus) at 4,096 and 10,000
tokens. Texts: the fixture texts (TinyStories documents, English, German) and the corpus's held-out files.
Compression is UTF-8 bytes per token; throughput is `Tokenizer.encode` on the held-out files, in one process,
beside tiktoken's on the same vocabulary.

    python benchmarks/tokenizer_stats.py [--out runs/quickstart]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import tiktoken

from scratchlm.data.corpus import END_OF_TEXT, build_corpus
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.serialization import save_tokenizer
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def as_tiktoken(tokenizer: Tokenizer, name: str) -> tiktoken.Encoding:
    ranks = {token: i for i, token in tokenizer.vocab.items() if i < 256 + len(tokenizer.merges)}
    specials = {END_OF_TEXT: tokenizer.token_id(END_OF_TEXT)}
    return tiktoken.Encoding(name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tokenizer_stats", help="where the corpus and tokenizers go")
    args = parser.parse_args()
    out = Path(args.out)
    corpus_dir = out / "corpus"
    if not (corpus_dir / "train.txt").exists():
        build_corpus(corpus_dir)

    tokenizers = {
        "GPT-2 (50,257)": Tokenizer.from_files(
            FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", [END_OF_TEXT]
        )
    }
    for vocab_size in (4096, 10_000):
        directory = out / f"stdlib-{vocab_size}"
        if not directory.exists():
            start = time.perf_counter()
            vocab, merges = train_bpe(corpus_dir / "train.txt", vocab_size, [END_OF_TEXT])
            save_tokenizer(directory, vocab, merges, [END_OF_TEXT])
            print(f"trained stdlib-{vocab_size} in {time.perf_counter() - start:.1f} s")
        tokenizers[f"stdlib ({vocab_size:,})"] = Tokenizer.from_dir(directory)

    texts = {
        name: (FIXTURES / name).read_text(encoding="utf-8")
        for name in ("tinystories_sample.txt", "corpus.en", "german.txt")
    }
    texts["stdlib held-out files"] = (corpus_dir / "valid.txt").read_text(encoding="utf-8")

    print("\ncompression, UTF-8 bytes per token:")
    print("| text | bytes | " + " | ".join(tokenizers) + " |")
    print("| --- | ---: |" + " ---: |" * len(tokenizers))
    for name, text in texts.items():
        size = len(text.encode("utf-8"))
        ratios = [size / len(t.encode(text)) for t in tokenizers.values()]
        print(f"| {name} | {size:,} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")

    for name, tokenizer in tokenizers.items():
        longest = max(tokenizer.vocab.values(), key=len)
        print(f"{name}: longest token, {len(longest)} bytes: {longest.decode('utf-8', 'replace')!r}")

    text = texts["stdlib held-out files"]
    size = len(text.encode("utf-8"))
    print(f"\nencoding throughput on the held-out files ({size / 1e6:.2f} MB), one process:")
    print(
        "| tokenizer | scratchlm MB/s | tiktoken MB/s | ids equal | 825 GB (the Pile) at scratchlm's rate |"
    )
    print("| --- | ---: | ---: | --- | ---: |")
    for name, tokenizer in tokenizers.items():
        start = time.perf_counter()
        ids = tokenizer.encode(text)
        ours = size / (time.perf_counter() - start)
        encoding = as_tiktoken(tokenizer, name)
        start = time.perf_counter()
        reference = encoding.encode(text, allowed_special="all")
        theirs = size / (time.perf_counter() - start)
        pile_hours = 825e9 / ours / 3600
        print(
            f"| {name} | {ours / 1e6:.2f} | {theirs / 1e6:.2f} | {ids == reference} | {pile_hours:,.0f} h |"
        )
    print(
        f"max id of each tokenizer fits uint16 (< 65,536): {all(t.vocab_size <= 65_536 for t in tokenizers.values())}"
    )


if __name__ == "__main__":
    main()
