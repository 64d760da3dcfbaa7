"""HF `tokenizers`' `tokenizer.json` <-> scratchlm's byte-level BPE `Tokenizer`.

scratchlm's tokenizer is GPT-2's algorithm, which `tokenizers` spells as:

    normalizer      none
    pre_tokenizer   ByteLevel, use_regex (GPT-2's pattern), no prefix space: the text's UTF-8 bytes, each as
                    its printable stand-in (`serialization.bytes_to_unicode`), cut by GPT-2's pattern
    model           BPE over those stand-in characters: `vocab` {token text: id}, `merges` ["a b", ...] in rank
                    order, no unknown token, no byte fallback, no `ignore_merges`
    decoder         ByteLevel (stand-ins back to bytes, then UTF-8)
    added_tokens    the special tokens, matched in the raw text before anything else, never split

Token text in `vocab` and `merges` is exactly what scratchlm's `vocab.json` and `merges.txt` hold, so the
conversion is a re-packaging of the same strings. Reading checks every field that would change the ids and
refuses, naming the field, a tokenizer that scratchlm would encode differently: another model type, a
normalizer, a pre-tokenizer that is not byte-level or whose pattern is not GPT-2's (Llama 3's, for instance,
caps digit runs at three), BPE options GPT-2 lacks, added tokens that strip whitespace.

A chat model's template travels beside tokenizer.json: `read_chat_template` finds it where transformers does,
and `usable_template` drops one scratchlm cannot render, so that the model imports as a base model rather than
as a chat model no conversation works with.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from scratchlm.chat.template import JINJA, chat_template
from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.io import read_json
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.serialization import CHAT_TEMPLATE_FILE, token_to_text, unicode_to_bytes
from scratchlm.tokenizer.tokenizer import Tokenizer

# GPT-2's pattern as `tokenizers` writes it (its ByteLevel pre-tokenizer's built-in one), and as scratchlm does.
GPT2_PATTERNS = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    GPT2_SPLIT_PATTERN,
)
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def to_tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    """The `tokenizer.json` that encodes and decodes exactly as `tokenizer`."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tokenizer.token_id(special),
                "content": special,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for special in tokenizer.special_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": BYTE_LEVEL,
        # ByteLevel post-processing only adjusts offsets: no token is added around the text.
        "post_processor": {**BYTE_LEVEL, "trim_offsets": False},
        "decoder": BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token_to_text(token): i for i, token in sorted(tokenizer.vocab.items())},
            "merges": [f"{token_to_text(a)} {token_to_text(b)}" for a, b in tokenizer.merges],
        },
    }


