"""`scratchlm encode`: encode a text file into a flat `.npy` array of token ids, on all cores."""

from __future__ import annotations

import argparse

HELP = "Encode a UTF-8 text file into a .npy array of token ids (uint16 when the vocabulary fits)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input", help="UTF-8 text file (documents separated by special tokens such as <|endoftext|>)"
    )
    parser.add_argument("output", help="output .npy file, written atomically")
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR",
        help="tokenizer directory (vocab.json, merges.txt, special_tokens.json)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, metavar="K", help="worker processes (default: all cores)"
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console, format_seconds
    from scratchlm.errors import ScratchlmError
    from scratchlm.tokenizer.encode_file import encode_file
    from scratchlm.tokenizer.tokenizer import Tokenizer

    if args.workers is not None and args.workers < 1:
        raise ScratchlmError(f"--workers must be at least 1, got {args.workers}")
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    summary = encode_file(tokenizer, args.input, args.output, workers=args.workers)
    console.print(
        f"{summary.num_tokens:,} tokens ({summary.dtype}) -> {summary.path}\n"
        f"  {summary.num_bytes / 1e6:,.1f} MB in {format_seconds(summary.seconds)}: "
        f"{summary.mb_per_s:.1f} MB/s, {summary.bytes_per_token:.2f} bytes/token, "
        f"{summary.workers} worker(s), peak memory {summary.peak_memory_mb:.0f} MB"
    )
    if summary.num_tokens == 0:
        console.print(f"warning: {args.input} holds no text: the token file is empty", style="yellow")
