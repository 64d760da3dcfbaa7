"""Reading HF `tokenizers`' `tokenizer.json`: every byte-level BPE tokenizer it describes, with its ids exactly.

scratchlm's `Tokenizer` is byte-level BPE; what a file sets beyond GPT-2's setup becomes its `EncodingOptions`:

    normalizer      none, or NFC (alone or in a Sequence)
    pre_tokenizer   ByteLevel last (with or without GPT-2's pattern, `use_regex`, and `add_prefix_space`),
                    after any number of Split (a Regex or String pattern, behavior Isolated, not inverted:
                    Llama 3's and Qwen2's patterns, for instance) and Digits steps
    model           BPE over ByteLevel's stand-in characters; `ignore_merges`; a vocabulary that lacks some
                    single-byte tokens, whose bytes are dropped as `tokenizers` drops them
    added_tokens    with their `special`, `lstrip`, `rstrip` and `normalized` flags
    post_processor  ByteLevel, TemplateProcessing, RobertaProcessing or BertProcessing (or a Sequence of them):
                    the ids put around a text, which `Tokenizer.encode(text, add_special_tokens=True)` adds

Everything else that would change the ids is refused in one line naming the file and the piece: another model
(WordPiece, Unigram), another normalizer or pre-tokenizer, a Split that does not isolate its matches, an added
token with `single_word`, BPE dropout or word affixes, and an unknown token or byte fallback in a vocabulary
that lacks single-byte tokens (where they would take effect).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import regex

from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer.options import AddedToken, EncodingOptions, compile_pattern
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.serialization import unicode_to_bytes
from scratchlm.tokenizer.tokenizer import Tokenizer

# GPT-2's pattern as `tokenizers` writes it (its ByteLevel pre-tokenizer's built-in one), and as scratchlm does.
GPT2_PATTERNS = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    GPT2_SPLIT_PATTERN,
)


def from_tokenizer_json(data: Any, source: str, chat_template: str | None = None) -> Tokenizer:
    """The scratchlm `Tokenizer` of a `tokenizer.json` (parsed), carrying `chat_template` (which a checkpoint
    keeps beside it); a one-line error naming the piece of `source` that scratchlm cannot reproduce."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ScratchlmError(f"{source} is not a tokenizers tokenizer.json (no model object)")
    model = data["model"]
    if model.get("type") != "BPE":
        raise ScratchlmError(
            f"{source}: model.type is {model.get('type')!r}; only byte-level BPE is supported"
        )
    for key, allowed in (
        ("dropout", (None, 0, 0.0)),
        ("continuing_subword_prefix", (None, "")),
        ("end_of_word_suffix", (None, "")),
    ):
        if model.get(key) not in allowed:
            raise ScratchlmError(f"{source}: model.{key} = {model[key]!r} is not supported by byte-level BPE")
    normalizer = _normalizer(data.get("normalizer"), source)
    splits, prefix_space, byte_level_regex = _pre_tokenizer(data.get("pre_tokenizer"), source)
    added, added_ids = _added_tokens(data.get("added_tokens") or [], source)
    model_vocab = model.get("vocab", {})
    if len(model_vocab) <= max(model_vocab.values(), default=-1):
        # `tokenizers` numbers an added token that the model's vocabulary lacks after the vocabulary's size,
        # whatever id the file gives it: with holes in the ids, that is another id.
        for i, token in enumerate(data.get("added_tokens") or []):
            if token["content"] not in model_vocab:
                raise ScratchlmError(
                    f"{source}: added_tokens[{i}] ({token['content']!r}) is not in model.vocab, whose ids have "
                    "holes: HF tokenizers would give it another id than its own"
                )
    prefix, suffix = _post_processor(data.get("post_processor"), source)
    texts = {token_id: text for text, token_id in model_vocab.items()}
    for token_id in (*prefix, *suffix):
        if token_id not in texts and token_id not in added_ids:
            raise ScratchlmError(
                f"{source}: post_processor adds id {token_id}, which is not in the vocabulary"
            )
    options = EncodingOptions(
        split_patterns=splits,
        add_prefix_space=prefix_space,
        byte_level_regex=byte_level_regex,
        normalizer=normalizer,
        ignore_merges=bool(model.get("ignore_merges")),
        added_tokens=added,
        prefix_ids=prefix,
        suffix_ids=suffix,
    )
    tokenizer = byte_level_tokenizer(
        texts, model.get("merges", []), added_ids, source, chat_template, options
    )
    if tokenizer.options.drop_missing_bytes:
        # Without an unknown token or byte fallback `tokenizers` drops such a byte; with them it would not.
        for key in ("unk_token", "byte_fallback"):
            if model.get(key):
                missing = missing_bytes(tokenizer.vocab)
                raise ScratchlmError(
                    f"{source}: model.{key} = {model[key]!r} with a vocabulary that lacks {len(missing)} "
                    f"single-byte tokens (first: {bytes(missing[:1])!r}) is not supported"
                )
    return tokenizer


