"""llama.cpp: a scratchlm model and its tokenizer as one GGUF file (written with the `gguf` package).

A GGUF file is a header of typed key/value metadata followed by named tensors. What llama.cpp's "llama"
architecture reads:

    general.architecture = "llama", general.name, general.file_type (0: all float32, 1: float16, 32: bfloat16)
    llama.context_length, .embedding_length (d_model), .block_count, .feed_forward_length (d_ff),
    llama.attention.head_count, .head_count_kv, .layer_norm_rms_epsilon, llama.rope.freq_base (theta),
    llama.rope.dimension_count (the head size, all of it rotated), llama.vocab_size
    tokenizer.ggml.model = "gpt2" (byte-level BPE), .pre (how text is cut: "gpt-2" for GPT-2's pattern, the
    name of an imported tokenizer's patterns, `PRE_TOKENIZERS`),
    tokenizer.ggml.tokens (each token's text in GPT-2's printable byte form, added tokens as written),
    .token_type (1 normal, 3 control = special, 4 user-defined = an added token that is not special, 5
    unused = padding up to the model's vocab_size), .merges ("a b", in rank order), .eos_token_id
    (<|endoftext|>), .add_bos_token with .bos_token_id (true and the BOS where a post-processor puts one
    before the text, as Llama 3's does; else false, with <|endoftext|> as the BOS), .add_eos_token likewise
    tokenizer.chat_template (a chat model's Jinja template, `scratchlm.chat`), .eot_token_id (its end of turn,
    <|end|>, where llama.cpp ends an answer as it ends a document at the end-of-sequence token)

Tensors are under llama.cpp's names (`GGUFAdapter.names`; `output` is absent when tied: llama.cpp then uses
`token_embd`). Each matrix is stored as numpy writes a PyTorch `(out, in)` weight, which GGUF records as
`ne = [in, out]`, the layout llama.cpp multiplies with. llama.cpp's "llama" RoPE rotates adjacent pairs, as
scratchlm's does, so no rows are permuted (transformers' conversion script permutes back to this layout).
Matrices are float32, float16, bfloat16 or Q8_0; the RMSNorm gains stay float32, as llama.cpp's own converter
keeps them (its kernels take 1-D tensors in float32 only).

Q8_0 (`--dtype q8_0`, file type 7, llama.cpp's `MOSTLY_Q8_0`) is llama.cpp's int8: each row cut into blocks of
32 weights, each block 32 int8 values and one float16 scale `max|w| / 127` (34 bytes for 32 weights), written
by the `gguf` package's own quantizer (`gguf.quants.quantize`, bit-exact with ggml's). As llama.cpp's
`convert_hf_to_gguf.py --outtype q8_0` does, every matrix is Q8_0, the token embeddings and the LM head too,
and a matrix whose rows are not a whole number of 32-weight blocks falls back to float16 (`stored_type`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.interop import LLAMA, require, stop_ids
from scratchlm.interop.adapter import StateDictAdapter
from scratchlm.interop.formats import ExportResult
from scratchlm.interop.verify import (
    as_stored,
    check_export,
    check_logits,
    dtype_keyword,
    optional_transformers,
    quiet,
)
from scratchlm.io import check_output_file
from scratchlm.model.transformer import TransformerLM
from scratchlm.run.load import TrainedModel
from scratchlm.tokenizer.options import AddedToken, EncodingOptions
from scratchlm.tokenizer.serialization import token_to_text
from scratchlm.tokenizer.tokenizer import Tokenizer

# llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16, MOSTLY_Q8_0
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}
# llama.cpp's token types (`llama_token_type`), those of byte-level BPE vocabularies
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# llama.cpp's split patterns (llama-vocab.cpp), applied in turn as `EncodingOptions.split_patterns`. Its GPT-2
# pattern lacks the final `|\s+`, which changes no cut: llama.cpp keeps unmatched text as a piece of its own.
_LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_LLAMA3_OPTIONS = EncodingOptions(split_patterns=(_LLAMA3,), byte_level_regex=False, ignore_merges=True)
# tokenizer.ggml.pre -> how llama.cpp cuts the text of a "gpt2" (byte-level BPE) vocabulary, as the
# `EncodingOptions` of the tokenizer.json each name comes from (the patterns as that file spells them; llama.cpp
# respells `(?i:'s|...)` as `'[sS]|...`). Where transformers' GGUF reader differs, the file's producer,
# llama.cpp, is followed: transformers cuts "default" and "smollm" with GPT-2's pattern alone, and applies
# Llama 3's merges to every pre-token (llama.cpp sets `ignore_merges` for Llama 3 only). Export writes the
# first name whose options are the tokenizer's (`pre_tokenizer_name`).
PRE_TOKENIZERS: dict[str, EncodingOptions] = {
    "gpt-2": EncodingOptions(),
    # punctuation runs first, then GPT-2's pattern, then digit runs, then digits in threes from the left
    "default": EncodingOptions(
        split_patterns=(r"[\p{P}\$\+<=>\^~\|]+", _LLAMA_CPP_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
        byte_level_regex=False,
    ),
    "llama-bpe": _LLAMA3_OPTIONS,
    "llama3": _LLAMA3_OPTIONS,
    "llama-v3": _LLAMA3_OPTIONS,
    "qwen2": EncodingOptions(split_patterns=(_QWEN2,), byte_level_regex=False),
    # each digit on its own, then GPT-2's pattern: SmolLM's Digits(individual_digits) then ByteLevel
    "smollm": EncodingOptions(split_patterns=(r"\p{N}",)),
}


class GGUFAdapter(StateDictAdapter):
    """scratchlm <-> llama.cpp's "llama" tensor names; both rotate adjacent pairs. llama.cpp runs Qwen3 too,
    but transformers' GGUF reader (the independent check of what is written) takes a Qwen3 file's head size
    from its default, not from the file: QK-norm models are refused."""

    format = "gguf"
    architectures = (LLAMA,)
    rotates_halves = False
    names = {
        "token_embeddings.weight": "token_embd.weight",
        "layers.{i}.ln1.weight": "blk.{i}.attn_norm.weight",
        "layers.{i}.attn.q_proj.weight": "blk.{i}.attn_q.weight",
        "layers.{i}.attn.k_proj.weight": "blk.{i}.attn_k.weight",
        "layers.{i}.attn.v_proj.weight": "blk.{i}.attn_v.weight",
        "layers.{i}.attn.output_proj.weight": "blk.{i}.attn_output.weight",
        "layers.{i}.ln2.weight": "blk.{i}.ffn_norm.weight",
        "layers.{i}.ffn.w1.weight": "blk.{i}.ffn_gate.weight",
        "layers.{i}.ffn.w3.weight": "blk.{i}.ffn_up.weight",
        "layers.{i}.ffn.w2.weight": "blk.{i}.ffn_down.weight",
        "ln_final.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }


def gguf_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) for the model's `vocab_size` ids: an added token is a control token when
    it is special, else a user-defined one (`token_type`); ids the tokenizer lacks (the model may have more
    rows than it has tokens) become unused padding tokens."""
    specials = {tokenizer.token_id(s): s for s in tokenizer.special_tokens}
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id in specials:
            tokens.append(specials[token_id])
            types.append(token_type(tokenizer.options.added_token(specials[token_id])))
        elif token_id in tokenizer.vocab:
            tokens.append(token_to_text(tokenizer.vocab[token_id]))
            types.append(TOKEN_NORMAL)
        else:
            tokens.append(f"[PAD{token_id}]")
            types.append(TOKEN_UNUSED)
    merges = [f"{token_to_text(a)} {token_to_text(b)}" for a, b in tokenizer.merges]
    return tokens, types, merges


