"""`scratchlm export --format gguf` against the `gguf` package's reader (fast) and llama.cpp itself (slow).

The fast tests read the file back and check its metadata, the tokenizer embedded in it (token text decoded
with transformers' own copy of GPT-2's byte table) and every tensor, by llama.cpp's names and layout, against
the scratchlm model in each precision; a model that llama.cpp's llama architecture does not compute is refused
in one line naming its features. The slow test runs the file in llama.cpp (`llama-cpp-python`, which
builds llama.cpp from source when it is installed): its tokenization of the fixture texts and its greedy
tokens for a prompt must equal scratchlm's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fixture_path
from interop_helpers import (
    FIXTURE_TEXTS,
    assert_one_line_error,
    make_run,
    run_cli,
    scratch_model,
    small_tokenizer,
)

from scratchlm import ModelConfig, generate
from scratchlm.tokenizer import END_OF_TEXT

gguf = pytest.importorskip("gguf", reason="gguf is not installed (scratchlm[hf])")

# 610 rows for a 600-token tokenizer: the last 10 ids are padding tokens in the file.
SMALL = ModelConfig(
    vocab_size=610, context_length=128, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=192
)


def export(tmp_path: Path, capsys, config: ModelConfig, dtype: str = "f32") -> tuple[torch.nn.Module, Path]:
    model = scratch_model(config)
    make_run(tmp_path / "run", model, small_tokenizer())
    out = tmp_path / f"model-{dtype}.gguf"
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(out), "--dtype", dtype],
        capsys,
    )
    assert status == 0, err
    return model, out


def field(reader, key: str):
    return reader.fields[key].contents()


def test_metadata_and_tokenizer_read_back(tmp_path, capsys):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    _, path = export(tmp_path, capsys, SMALL)
    reader = gguf.GGUFReader(path)
    expected = {
        "general.architecture": "llama",
        "general.file_type": 0,
        "llama.context_length": 128,
        "llama.embedding_length": 128,
        "llama.block_count": 2,
        "llama.feed_forward_length": 192,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.dimension_count": 32,
        "llama.vocab_size": 610,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {key: field(reader, key) for key in expected} == expected
    assert field(reader, "llama.rope.freq_base") == pytest.approx(SMALL.rope_theta)
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)

    tokenizer = small_tokenizer()
    eos = tokenizer.token_id(END_OF_TEXT)
    assert field(reader, "tokenizer.ggml.eos_token_id") == field(reader, "tokenizer.ggml.bos_token_id") == eos
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 610
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if token_id == eos:
            assert (text, kind) == (END_OF_TEXT, 3)  # control
        elif token_id >= tokenizer.vocab_size:
            assert kind == 5  # unused padding
        else:
            assert kind == 1 and bytes(to_byte[c] for c in text) == tokenizer.vocab[token_id]
    merges = [
        tuple(bytes(to_byte[c] for c in part) for part in m.split(" "))
        for m in field(reader, "tokenizer.ggml.merges")
    ]
    assert merges == tokenizer.merges


def llama_cpp_names(layers: int, tied: bool) -> dict[str, str]:
    """llama.cpp's tensor names -> scratchlm's, written out by hand."""
    names = {"token_embd.weight": "token_embeddings.weight", "output_norm.weight": "ln_final.weight"}
    if not tied:
        names["output.weight"] = "lm_head.weight"
    for i in range(layers):
        names |= {
            f"blk.{i}.attn_norm.weight": f"layers.{i}.ln1.weight",
            f"blk.{i}.attn_q.weight": f"layers.{i}.attn.q_proj.weight",
            f"blk.{i}.attn_k.weight": f"layers.{i}.attn.k_proj.weight",
            f"blk.{i}.attn_v.weight": f"layers.{i}.attn.v_proj.weight",
            f"blk.{i}.attn_output.weight": f"layers.{i}.attn.output_proj.weight",
            f"blk.{i}.ffn_norm.weight": f"layers.{i}.ln2.weight",
            f"blk.{i}.ffn_gate.weight": f"layers.{i}.ffn.w1.weight",
            f"blk.{i}.ffn_up.weight": f"layers.{i}.ffn.w3.weight",
            f"blk.{i}.ffn_down.weight": f"layers.{i}.ffn.w2.weight",
        }
    return names


@pytest.mark.parametrize(
    ("dtype", "tied", "ggml_type", "rounding"),
    [
        ("f32", False, "F32", torch.float32),
        ("f16", True, "F16", torch.float16),
        ("bf16", False, "BF16", torch.bfloat16),
    ],
)
def test_tensors_read_back_in_llama_cpp_names_and_layout(tmp_path, capsys, dtype, tied, ggml_type, rounding):
    model, path = export(tmp_path, capsys, dataclasses.replace(SMALL, tie_embeddings=tied), dtype)
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.file_type") == {"f32": 0, "f16": 1, "bf16": 32}[dtype]
    names = llama_cpp_names(2, tied)
    assert {t.name for t in reader.tensors} == set(names)
    state = model.state_dict()
    for tensor in reader.tensors:
        ours = state[names[tensor.name]]
        # GGUF lists dimensions innermost first: a PyTorch (out, in) weight is ne = [in, out].
        assert list(tensor.shape) == list(reversed(ours.shape)), tensor.name
        values = gguf.dequantize(tensor.data, tensor.tensor_type).reshape(ours.shape)
        if ours.dim() == 1:  # RMSNorm gains stay float32
            assert tensor.tensor_type.name == "F32"
            np.testing.assert_array_equal(values, ours.numpy())
        else:
            assert tensor.tensor_type.name == ggml_type
            np.testing.assert_array_equal(values, ours.to(rounding).float().numpy())


@pytest.mark.parametrize(
    ("changes", "features"),
    [
        ({"norm": "post"}, "post-norm (model.norm = 'post')"),
        ({"norm": "none"}, "blocks without RMSNorm (model.norm = 'none')"),
        ({"positions": "none"}, "NoPE (model.positions = 'none')"),
        ({"ffn": "silu"}, "SiLU MLP (model.ffn = 'silu')"),
        ({"qk_norm": True}, "QK-norm (model.qk_norm = True)"),
        ({"value_embeddings": 1}, "value embeddings (model.value_embeddings = 1)"),
        ({"unet_skips": True}, "U-net skips (model.unet_skips = True)"),
        (
            {"ffn": "relu2", "logit_softcap": 15.0},
            "ReLU² MLP (model.ffn = 'relu2') or logit soft-capping (model.logit_softcap = 15.0)",
        ),
        (
            {"norm": "post", "qk_norm": True, "logit_softcap": 15.0},
            "post-norm (model.norm = 'post'), QK-norm (model.qk_norm = True) or logit soft-capping "
            "(model.logit_softcap = 15.0)",
        ),
    ],
)
def test_export_refuses_what_llama_cpp_cannot_compute(tmp_path, capsys, changes, features):
    make_run(tmp_path / "run", scratch_model(dataclasses.replace(SMALL, **changes)), small_tokenizer())
    out = tmp_path / "model.gguf"
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(out)], capsys
    )
    assert_one_line_error(
        status,
        err,
        f"cannot export to gguf: the llama architecture of llama.cpp has no {features}; --format hf writes it "
        "with its modeling code",
    )
    assert not out.exists()


def test_export_refuses_to_overwrite_a_file_that_is_not_gguf(tmp_path, capsys):
    make_run(tmp_path / "run", scratch_model(SMALL), small_tokenizer())
    (tmp_path / "notes.gguf").write_text("my notes")
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "gguf", "--out", str(tmp_path / "notes.gguf")],
        capsys,
    )
    assert status == 2 and "is not a GGUF file" in err
    assert (tmp_path / "notes.gguf").read_text() == "my notes"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_tokenizes_and_generates_as_scratchlm(tmp_path, capsys, dtype):
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)",
    )
    model, path = export(tmp_path, capsys, SMALL, dtype)
    tokenizer = small_tokenizer()
    llm = llama_cpp.Llama(str(path), n_ctx=SMALL.context_length, n_threads=1, seed=0, verbose=False)
    assert_tokenizes_as_scratchlm(llm, tokenizer)

    # Greedy decoding: llama.cpp with the file's weights against scratchlm with the same (rounded) weights.
    reference = model
    if dtype == "f16":
        with torch.no_grad():
            for parameter in reference.parameters():
                if parameter.dim() >= 2:
                    parameter.copy_(parameter.half().float())
    prompt = tokenizer.encode(PROMPT)
    ours = generate(reference, prompt, 32, temperature=0.0)
    theirs = llama_greedy(llm, prompt, 32)
    assert theirs == ours and len(set(ours)) > 8  # not a constant or short loop a broken model might emit
    # The compiled decode step (`scratchlm.generation.decode`) gives the same tokens.
    assert generate(reference, prompt, 32, temperature=0.0, compile=True) == ours


PROMPT = "Once upon a time, there was a little"


def assert_tokenizes_as_scratchlm(llm, tokenizer) -> None:
    """llama.cpp's tokenization of the fixture texts (special tokens included) is scratchlm's, and its
    detokenization gives the texts back."""
    for name in FIXTURE_TEXTS:
        text = fixture_path(name).read_text(encoding="utf-8")
        for sample in (text, f"{END_OF_TEXT}{text[:300]}{END_OF_TEXT} x"):
            ids = llm.tokenize(sample.encode("utf-8"), add_bos=False, special=True)
            assert ids == tokenizer.encode(sample), name
            assert llm.detokenize(ids, special=True) == sample.encode("utf-8"), name


def llama_greedy(llm, prompt: list[int], count: int) -> list[int]:
    """llama.cpp's first `count` greedy tokens after `prompt`."""
    theirs = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == count:
            return theirs
    return theirs


