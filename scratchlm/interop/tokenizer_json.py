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
conversion is a re-packaging of the same strings. An imported tokenizer's `EncodingOptions` (another split
pattern, NFC, added-token flags, a BOS, ...) are written back as the same `tokenizers` settings, so that
`to_tokenizer_json` of an imported tokenizer encodes as the file it came from. Reading is
`tokenizer_json_read.from_tokenizer_json`, which says what is accepted and what is refused.

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
from scratchlm.interop.tokenizer_json_read import from_tokenizer_json
from scratchlm.io import read_json
from scratchlm.tokenizer.serialization import CHAT_TEMPLATE_FILE, token_to_text
from scratchlm.tokenizer.tokenizer import Tokenizer

__all__ = ["from_tokenizer_json", "read_chat_template", "to_tokenizer_json", "usable_template"]

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def to_tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    """The `tokenizer.json` that encodes and decodes exactly as `tokenizer`."""
    options = tokenizer.options
    added = {tokenizer.token_id(content): content for content in tokenizer.special_tokens}
    byte_level = {
        **BYTE_LEVEL,
        "add_prefix_space": options.add_prefix_space,
        "use_regex": options.byte_level_regex,
    }
    splits = [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        for pattern in options.split_patterns
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": tokenizer.token_id(content),
                "content": content,
                "single_word": False,
                "lstrip": flags.lstrip,
                "rstrip": flags.rstrip,
                "normalized": flags.normalized,
                "special": flags.special,
            }
            for content, flags in zip(
                tokenizer.special_tokens, map(options.added_token, tokenizer.special_tokens), strict=True
            )
        ],
        "normalizer": None if options.normalizer is None else {"type": options.normalizer},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]}
        if splits
        else byte_level,
        # ByteLevel post-processing only adjusts offsets; a template adds the ids put around the text.
        "post_processor": _post_processor(tokenizer),
        "decoder": BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": options.ignore_merges,
            # An added token is in the vocabulary under its own text, where `tokenizers` looks for its id.
            "vocab": {
                added.get(i) or token_to_text(token): i for i, token in sorted(tokenizer.vocab.items())
            },
            "merges": [f"{token_to_text(a)} {token_to_text(b)}" for a, b in tokenizer.merges],
        },
    }


def _post_processor(tokenizer: Tokenizer) -> dict[str, Any]:
    byte_level = {**BYTE_LEVEL, "trim_offsets": False}
    prefix, suffix = tokenizer.options.prefix_ids, tokenizer.options.suffix_ids
    if not prefix and not suffix:
        return byte_level
    special = {tokenizer.token_id(content): content for content in tokenizer.special_tokens}
    names = {i: special.get(i, token_to_text(tokenizer.vocab[i])) for i in (*prefix, *suffix)}

    def items(ids: tuple[int, ...], type_id: int) -> list[dict]:
        return [{"SpecialToken": {"id": names[i], "type_id": type_id}} for i in ids]

    single = [*items(prefix, 0), {"Sequence": {"id": "A", "type_id": 0}}, *items(suffix, 0)]
    pair = [*single, *items(prefix, 1), {"Sequence": {"id": "B", "type_id": 1}}, *items(suffix, 1)]
    template = {
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]} for i, name in names.items()},
    }
    return {"type": "Sequence", "processors": [byte_level, template]}


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
        return Tokenizer(
            tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, options=tokenizer.options
        )
    return tokenizer