def byte_level_tokenizer(
    texts: dict[int, str],
    merges: list[Any],
    special_ids: dict[int, str],
    source: str,
    chat_template: str | None = None,
    options: EncodingOptions | None = None,
    fields: tuple[str, str] = ("model.vocab", "model.merges"),
) -> Tokenizer:
    """The `Tokenizer` of a byte-level BPE as files spell it: tokenizer.json's `model`, and GGUF's
    `tokenizer.ggml.*` (`gguf_read.py`). `texts` maps ids to token text in GPT-2's printable byte form
    (`serialization.bytes_to_unicode`), `merges` lists "a b" (or [a, b]) in rank order, `special_ids` maps the
    added tokens' ids to their text as written (matched whole in the raw text, never in byte form), `options`
    says how the text is cut (GPT-2's way by default). A vocabulary without a token for some byte gets `drop_missing_bytes`: the byte is
    dropped from the text, as both `tokenizers` (with no unknown token) and llama.cpp drop it. A one-line error
    names the field of `source` (`fields`: where the token texts and the merges are) that is not byte-level."""
    tokens_field, merges_field = fields
    table = unicode_to_bytes()
    vocab: dict[int, bytes] = {}
    for token_id, text in texts.items():
        if token_id in special_ids:
            vocab[token_id] = special_ids[token_id].encode("utf-8")
        elif all(c in table for c in text):
            vocab[token_id] = bytes(table[c] for c in text)
        else:
            raise ScratchlmError(f"{source}: {tokens_field} token {text!r} is not in byte-level form")
    for token_id, content in special_ids.items():
        vocab.setdefault(token_id, content.encode("utf-8"))
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if len(parts) != 2 or not all(isinstance(p, str) and p and all(c in table for c in p) for p in parts):
            raise ScratchlmError(f"{source}: {merges_field}[{rank}] = {merge!r} is not two byte-level tokens")
        pairs.append(tuple(bytes(table[c] for c in part) for part in parts))
    options = options or EncodingOptions()
    if missing_bytes(vocab):
        options = dataclasses.replace(options, drop_missing_bytes=True)
    try:
        return Tokenizer(vocab, pairs, list(special_ids.values()), chat_template, options)
    except ScratchlmError as e:
        raise ScratchlmError(f"{source}: {e}") from None


def missing_bytes(vocab: dict[int, bytes]) -> list[int]:
    """The byte values that no token of `vocab` is alone."""
    tokens = set(vocab.values())
    return [b for b in range(256) if bytes([b]) not in tokens]


def _normalizer(normalizer: Any, source: str) -> str | None:
    """None or "NFC": the normalizers whose effect scratchlm reproduces."""
    steps = normalizer.get("normalizers", []) if _kind(normalizer) == "Sequence" else [normalizer]
    kinds = [_kind(step) for step in steps if step is not None]
    if any(kind != "NFC" for kind in kinds):
        raise ScratchlmError(
            f"{source}: normalizer {' then '.join(map(str, kinds))!r} is not supported (scratchlm applies "
            "none or NFC)"
        )
    return "NFC" if kinds else None


