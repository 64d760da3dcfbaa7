"""Vocabulary and merges on disk, in GPT-2's `vocab.json` + `merges.txt` form.

A byte-level BPE token is an arbitrary byte string, which is not always valid text. GPT-2 stores it as text
through a fixed bijection between the 256 byte values and 256 printable unicode characters
(`bytes_to_unicode`): printable Latin-1 bytes stand for themselves, the others (control bytes, space, ...)
are shifted to code points from U+0100 on. So the space byte is `Ġ`, newline is `Ċ`, and every token, whatever
its bytes, becomes a string without spaces or newlines. That makes the files lossless for any bytes:

- `vocab.json`: `{"<token as mapped text>": id, ...}`
- `merges.txt`: one merge per line in creation order, the two parts as mapped text separated by one space;
  an optional first line `#version: ...` is ignored.

A tokenizer directory holds these two files and `special_tokens.json`, the list of special tokens (each is
also in `vocab.json`), plus the output marker that lets a later save replace it (`scratchlm.io`). A chat
model's tokenizer also holds `chat_template.jinja`, its chat template (`scratchlm.chat`), in the file and the
language transformers uses. A tokenizer imported from a `tokenizer.json` that does not encode exactly as GPT-2's
also holds `encoding.json`, its `EncodingOptions` (`options.py`); without it a directory encodes as GPT-2.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_directory, atomic_write, check_output_dir

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
SPECIAL_TOKENS_FILE = "special_tokens.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ENCODING_FILE = "encoding.json"
TOKENIZER_KIND = "tokenizer"  # the output marker of a tokenizer directory (scratchlm.io)


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's bijection from the 256 byte values to printable unicode characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_text(token: bytes) -> str:
    """The mapped text of a token: one printable character per byte."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def text_to_token(text: str) -> bytes:
    """Inverse of `token_to_text`. Text with characters outside the mapping (a special token written literally,
    e.g. one containing a space) is taken as its UTF-8 bytes."""
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError:
        return text.encode("utf-8")


def save_tokenizer(
    directory: str | os.PathLike,
    vocab: dict[int, bytes],
    merges: list[tuple[bytes, bytes]],
    special_tokens: list[str] | None = None,
    chat_template: str | None = None,
    encoding: dict | None = None,
) -> Path:
    """Write `vocab.json`, `merges.txt`, `special_tokens.json`, the `chat_template` and the `encoding` options
    (each when there is one) into `directory`, atomically as a whole; an existing `directory` is replaced only
    when it is an earlier tokenizer (or empty)."""
    directory = Path(directory)
    ids_of: dict[bytes, int] = {}
    for token_id, token in sorted(vocab.items()):
        if token in ids_of:
            # vocab.json maps each token's text to one id, so such a vocabulary cannot be written losslessly.
            raise ScratchlmError(f"token {token!r} has two ids, {ids_of[token]} and {token_id}")
        ids_of[token] = token_id
    with atomic_directory(directory, TOKENIZER_KIND, previous=_is_unmarked_tokenizer) as tmp:
        with atomic_write(tmp / VOCAB_FILE, "w") as f:
            json.dump(
                {token_to_text(tok): i for i, tok in sorted(vocab.items())}, f, ensure_ascii=False, indent=0
            )
        with atomic_write(tmp / MERGES_FILE, "w") as f:
            f.write("#version: 0.2\n")
            f.writelines(f"{token_to_text(a)} {token_to_text(b)}\n" for a, b in merges)
        with atomic_write(tmp / SPECIAL_TOKENS_FILE, "w") as f:
            json.dump(list(special_tokens or []), f, ensure_ascii=False)
        if chat_template is not None:
            with atomic_write(tmp / CHAT_TEMPLATE_FILE, "w") as f:
                f.write(chat_template)
        if encoding is not None:
            with atomic_write(tmp / ENCODING_FILE, "w") as f:
                json.dump(encoding, f, ensure_ascii=False, indent=1)
    return directory


def check_tokenizer_output(directory: str | os.PathLike, inputs: list[str | os.PathLike]) -> None:
    """Fail before training, not after, when `directory` cannot take a tokenizer (see `scratchlm.io`)."""
    check_output_dir(directory, TOKENIZER_KIND, inputs, previous=_is_unmarked_tokenizer)