def token_type(token: AddedToken) -> int:
    """The llama.cpp token type of an added token; a one-line error for flags llama.cpp has no type for.

    llama.cpp finds every control and user-defined token in the raw text before pre-tokenization, the
    longest first (`tokenizer_st_partition`), as `tokenizers` finds an added token that is not `normalized`.
    A control token is a special one: it is found only when special tokens are parsed, and detokenizes to
    nothing unless they are rendered. A user-defined token is found always and always detokenizes to its
    text: `tokenizers`' added token that is not special. llama.cpp reads no strip or normalization flags from
    a file."""
    if token.lstrip or token.rstrip or token.normalized:
        flags = [name for name in ("lstrip", "rstrip", "normalized") if getattr(token, name)]
        raise ScratchlmError(
            f"GGUF export: the added token {token.content!r} is {' and '.join(flags)}, which llama.cpp's "
            "token types (control, user-defined) do not say: they are matched in the raw text, unstripped"
        )
    return TOKEN_CONTROL if token.special else TOKEN_USER_DEFINED


def pre_tokenizer_name(options: EncodingOptions) -> str:
    """The `tokenizer.ggml.pre` under which llama.cpp cuts text into pre-tokens as a tokenizer with `options`
    does; a one-line error naming the options when no name does (a prefix space, another split pattern).
    What the name does not carry is the file's other business: the added tokens' flags (`token_type`), the
    ids around the text (`SpecialIds`), NFC (which llama.cpp does not apply: `nfc_notice`), and a
    vocabulary's missing single-byte tokens, which its tokens say (llama.cpp drops such a byte as scratchlm
    does)."""
    cut = dataclasses.replace(
        options, drop_missing_bytes=False, normalizer=None, added_tokens=(), prefix_ids=(), suffix_ids=()
    )
    name = next((name for name, known in PRE_TOKENIZERS.items() if known == cut), None)
    if name is None:
        raise ScratchlmError(
            "GGUF export writes a tokenizer llama.cpp encodes by its tokenizer.ggml.pre name (one of "
            f"{', '.join(PRE_TOKENIZERS)}); none cuts text as this one, whose options "
            f"{', '.join(cut.changed())} differ from GPT-2's as no name's do"
        )
    return name


