"""llama.cpp's GGUF files as scratchlm models: `scratchlm import-gguf FILE --out RUN` (`import-hf` takes a
`.gguf` path too). The reverse of `gguf.py`, whose docstring lists what a file holds.

A GGUF file is typed key/value metadata and named tensors, read here with the `gguf` package's `GGUFReader`.
What becomes what:

    general.architecture           "llama" only: the architecture scratchlm's model computes. Another (mamba,
                                   qwen2 with its attention biases, ...) is refused, and so is a mixture of
                                   experts (llama.expert_count > 0) and RoPE scaling (llama.rope.scaling.type)
    llama.*                        `ModelConfig`: context_length, embedding_length (d_model), block_count,
                                   feed_forward_length (d_ff), attention.head_count, .head_count_kv (GQA),
                                   attention.layer_norm_rms_epsilon, rope.freq_base (theta), vocab_size (else
                                   the embedding's rows); rope.dimension_count and attention.key_length /
                                   value_length, when present, must be the whole head, as scratchlm rotates it
    tensors                        the state dict, under llama.cpp's names (`GGUFAdapter.names`); no
                                   `output.weight` means tied embeddings, as llama.cpp reads it
    tokenizer.ggml.*               the `Tokenizer`: model "gpt2" (byte-level BPE; "llama", SentencePiece, is
                                   refused), tokens in GPT-2's printable byte form, merges, token_type (control
                                   tokens become special tokens, user-defined ones added tokens that are not
                                   special, `AddedToken(special=False)`: both matched whole in the raw text,
                                   as llama.cpp matches them; unused ones, padding up to the model's
                                   vocabulary, are left out), pre: the split patterns, as llama.cpp reads the
                                   name (`gguf.PRE_TOKENIZERS`: gpt-2, default, Llama 3's, qwen2, smollm;
                                   another name is refused), add_bos_token / add_eos_token with bos_token_id /
                                   eos_token_id: the ids put around a text (`EncodingOptions.prefix_ids`,
                                   `suffix_ids`). A byte without a token of its own is dropped from the text,
                                   as llama.cpp drops it
    tokenizer.chat_template        the chat template (Jinja), kept when scratchlm can render it

Every tensor is dequantized to float32 by the `gguf` package's own `gguf.quants.dequantize`, bit-exact with
ggml's: float32, float16, bfloat16, the legacy blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K to Q6_K
and the IQ types. A type it cannot dequantize, or one it does not know, is refused by name.

RoPE's layout needs no change. llama.cpp's "llama" architecture rotates adjacent pairs of a head's dimensions,
as scratchlm does; llama.cpp's converter permutes the rows of a transformers checkpoint's W_Q and W_K (which
rotate halves) into that order, and transformers' GGUF loader permutes them back (`LlamaTensorProcessor`). So a
GGUF file's W_Q and W_K load into scratchlm unchanged, as `GGUFAdapter.rotates_halves = False` says.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.interop import LLAMA, one_of, require
from scratchlm.interop.gguf import (
    PRE_TOKENIZERS,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    GGUFAdapter,
)
from scratchlm.interop.imported import import_run
from scratchlm.interop.tokenizer_json import usable_template
from scratchlm.interop.tokenizer_json_read import byte_level_tokenizer
from scratchlm.model.config import DEFAULT_NORM_EPS, ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.load import check_pair
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.options import AddedToken
from scratchlm.tokenizer.tokenizer import Tokenizer

TOKEN_TYPE_NAMES = {2: "unknown", 6: "byte"}  # the types of SentencePiece vocabularies, not of byte-level BPE

_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "an array"}


class GGUFFile:
    """The metadata and tensors of one GGUF file, read with `gguf.GGUFReader`; every error names the file."""

    def __init__(self, path: Path) -> None:
        gguf = require("gguf")
        self.path = path
        if not path.is_file():
            raise ScratchlmError(f"{path} is not a file (expected a GGUF file)")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ScratchlmError(f"{path} is not a GGUF file (it does not start with GGUF)")
        try:
            self.reader = gguf.GGUFReader(path)
        except ValueError as e:
            # The reader turns each tensor's type number into the package's enum, which refuses unknown ones.
            unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(e))
            if unknown:
                raise ScratchlmError(
                    f"{path}: a tensor has type {unknown.group(1)}, which is no GGML tensor type the gguf package "
                    "knows"
                ) from None
            raise ScratchlmError(f"cannot read {path} as GGUF: {e}") from None
        except Exception as e:  # a truncated file: the reader's memory map or its parsing fails
            raise ScratchlmError(f"cannot read {path} as GGUF: {e or type(e).__name__}") from None

    def field(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        """The value of metadata `key`, of type `kind` (a list for an array); `default` when absent, a one-line
        error when it is required or of another type."""
        gguf = require("gguf")
        found = self.reader.get_field(key)
        if found is None:
            if default is _REQUIRED:
                raise ScratchlmError(f"{self.path} has no metadata {key}")
            return default
        value = found.contents()
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is float and isinstance(value, float) and found.types == [gguf.GGUFValueType.FLOAT32]:
            # The shortest decimal that rounds to the stored float32, the number its writer meant: 1e-05, not
            # 9.99999974738e-06 (a scratchlm export then imports with its own configuration).
            value = float(str(np.float32(value)))
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            shown = repr(value) if not isinstance(value, list) else f"an array of {len(value)}"
            raise ScratchlmError(f"{self.path}: {key} = {shown}, expected {_KINDS[kind]}")
        return value

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape as PyTorch writes it: GGUF records ggml's `ne`, innermost dimension first."""
        return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in self.reader.tensors}

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor, dequantized to float32 by the `gguf` package."""
        gguf = require("gguf")
        shapes = self.tensor_shapes()
        out = {}
        for tensor in self.reader.tensors:
            try:
                values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise ScratchlmError(
                    f"{self.path}: tensor {tensor.name} is of type {tensor.tensor_type.name}, which the gguf "
                    "package cannot dequantize"
                ) from None
            # A copy: the reader's arrays map the file, read-only.
            out[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
                shapes[tensor.name]
            )
        return out


def model_config_from_gguf(file: GGUFFile) -> ModelConfig:
    """The `ModelConfig` of the file's `llama.*` metadata (see the module docstring); a one-line error naming
    the key whose value scratchlm's model does not compute."""
    architecture = file.field("general.architecture", str)
    if architecture != LLAMA.name:
        raise ScratchlmError(
            f"{file.path}: general.architecture is {architecture!r}; scratchlm builds {LLAMA.name!r} models only"
        )
    prefix = f"{architecture}."
    experts = file.field(prefix + "expert_count", int, 0)
    if experts:
        raise ScratchlmError(
            f"{file.path}: {prefix}expert_count = {experts}, a mixture of experts; scratchlm builds dense models "
            "(no expert_count, or 0)"
        )
    scaling = file.field(prefix + "rope.scaling.type", str, "none")
    if scaling != "none":
        raise ScratchlmError(
            f"{file.path}: {prefix}rope.scaling.type = {scaling!r} is not supported (scratchlm: 'none')"
        )
    d_model = file.field(prefix + "embedding_length", int)
    heads = file.field(prefix + "attention.head_count", int)
    head_dim = d_model // heads if heads else 0
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = file.field(prefix + key, int, head_dim)
        if value != head_dim:
            raise ScratchlmError(
                f"{file.path}: {prefix}{key} = {value}, expected the whole head, embedding_length / head_count "
                f"= {head_dim}, as scratchlm's attention has it"
            )
    shapes = file.tensor_shapes()
    embedding = shapes.get("token_embd.weight", (0,))
    try:
        return ModelConfig(
            vocab_size=file.field(prefix + "vocab_size", int, embedding[0]),
            context_length=file.field(prefix + "context_length", int),
            d_model=d_model,
            num_layers=file.field(prefix + "block_count", int),
            num_heads=heads,
            num_kv_heads=file.field(prefix + "attention.head_count_kv", int, heads),
            d_ff=file.field(prefix + "feed_forward_length", int),
            rope_theta=file.field(prefix + "rope.freq_base", float, 10_000.0),
            norm_eps=file.field(prefix + "attention.layer_norm_rms_epsilon", float, DEFAULT_NORM_EPS),
            # llama.cpp multiplies by the token embeddings when the file has no LM head.
            tie_embeddings="output.weight" not in shapes,
        )
    except (ScratchlmError, TypeError, ValueError) as e:
        raise ScratchlmError(f"{file.path}: {e}") from None


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer | None:
    """The byte-level BPE `Tokenizer` of the file's `tokenizer.ggml.*` metadata, with `tokenizer.chat_template`;
    None when the file has no tokenizer; a one-line error for one that scratchlm's tokenizer would not encode
    as the file's owner does."""
    model = file.field("tokenizer.ggml.model", str, None)
    if model is None:
        return None
    if model != "gpt2":
        kind = " (SentencePiece)" if model == "llama" else ""
        raise ScratchlmError(
            f"{file.path}: tokenizer.ggml.model = {model!r}{kind}; scratchlm's tokenizer is byte-level BPE ('gpt2')"
        )
    pre = file.field("tokenizer.ggml.pre", str, "default")
    if pre not in PRE_TOKENIZERS:
        raise ScratchlmError(
            f"{file.path}: tokenizer.ggml.pre = {pre!r} is a pre-tokenizer scratchlm does not know (it knows "
            f"{one_of([repr(name) for name in PRE_TOKENIZERS])})"
        )
    tokens = file.field("tokenizer.ggml.tokens", list)
    types = file.field("tokenizer.ggml.token_type", list, [TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ScratchlmError(
            f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    texts, specials, user_defined = {}, {}, []
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == TOKEN_NORMAL:
            texts[token_id] = text
        elif kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            specials[token_id] = text
            if kind == TOKEN_USER_DEFINED:
                user_defined.append(AddedToken(text, special=False))
        elif kind != TOKEN_UNUSED:
            name = TOKEN_TYPE_NAMES.get(kind, "not a llama.cpp token type")
            raise ScratchlmError(
                f"{file.path}: tokenizer.ggml.token_type[{token_id}] = {kind} ({name}); byte-level BPE has "
                f"normal ({TOKEN_NORMAL}), control ({TOKEN_CONTROL}), user-defined ({TOKEN_USER_DEFINED}) and "
                f"unused ({TOKEN_UNUSED}) tokens"
            )
    merges = file.field("tokenizer.ggml.merges", list, [])
    template = file.field("tokenizer.chat_template", str, None)
    fields = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    prefix, suffix = _ids_around_text(file, pre, set(texts) | set(specials))
    options = dataclasses.replace(
        PRE_TOKENIZERS[pre], added_tokens=tuple(user_defined), prefix_ids=prefix, suffix_ids=suffix
    )
    tokenizer = byte_level_tokenizer(texts, merges, specials, str(file.path), template, options, fields)
    _warn_of_other_ends(file, tokenizer)
    return usable_template(tokenizer, file.path)


def _ids_around_text(file: GGUFFile, pre: str, ids: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix_ids, suffix_ids): the BOS and EOS llama.cpp puts around a text it tokenizes with `add_special`.
    As llama.cpp reads the file, `add_bos_token` is true by default under Llama 3's names (false under the
    others), `add_eos_token` false; the ids are `bos_token_id` and `eos_token_id`. A file that asks for one
    without naming it (llama.cpp would then add id 11, its default) gets a warning and adds none."""
    around: list[tuple[int, ...]] = []
    for end, default in (("bos", pre in ("llama-bpe", "llama3", "llama-v3")), ("eos", False)):
        if not file.field(f"tokenizer.ggml.add_{end}_token", bool, default):
            around.append(())
            continue
        token_id = file.field(f"tokenizer.ggml.{end}_token_id", int, None)
        if token_id is None:
            console.print(
                f"warning: {file.path} asks for a {end.upper()} token around every text "
                f"(tokenizer.ggml.add_{end}_token) but names none (tokenizer.ggml.{end}_token_id); none is added"
            )
            around.append(())
        elif token_id not in ids:
            raise ScratchlmError(
                f"{file.path}: tokenizer.ggml.{end}_token_id = {token_id}, which is no token of the vocabulary "
                f"(ids 0..{len(file.field('tokenizer.ggml.tokens', list)) - 1}, unused ones excepted)"
            )
        else:
            around.append((token_id,))
    return around[0], around[1]


def _warn_of_other_ends(file: GGUFFile, tokenizer: Tokenizer) -> None:
    """A warning when the file ends a text at an end-of-sequence token other than <|endoftext|>, which
    scratchlm's generation does not follow."""
    eos = file.field("tokenizer.ggml.eos_token_id", int, None)
    if eos is not None and eos != tokenizer.eos_id:
        text = tokenizer.decode([eos]) if eos in tokenizer.vocab else f"id {eos}"
        console.print(
            f"warning: the end-of-sequence token of {file.path} is {text!r}; scratchlm ends a text at "
            f"{END_OF_TEXT} and a chat template's end of turn"
        )


def read_gguf(source: str | os.PathLike) -> tuple[TransformerLM, Tokenizer | None]:
    """The scratchlm model (float32, in eval mode) and tokenizer, with its chat template, of a GGUF file."""
    file = GGUFFile(Path(source))
    config = model_config_from_gguf(file)
    tokenizer = tokenizer_from_gguf(file)
    if tokenizer is not None:
        check_pair(config, tokenizer, None, f"the tokenizer of {file.path}", "its model")
    state = GGUFAdapter(config).from_external(file.tensors(), str(file.path))
    model = TransformerLM(config)
    model.load_state_dict(state)
    return model.eval(), tokenizer


def import_gguf(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Turn the GGUF file `source` into the scratchlm run directory `out` (new, or empty; `imported.import_run`);
    returns `out`."""
    return import_run(source, out, read_gguf, "import-gguf")
