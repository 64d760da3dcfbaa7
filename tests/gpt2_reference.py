"""The GPT-2 tokenizer two ways, from the same fixture files: scratchlm's, and tiktoken's `gpt2` encoding as the
oracle. tiktoken normally downloads its files; here its `Encoding` is built offline from `gpt2_vocab.json`:
the mergeable ranks are the vocabulary's byte strings (undoing GPT-2's byte-to-unicode mapping) ranked by id.
"""

from __future__ import annotations

import functools
import json

import tiktoken
from helpers import fixture_path

from scratchlm.tokenizer.tokenizer import Tokenizer

END_OF_TEXT = "<|endoftext|>"
# tiktoken's own `gpt2` pattern, written out independently of scratchlm's copy.
TIKTOKEN_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.cache
def tiktoken_gpt2() -> tiktoken.Encoding:
    # Written out here rather than taken from scratchlm, so the oracle shares no code with what it checks.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    vocab = json.loads(fixture_path("gpt2_vocab.json").read_text(encoding="utf-8"))
    ranks = {bytes(char_to_byte[c] for c in text): i for text, i in vocab.items() if text != END_OF_TEXT}
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=TIKTOKEN_GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: vocab[END_OF_TEXT]},
    )


@functools.cache
def scratchlm_gpt2(*special_tokens: str) -> Tokenizer:
    return Tokenizer.from_files(
        fixture_path("gpt2_vocab.json"),
        fixture_path("gpt2_merges.txt"),
        list(special_tokens or [END_OF_TEXT]),
    )
