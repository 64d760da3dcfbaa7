"""Encoding text to token ids and back with a trained byte-level BPE vocabulary.

Encoding follows the order of training, so that a text is cut exactly where the vocabulary was learnt:

1. Split the text on the special tokens (longest first, so `<|endoftext|><|endoftext|>` beats `<|endoftext|>`
   when both are special). Each special token becomes its one id and is never merged.
2. Cut each ordinary piece into pre-tokens with GPT-2's pattern (`pretokenize.PRETOKEN_RE`, or its faster
   ASCII-only equivalent `ASCII_PRETOKEN_RE` for pure-ASCII pieces).
3. Turn each pre-token into its UTF-8 bytes and repeatedly merge the adjacent pair with the lowest merge rank
   (the order in which training created the merges) until no pair of the pre-token is a merge.

Step 3 depends on nothing but the pre-token, and real text repeats its words, so the ids of each pre-token are
cached (`_BoundedCache`, bounded). With a warm cache, encoding is one regex `findall` and one C-level dict
lookup per pre-token, flattened by `itertools.chain`: no Python code runs per token, which is where the speed
comes from. Only a pre-token not seen recently is merged, by `_bpe`.

Streaming (`encode_iterable`) needs places where the text can be cut without changing its encoding, which
`safe_cut` finds: after a special token that no later text can extend into a longer one, or between two
characters where GPT-2's pattern always ends a pre-token whatever follows (see `_CUT_RE`). Decoding ids that
arrive one at a time, as generation produces them, is `detokenizer()`'s (`Detokenizer`).
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
import itertools
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import regex

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.pretokenize import (
    CUT_PATTERN,
    PRETOKEN_RE,
    special_tokens_regex,
    split_on_special_tokens,
)
from scratchlm.tokenizer.serialization import (
    load_chat_template,
    load_merges,
    load_tokenizer_files,
    load_vocab,
    save_tokenizer,
)

# Pre-tokens whose ids are kept (roughly 150 bytes each, so about 20 MB when full): enough for the distinct
# pre-tokens of tens of megabytes of real text, bounded however much text passes through.
CACHE_SIZE = 1 << 17

# Characters `encode_iterable` gathers before it looks for a place to cut.
STREAM_CHUNK_CHARS = 1 << 16

# Where text may be cut (`pretokenize.CUT_PATTERN`); `(?r)` searches backwards: the last cut in a window is
# found first.
_CUT_RE = regex.compile(r"(?r)" + CUT_PATTERN)


# GPT-2's pattern for ASCII text, for the standard `re` module, which runs it about twice as fast as `regex` runs
# the Unicode pattern; most documents of English corpora are pure ASCII. On ASCII the classes coincide:
# \p{L} = [A-Za-z], \p{N} = [0-9], \s = [\t\n\x0b\x0c\r ] (the tests check all 128 characters).
_WS = r"\t\n\x0b\x0c\r "
ASCII_PRETOKEN_RE = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"""
)


