"""`scratchlm export --format hf` of every model the configuration can make, with the scratchlm model as the
oracle of transformers' reading of the export.

- Each variant (the CS336 assignment-1 handout's model, the fast recipe's, each of its switches alone, post-norm, no norm,
  NoPE, SiLU, grouped-query attention, tied embeddings, and all switches at once) exports as the architecture
  that computes it: Llama or Qwen3 where transformers has one, scratchlm's own modeling code otherwise.
- Loaded by transformers, the export gives scratchlm's logits (fp32, 1e-4), `generate` gives scratchlm's
  greedy tokens with and without its KV cache, and a padded batch (left or right, with its attention mask)
  gives each row's own logits and tokens; lm-eval's `hf` model scores and generates as scratchlm does.
- `import-hf` reads each export back bit for bit, the configuration included, without running its code.
- The modeling code imports torch and transformers only: a copy of the directory elsewhere loads with
  scratchlm out of reach.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import shutil
import sys

import pytest
import torch
from interop_helpers import make_run, run_cli, scratch_model, small_tokenizer

from scratchlm import ModelConfig, generate
from scratchlm.errors import ScratchlmError
from scratchlm.interop import INIT_ONLY_FIELDS, LLAMA, QWEN3, SCRATCHLM, SHAPE_FIELDS, check_exportable
from scratchlm.interop.hf import export_hf, read_hf
from scratchlm.interop.hf_remote import FILES, REMOTE_CODE
from scratchlm.model.config import COMPUTATION_FIELDS
from scratchlm.quickstart import RECIPES
from scratchlm.run.load import load_trained
from scratchlm.tokenizer import END_OF_TEXT

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scratchlm[hf])")

# Three blocks: the middle one has no value embeddings, and only the last reads a U-net skip.
SMALL = ModelConfig(vocab_size=610, context_length=64, d_model=32, num_layers=3, num_heads=4, d_ff=64)
FAST = RECIPES["fast"]["model"]  # the quickstart's default model: the fast recipe's switches, in its shape
VARIANTS = {
    "spec": ({}, LLAMA),
    "fast": (FAST, SCRATCHLM),
    "relu2": ({"ffn": "relu2"}, SCRATCHLM),
    "qk_norm": ({"qk_norm": True}, QWEN3),
    "logit_softcap": ({"logit_softcap": 0.5}, SCRATCHLM),  # small, so that it changes the logits visibly
    "value_embeddings": ({"value_embeddings": 1}, SCRATCHLM),
    "unet_skips": ({"unet_skips": True}, SCRATCHLM),
    "post-norm": ({"norm": "post"}, SCRATCHLM),
    "no-norm": ({"norm": "none"}, SCRATCHLM),
    "nope": ({"positions": "none"}, SCRATCHLM),
    "silu": ({"ffn": "silu"}, SCRATCHLM),
    "gqa": ({"num_kv_heads": 2}, LLAMA),
    "tied": ({"tie_embeddings": True}, LLAMA),
    "everything": (
        {
            **FAST,
            "num_layers": 4,
            "value_embeddings": 2,
            "unet_skips": True,
            "num_kv_heads": 1,
            "tie_embeddings": True,
            "norm_eps": 1e-6,
            "rope_theta": 500.0,
        },
        SCRATCHLM,
    ),
    "post-norm-nope-silu": (
        {"norm": "post", "positions": "none", "ffn": "silu", "num_kv_heads": 2},
        SCRATCHLM,
    ),
}


def oracle(config: ModelConfig) -> torch.nn.Module:
    """A scratchlm model of `config` with every weight random: zero_init's zero matrices too, so that every
    block changes the logits."""
    model = scratch_model(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2 and not parameter.any():
                parameter.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module", params=VARIANTS)
def exported(request, tmp_path_factory):
    """(variant, scratchlm model, export directory, transformers' model of it)."""
    changes, architecture = VARIANTS[request.param]
    model = oracle(dataclasses.replace(SMALL, **changes))
    directory = tmp_path_factory.mktemp(request.param)
    make_run(directory / "run", model, small_tokenizer())
    result = export_hf(load_trained(directory / "run"), directory / "hf")
    assert result.architecture == architecture
    assert result.max_logit_difference is not None and result.max_logit_difference < 1e-4
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory / "hf"), trust_remote_code=architecture.custom_code
    ).eval()
    assert type(hf_model).__name__ == architecture.hf_class
    return request.param, model, directory / "hf", hf_model


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_every_model_config_field_is_exported_by_the_custom_code():
    """A field added to ModelConfig is refused by every architecture until the modeling code computes it."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields == SHAPE_FIELDS | INIT_ONLY_FIELDS | COMPUTATION_FIELDS | set(SCRATCHLM.free)


def test_a_switch_the_modeling_code_does_not_read_is_refused():
    partial = dataclasses.replace(SCRATCHLM, free=("norm",))  # as if it knew nothing of the other switches
    config = dataclasses.replace(SMALL, norm="post", ffn="relu2")
    assert (
        check_exportable(dataclasses.replace(SMALL, norm="post"), "hf", "transformers", [LLAMA, partial])
        == partial
    )
    with pytest.raises(ScratchlmError) as error:
        check_exportable(config, "hf", "transformers", [LLAMA, partial])
    assert str(error.value) == (
        "cannot export to hf: the scratchlm architecture of transformers has no ReLU² MLP (model.ffn = 'relu2')"
    )


def test_transformers_computes_scratchlm_logits(exported):
    _, model, _, hf_model = exported
    ids = torch.randint(0, SMALL.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        assert max_difference(hf_model(ids).logits, ours) < 1e-4
        # The cache gives the same logits, a prefix then the rest.
        first = hf_model(ids[:, :40], use_cache=True)
        name = "cache" if "cache" in first else "past_key_values"  # transformers' name, recent or older
        rest = hf_model(ids[:, 40:], use_cache=True, **{name: first[name]})
        assert max_difference(torch.cat([first.logits, rest.logits], dim=1), ours) < 1e-4
        # The loss of predicting each next token, and the embeddings given instead of the ids.
        loss = model(ids[:, :-1], targets=ids[:, 1:])
        assert hf_model(ids, labels=ids).loss.item() == pytest.approx(loss.item(), abs=1e-5)
        if not model.config.value_embeddings:  # looked up by id
            embeddings = hf_model.get_input_embeddings()(ids)
            assert max_difference(hf_model(inputs_embeds=embeddings).logits, ours) < 1e-4


def test_transformers_generate_gives_scratchlm_greedy_tokens(exported):
    _, model, _, hf_model = exported
    prompt = small_tokenizer().encode("Once upon a time")
    ours = generate(model, prompt, 24, temperature=0.0)
    for use_cache in (True, False):
        output = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24, do_sample=False, use_cache=use_cache, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        assert output[0, len(prompt) :].tolist() == ours, use_cache


def test_import_reads_the_export_back_bit_for_bit(exported):
    _, model, directory, _ = exported
    imported, tokenizer = read_hf(directory)
    assert imported.config == model.config
    assert tokenizer.fingerprint == small_tokenizer().fingerprint
    theirs = imported.state_dict()
    assert theirs.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key


# The custom code's attention masks, on the variants that combine its switches.
PADDED = pytest.mark.parametrize("exported", ["fast", "everything", "post-norm-nope-silu"], indirect=True)


@PADDED
def test_a_padded_batch_gives_each_row_its_own_logits(exported):
    _, model, _, hf_model = exported
    short, long = torch.randint(0, SMALL.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    short = short[:17]
    pad = torch.zeros(13, dtype=torch.long)
    with torch.no_grad():
        expected_short, expected_long = model(short[None])[0], model(long[None])[0]
        for left in (True, False):
            row = torch.cat([pad, short] if left else [short, pad])
            mask = torch.cat([torch.zeros(13), torch.ones(17)] if left else [torch.ones(17), torch.zeros(13)])
            logits = hf_model(
                torch.stack([row, long]), attention_mask=torch.stack([mask, torch.ones(30)]).long()
            ).logits
            real = logits[0, 13:] if left else logits[0, :17]
            assert max_difference(real, expected_short) < 1e-4, left
            assert max_difference(logits[1], expected_long) < 1e-4, left


@pytest.mark.parametrize("exported", ["fast"], indirect=True)
def test_a_padding_query_attends_to_its_own_key(exported):
    """A query that saw no key would take a softmax over nothing, NaN on some backends, which would reach the
    real tokens through the padding's values: each padding query sees its own key, and only that."""
    _, _, _, hf_model = exported
    padding = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 0]])
    mask = inspect.getmodule(hf_model).attention_mask_4d(padding, past=2, seq=3, device="cpu")
    assert mask.shape == (2, 1, 3, 5)
    assert mask[0, 0].tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert mask[1, 0].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@PADDED