def _pre_tokenizer(pre: Any, source: str) -> tuple[tuple[str, ...], bool, bool]:
    """(split patterns, add_prefix_space, use_regex) of Split and Digits steps followed by ByteLevel."""
    steps = pre.get("pretokenizers", []) if _kind(pre) == "Sequence" else [pre]
    kinds = [_kind(step) for step in steps]
    if not kinds or kinds[-1] != "ByteLevel" or any(kind not in ("Split", "Digits") for kind in kinds[:-1]):
        raise ScratchlmError(
            f"{source}: pre_tokenizer {' then '.join(map(str, kinds))} is not byte-level (scratchlm reads "
            "Split and Digits steps followed by ByteLevel)"
        )
    patterns = []
    for step in steps[:-1]:
        if step["type"] == "Digits":
            patterns.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
            continue
        pattern = step.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            regex_text = pattern["Regex"]
        elif isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            regex_text = regex.escape(pattern["String"])  # the literal text
        else:
            raise ScratchlmError(
                f"{source}: pre_tokenizer Split pattern {pattern!r} is not a Regex or a String"
            )
        if step.get("behavior") != "Isolated" or step.get("invert"):
            raise ScratchlmError(
                f"{source}: pre_tokenizer Split behavior {step.get('behavior')!r} (invert "
                f"{bool(step.get('invert'))}) is not supported; scratchlm reads Isolated, not inverted"
            )
        compile_pattern(regex_text, f"{source}: pre_tokenizer")
        patterns.append(regex_text)
    byte_level = steps[-1]
    use_regex = bool(byte_level.get("use_regex", True))
    # A Split by GPT-2's own pattern then a ByteLevel without one is GPT-2's setup: the fast path.
    if len(patterns) == 1 and patterns[0] in GPT2_PATTERNS and not use_regex:
        patterns, use_regex = [], True
    return tuple(patterns), bool(byte_level.get("add_prefix_space")), use_regex


def _added_tokens(added: list, source: str) -> tuple[tuple[AddedToken, ...], dict[int, str]]:
    """The flags of the added tokens that are not plain special tokens, and id -> content of them all."""
    flagged, ids = [], {}
    for i, token in enumerate(added):
        if not isinstance(token, dict) or not isinstance(token.get("content"), str) or not token["content"]:
            raise ScratchlmError(f"{source}: added_tokens[{i}] has no content")
        if token.get("single_word"):
            raise ScratchlmError(
                f"{source}: added_tokens[{i}].single_word is true, which scratchlm does not support"
            )
        if not isinstance(token.get("id"), int):
            raise ScratchlmError(
                f"{source}: added_tokens[{i}].id is {token.get('id')!r}, expected an integer"
            )
        flags = AddedToken(
            token["content"],
            special=bool(token.get("special", False)),
            lstrip=bool(token.get("lstrip")),
            rstrip=bool(token.get("rstrip")),
            normalized=bool(token.get("normalized", not token.get("special", False))),
        )
        if flags != AddedToken(flags.content):
            flagged.append(flags)
        ids[token["id"]] = flags.content
    return tuple(flagged), ids


def _post_processor(post: Any, source: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a post-processor puts before and after a single text."""
    steps = post.get("processors", []) if _kind(post) == "Sequence" else [post]
    prefix: list[int] = []
    suffix: list[int] = []
    for step in steps:
        kind = _kind(step)
        if kind in (None, "ByteLevel"):  # ByteLevel only adjusts offsets
            continue
        if kind in ("RobertaProcessing", "BertProcessing"):
            prefix.append(step["cls"][1])
            suffix.append(step["sep"][1])
        elif kind == "TemplateProcessing":
            single = step.get("single", [])
            named = step.get("special_tokens", {})
            where = prefix
            for item in single:
                if "Sequence" in item:
                    where = suffix
                elif "SpecialToken" in item and item["SpecialToken"].get("id") in named:
                    where.extend(named[item["SpecialToken"]["id"]]["ids"])
                else:
                    raise ScratchlmError(
                        f"{source}: post_processor TemplateProcessing item {item!r} is not supported"
                    )
            if where is prefix:
                raise ScratchlmError(f"{source}: post_processor TemplateProcessing single has no $A sequence")
        else:
            raise ScratchlmError(f"{source}: post_processor {kind!r} is not supported")
    return tuple(prefix), tuple(suffix)


def _kind(step: Any) -> str | None:
    return step.get("type") if isinstance(step, dict) else None