class Tokenizer:
    """A byte-level BPE tokenizer: `vocab` maps ids to byte strings, `merges` lists the merges in creation order.

    Special tokens not in `vocab` are added with the next free ids. Every merge must join two tokens of the
    vocabulary into a third. `chat_template`: a chat model's (Jinja, `scratchlm.chat`), carried along."""

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.vocab: dict[int, bytes] = dict(vocab)
        self.merges: list[tuple[bytes, bytes]] = list(merges)
        self.special_tokens: list[str] = list(dict.fromkeys(special_tokens or []))
        self.chat_template = chat_template

        # Special tokens not in the vocabulary join it here, with the next free ids.
        self._token_ids, self._special_ids = index_vocabulary(self.vocab, self.special_tokens)
        self._special_re = special_tokens_regex(self.special_tokens)
        self._longest_special = max(map(len, self.special_tokens), default=0)

        missing_bytes = [b for b in range(256) if bytes([b]) not in self._token_ids]
        if missing_bytes:
            raise ScratchlmError(
                f"the vocabulary lacks {len(missing_bytes)} single-byte tokens (first: {bytes(missing_bytes[:1])!r});"
                " a byte-level vocabulary needs all 256"
            )
        self._byte_ids: list[int] = [self._token_ids[bytes([b])] for b in range(256)]

        self._merges = merge_table(self.merges, self._token_ids)

        self._cache = _BoundedCache(self._bpe, CACHE_SIZE)

    # -- construction and saving ------------------------------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        vocab_filepath: str | os.PathLike,
        merges_filepath: str | os.PathLike,
        special_tokens: list[str] | None = None,
    ) -> Tokenizer:
        """Load GPT-2 style `vocab.json` and `merges.txt` files."""
        vocab = load_vocab(vocab_filepath)
        merges = load_merges(merges_filepath, vocab)
        try:
            return cls(vocab, merges, special_tokens)
        except ScratchlmError as e:
            raise ScratchlmError(f"{vocab_filepath} + {merges_filepath}: {e}") from None

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer directory written by `save` (or `save_tokenizer`)."""
        vocab, merges, special_tokens = load_tokenizer_files(directory)
        try:
            return cls(vocab, merges, special_tokens, load_chat_template(directory))
        except ScratchlmError as e:
            raise ScratchlmError(f"{directory}: {e}") from None

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer's files (`save_tokenizer`) into `directory`, atomically."""
        return save_tokenizer(directory, self.vocab, self.merges, self.special_tokens, self.chat_template)

    def __reduce__(self) -> tuple:
        # Rebuilt from its definition: the cache is not worth sending to another process.
        return (type(self), (self.vocab, self.merges, self.special_tokens, self.chat_template))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={self.special_tokens})"
        )

    @property
    def fingerprint(self) -> str:
        """A SHA-256 of the vocabulary, the merges and the special tokens: equal for two tokenizers exactly
        when they encode and decode alike. A checkpoint records it, so a model is never paired with a
        tokenizer it was not trained with."""
        digest = hashlib.sha256()
        for token_id, token in sorted(self.vocab.items()):
            digest.update(b"%d:%d:" % (token_id, len(token)) + token)
        for left, right in self.merges:
            digest.update(b"m%d:%d:" % (len(left), len(right)) + left + right)
        for special in self.special_tokens:
            digest.update(b"s%d:" % len(special.encode()) + special.encode())
        return digest.hexdigest()

    @property
    def vocab_size(self) -> int:
        """One more than the largest id: the number of rows an embedding table needs."""
        return max(self.vocab) + 1

    @property
    def eos_id(self) -> int | None:
        """The id of `END_OF_TEXT`, which ends a document (and, given as the prompt, starts one); None when
        the tokenizer has no such special token. Generation, serving and export all ask this one question."""
        return self._special_ids.get(END_OF_TEXT)

    def token_id(self, special_token: str) -> int:
        """The id of a special token, e.g. `token_id("<|endoftext|>")`."""
        try:
            return self._special_ids[special_token]
        except KeyError:
            raise ScratchlmError(
                f"{special_token!r} is not a special token of this tokenizer (it has {self.special_tokens})"
            ) from None

    # -- encoding ---------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, where the text of a special token becomes that token."""
        ids: list[int] = []
        for piece, is_special in split_on_special_tokens(text, self._special_re):
            ids.extend((self._special_ids[piece],) if is_special else self._ordinary(piece))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """The ids of `text` as plain text, special tokens' text included (a chat user's, who can't forge a turn)."""
        return list(self._ordinary(text))

    def _ordinary(self, text: str) -> Iterator[int]:
        # All C-level while the cache is warm: findall, dict lookups, chain (`isascii` is recorded by CPython).
        pretokens = (ASCII_PRETOKEN_RE if text.isascii() else PRETOKEN_RE).findall(text)
        return itertools.chain.from_iterable(map(self._cache.__getitem__, pretokens))

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Ids of the concatenation of `iterable` (e.g. an open text file), produced lazily in bounded memory.

        Text is gathered into chunks that end at safe cuts, so the ids are exactly `encode("".join(iterable))`
        however the input is split. Memory grows only with the longest stretch of text without a safe cut
        (in practice a few words).
        """
        for chunk in self.safe_chunks(iterable, STREAM_CHUNK_CHARS):
            yield from self.encode(chunk)

    def safe_chunks(self, pieces: Iterable[str], chunk_chars: int) -> Iterator[str]:
        """`pieces` regrouped into chunks of about `chunk_chars` characters or more, each ending at a `safe_cut`."""
        return regroup(pieces, chunk_chars, self.safe_cut)

    def safe_cut(self, text: str) -> int:
        """The largest position `c` (0 if none) such that for any text `t` that may follow,
        `encode(text + t) == encode(text[:c]) + encode(text[c:] + t)`."""
        # A special token starting at `settled` or later might still be completed, or lengthened into a longer
        # special token, by what follows; one starting before it is fully visible and final.
        settled = len(text) - max(self._longest_special - 1, 0)
        cut = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                if match.start() >= settled:
                    break
                cut = match.end()
        # An ordinary cut needs the character after it to be visible and not part of a possible special token.
        end = min(settled + 1, len(text))
        match = _CUT_RE.search(text, cut, end) if end > cut else None
        return match.end() if match else cut

    def _bpe(self, pretoken: str) -> tuple[int, ...]:
        """Merge the bytes of one pre-token: repeatedly the adjacent pair with the lowest merge rank, leftmost
        first, until no adjacent pair is a merge."""
        try:
            data = pretoken.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates have no UTF-8 form; like tiktoken, read them as U+FFFD (pairs become one character).
            data = pretoken.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
        ids = [self._byte_ids[b] for b in data]
        if len(ids) > _LONG_PRETOKEN:
            return _bpe_long(ids, self._merges)
        # candidates[k] is the (rank, merged id) of the pair ids[k], ids[k + 1], or _NO_MERGE. Finding the
        # smallest and its leftmost place is C-level work; after a merge only its two neighbours change.
        lookup = self._merges.get
        candidates = list(map(lookup, itertools.pairwise(ids), itertools.repeat(_NO_MERGE)))
        while candidates and (best := min(candidates)) is not _NO_MERGE:
            i = candidates.index(best)
            ids[i : i + 2] = (best[1],)
            del candidates[i]
            if i > 0:
                candidates[i - 1] = lookup((ids[i - 1], ids[i]), _NO_MERGE)
            if i < len(candidates):
                candidates[i] = lookup((ids[i], ids[i + 1]), _NO_MERGE)
        return tuple(ids)

    # -- decoding ---------------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors: plain ints are much faster to look up
            ids = ids.tolist()
        try:
            data = b"".join(map(self.vocab.__getitem__, ids))
        except KeyError as e:
            raise ValueError(
                f"token id {e.args[0]!r} is not in the vocabulary (ids 0..{self.vocab_size - 1})"
            ) from None
        return data.decode("utf-8", errors="replace")

    def detokenizer(self) -> Detokenizer:
        """A decoder for ids that arrive one at a time: text as soon as it is whole (see `Detokenizer`)."""
        return Detokenizer(self.vocab)


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


def index_vocabulary(
    vocab: dict[int, bytes], special_tokens: list[str]
) -> tuple[dict[bytes, int], dict[str, int]]:
    """Token -> id, and special token -> id, adding to `vocab` (in place) each special token it lacks, with
    the next free id; a token that two ids share, or an empty special token, is refused."""
    token_ids: dict[bytes, int] = {}
    for token_id, token in sorted(vocab.items()):
        if token in token_ids:
            raise ScratchlmError(
                f"vocabulary ids {token_ids[token]} and {token_id} are both the token {token!r}"
            )
        token_ids[token] = token_id
    special_ids: dict[str, int] = {}
    for special in special_tokens:
        if not special:
            raise ScratchlmError("a special token cannot be the empty string")
        token = special.encode("utf-8")
        if token not in token_ids:
            new_id = max(vocab, default=-1) + 1
            vocab[new_id] = token
            token_ids[token] = new_id
        special_ids[special] = token_ids[token]
    return token_ids, special_ids


def merge_table(
    merges: list[tuple[bytes, bytes]], token_ids: dict[bytes, int]
) -> dict[tuple[int, int], tuple[int, int]]:
    """(left id, right id) -> (rank, merged id). The lowest rank is the earliest merge; a pair listed twice
    keeps its first rank. Each merge may only join tokens that exist by then (bytes or earlier merges), as
    training makes them: this is what makes "apply the merges in creation order" and "repeatedly merge the
    lowest-ranked pair" the same thing."""
    table: dict[tuple[int, int], tuple[int, int]] = {}
    made = {bytes([b]) for b in range(256)}
    for rank, (left, right) in enumerate(merges):
        for part in (left, right):
            if part not in made:
                raise ScratchlmError(
                    f"merge {rank} ({left!r}, {right!r}): {part!r} is neither a byte nor made by an earlier merge"
                )
        made.add(left + right)
        ids = []
        for part in (left, right, left + right):
            if part not in token_ids:
                raise ScratchlmError(
                    f"merge {rank} ({left!r}, {right!r}): the token {part!r} is not in the vocabulary"
                )
            ids.append(token_ids[part])
        table.setdefault((ids[0], ids[1]), (rank, ids[2]))
    return table