def test_q8_0_matrices_are_blocks_of_32_int8_weights_with_a_float16_scale(tmp_path, capsys):
    """Every matrix whose rows are whole blocks of 32 is Q8_0, the embeddings and the head too (as llama.cpp's
    converter writes `--outtype q8_0`); the FFN's down projection, whose rows of d_ff = 200 are not, is
    float16; the gains float32. Each block read back is integers in [-127, 127] times one float16 scale, the
    block's largest magnitude over 127, within half a step of the weights and the scale's float16 rounding
    (the oracle: those definitions)."""
    config = dataclasses.replace(SMALL, d_ff=200)
    model, path = export(tmp_path, capsys, config, "q8_0")
    reader = gguf.GGUFReader(path)
    assert field(reader, "general.file_type") == 7  # MOSTLY_Q8_0
    names, state = llama_cpp_names(2, tied=False), model.state_dict()
    for tensor in reader.tensors:
        ours = state[names[tensor.name]].double()
        values = (
            torch.from_numpy(np.array(gguf.dequantize(tensor.data, tensor.tensor_type)))
            .reshape(ours.shape)
            .double()
        )
        expected = "F32" if ours.dim() == 1 else "F16" if tensor.name.endswith("ffn_down.weight") else "Q8_0"
        assert tensor.tensor_type.name == expected, tensor.name
        if expected != "Q8_0":
            continue
        blocks, read = ours.reshape(-1, 32), values.reshape(-1, 32)
        scale = (blocks.abs().amax(dim=1) / 127).half().double()[:, None]
        steps = read / scale
        assert torch.equal(steps, steps.round()) and steps.abs().max() <= 127, tensor.name
        # Rounded with the float32 scale, read back with the float16 one: up to 127 times its rounding more.
        assert torch.all((read - blocks).abs() <= scale * (0.5 + 127 * 2**-11)), tensor.name


