"""`scratchlm import-gguf` (and `import-hf` given a .gguf file) against transformers' own GGUF reader.

- Models that `scratchlm export --format gguf` wrote at f32, f16 and q8_0 import into runs whose logits equal
  those of `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` to fp32 rounding, and whose tokenizer gives
  the ids of `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the fixture texts; at f32 the weights, the
  configuration, the tokenizer and the chat template come back exactly.
- Files written here with the `gguf` package's `GGUFWriter`, as llama.cpp's converter lays them out, at Q4_0 and
  Q4_1 (quantized by `gguf.quants.quantize`) and Q4_K (which the package cannot quantize: random blocks of valid
  scales), with grouped-query attention: the same logits as transformers' reading.
- `generate --run` works on the imported run; every refusal is one line, and leaves no run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fixture_path
from interop_helpers import (
    FIXTURE_TEXTS,
    assert_one_line_error,
    chat_tokenizer,
    fuzzed_documents,
    hf_tokenizer_json,
    make_run,
    run_cli,
    scratch_model,
    small_tokenizer,
)

from scratchlm import ModelConfig, Tokenizer, generate, load_trained
from scratchlm.interop.hf import HFAdapter
from scratchlm.interop.tokenizer_json import from_tokenizer_json
from scratchlm.tokenizer import END_OF_TEXT

gguf = pytest.importorskip("gguf", reason="gguf is not installed (scratchlm[hf])")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (scratchlm[hf])")

SMALL = ModelConfig(
    vocab_size=610, context_length=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96
)
TEXT = f"Once upon a time, naïve café 東京 🙂 42{END_OF_TEXT}The end.\n\n\tx  y"


def transformers_reading(path: Path):
    """transformers' model (float32) and tokenizer of the GGUF file `path`."""
    dtype = {"dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def assert_same_logits(run: Path, reference: torch.nn.Module, vocab: int) -> None:
    model = load_trained(run).model.eval()
    ids = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = reference(ids).logits
        assert (model(ids) - theirs).abs().max().item() < 1e-4 * max(1.0, theirs.abs().max().item())


def import_gguf(path: Path, out: Path, capsys, command: str = "import-gguf") -> Path:
    status, _, err = run_cli([command, str(path), "--out", str(out)], capsys)
    assert status == 0, err
    return out


# -- scratchlm's own exports -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "tokenizer"), [("f32", chat_tokenizer), ("f16", small_tokenizer), ("q8_0", small_tokenizer)]
)
def test_an_export_imports_as_transformers_reads_it(tmp_path, capsys, dtype, tokenizer):
    model = scratch_model(SMALL)
    make_run(tmp_path / "run", model, tokenizer())
    path = tmp_path / f"model-{dtype}.gguf"
    argv = [
        "export",
        "--run",
        str(tmp_path / "run"),
        "--format",
        "gguf",
        "--out",
        str(path),
        "--dtype",
        dtype,
    ]
    assert run_cli(argv, capsys)[0] == 0
    run = import_gguf(path, tmp_path / "imported", capsys)
    reference, hf_tokenizer = transformers_reading(path)
    assert_same_logits(run, reference, SMALL.vocab_size)

    trained = load_trained(run)
    for name in FIXTURE_TEXTS:
        text = fixture_path(name).read_text()
        assert trained.tokenizer.encode(text) == hf_tokenizer.encode(text), name
    assert trained.tokenizer.encode(TEXT) == hf_tokenizer.encode(TEXT)
    if dtype == "f32":  # nothing rounded: everything comes back as it was
        assert trained.model.config == SMALL
        assert trained.tokenizer.fingerprint == tokenizer().fingerprint
        assert trained.tokenizer.chat_template == tokenizer().chat_template is not None
        for key, value in model.state_dict().items():
            assert torch.equal(trained.model.state_dict()[key], value), key