class Detokenizer:
    """The text of token ids given one at a time, as generation produces them.

    A token can end inside a multi-byte UTF-8 character that the next token completes ("é" is C3 A9, and a
    byte-level vocabulary may cut between them), so decoding each token alone would show replacement
    characters in the middle of good text. `add` returns the characters that the bytes so far complete and
    keeps the bytes of an unfinished one; `flush` ends the text. Everything returned, concatenated, is the
    text of all the ids as `Tokenizer.decode` gives it: bytes that are not valid UTF-8, and a character left
    unfinished at the end, become U+FFFD. An id the vocabulary lacks (a model's vocabulary may be padded past
    its tokenizer's) reads as U+FFFD too, rather than ending a stream that is already being shown.
    """

    def __init__(self, vocab: dict[int, bytes]) -> None:
        self._vocab = vocab
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The characters that `token_id`'s bytes complete (possibly none)."""
        return self._decoder.decode(self._vocab.get(token_id, _REPLACEMENT))

    def flush(self) -> str:
        """The end of the text: U+FFFD for the bytes of an unfinished character, else nothing."""
        return self._decoder.decode(b"", final=True)


_REPLACEMENT = "\ufffd".encode()

_NO_MERGE = (float("inf"), -1)

# Pre-tokens longer than this (in bytes) are merged with a heap: the simple loop above rescans every pair after
# each merge, which is fastest for words but quadratic for, say, a megabyte-long run of letters.
_LONG_PRETOKEN = 128


