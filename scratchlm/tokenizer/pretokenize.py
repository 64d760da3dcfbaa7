"""Pre-tokenization: cutting text into the pieces inside which BPE works.

BPE never merges across a pre-token boundary. Text is first split on the special tokens (which are never
merged, counted, or split), then each piece between them is cut by GPT-2's regular expression into
contractions, runs of letters, runs of digits, runs of other symbols (each optionally led by one space), and
whitespace. `\\s+(?!\\S)` keeps the last space of a whitespace run attached to the word that follows it, which
is why " world" and not "world" is the usual token.

Counting pre-tokens over a large corpus (`pretoken_counts`) avoids running that expression over every byte: the
text is first cut, by a much simpler expression, into segments of a whitespace run followed by a run of
non-whitespace (`" foo(bar):"`, `"\\n    return"`). No match of the pattern contains a non-whitespace
character followed by a whitespace character, and the pattern has no look-behind, so each segment pre-tokenizes
on its own exactly as it does in place. Real text repeats its segments a great deal, so only the distinct
ones go through the GPT-2 pattern, each weighted by how often it occurs.
"""

from __future__ import annotations

import functools
import re
import sys
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from itertools import compress, repeat
from operator import add, mul

import regex

GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKEN_RE = regex.compile(GPT2_SPLIT_PATTERN)

# GPT-2's pattern for ASCII text, for the standard `re` module, which runs it about twice as fast as `regex` runs
# the Unicode pattern; most documents of English corpora are pure ASCII. On ASCII the classes coincide:
# \p{L} = [A-Za-z], \p{N} = [0-9], \s = [\t\n\x0b\x0c\r ] (the tests check all 128 characters).
_WS = r"\t\n\x0b\x0c\r "
ASCII_PRETOKEN_RE = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"""
)

# Where GPT-2's pattern ends a pre-token whatever text comes next: the places where text may be cut without
# changing its pre-tokens, so that encode(a + b) == encode(a) + encode(b). The match is the character just
# before the cut; a pre-token of the pattern never contains both characters around the cut when
#   - a letter is followed by a non-letter (letter runs, and contractions, end with their last letter),
#   - a digit is followed by a non-digit (digit runs are the only pre-tokens holding digits),
#   - a symbol other than the apostrophe is followed by a letter, digit or whitespace (symbol runs end there;
#     an apostrophe before a letter may open a contraction such as `'s`).
# Whitespace before the cut is never safe: `\s+(?!\S)` leaves a run's last space to the word after it.
CUT_PATTERN = r"\p{L}(?=\P{L})|\p{N}(?=\P{N})|[^\s\p{L}\p{N}'](?=[\s\p{L}\p{N}])"
# The first of those cuts on raw bytes, for BPE training, which splits files before decoding them: an ASCII
# letter followed by an ASCII non-letter (a byte that may start or continue a multi-byte character is neither,
# so no cut falls inside one). Every cut it finds is a cut of `CUT_PATTERN` (tested).
ASCII_LETTER_CUT_PATTERN = rb"[A-Za-z](?=[\x00-\x40\x5b-\x60\x7b-\x7f])"


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


@functools.cache
def whitespace() -> frozenset[str]:
    """The characters the pattern's `\\s` matches, as the installed `regex` module defines them."""
    # Every code point but the surrogates, built through UTF-32 (a join of a million `chr` is slower).
    code_points = array("I", range(0xD800)) + array("I", range(0xE000, sys.maxunicode + 1))
    return frozenset(regex.findall(r"\s", code_points.tobytes().decode(f"utf-32-{sys.byteorder[0]}e")))


@functools.cache
def _segment_re() -> re.Pattern:
    # A whitespace run then a non-whitespace run (or trailing whitespace); the standard `re` is faster here.
    space = "".join(map(re.escape, sorted(whitespace())))
    return re.compile(f"[{space}]*[^{space}]+|[{space}]+")


def pretoken_counts(texts: Iterable[str], max_segments: int = 1 << 20) -> Counter[str]:
    """How often each pre-token occurs in `texts` (pieces without special tokens), pre-tokenizing each distinct
    segment once (see the module docstring). At most `max_segments` distinct segments are held at a time."""
    segment_re = _segment_re()
    space = whitespace()
    segments: Counter[str] = Counter()
    edges: set[str] = set()  # segments that may not be joined to others (see `_add_pretokens`)
    counts: Counter[str] = Counter()
    for text in texts:
        found = segment_re.findall(text)
        if not found:
            continue
        segments.update(found)
        # Only a text's first segment can lack leading whitespace, only its last be whitespace alone.
        if found[0][0] not in space:
            edges.add(found[0])
        if found[-1][-1] in space:
            edges.add(found[-1])
        if len(segments) > max_segments:
            _add_pretokens(segments, edges, counts)
            segments.clear()
            edges.clear()
    _add_pretokens(segments, edges, counts)
    return counts


def _add_pretokens(segments: Counter[str], edges: set[str], counts: Counter[str]) -> None:
    """Add the pre-tokens of `segments` (segment -> count) to `counts`. `edges` are the segments that do not
    start with whitespace or end with it: the others can be concatenated without changing how each splits."""
    for segment in edges:
        n = segments.pop(segment)
        for pretoken in PRETOKEN_RE.findall(segment):
            counts[pretoken] += n
    # Segments that occur equally often go through one call of the pattern together. Those seen once are most
    # of the distinct ones in prose, so they are picked out (by `compress`) and counted (by `update`) in C.
    counts.update(PRETOKEN_RE.findall("".join(compress(segments, map((1).__eq__, segments.values())))))
    by_frequency: dict[int, list[str]] = defaultdict(list)
    for segment, n in compress(segments.items(), map((1).__lt__, segments.values())):
        by_frequency[n].append(segment)
    for n, group in by_frequency.items():
        found = Counter(PRETOKEN_RE.findall("".join(group)))
        add_counts(counts, dict(zip(found, map(mul, found.values(), repeat(n)), strict=True)))


def add_counts(total: dict, more: Mapping) -> None:
    """`total[key] += more[key]` for every key of `more` (a key missing from `total` counts as 0), iterating in
    C: on text with many distinct pre-tokens a loop over the keys in Python (what `Counter.update` does with a
    mapping) is a large share of the time."""
    common = list(filter(total.__contains__, more))
    sums = list(map(add, map(total.__getitem__, common), map(more.__getitem__, common)))
    dict.update(total, more)  # not `Counter.update`, which adds, in Python
    dict.update(total, zip(common, sums, strict=True))
