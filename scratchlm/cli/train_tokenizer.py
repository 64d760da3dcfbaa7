"""`scratchlm train-tokenizer`: train a byte-level BPE tokenizer on a text file and save it as a directory."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

HELP = (
    "Train a byte-level BPE tokenizer on a UTF-8 text file (vocab.json + merges.txt + special_tokens.json)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input", metavar="INPUT", help="UTF-8 text file, documents separated by a special token"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="vocabulary size, counting the 256 bytes, the merges and the special tokens",
    )
    parser.add_argument(
        "--special-token",
        action="append",
        default=[],
        dest="special_tokens",
        metavar="TOKEN",
        help="a special token, e.g. '<|endoftext|>' (repeatable); never merged, and it splits the text",
    )
    parser.add_argument(
        "--no-chat-tokens",
        action="store_true",
        help="do not reserve the chat template's special tokens (<|system|>, <|user|>, <|assistant|>, <|end|>)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output directory: new, empty, or an earlier tokenizer (replaced atomically); other files are refused",
    )
    parser.add_argument(
        "--workers", type=int, metavar="K", help="pre-tokenizing processes (default: every available core)"
    )


def run(args: argparse.Namespace) -> None:
    import time

    from scratchlm.console import console, format_seconds, peak_memory_mb
    from scratchlm.errors import ScratchlmError
    from scratchlm.tokenizer import CHAT_TOKENS
    from scratchlm.tokenizer.serialization import save_tokenizer
    from scratchlm.tokenizer.train import train_bpe

    # The chat tokens are reserved, so that a model pretrained with this tokenizer can learn to chat.
    reserved = () if args.no_chat_tokens else CHAT_TOKENS
    special_tokens = list(dict.fromkeys([*args.special_tokens, *reserved]))
    for token in special_tokens:
        # vocab.json maps token text to one id: a one-byte special token would share its text with that byte.
        if len(token.encode("utf-8")) == 1:
            raise ScratchlmError(f"special token {token!r} is a single byte, which is already a token")
    if args.workers is not None and args.workers < 1:
        raise ScratchlmError(f"--workers must be at least 1, got {args.workers}")
    if Path(args.input).is_file() and Path(args.input).stat().st_size == 0:
        # It would "train" a vocabulary of the 256 bytes and the special tokens alone.
        raise ScratchlmError(f"{args.input} is empty: there is no text to learn merges from")
    out = Path(args.out)
    _check_output(out, Path(args.input))

    start = time.perf_counter()
    vocab, merges = train_bpe(
        args.input, args.vocab_size, special_tokens, workers=args.workers, progress=True
    )
    seconds = time.perf_counter() - start
    save_tokenizer(out, vocab, merges, special_tokens)

    longest = max((vocab[i] for i in range(256 + len(merges))), key=len)  # special tokens aside
    lines = [
        f"trained {len(vocab):,} tokens (256 bytes + {len(merges):,} merges + {len(special_tokens)} special) "
        f"in {format_seconds(seconds)}, peak memory {peak_memory_mb():,.0f} MiB",
        f"longest token: {longest.decode('utf-8', errors='backslashreplace')!r} ({len(longest)} bytes)",
    ]
    asked = args.vocab_size - 256 - len(special_tokens)
    lines.append(f"saved to {out}")
    console.print("\n".join(lines), soft_wrap=True)
    if len(merges) < asked:
        console.print(
            f"warning: stopped early: no pair of tokens was left to merge after {len(merges):,} merges "
            f"({asked:,} asked for), so the vocabulary has {len(vocab):,} tokens instead of {args.vocab_size:,}",
            style="yellow",
            soft_wrap=True,
        )


def _check_output(out: Path, source: Path) -> None:
    """Fail before training, not after, when the output directory cannot be written or is not the
    tokenizer's to replace."""
    from scratchlm.errors import ScratchlmError
    from scratchlm.tokenizer.serialization import check_tokenizer_output

    check_tokenizer_output(out, [source])
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ScratchlmError(f"cannot create output {out}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ScratchlmError(f"cannot write output {out}: {ancestor} is not writable")