def _bpe_long(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> tuple[int, ...]:
    """The same merges as `Tokenizer._bpe`, in O(n log n): a heap of candidate pairs `(rank, position)` over a
    linked list of positions. An entry whose pair has changed since it was pushed is skipped when popped."""
    n = len(ids)
    following = list(range(1, n + 1))  # next live position (n = none)
    preceding = list(range(-1, n - 1))  # previous live position (-1 = none)
    heap = [(*merges[pair], i) for i, pair in enumerate(itertools.pairwise(ids)) if pair in merges]
    heapq.heapify(heap)
    while heap:
        rank, merged_id, i = heapq.heappop(heap)
        j = following[i]
        if j >= n or merges.get((ids[i], ids[j]), _NO_MERGE)[0] != rank:
            continue  # stale: one side of this pair has been merged away since
        ids[i] = merged_id
        ids[j] = -1
        following[i] = following[j]
        if following[j] < n:
            preceding[following[j]] = i
        for left, right in ((preceding[i], i), (i, following[i])):
            if left >= 0 and right < n and (pair := (ids[left], ids[right])) in merges:
                heapq.heappush(heap, (*merges[pair], left))
    return tuple(token for token in ids if token >= 0)


class _BoundedCache(dict):
    """key -> compute(key), computed on first use. When full, the older half is dropped (dicts keep insertion
    order), so memory stays bounded while frequent keys come straight back."""

    def __init__(self, compute: Callable[[str], tuple[int, ...]], max_size: int) -> None:
        super().__init__()
        self._compute = compute
        self._max_size = max_size

    def __missing__(self, key: str) -> tuple[int, ...]:
        value = self._compute(key)
        if len(self) >= self._max_size:
            for old in list(itertools.islice(self, len(self) // 2)):
                del self[old]
        self[key] = value
        return value
