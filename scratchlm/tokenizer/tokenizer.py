"""Encoding text to token ids and back with a trained byte-level BPE vocabulary.

Encoding follows the order of training, so that a text is cut exactly where the vocabulary was learnt:

1. Split the text on the special tokens (longest first, so `<|endoftext|><|endoftext|>` beats `<|endoftext|>`
   when both are special). Each special token becomes its one id and is never merged.
2. Cut each ordinary piece into pre-tokens with GPT-2's pattern (`pretokenize.PRETOKEN_RE`, or its faster
   ASCII-only equivalent `ASCII_PRETOKEN_RE` for pure-ASCII pieces).
3. Turn each pre-token into its UTF-8 bytes and repeatedly merge the adjacent pair with the lowest merge rank
   (the order in which training created the merges) until no pair of the pre-token is a merge.

Step 3 depends on nothing but the pre-token, and real text repeats its words, so the ids of each pre-token are
cached (`bpe.BoundedCache`, bounded). With a warm cache, encoding is one regex `findall` and one C-level dict
lookup per pre-token, flattened by `itertools.chain`: no Python code runs per token, which is where the speed
comes from. Only a pre-token not seen recently is merged, by `bpe.PretokenMerger`.

Streaming (`encode_iterable`) needs places where the text can be cut without changing its encoding, which
`safe_cut` finds: after a special token that no later text can extend into a longer one, or between two
characters where GPT-2's pattern always ends a pre-token whatever follows (`streaming.SafeCut`). Decoding ids that
arrive one at a time, as generation produces them, is `detokenizer()`'s (`Detokenizer`).
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.bpe import BoundedCache, PretokenMerger, index_vocabulary
from scratchlm.tokenizer.options import EncodingOptions
from scratchlm.tokenizer.pipeline import Pipeline
from scratchlm.tokenizer.pretokenize import (
    ASCII_PRETOKEN_RE,
    PRETOKEN_RE,
    special_tokens_regex,
    split_on_special_tokens,
)
from scratchlm.tokenizer.serialization import (
    ENCODING_FILE,
    load_chat_template,
    load_encoding,
    load_merges,
    load_tokenizer_files,
    load_vocab,
    save_tokenizer,
)
from scratchlm.tokenizer.streaming import SafeCut, regroup

# Pre-tokens whose ids are kept (roughly 150 bytes each, so about 20 MB when full): enough for the distinct
# pre-tokens of tens of megabytes of real text, bounded however much text passes through.
CACHE_SIZE = 1 << 17

# Characters `encode_iterable` gathers before it looks for a place to cut.
STREAM_CHUNK_CHARS = 1 << 16


class Tokenizer:
    """A byte-level BPE tokenizer: `vocab` maps ids to byte strings, `merges` lists the merges in creation order.

    Special tokens not in `vocab` are added with the next free ids. Every merge must join two tokens of the
    vocabulary into a third. `chat_template`: a chat model's (Jinja, `scratchlm.chat`), carried along.
    `options`: how an imported tokenizer departs from GPT-2's encoding (`EncodingOptions`); `special_tokens`
    then lists all its added tokens, the options giving the flags of those that are not plain special tokens.
    A tokenizer with default options takes the fast path of the module docstring; the others go through
    `Pipeline`, which mirrors HF `tokenizers`."""

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
        chat_template: str | None = None,
        options: EncodingOptions | None = None,
    ) -> None:
        self.vocab: dict[int, bytes] = dict(vocab)
        self.merges: list[tuple[bytes, bytes]] = list(merges)
        self.special_tokens: list[str] = list(dict.fromkeys(special_tokens or []))
        self.chat_template = chat_template
        self.options = options or EncodingOptions()

        # Special tokens not in the vocabulary join it here, with the next free ids.
        self._token_ids, self._special_ids = index_vocabulary(self.vocab, self.special_tokens)
        unknown = [t.content for t in self.options.added_tokens if t.content not in self._special_ids]
        if unknown:
            raise ScratchlmError(f"added token {unknown[0]!r} is not among the special tokens")
        self._pipeline = None
        if not self.options.gpt2_pretokens or self.options.added_tokens:
            self._pipeline = Pipeline(self.options, self._special_ids)
        self._special_re = special_tokens_regex(self.special_tokens)
        self._safe_cut = SafeCut(self.special_tokens, self.options)

        self._cache = BoundedCache(PretokenMerger(self._token_ids, self.merges, self.options), CACHE_SIZE)

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
        options = load_encoding(directory)
        if options is not None:
            options = EncodingOptions.from_dict(options, str(Path(directory) / ENCODING_FILE))
        try:
            return cls(vocab, merges, special_tokens, load_chat_template(directory), options)
        except ScratchlmError as e:
            raise ScratchlmError(f"{directory}: {e}") from None

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer's files (`save_tokenizer`) into `directory`, atomically."""
        encoding = None if self.options.is_default else self.options.to_dict()
        return save_tokenizer(
            directory, self.vocab, self.merges, self.special_tokens, self.chat_template, encoding
        )

    def __reduce__(self) -> tuple:
        # Rebuilt from its definition: the cache is not worth sending to another process.
        return (type(self), (self.vocab, self.merges, self.special_tokens, self.chat_template, self.options))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={self.special_tokens})"
        )

    @property
    def fingerprint(self) -> str:
        """A SHA-256 of the vocabulary, the merges, the special tokens and the encoding options (when they are
        not the defaults, so that GPT-2-style tokenizers keep their fingerprints): equal for two tokenizers
        exactly when they encode and decode alike. A checkpoint records it, so a model is never paired with a
        tokenizer it was not trained with."""
        digest = hashlib.sha256()
        for token_id, token in sorted(self.vocab.items()):
            digest.update(b"%d:%d:" % (token_id, len(token)) + token)
        for left, right in self.merges:
            digest.update(b"m%d:%d:" % (len(left), len(right)) + left + right)
        for special in self.special_tokens:
            digest.update(b"s%d:" % len(special.encode()) + special.encode())
        if not self.options.is_default:
            digest.update(b"o" + json.dumps(self.options.to_dict(), sort_keys=True).encode())
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The token ids of `text`, where the text of a special token becomes that token: HF `tokenizers`'
        `encode(text, add_special_tokens=False).ids`. With `add_special_tokens`, the ids its post-processor
        adds around them too (an imported tokenizer's BOS): `tokenizers`' default `encode(text).ids`."""
        if self._pipeline is not None:
            ids = self._pipeline_ids(text, ordinary=False)
        else:
            ids = []
            for piece, is_special in split_on_special_tokens(text, self._special_re):
                ids.extend((self._special_ids[piece],) if is_special else self._ordinary(piece))
        if add_special_tokens and (self.options.prefix_ids or self.options.suffix_ids):
            return [*self.options.prefix_ids, *ids, *self.options.suffix_ids]
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """The ids of `text` as plain text, special tokens' text included (a chat user's, who can't forge a turn);
        an imported tokenizer's added tokens that are not special are still found."""
        if self._pipeline is not None:
            return self._pipeline_ids(text, ordinary=True)
        return list(self._ordinary(text))

    def _pipeline_ids(self, text: str, ordinary: bool) -> list[int]:
        ids: list[int] = []
        for piece in self._pipeline.pieces(text, ordinary):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += self._cache[piece]
        return ids

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
        return self._safe_cut(text)

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
