"""Hugging Face transformers as the oracle of `scratchlm export --format hf` and `scratchlm import-hf`.

- Llama checkpoints made by transformers (with and without grouped-query attention and tied embeddings, one
  safetensors file or shards) import into scratchlm models whose logits equal transformers' to 1e-4.
- scratchlm models of the Llama architecture export to directories that `AutoModelForCausalLM` /
  `AutoTokenizer.from_pretrained` load with no custom code: equal logits, the same 32 greedy tokens, and
  export -> import gives back the same tensors bit for bit. QK-norm exports as Qwen3, which computes the same
  function. (Every other model exports with its own modeling code: tests/test_interop_remote_code.py.)
- The exported tokenizer.json gives scratchlm's ids on the fixture texts and on random Unicode, and decodes
  alike; a tokenizer.json made by `tokenizers` imports as the same tokenizer.
- Every refusal, and every corrupt input, is one line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fixture_path
from hypothesis import given, settings
from hypothesis import strategies as st
from interop_helpers import (
    FIXTURE_TEXTS,
    assert_one_line_error,
    gpt2_tokenizer,
    hf_tokenizer_json,
    make_run,
    random_llama,
    run_cli,
    scratch_model,
    small_tokenizer,
)

from scratchlm import ModelConfig, Tokenizer, TransformerLM, generate, load_trained, train_bpe
from scratchlm.interop.hf import read_hf
from scratchlm.interop.tokenizer_json import from_tokenizer_json
from scratchlm.tokenizer import END_OF_TEXT

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scratchlm[hf])")

SMALL = ModelConfig(vocab_size=610, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=96)
VARIANTS = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "mqa-tied": {"num_kv_heads": 1, "tie_embeddings": True},
}


def tokens(*shape: int, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- import ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_heads", "tied", "shards"),
    [(4, False, None), (2, False, None), (1, True, None), (2, True, "40KB")],
    ids=["mha", "gqa", "mqa-tied", "gqa-tied-sharded"],
)
def test_imported_llama_gives_transformers_logits(tmp_path, kv_heads, tied, shards):
    reference = random_llama(
        tmp_path / "hf", num_key_value_heads=kv_heads, tie_word_embeddings=tied, max_shard_size=shards
    )
    if shards:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model, tokenizer = read_hf(tmp_path / "hf")
    assert tokenizer is None
    assert model.config.kv_heads == kv_heads and model.config.tie_embeddings == tied
    ids = tokens(2, 50)
    with torch.no_grad():
        assert max_difference(model(ids), reference(ids).logits) < 1e-4


def test_an_imported_model_keeps_its_rmsnorm_epsilon(tmp_path):
    # A large epsilon, so that the logits depend on it visibly: importing it as 1e-5 would not match.
    reference = random_llama(tmp_path / "hf", rms_norm_eps=0.5)
    model, _ = read_hf(tmp_path / "hf")
    assert model.config.norm_eps == 0.5
    ids = tokens(2, 30)
    with torch.no_grad():
        assert max_difference(model(ids), reference(ids).logits) < 1e-4
        default = dataclasses.replace(model.config, norm_eps=1e-5)
        other = TransformerLM.from_config(default)
        other.load_state_dict(model.state_dict())
        assert max_difference(other(ids), reference(ids).logits) > 1e-2


def test_imported_qwen3_is_qk_norm(tmp_path):
    reference = random_llama(tmp_path / "hf", model_type="qwen3", num_key_value_heads=2)
    model, _ = read_hf(tmp_path / "hf")
    assert model.config.qk_norm
    ids = tokens(2, 40)
    with torch.no_grad():
        assert max_difference(model(ids), reference(ids).logits) < 1e-4


def test_import_hf_command_writes_a_run_that_generate_uses(tmp_path, capsys):
    random_llama(tmp_path / "hf", vocab_size=610, num_key_value_heads=2)
    tokenizer = small_tokenizer()
    hf_tokenizer_json(tokenizer, tmp_path / "hf")
    status, _, err = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")], capsys)
    assert status == 0, err
    trained = load_trained(tmp_path / "run")
    assert trained.tokenizer.fingerprint == tokenizer.fingerprint == trained.tokenizer_fingerprint
    status, out, err = run_cli(
        ["generate", "--run", str(tmp_path / "run"), "--prompt", "The cat", "--temperature", "0",
         "--max-new-tokens", "8", "--device", "cpu", "--precision", "fp32"],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    eos = tokenizer.token_id(END_OF_TEXT)
    expected = generate(trained.model, tokenizer.encode("The cat"), 8, temperature=0.0, eos_id=eos)
    assert out == "The cat" + tokenizer.decode([t for t in expected if t != eos]) + "\n"


def test_fine_tuning_starts_from_the_imported_weights(tmp_path, capsys):
    random_llama(tmp_path / "hf", vocab_size=610, num_key_value_heads=2)
    tokenizer = small_tokenizer()
    hf_tokenizer_json(tokenizer, tmp_path / "hf")
    run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")], capsys)
    ids = np.array(tokenizer.encode(fixture_path("tinystories_sample.txt").read_text()), dtype=np.uint16)
    np.save(tmp_path / "tokens.npy", ids)
    common = [
        "--config", str(tmp_path / "imported" / "config.toml"),
        "--set", f"data.train={json.dumps(str(tmp_path / 'tokens.npy'))}",
        "--set", f"data.valid={json.dumps(str(tmp_path / 'tokens.npy'))}",
        "--set", "training.max_steps=2", "--set", "training.batch_size=2", "--set", "training.device=cpu",
        "--set", "optimizer.lr=1e-4", "--set", "schedule.warmup_iters=0", "--set", "eval.iters=1",
    ]  # fmt: skip
    # config.toml carries training.init_from; --init-from on the command line says the same.
    status, _, err = run_cli(
        [
            "train",
            *common,
            "--init-from",
            str(tmp_path / "imported"),
            "--set",
            f"logging.run_dir={tmp_path / 'ft'}",
        ],
        capsys,
    )
    assert status == 0, err
    imported = load_trained(tmp_path / "imported").model.state_dict()
    tuned = load_trained(tmp_path / "ft").model.state_dict()
    # Two AdamW steps of 1e-4 move each weight by at most about 2e-4; a fresh init would differ by ~0.1.
    for key, value in imported.items():
        assert max_difference(tuned[key], value) < 1e-3, key
    assert any(not torch.equal(tuned[key], value) for key, value in imported.items())

    status, _, err = run_cli(
        ["train", *common, "--set", "model.num_layers=3", "--set", f"logging.run_dir={tmp_path / 'other'}"],
        capsys,
    )
    assert_one_line_error(status, err, "training.init_from", "model.num_layers = 3, theirs 2")

    vocab, merges = train_bpe(fixture_path("tinystories_sample.txt"), 400, [END_OF_TEXT])
    Tokenizer(vocab, merges, [END_OF_TEXT]).save(tmp_path / "other-tokenizer")
    status, _, err = run_cli(
        ["train", *common, "--set", f"data.tokenizer={json.dumps(str(tmp_path / 'other-tokenizer'))}",
         "--set", f"logging.run_dir={tmp_path / 'other'}"],
        capsys,
    )  # fmt: skip
    assert_one_line_error(status, err, "training.init_from", "was trained with another tokenizer")


# -- export ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_in_transformers_with_equal_logits_and_greedy_tokens(tmp_path, capsys, variant):
    tokenizer = small_tokenizer()
    model = scratch_model(dataclasses.replace(SMALL, **VARIANTS[variant]))
    make_run(tmp_path / "run", model, tokenizer)
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err
    assert "LlamaForCausalLM" in err and "logits equal to scratchlm's" in err
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"
    }  # fmt: skip

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    assert hf_model.config.tie_word_embeddings == model.config.tie_embeddings
    ids = tokens(2, 64, vocab=SMALL.vocab_size)
    with torch.no_grad():
        assert max_difference(hf_model(ids).logits, model(ids)) < 1e-4

    prompt = tokenizer.encode("Once upon a time")
    eos = tokenizer.token_id(END_OF_TEXT)
    ours = generate(model, prompt, 32, temperature=0.0, eos_id=eos)
    output = hf_model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=32, do_sample=False, pad_token_id=eos,
    )  # fmt: skip
    assert output[0, len(prompt) :].tolist() == ours and len(ours) == 32


@pytest.mark.parametrize(
    "changes",
    [{}, {"num_kv_heads": 2, "tie_embeddings": True}, {"qk_norm": True, "num_kv_heads": 1, "norm_eps": 1e-6}],
)
def test_export_then_import_is_bit_exact(tmp_path, capsys, changes):
    tokenizer = small_tokenizer()
    model = scratch_model(dataclasses.replace(SMALL, **changes))
    make_run(tmp_path / "run", model, tokenizer)
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err
    if changes.get("qk_norm"):
        assert "QK-norm (model.qk_norm = True): written as Qwen3ForCausalLM" in err
    imported, imported_tokenizer = read_hf(tmp_path / "hf")
    assert imported.config == model.config
    assert imported_tokenizer.fingerprint == tokenizer.fingerprint
    theirs = imported.state_dict()
    assert theirs.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key


def test_export_in_bfloat16_compares_with_the_rounded_weights(tmp_path, capsys):
    model = scratch_model(SMALL)
    make_run(tmp_path / "run", model, small_tokenizer())
    argv = ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]
    status, _, err = run_cli([*argv, "--dtype", "bf16"], capsys)
    assert status == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    imported, _ = read_hf(tmp_path / "hf")
    for key, value in model.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value.bfloat16().float()), key


# -- the tokenizer ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["gpt2", "small"])
def exported_tokenizer(request, tmp_path_factory):
    """(scratchlm tokenizer, transformers' AutoTokenizer of its export)."""
    from scratchlm.interop.hf import write_tokenizer

    tokenizer = gpt2_tokenizer() if request.param == "gpt2" else small_tokenizer()
    directory = tmp_path_factory.mktemp(f"tokenizer-{request.param}")
    write_tokenizer(tokenizer, directory, context_length=1024)
    return tokenizer, transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("name", FIXTURE_TEXTS)
def test_exported_tokenizer_gives_scratchlm_ids_on_fixture_texts(exported_tokenizer, name):
    ours, theirs = exported_tokenizer
    text = fixture_path(name).read_text(encoding="utf-8")
    for sample in (text, f"{END_OF_TEXT}{text[:500]}{END_OF_TEXT}{END_OF_TEXT} x{END_OF_TEXT}"):
        ids = ours.encode(sample)
        assert theirs.encode(sample) == ids
        assert theirs.decode(ids) == ours.decode(ids) == sample


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60))
def test_exported_tokenizer_gives_scratchlm_ids_on_random_unicode(exported_tokenizer, text):
    ours, theirs = exported_tokenizer
    text = text.replace("\x00", "") + END_OF_TEXT + text[::-1]
    ids = ours.encode(text)
    assert theirs.encode(text) == ids
    assert theirs.decode(ids) == ours.decode(ids)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 599), max_size=20))
