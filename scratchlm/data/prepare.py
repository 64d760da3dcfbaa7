"""From text files to what training reads: a BPE tokenizer trained on the training split, and both splits
encoded as flat `.npy` arrays of token ids.

    OUT/tokenizer/   vocab.json, merges.txt, special_tokens.json
    OUT/prepare.json the vocabulary size asked for
    OUT/train.npy    the training text's ids (uint16 when the vocabulary fits)
    OUT/valid.npy    the validation text's ids

Each output is written atomically, so an output that exists is complete and its step is skipped: running the
command again after an interruption finishes only what is missing. A tokenizer trained in this run makes any
existing `.npy` stale, so both splits are encoded again then.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from scratchlm.console import console, format_seconds
from scratchlm.data.download import DATASETS
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write
from scratchlm.tokenizer import DEFAULT_SPECIAL_TOKENS
from scratchlm.tokenizer.encode_file import encode_file
from scratchlm.tokenizer.serialization import load_tokenizer_files, save_tokenizer
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train import train_bpe

# The vocabulary size the CS336 assignment-1 handout uses for each downloadable dataset.
VOCAB_SIZES = {"tinystories": 10_000, "owt-sample": 32_000}


@dataclass(frozen=True)
class PreparedData:
    tokenizer: Path
    train: Path
    valid: Path


def dataset_text_files(name: str, directory: str | Path) -> tuple[Path, Path]:
    """The (train, valid) text files of a downloaded dataset (see `scratchlm download`)."""
    train, valid = (Path(directory) / remote.filename for remote in DATASETS[name])
    return train, valid


def prepare_data(
    train_text: str | Path,
    valid_text: str | Path,
    out_dir: str | Path,
    vocab_size: int,
    special_tokens: tuple[str, ...] = DEFAULT_SPECIAL_TOKENS,
) -> PreparedData:
    """Train a byte-level BPE tokenizer on `train_text`, then encode both files; skips finished steps."""
    train_text, valid_text, out_dir = Path(train_text), Path(valid_text), Path(out_dir)
    for path in (train_text, valid_text):
        if not path.is_file():
            raise ScratchlmError(f"text file {path} not found")
        if path.stat().st_size == 0:
            raise ScratchlmError(f"text file {path} is empty")

    prepared = PreparedData(out_dir / "tokenizer", out_dir / "train.npy", out_dir / "valid.npy")

    # The vocabulary size asked for, recorded beside the tokenizer: a small corpus can run out of pairs to
    # merge, leaving fewer tokens than asked, and that must not look like a different request on a rerun.
    request_file = out_dir / "prepare.json"
    fresh_tokenizer = not prepared.tokenizer.exists()
    if fresh_tokenizer:
        console.print(f"training a {vocab_size:,}-token BPE tokenizer on {train_text} ...")
        start = time.perf_counter()
        vocab, merges = train_bpe(train_text, vocab_size, list(special_tokens), progress=True)
        save_tokenizer(prepared.tokenizer, vocab, merges, list(special_tokens))
        with atomic_write(request_file, "w") as f:
            json.dump({"vocab_size": vocab_size}, f)
        console.print(f"  {len(merges):,} merges in {format_seconds(time.perf_counter() - start)}")
        if len(vocab) < vocab_size:
            console.print(f"  the text ran out of pairs to merge: {len(vocab):,} tokens", style="yellow")
    else:
        if request_file.exists():
            existing = json.loads(request_file.read_text())["vocab_size"]
        else:
            existing = len(load_tokenizer_files(prepared.tokenizer)[0])
        if existing != vocab_size:
            raise ScratchlmError(
                f"{prepared.tokenizer} is a {existing:,}-token tokenizer, not {vocab_size:,}; "
                "delete it or choose another output directory"
            )
        console.print(f"tokenizer: reusing {prepared.tokenizer}")

    tokenizer = Tokenizer.from_dir(prepared.tokenizer)
    for text, ids in ((train_text, prepared.train), (valid_text, prepared.valid)):
        if ids.exists() and not fresh_tokenizer:
            console.print(f"token ids: reusing {ids}")
            continue
        console.print(f"encoding {text} -> {ids} ...")
        done = encode_file(tokenizer, text, ids)
        console.print(
            f"  {done.num_tokens:,} tokens, {done.bytes_per_token:.2f} bytes/token, in "
            f"{format_seconds(done.seconds)} ({done.mb_per_s:.1f} MB/s)"
        )
    return prepared
