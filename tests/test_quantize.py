"""Weight-only int8 (`--quantize int8`, `scratchlm.generation.quantize`) against independent oracles.

- The quantization is per output channel and symmetric: each row's scale is its largest magnitude over 127,
  and each weight is within half a step of what the integers and the scale stand for.
- The int8 matmul, in each of its forms (PyTorch's `_weight_int8pack_mm` or the dequantized product eagerly,
  the loop of a compiled decode step), equals a brute-force float64 product of the activations and the
  dequantized matrix to float32 rounding: `K` roundings of the dot products' magnitudes, `K` the dot length.
- A model trained a few hundred steps keeps its held-out loss within 0.01 nats at int8, and greedy decoding
  (eager, compiled, batched, llama.cpp's at Q8_0 in test_interop_gguf.py) picks the unquantized model's tokens
  up to the bound of test_precision.py at int8's unit: a weight's error is at most 1/254 of its row's largest.
- The layout changes no state-dict key and writes nothing to the run; the commands take `--quantize` and refuse
  what they cannot do in one line.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fixture_path
from interop_helpers import make_run, run_cli, scratch_model, small_tokenizer
from test_cli import assert_usage_error
from test_precision import assert_same_greedy

from scratchlm.cli.options import QUANTIZE_SCHEMES as FLAG_SCHEMES
from scratchlm.data.tokens import get_batch
from scratchlm.device import plan
from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.generation.engine import SequenceRequest, generate_batch
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.generation.quantize import (
    QUANTIZE_SCHEMES,
    dequantize,
    quantize_per_channel,
    weight_bytes,
)
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Embedding, LinearStack, int8_matmul, tracing_step
from scratchlm.model.transformer import TransformerLM

CPU = torch.device("cpu")
UNIT = 2.0**-24  # float32's unit roundoff


def fp32_plan():
    return plan(CPU, "fp32", threads=1)


def brute_force(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product with the dequantized matrix in float64, and the magnitudes `|x| @ |W|ᵀ` that bound a
    float32 computation's rounding."""
    w = q.double() * scale.double()[:, None]
    return x.double() @ w.T, x.double().abs() @ w.abs().T


# -- the quantization and the matmul ------------------------------------------------------------------------


def test_quantization_is_symmetric_per_output_channel():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 80, generator=generator) * torch.logspace(-3, 1, 48)[:, None]
    weight[5] = 0.0  # an all-zero row
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    for row in range(48):
        largest = float(weight[row].abs().max())
        if largest == 0:
            assert torch.all(q[row] == 0)
            continue
        assert float(scale[row]) == pytest.approx(largest / 127, rel=1e-7)
        assert int(q[row].abs().max()) == 127  # the largest weight of each row takes the whole range
        error = (dequantize(q, scale)[row].double() - weight[row].double()).abs().max()
        assert error <= float(scale[row]) / 2 * (1 + 1e-6)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize(("d_in", "d_out"), [(512, 1344), (1344, 512), (512, 1000), (96, 40)])
@pytest.mark.parametrize("compiled_form", [False, True])
def test_int8_matmul_equals_the_dequantized_product(rows, d_in, d_out, compiled_form):
    generator = torch.Generator().manual_seed(d_in + d_out)
    q, scale = quantize_per_channel(torch.randn(d_out, d_in, generator=generator) / 20)
    x = torch.randn(rows, d_in, generator=generator)
    if compiled_form:  # the forms the layer takes inside a compiled CPU decode step, run eagerly
        with tracing_step():
            y = int8_matmul(x, q, scale)
    else:
        y = int8_matmul(x, q, scale)
    reference, magnitude = brute_force(x, q, scale)
    assert y.shape == (rows, d_out) and y.dtype == torch.float32
    assert torch.all((y.double() - reference).abs() <= (d_in + 2) * UNIT * magnitude)


def test_the_flag_and_the_module_name_the_same_schemes():
    assert FLAG_SCHEMES == QUANTIZE_SCHEMES


# -- the model laid out in int8 -----------------------------------------------------------------------------

SMALL = ModelConfig(
    vocab_size=610, context_length=64, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=192
)


def test_matrices_are_int8_and_everything_else_stays_in_the_plans_precision():
    model = scratch_model(SMALL)
    keys = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    fp32_bytes = weight_bytes(model)
    prepare_for_inference(model, fp32_plan(), quantize="int8")
    assert {name: tuple(value.shape) for name, value in model.state_dict().items()} == keys
    for name, value in model.state_dict().items():
        matrix = (
            name.endswith(("proj.weight", "w1.weight", "w2.weight", "w3.weight")) or name == "lm_head.weight"
        )
        assert value.dtype == (torch.int8 if matrix else torch.float32), name
    stacks = [s for m in model.modules() for s in vars(m).values() if isinstance(s, LinearStack)]
    assert stacks and all(s.weight.dtype == torch.int8 and s.scale is not None for s in stacks)
    # A byte a weight and a float32 scale a row: (1 + 4 / d_in) / 4 of float32's bytes.
    assert weight_bytes(model) <= 0.275 * fp32_bytes
    assert model.new_padded_kv_cache(2).layers[0].keys.dtype == torch.float32


def test_a_tied_head_gets_its_own_int8_copy_and_the_embeddings_stay_float():
    model = scratch_model(dataclasses.replace(SMALL, tie_embeddings=True))
    reference = copy.deepcopy(model)
    prepare_for_inference(model, fp32_plan(), quantize="int8")
    assert model.lm_head.weight.dtype == torch.int8
    assert torch.equal(model.token_embeddings.weight, reference.token_embeddings.weight)
    ids = torch.randint(0, SMALL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(ids), reference(ids), atol=0.05 * float(reference(ids).abs().max()))