@dataclass(frozen=True)
class SpecialIds:
    """The ids a GGUF file names: `bos`, `eos` and whether llama.cpp puts them around every text it tokenizes
    with `add_special` (`tokenizer.ggml.add_bos_token`, `.add_eos_token`): a tokenizer's post-processor ids,
    `EncodingOptions.prefix_ids` and `suffix_ids`, which `Tokenizer.encode(text, add_special_tokens=True)`
    adds. llama.cpp adds one BOS before and one EOS after, so a tokenizer that puts more around its text is
    refused, and so is one whose suffix is not its end of text (the file's one EOS, where llama.cpp ends a
    generation). Without a BOS of its own a file names <|endoftext|> as its BOS, as GPT-2's files do."""

    bos: int | None
    eos: int | None
    add_bos: bool = False
    add_eos: bool = False

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> SpecialIds:
        options, eos = tokenizer.options, tokenizer.eos_id
        if len(options.prefix_ids) > 1:
            raise ScratchlmError(
                f"GGUF export: the tokenizer puts {len(options.prefix_ids)} ids {list(options.prefix_ids)} "
                "before the text; llama.cpp adds one BOS token (tokenizer.ggml.add_bos_token)"
            )
        if options.suffix_ids not in ((), (eos,)):
            raise ScratchlmError(
                f"GGUF export: the tokenizer puts the ids {list(options.suffix_ids)} after the text; llama.cpp "
                f"adds one, the end-of-sequence token {eos} (tokenizer.ggml.add_eos_token)"
            )
        bos = options.prefix_ids[0] if options.prefix_ids else eos
        return cls(bos, eos, bool(options.prefix_ids), bool(options.suffix_ids))


def nfc_notice(options: EncodingOptions, pre: str) -> str | None:
    """What export says of an NFC normalizer (Qwen2's), which llama.cpp does not apply: its BPE tokenizer
    normalizes nothing under any `tokenizer.ggml.pre` name. Text already in NFC (as most text is: keyboards
    and the web write composed characters) encodes the same; a decomposed accent (e + U+0301) is cut and merged
    as it is where this tokenizer would first compose it. llama.cpp's own converter writes Qwen2 so too."""
    if options.normalizer != "NFC":
        return None
    return (
        f"warning: llama.cpp does not NFC-normalize text (tokenizer.ggml.pre = {pre!r}): text that is not "
        "already in NFC form encodes differently there"
    )