def test_generate_on_a_left_padded_batch_gives_each_rows_tokens(exported):
    _, model, _, hf_model = exported
    tokenizer = small_tokenizer()
    prompts = [tokenizer.encode("Once upon a time"), tokenizer.encode("The cat sat on the mat, and then")]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    output = hf_model.generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    for row, prompt in enumerate(prompts):
        assert output[row, width:].tolist() == generate(model, prompt, 16, temperature=0.0), row


def test_the_command_says_what_it_wrote(tmp_path, capsys):
    make_run(tmp_path / "run", oracle(dataclasses.replace(SMALL, **FAST)), small_tokenizer())
    status, _, err = run_cli(
        ["export", "--run", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err
    err = " ".join(err.split())
    assert (
        "ReLU² MLP (model.ffn = 'relu2'), QK-norm (model.qk_norm = True), logit soft-capping "
        "(model.logit_softcap = 15.0), value embeddings (model.value_embeddings = 1): written as "
        "ScratchlmForCausalLM with its modeling code (load it with trust_remote_code=True)"
    ) in err
    assert f"wrote {tmp_path / 'hf'} (ScratchlmForCausalLM with its modeling code, f32); logits equal" in err
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {"config.json", "model.safetensors", *FILES}

    status, _, err = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")], capsys)
    assert status == 0, err
    assert load_trained(tmp_path / "imported").model.config == load_trained(tmp_path / "run").model.config


def test_export_in_bfloat16_compares_with_the_rounded_weights(tmp_path):
    model = oracle(dataclasses.replace(SMALL, **VARIANTS["everything"][0]))
    make_run(tmp_path / "run", model, small_tokenizer())
    result = export_hf(load_trained(tmp_path / "run"), tmp_path / "hf", "bf16")
    assert result.max_logit_difference < 1e-4
    imported, _ = read_hf(tmp_path / "hf")
    for key, value in model.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value.bfloat16().float()), key


def test_a_copy_elsewhere_loads_without_scratchlm(tmp_path, monkeypatch):
    model = oracle(dataclasses.replace(SMALL, **FAST))
    make_run(tmp_path / "run", model, small_tokenizer())
    export_hf(load_trained(tmp_path / "run"), tmp_path / "hf")
    copy = shutil.copytree(tmp_path / "hf", tmp_path / "elsewhere" / "my-model")
    shutil.rmtree(tmp_path / "hf")
    text = "Once upon a time"
    with torch.no_grad():
        expected = model(torch.tensor([small_tokenizer().encode(text)]))

    monkeypatch.setitem(sys.modules, "scratchlm", None)  # `import scratchlm` now fails
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(copy), trust_remote_code=True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(copy), trust_remote_code=True).eval()
    with torch.no_grad():
        logits = hf_model(**tokenizer(text, return_tensors="pt")).logits
    assert max_difference(logits, expected) < 1e-4