def from_tokenizer_json(data: Any, source: str, chat_template: str | None = None) -> Tokenizer:
    """The scratchlm `Tokenizer` of a `tokenizer.json` (parsed), carrying `chat_template` (which a checkpoint
    keeps beside it); a one-line error naming the field of `source` that scratchlm's byte-level BPE cannot
    reproduce."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ScratchlmError(f"{source} is not a tokenizers tokenizer.json (no model object)")
    model = data["model"]
    if model.get("type") != "BPE":
        raise ScratchlmError(
            f"{source}: model.type is {model.get('type')!r}; only byte-level BPE is supported"
        )
    if data.get("normalizer") is not None:
        kind = data["normalizer"].get("type") if isinstance(data["normalizer"], dict) else data["normalizer"]
        raise ScratchlmError(f"{source}: normalizer {kind!r} is not supported (byte-level BPE has none)")
    _check_pre_tokenizer(data.get("pre_tokenizer"), source)
    for key, allowed in (
        ("dropout", (None,)),
        ("continuing_subword_prefix", (None, "")),
        ("end_of_word_suffix", (None, "")),
        ("byte_fallback", (None, False)),
        ("ignore_merges", (None, False)),
    ):
        if model.get(key) not in allowed:
            raise ScratchlmError(f"{source}: model.{key} = {model[key]!r} is not supported by byte-level BPE")

    added = data.get("added_tokens") or []
    special_ids = {}
    for i, token in enumerate(added):
        for key in ("lstrip", "rstrip", "single_word"):
            if token.get(key):
                raise ScratchlmError(
                    f"{source}: added_tokens[{i}].{key} is true, which scratchlm does not support"
                )
        special_ids[token["id"]] = token["content"]
    texts = {token_id: text for text, token_id in model.get("vocab", {}).items()}
    return byte_level_tokenizer(texts, model.get("merges", []), special_ids, source, chat_template)


def byte_level_tokenizer(
    texts: dict[int, str],
    merges: list[Any],
    special_ids: dict[int, str],
    source: str,
    chat_template: str | None = None,
    fields: tuple[str, str] = ("vocab", "model.merges"),
) -> Tokenizer:
    """The `Tokenizer` of a byte-level BPE as files spell it (tokenizer.json, and GGUF's `tokenizer.ggml.*`):
    `texts` maps ids to token text in GPT-2's printable byte form (`serialization.bytes_to_unicode`), `merges`
    lists "a b" (or [a, b]) in rank order, `special_ids` maps the special tokens' ids to their text as written
    (matched whole in raw text, never in byte form). A one-line error names the field of `source` (`fields`:
    the names of the tokens and of the merges there) that is not byte-level."""
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
    try:
        return Tokenizer(vocab, pairs, list(special_ids.values()), chat_template)
    except ScratchlmError as e:
        raise ScratchlmError(f"{source}: {e}") from None


def _check_pre_tokenizer(pre: Any, source: str) -> None:
    """Byte-level with GPT-2's pattern: `ByteLevel(use_regex)`, or a `Split` by the same pattern then
    `ByteLevel` without its own, both without a prefix space."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") if isinstance(step, dict) else None for step in steps]
    if kinds not in (["ByteLevel"], ["Split", "ByteLevel"]):
        raise ScratchlmError(
            f"{source}: pre_tokenizer {' then '.join(map(str, kinds))} is not byte-level "
            "(scratchlm's tokenizer is GPT-2's byte-level BPE)"
        )
    *split, byte_level = steps
    if byte_level.get("add_prefix_space"):
        raise ScratchlmError(f"{source}: pre_tokenizer ByteLevel.add_prefix_space is true; GPT-2's is false")
    if split:
        pattern = split[0].get("pattern", {})
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex not in GPT2_PATTERNS or split[0].get("behavior") != "Isolated" or split[0].get("invert"):
            raise ScratchlmError(
                f"{source}: pre_tokenizer Split pattern {regex!r} is not GPT-2's regular expression, which "
                "is scratchlm's pre-tokenizer"
            )
        if byte_level.get("use_regex"):
            raise ScratchlmError(f"{source}: pre_tokenizer splits twice (Split, then ByteLevel.use_regex)")
    elif not byte_level.get("use_regex", True):
        raise ScratchlmError(f"{source}: pre_tokenizer ByteLevel.use_regex is false (no GPT-2 pattern)")


def read_chat_template(directory: Path) -> str | None:
    """The chat template of a transformers checkpoint, where transformers looks for it: `chat_template.jinja`,
    which takes priority, else tokenizer_config.json's `chat_template` (one template, or named ones, of which
    chat uses `default`). None when there is none."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ScratchlmError(f"{jinja} is not UTF-8 text (byte {e.start})") from None
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    values = read_json(path)
    template = values.get("chat_template") if isinstance(values, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            console.print(f"warning: {path} names no default chat template; imported without one")
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ScratchlmError(f"{path}: chat_template is not Jinja text (got {type(template).__name__})")
    return template


def usable_template(tokenizer: Tokenizer, source: Path) -> Tokenizer:
    """`tokenizer`, or, when scratchlm cannot use its chat template (Jinja that does not parse, or that refuses
    a plain conversation), the same tokenizer without it: the model is imported as a base model, with a
    warning naming the reason, rather than as a chat model on which every conversation would fail. Without
    jinja2 a foreign template cannot be tried here and is kept."""
    foreign = tokenizer.chat_template != JINJA  # scratchlm's own template is Python: no jinja2 needed
    if tokenizer.chat_template is None or (foreign and importlib.util.find_spec("jinja2") is None):
        return tokenizer
    try:
        chat_template(tokenizer)
    except ScratchlmError as e:
        console.print(f"warning: the chat template of {source} cannot be used ({e}); imported without it")
        return Tokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens)
    return tokenizer