def test_exported_tokenizer_decodes_any_ids_alike(exported_tokenizer, ids):
    """Token sequences that cut characters apart decode to the same replacement characters."""
    ours, theirs = exported_tokenizer
    assert theirs.decode(ids) == ours.decode(ids)


def test_tokenizer_json_made_by_tokenizers_imports_as_the_same_tokenizer(tmp_path):
    path = hf_tokenizer_json(gpt2_tokenizer(), tmp_path)
    imported = from_tokenizer_json(json.loads(path.read_text()), str(path))
    assert imported.fingerprint == gpt2_tokenizer().fingerprint


# -- refusals and corrupt inputs -------------------------------------------------------------------------------


def test_zero_init_exports_since_it_changes_only_the_initial_weights(tmp_path, capsys):
    make_run(tmp_path / "run", scratch_model(dataclasses.replace(SMALL, zero_init=True)), small_tokenizer())
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err


def test_export_refuses_a_missing_extra(tmp_path, capsys, monkeypatch):
    make_run(tmp_path / "run", scratch_model(SMALL), small_tokenizer())
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # `import safetensors.torch` now fails
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert_one_line_error(status, err, "safetensors.torch is not installed", 'pip install "scratchlm[hf]"')


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _replace_tensors(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _tokenizer_json(directory: Path, change) -> None:
    hf_tokenizer_json(small_tokenizer(), directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    change(data)
    (directory / "tokenizer.json").write_text(json.dumps(data))


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
CORRUPTIONS = {
    "no config.json": (lambda d: (d / "config.json").unlink(), "config.json not found"),
    "malformed config.json": (lambda d: (d / "config.json").write_text("{"), "malformed JSON"),
    "another model type": (
        lambda d: _edit_config(d, model_type="gpt2"),
        "model_type 'gpt2' is not supported",
    ),
    "rope scaling": (
        lambda d: _edit_config(d, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_parameters=None),
        "rope_scaling",
    ),
    "rope type": (
        lambda d: _edit_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
        "rope_parameters.rope_type",
    ),
    "attention bias": (
        lambda d: _edit_config(d, attention_bias=True),
        "attention_bias = true is not supported",
    ),
    "activation": (lambda d: _edit_config(d, hidden_act="gelu"), 'hidden_act = "gelu" is not supported'),
    "epsilon": (lambda d: _edit_config(d, rms_norm_eps=0), "model.norm_eps must lie in (0, 1), got 0"),
    "head_dim": (lambda d: _edit_config(d, head_dim=32), "head_dim = 32"),
    "missing tensor": (
        lambda d: _replace_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "has no tensor model.layers.1.mlp.up_proj.weight",
    ),
    "bias tensor": (
        lambda d: _replace_tensors(
            d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
        ),
        "has tensor model.layers.0.self_attn.q_proj.bias",
    ),
    "wrong shape": (
        lambda d: _replace_tensors(d, lambda t: t.update({"lm_head.weight": torch.zeros(96, 64)})),
        "lm_head.weight has shape (96, 64), its config implies (97, 64)",
    ),
    "truncated safetensors": (
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]),
        "cannot read",
    ),
    "pickle only": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        "found pytorch_model.bin, a pickle",
    ),
    "sentencepiece tokenizer": (
        lambda d: _tokenizer_json(
            d, lambda j: j.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁"})
        ),
        "pre_tokenizer Metaspace is not byte-level",
    ),
    "split that removes its matches": (
        lambda d: _tokenizer_json(
            d,
            lambda j: j.update(
                pre_tokenizer={
                    "type": "Sequence",
                    "pretokenizers": [
                        {
                            "type": "Split",
                            "pattern": {"Regex": LLAMA3_PATTERN},
                            "behavior": "Removed",
                            "invert": False,
                        },
                        {
                            "type": "ByteLevel",
                            "add_prefix_space": False,
                            "trim_offsets": True,
                            "use_regex": False,
                        },
                    ],
                }
            ),
        ),
        "pre_tokenizer Split behavior 'Removed'",
    ),
    "single word": (
        lambda d: _tokenizer_json(d, lambda j: j["added_tokens"][0].update(single_word=True)),
        "added_tokens[0].single_word is true",
    ),
    "byte fallback without some bytes": (
        lambda d: _tokenizer_json(
            d, lambda j: (j["model"].update(byte_fallback=True), j["model"]["vocab"].pop("\u0104"))
        ),
        "model.byte_fallback = True with a vocabulary that lacks 1 single-byte tokens (first: b'\\x04')",
    ),
    "normalizer": (
        lambda d: _tokenizer_json(
            d, lambda j: j.update(normalizer={"type": "Sequence", "normalizers": [{"type": "Lowercase"}]})
        ),
        "normalizer 'Lowercase' is not supported",
    ),
    "unigram": (
        lambda d: _tokenizer_json(d, lambda j: j["model"].update(type="Unigram")),
        "model.type is 'Unigram'",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_import_refuses_unsupported_or_corrupt_input_in_one_line(tmp_path, capsys, corruption):
    random_llama(tmp_path / "hf")
    change, fragment = CORRUPTIONS[corruption]
    change(tmp_path / "hf")
    status, _, err = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, fragment)
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_missing_directory_and_an_existing_output(tmp_path, capsys):
    status, _, err = run_cli(["import-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, "is not a directory")
    random_llama(tmp_path / "hf")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    status, _, err = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(status, err, "exists and is not empty")
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"