@pytest.mark.parametrize("name", FILES)
def test_the_modeling_code_imports_torch_and_transformers_only(name):
    tree = ast.parse((REMOTE_CODE / name).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:  # relative: the other file
            imported.add(node.module.split(".")[0])
    assert imported <= {"dataclasses", "torch", "transformers"}, imported


def test_lm_eval_scores_and_generates_as_scratchlm(tmp_path):
    huggingface = pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval is not installed")
    from lm_eval.api.instance import Instance

    model = oracle(dataclasses.replace(SMALL, **FAST))
    tokenizer = small_tokenizer()
    make_run(tmp_path / "run", model, tokenizer)
    export_hf(load_trained(tmp_path / "run"), tmp_path / "hf")
    lm = huggingface.HFLM(pretrained=str(tmp_path / "hf"), trust_remote_code=True, device="cpu", batch_size=2)

    pairs = [("Once upon a time", " there was a girl"), ("The cat", " sat on the mat, and then it slept")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (context, continuation), (score, _) in zip(pairs, lm.loglikelihood(requests), strict=True):
        context_ids = tokenizer.encode(context)
        ids = tokenizer.encode(context + continuation)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor(ids[:-1])), dim=-1)
        expected = sum(logprobs[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids)))
        assert score == pytest.approx(expected, abs=1e-3)

    prompts = ["Once upon a time", "The"]  # of different lengths: lm-eval pads them on the left
    options = {"until": [END_OF_TEXT], "max_gen_toks": 8, "do_sample": False}
    requests = [Instance("generate_until", {}, (prompt, options), i) for i, prompt in enumerate(prompts)]
    for prompt, text in zip(prompts, lm.generate_until(requests), strict=True):
        expected = generate(model, tokenizer.encode(prompt), 8, temperature=0.0)
        assert text == tokenizer.decode(expected)