def write_gguf(model: TransformerLM, tokenizer: Tokenizer, path: Path, dtype: str, name: str) -> None:
    """Write the GGUF file of `model` and `tokenizer` to `path` (see the module docstring)."""
    pre = pre_tokenizer_name(tokenizer.options)  # the refusals before anything is written
    ids = SpecialIds.of(tokenizer)
    tokens, types, merges = gguf_vocabulary(tokenizer, model.config.vocab_size)
    gguf = require("gguf")
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[dtype])
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.d_model)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.kv_heads)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if ids.bos is not None:
        writer.add_bos_token_id(ids.bos)
    if ids.eos is not None:
        writer.add_eos_token_id(ids.eos)
    # Always written: llama.cpp adds a BOS by default under Llama 3's names.
    writer.add_add_bos_token(ids.add_bos)
    writer.add_add_eos_token(ids.add_eos)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
        turn_ends = [i for i in stop_ids(tokenizer) if i != ids.eos]
        if turn_ends:
            writer.add_eot_token_id(turn_ends[0])

    for tensor_name, tensor in GGUFAdapter(c).to_external(model.state_dict()).items():
        data = tensor.detach().cpu().float().numpy()
        qtype = stored_type(data.shape, dtype)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, np.ascontiguousarray(data))
        else:
            # float16 comes back as a float16 array; bfloat16, which numpy lacks, and Q8_0's blocks as their
            # bytes (uint8), whose element shape the writer works out from `raw_dtype`.
            writer.add_tensor(tensor_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def stored_type(shape: tuple[int, ...], dtype: str) -> Any:
    """The GGML type (`gguf.GGMLQuantizationType`) a tensor of `shape` is written in at `--dtype dtype`:
    vectors (the RMSNorm gains) in float32; matrices in `dtype`, except at q8_0 those whose rows are not a
    whole number of 32-weight blocks, in float16 (what llama.cpp's converter falls back to)."""
    gguf = require("gguf")
    types = gguf.GGMLQuantizationType
    if len(shape) < 2 or dtype == "f32":
        return types.F32
    if dtype == "q8_0":
        block = gguf.GGML_QUANT_SIZES[types.Q8_0][0]
        return types.Q8_0 if shape[-1] % block == 0 else types.F16
    return {"f16": types.F16, "bf16": types.BF16}[dtype]


def as_written(model: TransformerLM, dtype: str) -> TransformerLM:
    """A float32 copy of `model` with the weights the file holds at `dtype`: each tensor quantized to its
    `stored_type` and dequantized by the `gguf` package, as transformers and llama.cpp read them back."""
    if dtype != "q8_0":
        return as_stored(model, dtype, vectors_too=False)
    gguf = require("gguf")
    stored = copy.deepcopy(model).float()
    with torch.no_grad():
        for parameter in stored.parameters():
            data = parameter.detach().numpy()
            qtype = stored_type(data.shape, dtype)
            values = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
            parameter.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(data.shape)))
    return stored


def export_gguf(trained: TrainedModel, out: str | os.PathLike, dtype: str = "f32") -> ExportResult:
    """Write `trained` (model and tokenizer) as the GGUF file `out`. With transformers installed, its GGUF
    reader loads the file and its logits are compared with scratchlm's before the file takes its name."""
    out = Path(out)
    architecture, _ = check_export(trained, (GGUFAdapter,), dtype, dtypes=tuple(FILE_TYPES))
    check_output_file(out, previous=_is_gguf, what="a GGUF file")  # before any work
    require("gguf")
    model = trained.model.cpu().float()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.tmp-", dir=out.parent) as tmp:
        path = Path(tmp) / out.name
        write_gguf(model, trained.tokenizer, path, dtype, out.stem)
        if notice := nfc_notice(trained.tokenizer.options, pre_tokenizer_name(trained.tokenizer.options)):
            console.print(notice)
        difference = _verify(path, model, dtype)
        os.chmod(path, 0o666 & ~_umask())
        os.replace(path, out)
    return ExportResult(
        out, architecture, difference, loaded_as=f"llama.cpp architecture {architecture.name}"
    )


def _verify(path: Path, model: TransformerLM, dtype: str) -> float | None:
    transformers = optional_transformers()
    if transformers is None:
        console.print("warning: transformers is not installed, so the export was not checked against it")
        return None
    require("accelerate")  # transformers reads GGUF files through it
    # The file's weights are dequantized straight into float32 (transformers calls such a model quantized, and
    # a quantized model cannot be cast afterwards).
    with quiet(transformers):
        external = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, **{dtype_keyword(transformers): torch.float32}
        ).eval()
    reference = as_written(model, dtype)
    return check_logits(reference, lambda ids: external(ids).logits, "transformers' reading of the GGUF file")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
