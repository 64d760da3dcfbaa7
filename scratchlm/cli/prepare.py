"""`scratchlm prepare`: train the tokenizer on a dataset's training split and encode both splits to `.npy`."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Train a tokenizer on a dataset's train split and encode train and valid to .npy token ids."

DEFAULT_VOCAB_SIZE = 10_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        nargs="+",
        help="tinystories or owt-sample (downloaded with `scratchlm download`); or a directory holding "
        "train.txt and valid.txt; or two text files TRAIN VALID",
    )
    parser.add_argument("--dir", help="where a named dataset was downloaded (default: data/NAME)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: the dataset's directory)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help=f"vocabulary size (default: 10,000 for tinystories, 32,000 for owt-sample, else {DEFAULT_VOCAB_SIZE:,})",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console
    from scratchlm.data.prepare import VOCAB_SIZES, dataset_text_files, prepare_data
    from scratchlm.errors import ScratchlmError

    source = args.source
    if len(source) == 1 and source[0] in VOCAB_SIZES:
        directory = Path(args.dir or f"data/{source[0]}")
        train, valid = dataset_text_files(source[0], directory)
        if not train.exists():
            raise ScratchlmError(
                f"{train} not found; run `scratchlm download {source[0]} --out {directory}` first"
            )
        vocab_size = args.vocab_size or VOCAB_SIZES[source[0]]
    elif len(source) == 1 and Path(source[0]).is_dir():
        directory = Path(source[0])
        train, valid = directory / "train.txt", directory / "valid.txt"
        vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
    elif len(source) == 2:
        train, valid = Path(source[0]), Path(source[1])
        directory = train.parent
        vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
    else:
        raise ScratchlmError(
            f"cannot prepare {' '.join(source)}: expected tinystories, owt-sample, a directory with train.txt "
            "and valid.txt, or two files TRAIN VALID"
        )
    if vocab_size < 257:
        raise ScratchlmError(
            f"--vocab-size must be at least 257 (256 bytes + <|endoftext|>), got {vocab_size}"
        )
    prepared = prepare_data(train, valid, args.out or directory, vocab_size)
    console.print(f"tokenizer {prepared.tokenizer}\ntrain ids {prepared.train}\nvalid ids {prepared.valid}")
