"""Where text may be cut so that encoding the parts gives the ids of the whole (`SafeCut`), and the regrouping of
streamed text into chunks that end at such cuts (`regroup`): what `Tokenizer.encode_iterable` and
`encode_file` stand on.

Two kinds of cut are safe. After an added token matched in the raw text, when nothing later can extend it into
a longer one: `tokenizers` cuts the text there before normalizing or pre-tokenizing it, so what follows is
encoded on its own anyway (not after a token that swallows the whitespace after it, `rstrip`). And, when the
text between added tokens is cut into pre-tokens exactly as GPT-2 cuts it, between two characters where GPT-2's
pattern always ends a pre-token whatever follows (`pretokenize.CUT_PATTERN`). Other split patterns, a prefix
space or a normalizer make the text between added tokens uncuttable: it is then encoded in one piece.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import regex

from scratchlm.tokenizer.options import EncodingOptions
from scratchlm.tokenizer.pretokenize import CUT_PATTERN, special_tokens_regex

# Where text may be cut (`pretokenize.CUT_PATTERN`); `(?r)` searches backwards: the last cut in a window is
# found first.
_CUT_RE = regex.compile(r"(?r)" + CUT_PATTERN)


class SafeCut:
    """`Tokenizer.safe_cut` of a tokenizer with these added tokens and options."""

    def __init__(self, added_tokens: list[str], options: EncodingOptions) -> None:
        raw = [t for t in added_tokens if not options.added_token(t).normalized]
        self._added_re = special_tokens_regex(raw)
        self._longest = max(map(len, raw), default=0)
        self._open_ended = {t for t in raw if options.added_token(t).rstrip}
        self._ordinary_cuts = options.gpt2_pretokens

    def __call__(self, text: str) -> int:
        # An added token starting at `settled` or later might still be completed, or lengthened into a longer
        # one, by what follows; one starting before it is fully visible and final.
        settled = len(text) - max(self._longest - 1, 0)
        cut = searched = 0
        if self._added_re is not None:
            for match in self._added_re.finditer(text):
                if match.start() >= settled:
                    break
                searched = match.end()
                if match.group() not in self._open_ended:
                    cut = searched
        if not self._ordinary_cuts:
            return cut
        # An ordinary cut needs the character after it to be visible and not part of a possible added token.
        end = min(settled + 1, len(text))
        match = _CUT_RE.search(text, searched, end) if end > searched else None
        return match.end() if match else cut


def regroup(pieces: Iterable[str], chunk_chars: int, safe_cut: Callable[[str], int]) -> Iterator[str]:
    """`Tokenizer.safe_chunks`: the pieces joined and cut again at the safe cuts, about `chunk_chars` apart."""
    pending: list[str] = []
    pending_chars = 0
    wanted = chunk_chars
    for piece in pieces:
        if not isinstance(piece, str):
            raise TypeError(f"expected pieces of text (str), got {type(piece).__name__}")
        pending.append(piece)
        pending_chars += len(piece)
        if pending_chars < wanted:
            continue
        text = "".join(pending)
        cut = safe_cut(text)
        if cut:
            yield text[:cut]
        rest = text[cut:]
        pending, pending_chars = [rest], len(rest)
        # Without a cut the text is scanned again only once it has doubled, so a long stretch without a
        # safe cut costs linear, not quadratic, time.
        wanted = max(chunk_chars + len(rest), 2 * len(rest))
    tail = "".join(pending)
    if tail:
        yield tail