def test_quantizing_writes_nothing_to_the_run_and_keeps_its_keys(tmp_path):
    from scratchlm.run.load import load_trained

    run = make_run(tmp_path / "run", scratch_model(SMALL), small_tokenizer())
    files = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()}
    trained = load_trained(run)
    keys = list(trained.model.state_dict())
    prepare_for_inference(trained.model, fp32_plan(), quantize="int8")
    assert list(trained.model.state_dict()) == keys
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*") if p.is_file()} == files


def test_an_unknown_scheme_or_a_model_without_matrices_is_a_one_line_error():
    with pytest.raises(ScratchlmError, match=r"^--quantize int4: unknown scheme; choose int8$"):
        prepare_for_inference(scratch_model(SMALL), fp32_plan(), quantize="int4")
    with pytest.raises(ScratchlmError) as error:
        prepare_for_inference(torch.nn.Sequential(Embedding(10, 4)), fp32_plan(), quantize="int8")
    message = str(error.value)
    assert message.startswith("--quantize int8: the model has no weight matrices") and "\n" not in message


# -- quality ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_pair():
    """A model trained 300 steps on a fixture's text (English prose), its held-out tenth of the tokens, and
    the tokenizer."""
    tokenizer = small_tokenizer()
    ids = np.array(tokenizer.encode(fixture_path("corpus.en").read_text(encoding="utf-8")), dtype=np.int64)
    split = len(ids) * 9 // 10
    train, valid = ids[:split], ids[split:]
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=176
    )
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    generator = np.random.default_rng(0)
    for _ in range(300):
        inputs, targets = get_batch(train, 16, config.context_length, "cpu", generator)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), valid, tokenizer


def test_the_held_out_loss_moves_by_under_a_hundredth_of_a_nat(trained_pair):
    model, valid, _ = trained_pair
    full = prepare_for_inference(copy.deepcopy(model), fp32_plan())
    int8 = prepare_for_inference(copy.deepcopy(model), fp32_plan(), quantize="int8")
    loss, loss_int8 = evaluate(full, valid).loss, evaluate(int8, valid).loss
    assert loss < 5.0  # it learned (4.44 measured): a uniform guess over the vocabulary is ln(600) = 6.4
    assert abs(loss_int8 - loss) < 0.01, (loss, loss_int8)


def test_greedy_tokens_eager_compiled_and_batched_follow_the_unquantized_model(trained_pair):
    model, _, tokenizer = trained_pair
    full = prepare_for_inference(copy.deepcopy(model), fp32_plan())
    int8 = prepare_for_inference(copy.deepcopy(model), fp32_plan(), quantize="int8")
    prompt = tokenizer.encode("The quick brown fox jumps over the")
    eager = generate(int8, prompt, 24, temperature=0.0, compile=False)
    assert len(set(eager)) > 4
    # int8 against float32: the same tokens up to int8's rounding of the weights.
    assert_same_greedy(full, prompt, eager, "int8")
    # The compiled step and the batched engine run the same int8 model: float32 rounding apart.
    compiled = generate(int8, prompt, 24, temperature=0.0, compile=True)
    assert_same_greedy(int8, prompt, compiled, "fp32")
    options = SamplingOptions(max_new_tokens=24, temperature=0.0)
    prompts = [prompt, tokenizer.encode("Once upon a time")]
    batched = generate_batch(int8, [SequenceRequest(p, options) for p in prompts], eos_id=None)
    for p, tokens in zip(prompts, batched, strict=True):
        assert_same_greedy(int8, p, tokens, "fp32")


# -- the commands -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("quantize") / "run", scratch_model(SMALL), small_tokenizer())


def test_generate_announces_int8_and_its_bytes(run_dir, capsys):
    status, out, err = run_cli(
        [
            "generate",
            "--run",
            str(run_dir),
            "--prompt",
            "Once",
            "--max-new-tokens",
            "5",
            "--quantize",
            "int8",
            "--precision",
            "fp32",
            "--temperature",
            "0",
            "--no-compile",
        ],
        capsys,
    )
    assert status == 0, err
    assert "weights: int8 weights per output channel" in err and "MiB of matrices instead of" in err


def test_eval_takes_the_flag(run_dir, tmp_path, capsys):
    ids = np.arange(500, dtype=np.uint16) % SMALL.vocab_size
    np.save(tmp_path / "valid.npy", ids)
    status, out, err = run_cli(
        ["eval", "--run", str(run_dir), "--data", str(tmp_path / "valid.npy"), "--quantize", "int8"], capsys
    )
    assert status == 0, err
    assert out.startswith("loss ")


def test_the_flag_refuses_an_unknown_scheme_and_train_refuses_the_flag(run_dir, capsys):
    status, _, err = run_cli(["generate", "--run", str(run_dir), "--quantize", "int4"], capsys)
    assert_usage_error(status, err, "argument --quantize: invalid choice: 'int4'")
    status, _, err = run_cli(["train", "--config", "configs/tiny.toml", "--quantize", "int8"], capsys)
    assert_usage_error(status, err, "unrecognized arguments: --quantize int8")


def test_doctor_says_what_int8_would_do(capsys):
    status, out, err = run_cli(["doctor", "--json", "--no-compile-check"], capsys)
    assert status == 0, err
    assert "with --quantize int8" in json.loads(out)["quantize"]
