"""The general way from text to pre-tokens, for tokenizers that are not exactly GPT-2's (`EncodingOptions`).

It follows HF `tokenizers`' order, step by step, so that the ids are the ones `tokenizers` gives:

1. Added tokens that are not `normalized` are found in the raw text: the leftmost match, the longest there
   (one alternation of the tokens, longest first, is exactly that), then the next match after it. An `lstrip`
   token takes in the whitespace before it (not past the previous match), an `rstrip` token the whitespace
   after it; whitespace is Unicode's White_Space, as Rust's `char::is_whitespace` has it. `encode_ordinary`
   passes over the special ones (their text stays text) and still cuts out the others.
2. Each piece between them is normalized (NFC, when the tokenizer has that normalizer), and the `normalized`
   added tokens are found in it in the same way.
3. Each remaining piece is cut by the split patterns in turn (each piece into its matches and the text
   between them; empty pieces vanish), gets a space in front when `add_prefix_space` and it has none, and
   is cut by GPT-2's pattern when `byte_level_regex`.

The result interleaves added tokens' ids (ints) with pre-tokens (strs), which `Tokenizer` merges.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

import regex

from scratchlm.tokenizer.options import AddedToken, EncodingOptions, compile_pattern
from scratchlm.tokenizer.pretokenize import ASCII_PRETOKEN_RE, PRETOKEN_RE

# Unicode's White_Space property: what Rust's `char::is_whitespace` tests, and so what `tokenizers`' lstrip and
# rstrip swallow. (Python's `str.isspace` differs: it also takes the separators U+001C..U+001F.)
WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))
)


class Pipeline:
    """`pieces(text)`: the added tokens' ids and the pre-tokens of `text`, as the module docstring says.
    `token_ids` maps each added token's content to its id."""

    def __init__(self, options: EncodingOptions, token_ids: dict[str, int]) -> None:
        self._nfc = options.normalizer == "NFC"
        tokens = [options.added_token(content) for content in token_ids]
        self._raw = _Matcher([t for t in tokens if not t.normalized], token_ids, nfc=False)
        self._normalized = _Matcher([t for t in tokens if t.normalized], token_ids, nfc=self._nfc)
        self._splits = [compile_pattern(p, "split pattern") for p in options.split_patterns]
        self._prefix_space = options.add_prefix_space
        self._byte_level_regex = options.byte_level_regex

    def pieces(self, text: str, ordinary: bool) -> list[int | str]:
        """Added tokens' ids and pre-tokens, in order; `ordinary`: special tokens' text is plain text."""
        out: list[int | str] = []
        for piece in self._raw.split(text, ordinary):
            if isinstance(piece, int):
                out.append(piece)
                continue
            if self._nfc:
                piece = unicodedata.normalize("NFC", piece)
            for part in self._normalized.split(piece, ordinary):
                if isinstance(part, int):
                    out.append(part)
                else:
                    out.extend(self.pretokens(part))
        return out

    def pretokens(self, text: str) -> list[str]:
        """The pre-tokens of a piece of text that holds no added token."""
        pieces = [text]
        for pattern in self._splits:
            pieces = [part for piece in pieces for part in _isolated(pattern, piece)]
        if self._prefix_space:
            pieces = [piece if piece[0] == " " else " " + piece for piece in pieces]
        if self._byte_level_regex:
            pieces = [
                part
                for piece in pieces
                for part in (ASCII_PRETOKEN_RE if piece.isascii() else PRETOKEN_RE).findall(piece)
            ]
        return pieces


def _isolated(pattern: regex.Pattern, text: str) -> list[str]:
    """`text` cut into the matches of `pattern` and the stretches between them (`tokenizers`' Split with
    behavior Isolated), leaving out empty pieces."""
    if pattern.groups == 0:
        found = pattern.findall(text)
        if sum(map(len, found)) == len(text):  # the matches cover the text: no stretch between them
            return [piece for piece in found if piece]
    pieces: list[str] = []
    previous = 0
    for match in pattern.finditer(text):
        start, end = match.span()
        pieces += [text[previous:start]] if start > previous else []
        pieces += [text[start:end]] if end > start else []
        previous = end
    return pieces + ([text[previous:]] if previous < len(text) else [])


class _Matcher:
    """Finds a set of added tokens in text, with their strip flags."""

    def __init__(self, tokens: Iterable[AddedToken], ids: dict[str, int], nfc: bool) -> None:
        # A normalized token is matched in normalized text, so it is looked for in its normalized form.
        self._tokens = {(unicodedata.normalize("NFC", t.content) if nfc else t.content): t for t in tokens}
        self._ids = {matched: ids[token.content] for matched, token in self._tokens.items()}
        ordered = sorted(self._tokens, key=len, reverse=True)
        self._re = regex.compile("|".join(map(regex.escape, ordered))) if ordered else None

    def split(self, text: str, ordinary: bool) -> list[int | str]:
        """`text` as the ids of the tokens found and the non-empty text between them."""
        if self._re is None:
            return [text] if text else []
        out: list[int | str] = []
        done = 0  # where the previous match, with what it swallowed, ended
        for match in self._re.finditer(text):
            token = self._tokens[match.group()]
            if ordinary and token.special:
                continue
            start, stop = match.span()
            if token.lstrip:
                while start > done and text[start - 1] in WHITE_SPACE:
                    start -= 1
            if token.rstrip:
                while stop < len(text) and text[stop] in WHITE_SPACE:
                    stop += 1
            if done < start:
                out.append(text[done:start])
            out.append(self._ids[match.group()])
            # `tokenizers` resumes its search after the match itself, not after what rstrip swallowed: a token
            # made of whitespace may still be found inside that whitespace, and then ends the piece there.
            done = stop
        if done < len(text):
            out.append(text[done:])
        return out
