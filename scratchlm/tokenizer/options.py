"""How a tokenizer encodes when it is not exactly GPT-2's setup: the options HF `tokenizers` files carry.

A tokenizer scratchlm trains encodes as GPT-2 does, and `EncodingOptions()` (every field at its default) says
so. A tokenizer imported from a `tokenizer.json` may differ in ways that change its ids but that scratchlm can
reproduce exactly; each field is one of them, named after the `tokenizers` setting it mirrors:

    split_patterns      the pre-tokenizer's `Split` (behavior Isolated) and `Digits` steps, before ByteLevel:
                        regular expressions applied in turn, each cutting every piece into its matches and
                        the text between them (Llama 3's and Qwen2's patterns, digits one by one, ...)
    add_prefix_space    ByteLevel's: a space is put before every piece that does not start with one
    byte_level_regex    ByteLevel's `use_regex`: GPT-2's pattern cuts the pieces last
    normalizer          None, or "NFC": each piece of text between added tokens is NFC-normalized first
    ignore_merges       the BPE model's: a pre-token that is itself a token is that token, unmerged
    drop_missing_bytes  the vocabulary lacks some single-byte tokens, and a byte without a token is dropped
                        from the text it is in (what `tokenizers` does with no unknown token)
    added_tokens        the added tokens whose flags are not those of a plain special token (`AddedToken`)
    prefix_ids          the ids a post-processor puts before the text (a BOS), and `suffix_ids` after it;
                        `Tokenizer.encode(text, add_special_tokens=True)` adds them, as `tokenizers` does

The options are saved beside the vocabulary (`encoding.json`, `to_dict` / `from_dict`), only when they are
not the defaults, so GPT-2-style tokenizer directories are unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import regex

from scratchlm.errors import ScratchlmError


@dataclass(frozen=True)
class AddedToken:
    """An added token's flags, with `tokenizers`' meaning. Every added token is matched in the text before
    pre-tokenization and becomes its one id; `special` ones are not matched by `Tokenizer.encode_ordinary`.
    `lstrip` / `rstrip`: the whitespace before / after the match is swallowed into it. `normalized`: the
    token is matched in the text after normalization, once the other added tokens have been cut out."""

    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False


@dataclass(frozen=True)
class EncodingOptions:
    """See the module's docstring; the defaults are GPT-2's byte-level BPE."""

    split_patterns: tuple[str, ...] = ()
    add_prefix_space: bool = False
    byte_level_regex: bool = True
    normalizer: str | None = None
    ignore_merges: bool = False
    drop_missing_bytes: bool = False
    added_tokens: tuple[AddedToken, ...] = ()
    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()

    @property
    def is_default(self) -> bool:
        return self == EncodingOptions()

    @property
    def gpt2_pretokens(self) -> bool:
        """Whether the text between added tokens is cut into pre-tokens exactly as GPT-2 cuts it."""
        return (
            not self.split_patterns
            and self.byte_level_regex
            and not self.add_prefix_space
            and self.normalizer is None
            and not any(token.normalized for token in self.added_tokens)
        )

    def changed(self) -> list[str]:
        """The names of the fields that are not at their defaults."""
        default = EncodingOptions()
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)]

    def added_token(self, content: str) -> AddedToken:
        """The flags of the added token `content` (a plain special token unless listed)."""
        return next((t for t in self.added_tokens if t.content == content), AddedToken(content))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, `encoding.json`: every field, lists for tuples."""
        values = dataclasses.asdict(self)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}

    @classmethod
    def from_dict(cls, values: Any, source: str) -> EncodingOptions:
        """The options of their JSON form; a missing key keeps its default (a later version's file with more
        keys is refused, naming the key, rather than encoding differently)."""
        if not isinstance(values, dict):
            raise ScratchlmError(f"{source}: expected a JSON object of encoding options")
        fields = {field.name: field for field in dataclasses.fields(cls)}
        unknown = [key for key in values if key not in fields]
        if unknown:
            raise ScratchlmError(
                f"{source}: unknown encoding option {unknown[0]!r} (this version knows {sorted(fields)})"
            )
        kinds = {
            "split_patterns": (list, str),
            "add_prefix_space": (bool, None),
            "byte_level_regex": (bool, None),
            "ignore_merges": (bool, None),
            "drop_missing_bytes": (bool, None),
            "added_tokens": (list, dict),
            "prefix_ids": (list, int),
            "suffix_ids": (list, int),
        }
        read: dict[str, Any] = {}
        for key, value in values.items():
            if key == "normalizer":
                if value not in (None, "NFC"):
                    raise ScratchlmError(f'{source}: normalizer is {value!r}, expected null or "NFC"')
                read[key] = value
                continue
            kind, item = kinds[key]
            if not isinstance(value, kind) or (item and not all(isinstance(v, item) for v in value)):
                expected = kind.__name__ + (f" of {item.__name__}" if item else "")
                raise ScratchlmError(f"{source}: {key} is {value!r}, expected a {expected}")
            read[key] = tuple(value) if kind is list else value
        if "added_tokens" in read:
            read["added_tokens"] = tuple(_added_token(t, source) for t in read["added_tokens"])
        for pattern in read.get("split_patterns", ()):
            compile_pattern(pattern, source)
        return cls(**read)


def _added_token(values: dict, source: str) -> AddedToken:
    names = {field.name for field in dataclasses.fields(AddedToken)}
    if not isinstance(values.get("content"), str) or not set(values) <= names:
        raise ScratchlmError(
            f"{source}: added token {values!r} is not {{content, special, lstrip, rstrip, normalized}}"
        )
    return AddedToken(**values)


def compile_pattern(pattern: str, source: str) -> regex.Pattern:
    """A pre-tokenizer's split pattern, compiled; a one-line error naming it when Python's `regex` cannot."""
    try:
        return regex.compile(pattern)
    except regex.error as e:
        raise ScratchlmError(f"{source}: the split pattern {pattern!r} does not compile ({e})") from None
