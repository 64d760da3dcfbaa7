"""Pre-tokenization: cutting text into the pieces inside which BPE works.

BPE never merges across a pre-token boundary. Text is first split on the special tokens (which are never
merged, counted, or split), then each piece between them is cut by GPT-2's regular expression into
contractions, runs of letters, runs of digits, runs of other symbols (each optionally led by one space), and
whitespace. `\\s+(?!\\S)` keeps the last space of a whitespace run attached to the word that follows it, which
is why " world" and not "world" is the usual token.
"""

from __future__ import annotations

from collections.abc import Iterable

import regex

GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKEN_RE = regex.compile(GPT2_SPLIT_PATTERN)


def special_tokens_regex(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """A pattern matching any special token, longest first, so that of two overlapping special tokens
    (`<|endoftext|>` and `<|endoftext|><|endoftext|>`) the longer one wins. None when there are none."""
    tokens = sorted(set(special_tokens), key=len, reverse=True)
    if not tokens:
        return None
    return regex.compile("|".join(regex.escape(t) for t in tokens))


def split_on_special_tokens(text: str, special_re: regex.Pattern | None) -> list[tuple[str, bool]]:
    """`text` as consecutive `(piece, is_special)` parts; empty ordinary pieces are left out."""
    if special_re is None:
        return [(text, False)] if text else []
    parts: list[tuple[str, bool]] = []
    position = 0
    for match in special_re.finditer(text):
        if match.start() > position:
            parts.append((text[position : match.start()], False))
        parts.append((match.group(), True))
        position = match.end()
    if position < len(text):
        parts.append((text[position:], False))
    return parts