def test_q8_0_is_a_gguf_dtype_only(tmp_path, capsys):
    make_run(tmp_path / "run", scratch_model(SMALL), small_tokenizer())
    out = tmp_path / "model"
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(out), "--dtype", "q8_0"],
        capsys,
    )
    assert_one_line_error(
        status, err, "--format hf does not write --dtype q8_0; choose one of f32, f16, bf16"
    )
    assert not out.exists()


@pytest.mark.slow
def test_llama_cpp_at_q8_0_generates_as_scratchlms_int8_model(tmp_path, capsys):
    """The Q8_0 file in llama.cpp against the same weights in scratchlm at `--quantize int8`: two 8-bit
    roundings of the weights (per 32-weight block there, per row here; llama.cpp rounds the activations to
    Q8_0 too), so the greedy tokens agree up to test_precision.py's bound at int8's unit, a weight's largest
    error relative to its row's largest, 1/254."""
    from test_precision import assert_same_greedy

    from scratchlm.device import plan
    from scratchlm.generation.layout import prepare_for_inference

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed")
    model, path = export(tmp_path, capsys, SMALL, "q8_0")
    tokenizer = small_tokenizer()
    llm = llama_cpp.Llama(str(path), n_ctx=SMALL.context_length, n_threads=1, seed=0, verbose=False)
    assert_tokenizes_as_scratchlm(llm, tokenizer)
    int8 = prepare_for_inference(model, plan(torch.device("cpu"), "fp32", threads=1), quantize="int8")
    prompt = tokenizer.encode(PROMPT)
    theirs = llama_greedy(llm, prompt, 32)
    assert len(set(theirs)) > 8
    assert_same_greedy(int8, prompt, theirs, "int8")
    assert_same_greedy(int8, prompt, generate(int8, prompt, 32, temperature=0.0, compile=True), "int8")