def _is_unmarked_tokenizer(directory: Path) -> bool:
    """A tokenizer directory saved before directories were marked: exactly the three files, nothing else."""
    return set(os.listdir(directory)) == {VOCAB_FILE, MERGES_FILE, SPECIAL_TOKENS_FILE}


def load_vocab(vocab_path: str | os.PathLike) -> dict[int, bytes]:
    """Read a GPT-2 style `vocab.json` into `{id: token bytes}`."""
    vocab_path = Path(vocab_path)
    text = _read_text(vocab_path)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScratchlmError(f"{vocab_path}, line {e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise ScratchlmError(f"{vocab_path}: expected a JSON object mapping token text to id")
    vocab: dict[int, bytes] = {}
    for token_text, token_id in raw.items():
        if not isinstance(token_id, int) or token_id < 0:
            raise ScratchlmError(
                f"{vocab_path}: token {token_text!r} has id {token_id!r}, expected an integer ≥ 0"
            )
        if token_id in vocab:
            raise ScratchlmError(f"{vocab_path}: id {token_id} is used twice")
        vocab[token_id] = text_to_token(token_text)
    return vocab


def load_merges(
    merges_path: str | os.PathLike, vocab: dict[int, bytes] | None = None
) -> list[tuple[bytes, bytes]]:
    """Read a GPT-2 style `merges.txt`; with `vocab`, check that both parts of every merge are tokens."""
    merges_path = Path(merges_path)
    known = set(vocab.values()) if vocab is not None else None
    merges: list[tuple[bytes, bytes]] = []
    for lineno, line in enumerate(_read_text(merges_path).split("\n"), start=1):
        if not line.strip() or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.rstrip("\r").split(" ")
        if len(parts) != 2 or not all(parts):
            raise ScratchlmError(
                f"{merges_path}, line {lineno}: expected two tokens separated by one space, got {line!r}"
            )
        first, second = text_to_token(parts[0]), text_to_token(parts[1])
        if known is not None:
            for part, raw in ((first, parts[0]), (second, parts[1])):
                if part not in known:
                    raise ScratchlmError(
                        f"{merges_path}, line {lineno}: merge part {raw!r} is not in the vocabulary"
                    )
        merges.append((first, second))
    return merges


def load_special_tokens(path: str | os.PathLike) -> list[str]:
    path = Path(path)
    try:
        tokens = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ScratchlmError(f"{path}, line {e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise ScratchlmError(f"{path}: expected a JSON list of non-empty strings")
    return tokens


def load_tokenizer_files(
    directory: str | os.PathLike,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], list[str]]:
    """Read a tokenizer directory written by `save_tokenizer`: `(vocab, merges, special_tokens)`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ScratchlmError(f"tokenizer directory {directory} does not exist")
    vocab = load_vocab(directory / VOCAB_FILE)
    merges = load_merges(directory / MERGES_FILE, vocab)
    special_path = directory / SPECIAL_TOKENS_FILE
    special_tokens = load_special_tokens(special_path) if special_path.exists() else []
    return vocab, merges, special_tokens


def load_chat_template(directory: str | os.PathLike) -> str | None:
    """The chat template of a tokenizer directory, None when it has none (a base model's tokenizer)."""
    path = Path(directory) / CHAT_TEMPLATE_FILE
    return _read_text(path) if path.exists() else None


def load_encoding(directory: str | os.PathLike) -> object | None:
    """The parsed `encoding.json` of a tokenizer directory (checked by `EncodingOptions.from_dict`), None when
    it has none."""
    path = Path(directory) / ENCODING_FILE
    if not path.exists():
        return None
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ScratchlmError(f"{path}, line {e.lineno}: malformed JSON ({e.msg})") from None


def _read_text(path: Path) -> str:
    if not path.exists():
        raise ScratchlmError(f"file not found: {path}")
    if path.is_dir():
        raise ScratchlmError(f"{path} is a directory, expected a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ScratchlmError(f"{path}: not valid UTF-8 at byte {e.start}") from None