def test_generate_runs_on_an_import_through_import_hf(tmp_path, capsys):
    """`import-hf` hands a .gguf file to `import-gguf`; `generate --run` then writes scratchlm's greedy tokens."""
    make_run(tmp_path / "run", scratch_model(dataclass_tied(SMALL)), small_tokenizer())
    path = tmp_path / "model.gguf"
    run_cli(["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(path)], capsys)
    run = import_gguf(path, tmp_path / "imported", capsys, command="import-hf")
    trained = load_trained(run)
    assert trained.model.config.tie_embeddings
    status, out, err = run_cli(
        ["generate", "--run", str(run), "--prompt", "The cat", "--temperature", "0",
         "--max-new-tokens", "8", "--device", "cpu", "--precision", "fp32"],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    tokenizer = small_tokenizer()
    eos = tokenizer.token_id(END_OF_TEXT)
    expected = generate(trained.model, tokenizer.encode("The cat"), 8, temperature=0.0, eos_id=eos)
    assert out == "The cat" + tokenizer.decode([t for t in expected if t != eos]) + "\n"


def dataclass_tied(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, num_kv_heads=1, tie_embeddings=True)


# -- files written by the gguf package, as llama.cpp's converter lays them out ---------------------------------


def llama_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors of a Llama model under llama.cpp's names, in PyTorch's (out, in) layout."""
    rng = np.random.default_rng(seed)
    c, kv = config, config.kv_heads * config.head_dim
    shapes = {"token_embd.weight": (c.vocab_size, c.d_model), "output_norm.weight": (c.d_model,)}
    shapes["output.weight"] = (c.vocab_size, c.d_model)
    for i in range(c.num_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (c.d_model,),
            f"blk.{i}.attn_q.weight": (c.d_model, c.d_model),
            f"blk.{i}.attn_k.weight": (kv, c.d_model),
            f"blk.{i}.attn_v.weight": (kv, c.d_model),
            f"blk.{i}.attn_output.weight": (c.d_model, c.d_model),
            f"blk.{i}.ffn_norm.weight": (c.d_model,),
            f"blk.{i}.ffn_gate.weight": (c.d_ff, c.d_model),
            f"blk.{i}.ffn_up.weight": (c.d_ff, c.d_model),
            f"blk.{i}.ffn_down.weight": (c.d_model, c.d_ff),
        }
    return {
        name: (rng.uniform(0.5, 1.5, shape) if len(shape) == 1 else rng.normal(0, 0.1, shape)).astype(
            np.float32
        )
        for name, shape in shapes.items()
    }


def random_q4_k(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks (256 weights: float16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit
    values) of random content: the gguf package can dequantize Q4_K but not quantize it. A weight is
    `d * scale * q - dmin * min`, and with `dmin = 7.5 d` (q averages 7.5, scale and min alike) the weights are
    centred, about 0.1 apart: queries and keys are not all one direction, so a wrong RoPE layout shows."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(3e-4, 5e-4, blocks.shape[0])
    blocks[:, :4] = np.stack([d, 7.5 * d], axis=1).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def small_vocabulary(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """The small tokenizer as llama.cpp's converter lists it: (tokens, token types, merges) for `vocab_size`
    ids, its token text spelled with transformers' copy of GPT-2's byte table, unused padding after it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    tokenizer = small_tokenizer()
    tokens, types = [], []
    for token_id in range(vocab_size):
        token = tokenizer.vocab.get(token_id)
        special = token is not None and token.decode("utf-8", "replace") in tokenizer.special_tokens
        tokens.append(
            token.decode() if special else "".join(spell[b] for b in token) if token else f"[PAD{token_id}]"
        )
        types.append(3 if special else 1 if token is not None else 5)
    merges = [
        "".join(spell[b] for b in a) + " " + "".join(spell[b] for b in b_) for a, b_ in tokenizer.merges
    ]
    return tokens, types, merges


def write_gguf(
    path: Path,
    config: ModelConfig,
    tensors: dict,
    edit=None,
    architecture: str = "llama",
    vocabulary: tuple[list[str], list[int], list[str]] | None = None,
) -> Path:
    """A GGUF file as llama.cpp's converter writes a Llama model with a GPT-2-style tokenizer (`vocabulary`:
    tokens, token types and merges; the small tokenizer's by default). `tensors` maps names to float32 arrays
    or (quantized bytes, GGML type); `edit(writer)` may add or change metadata before writing."""
    tokens, types, merges = vocabulary or small_vocabulary(config.vocab_size)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(types.index(3))  # the first control token is the end of a text
    if edit is not None:
        edit(writer)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_quantized_files_import_as_transformers_reads_them(tmp_path, capsys, qtype):
    # Q4_K's blocks are 256 weights: every matrix's rows must be whole blocks.
    config = ModelConfig(
        vocab_size=610, context_length=64, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=512
    )
    ggml_type = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(1)
    tensors = {}
    for name, values in llama_tensors(config).items():
        if values.ndim == 1:
            tensors[name] = values  # RMSNorm gains stay float32, as llama.cpp keeps them
        elif qtype == "Q4_K":
            tensors[name] = (random_q4_k(values.shape, rng), ggml_type)
        else:
            tensors[name] = (gguf.quants.quantize(values, ggml_type), ggml_type)
    path = write_gguf(tmp_path / f"model-{qtype}.gguf", config, tensors)
    run = import_gguf(path, tmp_path / "imported", capsys)
    reference, hf_tokenizer = transformers_reading(path)
    assert_same_logits(run, reference, config.vocab_size)
    trained = load_trained(run)
    assert trained.model.config == config
    # The dequantized weights are transformers' to the bit, once in its names and RoPE layout (checked against
    # transformers by the export tests of tests/test_interop_hf.py).
    theirs = reference.state_dict()
    for name, tensor in HFAdapter(config).to_external(trained.model.state_dict()).items():
        assert torch.equal(tensor, theirs[name]), name
    assert trained.tokenizer.fingerprint == small_tokenizer().fingerprint
    assert trained.tokenizer.encode(TEXT) == hf_tokenizer.encode(TEXT)


# -- tokenizers that are not GPT-2's: tokenizer.ggml.pre -----------------------------------------------------------

# Single-byte tokens a SmolLM-like vocabulary lacks (control bytes among them).
MISSING = (0x00, 0x04, 0x05, 0x0B, 0x1B, 0x1F, 0x7F, 0xC0, 0xC1, 0xF5, 0xFE, 0xFF)
# llama.cpp's split patterns for a "default" file, as its llama-vocab.cpp lists them, applied in turn.
LLAMA_CPP_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@functools.cache
def trained_vocabulary(pre: str, missing: tuple[int, ...] = ()) -> tuple[list[str], list[int], list[str]]:
    """A small byte-level BPE that HF `tokenizers` trains on the fixture texts, cutting text as transformers' GGUF
    reader cuts a file whose tokenizer.ggml.pre is `pre`, listed as llama.cpp's converter lists it: (tokens,
    token types, merges), the end and the beginning of text first, as control tokens. The tokens with a byte
    of `missing` are left out, with their merges, as SmolLM's vocabulary lacks some single-byte tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's, for other names
    if pre in GGUF_PRE_TOKENIZER_SPLITS:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        split = pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), "isolated")
        trained.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # GPT-2's end of text: transformers' GGUF reader adds it (its unknown token) when the file lacks it
        special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
        show_progress=False,
    )
    trained.train_from_iterator([fixture_path(name).read_text() for name in FIXTURE_TEXTS], trainer)
    model = json.loads(trained.to_str())["model"]
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    gone = {bytes_to_unicode()[b] for b in missing}
    tokens = [
        text for text, _ in sorted(model["vocab"].items(), key=lambda item: item[1]) if not set(text) & gone
    ]
    merges = [" ".join(merge) for merge in model["merges"] if not set("".join(merge)) & gone]
    return tokens, [3, 3] + [1] * (len(tokens) - 2), merges


def import_trained(tmp_path: Path, capsys, pre: str, missing: tuple[int, ...] = ()) -> tuple[Path, Path]:
    """(the GGUF file of a small model with `trained_vocabulary(pre, missing)` under the name `pre`, its import)."""
    vocabulary = trained_vocabulary(pre, missing)
    config = dataclasses.replace(SMALL, vocab_size=len(vocabulary[0]))
    path = write_gguf(
        tmp_path / f"{pre}.gguf",
        config,
        llama_tensors(config),
        lambda writer: writer.add_tokenizer_pre(pre),  # a second value of a key replaces the first
        vocabulary=vocabulary,
    )
    return path, import_gguf(path, tmp_path / f"imported-{pre}", capsys)


def assert_encodes_as_transformers(run: Path, path: Path, seed: int) -> None:
    """The run's tokenizer gives the ids of transformers' reading of the GGUF file `path` on fuzzed text, where
    transformers reads the file as llama.cpp does. Where they differ, transformers' tokenizer is given llama.cpp's
    reading first: for Llama 3's names, `ignore_merges` (a pre-token that is a token is that token), which
    transformers' GGUF reader leaves out; for "smollm", SmolLM's own pre-tokenizer (each digit on its own, then
    GPT-2's pattern), and for "default" llama.cpp's patterns, where transformers' reader takes GPT-2's pattern
    alone."""
    from tokenizers import Regex, pre_tokenizers

    ours = Tokenizer.from_dir(run / "tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    theirs.backend_tokenizer.model.ignore_merges = ours.options.ignore_merges
    name = gguf.GGUFReader(path).get_field("tokenizer.ggml.pre").contents()
    if name == "smollm":
        theirs.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if name == "default":
        splits = [pre_tokenizers.Split(Regex(pattern), "isolated") for pattern in LLAMA_CPP_DEFAULT]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        theirs.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    for document in fuzzed_documents(seed, 100_000):
        assert ours.encode(document) == theirs.encode(document, add_special_tokens=False), document


@pytest.mark.parametrize(
    ("pre", "missing"),
    [
        ("llama-bpe", ()),
        ("llama3", ()),
        ("qwen2", ()),
        ("llama-bpe", MISSING),
        ("smollm", MISSING),
        ("default", ()),
    ],
)
def test_tokenizers_of_every_pre_name_import_as_llama_cpp_reads_them(tmp_path, capsys, pre, missing):
    path, run = import_trained(tmp_path, capsys, pre, missing)
    assert_encodes_as_transformers(run, path, seed=len(pre) + len(missing))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_an_imported_tokenizer_exports_under_its_pre_name_and_comes_back(tmp_path, capsys, pre):
    _, run = import_trained(tmp_path, capsys, pre)
    exported = tmp_path / "exported.gguf"
    argv = ["export", "--run", str(run), "--format", "gguf", "--out", str(exported)]
    status, _, err = run_cli(argv, capsys)
    assert status == 0, err
    assert gguf.GGUFReader(exported).get_field("tokenizer.ggml.pre").contents() == pre
    again = import_gguf(exported, tmp_path / "again", capsys)
    before, after = Tokenizer.from_dir(run / "tokenizer"), Tokenizer.from_dir(again / "tokenizer")
    assert after.fingerprint == before.fingerprint and after.options == before.options
    assert_encodes_as_transformers(again, exported, seed=5)


def _template(before: list[int], after: list[int]) -> dict:
    """A TemplateProcessing post-processor that puts `before` and `after` around the text."""
    names = {f"T{i}": i for i in (*before, *after)}
    items = [{"SpecialToken": {"id": f"T{i}", "type_id": 0}} for i in before]
    items += [{"Sequence": {"id": "A", "type_id": 0}}]
    items += [{"SpecialToken": {"id": f"T{i}", "type_id": 0}} for i in after]
    special = {name: {"id": name, "ids": [i], "tokens": [name]} for name, i in names.items()}
    return {"type": "TemplateProcessing", "single": items, "pair": [], "special_tokens": special}


EOS = small_tokenizer().token_id(END_OF_TEXT)
EXPORT_REFUSALS = {
    # A prefix space (RoBERTa's, say) is no setting of llama.cpp's byte-level BPE.
    "prefix space": (
        lambda data: data["pre_tokenizer"].update(add_prefix_space=True),
        ("tokenizer.ggml.pre", "add_prefix_space"),
    ),
    "two ids before": (
        lambda data: data.update(post_processor=_template([EOS, 300], [])),
        (f"puts 2 ids [{EOS}, 300] before the text; llama.cpp adds one BOS token",),
    ),
    "a suffix that is not the EOS": (
        lambda data: data.update(post_processor=_template([], [300])),
        (f"puts the ids [300] after the text; llama.cpp adds one, the end-of-sequence token {EOS}",),
    ),
    "an lstrip token": (
        lambda data: data["added_tokens"][0].update(lstrip=True),
        ("the added token '<|endoftext|>' is lstrip, which llama.cpp's token types",),
    ),
}


@pytest.mark.parametrize("case", EXPORT_REFUSALS)
def test_export_refuses_a_tokenizer_llama_cpp_would_encode_otherwise_in_one_line(tmp_path, capsys, case):
    """What neither a tokenizer.ggml.pre name nor GGUF's token types and BOS/EOS keys say: no GGUF is written."""
    change, fragments = EXPORT_REFUSALS[case]
    data = json.loads(hf_tokenizer_json(small_tokenizer(), tmp_path).read_text())
    change(data)
    tokenizer = from_tokenizer_json(data, "tokenizer.json")
    make_run(tmp_path / "run", scratch_model(SMALL), tokenizer)
    out = tmp_path / "model.gguf"
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(out)], capsys
    )
    assert_one_line_error(status, err, *fragments)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "scratchlm-tokenizer", "tokenizer.json"]


# -- refusals --------------------------------------------------------------------------------------------------


def _set_tensor_type(path: Path, name: str, type_number: int) -> None:
    """Overwrite the GGML type number in the tensor info of `name` (name length, name, dimensions, ne[...],
    type), so that the file names a type no reader knows."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", 2)
    at = data.index(key) + len(key) + 2 * 8
    data[at : at + 4] = struct.pack("<I", type_number)
    path.write_bytes(bytes(data))


def _without(name: str):
    return lambda tensors: tensors.pop(name)


REFUSALS = {
    "mamba": (dict(architecture="mamba"), "general.architecture is 'mamba'; scratchlm builds 'llama'"),
    "experts": (dict(edit=lambda w: w.add_expert_count(8)), "llama.expert_count = 8, a mixture of experts"),
    "rope scaling": (
        dict(edit=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)),
        "llama.rope.scaling.type = 'linear' is not supported",
    ),
    "missing tensor": (dict(change=_without("blk.1.ffn_up.weight")), "has no tensor blk.1.ffn_up.weight"),
    "float64": (
        dict(change=lambda t: t.update({"output_norm.weight": t["output_norm.weight"].astype(np.float64)})),
        "tensor output_norm.weight is of type F64, which the gguf package cannot dequantize",
    ),
    "sentencepiece": (
        dict(edit=lambda w: w.add_tokenizer_model("llama")),
        "tokenizer.ggml.model = 'llama' (SentencePiece); scratchlm's tokenizer is byte-level BPE",
    ),
    "unknown pre": (
        dict(edit=lambda w: w.add_tokenizer_pre("mystery")),
        "tokenizer.ggml.pre = 'mystery' is a",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_import_refuses_what_scratchlm_does_not_build_in_one_line(tmp_path, capsys, case):
    settings, fragment = REFUSALS[case]
    tensors = llama_tensors(SMALL)
    settings.get("change", lambda t: None)(tensors)
    path = tmp_path / "model.gguf"

    def edit(writer) -> None:
        if "edit" in settings:  # a second value of a key replaces the first in the writer's table
            settings["edit"](writer)

    write_gguf(path, SMALL, tensors, edit, settings.get("architecture", "llama"))
    status, _, err = run_cli(["import-gguf", str(path), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, str(path), fragment)
    assert not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no temporary directory left either


def test_import_refuses_an_unknown_tensor_type_a_foreign_file_and_an_existing_output(tmp_path, capsys):
    path = write_gguf(tmp_path / "model.gguf", SMALL, llama_tensors(SMALL))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    status, _, err = run_cli(["import-gguf", str(path), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, "exists and is not empty")
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"

    _set_tensor_type(path, "blk.0.attn_q.weight", 99)
    status, _, err = run_cli(["import-gguf", str(path), "--out", str(tmp_path / "new")], capsys)
    assert_one_line_error(status, err, str(path), "a tensor has type 99")

    (tmp_path / "text.gguf").write_text("not a model")
    status, _, err = run_cli(
        ["import-gguf", str(tmp_path / "text.gguf"), "--out", str(tmp_path / "new")], capsys
    )
    assert_one_line_error(status, err, "text.gguf is not a GGUF file")
    assert not (tmp_path / "new").exists()
