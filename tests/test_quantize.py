"""Weight-only int8 (`--quantize int8`, `scratchlm.generation.quantize`) against independent oracles.

- The quantization is per output channel and symmetric: each row's scale is its largest magnitude over 127,
  and each weight is within half a step of what the integers and the scale stand for.
- The int8 matmul, in each of its forms (PyTorch's `_weight_int8pack_mm`, scratchlm's kernel, where it builds
  (tests/test_int8_kernel.py), or the dequantized product eagerly; the kernel or the loop of a compiled step), equals a brute-force float64 product of the activations and the
  dequantized matrix to float32 rounding: `K` roundings of the dot products' magnitudes, `K` the dot length.
- Which eager form runs is the plan's (`Plan.int8_matmul`), from the device profile's int8 rates: the kernel
  only where it ran and measured no slower at every size, with the rates mocked both ways; the layers then
  call the kernel, or not, as the dispatcher sees, and give the brute-force product either way. The
  measurement leaves out a kernel that is missing or gives a wrong product.
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
from int8_reference import activation_rounding
from interop_helpers import make_run, run_cli, scratch_model, small_tokenizer
from test_cli import assert_usage_error
from test_precision import assert_same_greedy
from torch.utils._python_dispatch import TorchDispatchMode

from scratchlm.cli.options import QUANTIZE_SCHEMES as FLAG_SCHEMES
from scratchlm.data.tokens import get_batch
from scratchlm.device import plan
from scratchlm.device import planning as plan_module
from scratchlm.device import rates as rates_module
from scratchlm.device.choices import choose_int8_matmul
from scratchlm.device.profile import DeviceProfile
from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.generation.engine import SequenceRequest, generate_batch
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.generation.quantize import (
    QUANTIZE_SCHEMES,
    dequantize,
    describe,
    quantize_per_channel,
    weight_bytes,
)
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.kernels import int8_cpu
from scratchlm.model import layers as layers_module
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Embedding, Linear, LinearStack, int8_matmul, tracing_step
from scratchlm.model.transformer import TransformerLM

CPU = torch.device("cpu")
UNIT = 2.0**-24  # float32's unit roundoff


NEEDS_KERNEL = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="this PyTorch has no _weight_int8pack_mm"
)


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
@pytest.mark.parametrize(
    "form", ["dequantize", pytest.param("pack", marks=NEEDS_KERNEL), "kernel", "compiled", "compiled-loop"]
)
def test_int8_matmul_equals_the_dequantized_product(rows, d_in, d_out, form, monkeypatch):
    generator = torch.Generator().manual_seed(d_in + d_out)
    q, scale = quantize_per_channel(torch.randn(d_out, d_in, generator=generator) / 20)
    x = torch.randn(rows, d_in, generator=generator)
    if form == "compiled-loop":  # where scratchlm's kernel did not build
        monkeypatch.setattr(int8_cpu, "load", lambda: False)
    if form.startswith(
        "compiled"
    ):  # the forms the layer takes inside a compiled CPU decode step, run eagerly
        with tracing_step():
            y = int8_matmul(x, q, scale)
    else:
        y = int8_matmul(x, q, scale, form)
    reference, magnitude = brute_force(x, q, scale)
    bound = (d_in + 2) * UNIT * magnitude
    if form in ("kernel", "compiled") and int8_cpu.load() and rows <= int8_cpu.Q8_ROWS_AT_MOST:
        # The kernel's int8 x int8 form: the activations' rounding too, and float rounding per block.
        bound = bound + activation_rounding(x, q, scale) + (d_in // 32 + 12) * UNIT * magnitude
    assert y.shape == (rows, d_out) and y.dtype == torch.float32
    assert torch.all((y.double() - reference).abs() <= bound)


# -- which eager form runs: measured, chosen in the plan, applied by the layout --------------------------------


def profile_with_int8(rates: dict[str, float] | None) -> DeviceProfile:
    """A CPU whose fp32 int8 products measured `rates` ("{way}_{tokens}" -> GB/s; None: not measured)."""
    return DeviceProfile(
        type="cpu",
        name="a CPU",
        matmul_gflops={"fp32": 100.0, "bf16": 1.0, "fp16": 1.0},
        int8_gbps={} if rates is None else {"fp32": rates},
    )


class OpsRun(TorchDispatchMode):
    """Records the name of every aten operator that runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class StackAndHead(torch.nn.Module):
    """Two matrices that read the same input, stacked (as attention's q, k and v), and one alone (a head)."""

    def __init__(self, d_in: int = 96) -> None:
        super().__init__()
        self.a, self.b, self.head = Linear(d_in, 40), Linear(d_in, 24), Linear(d_in, 130)
        self.stack = LinearStack(self.a, self.b)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*self.stack(x), self.head(x))


# fp32 int8 rates, GB/s, as measured on a 2-core AVX2 EPYC for bf16 (the kernel 5x faster) and for fp32 (the
# kernel 4x slower at one token, 20x at 16); one the kernel wins at one token only; one where it did not run.
KERNEL_FASTER = {"pack_1": 11.7, "dequantize_1": 2.36, "pack_16": 1.37, "dequantize_16": 0.29}
KERNEL_SLOWER = {"pack_1": 1.07, "dequantize_1": 4.4, "pack_16": 0.0655, "dequantize_16": 1.47}
SLOWER_BATCHED = {"pack_1": 5.0, "dequantize_1": 4.0, "pack_16": 1.0, "dequantize_16": 1.5}
NO_KERNEL = {"pack_1": 0.0, "dequantize_1": 4.4, "pack_16": 0.0, "dequantize_16": 1.47}


@pytest.mark.parametrize(
    "rates, expected",
    [
        pytest.param(KERNEL_FASTER, "pack", marks=NEEDS_KERNEL),
        (KERNEL_SLOWER, "dequantize"),
        (SLOWER_BATCHED, "dequantize"),
        (NO_KERNEL, "dequantize"),
        (None, "dequantize"),
    ],
    ids=["kernel-faster", "kernel-slower", "kernel-slower-batched", "no-kernel", "not-measured"],
)
def test_the_plans_int8_form_is_the_one_the_layers_run_and_both_give_the_dequantized_product(
    rates, expected, monkeypatch
):
    choice = choose_int8_matmul(profile_with_int8(rates), "fp32")
    assert choice.value == expected and choice.measured == (rates is not None)
    if rates is NO_KERNEL:
        assert "_weight_int8pack_mm does not run for fp32" in choice.reason
    elif rates is not None:  # the reason shows every rate it was chosen from
        assert all(f"{key.split('_')[0]} {rate:g}" in choice.reason for key, rate in rates.items())
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: profile_with_int8(rates))
    choices = plan(CPU, "fp32", threads=1)
    assert choices.int8_matmul == choice
    assert ("aten._weight_int8pack_mm" in describe("int8", choices)) == (expected == "pack")

    torch.manual_seed(0)
    model = prepare_for_inference(StackAndHead(), choices, quantize="int8")
    assert model.stack.weight is not None and model.stack.weight.dtype == torch.int8  # the stack is in use
    for tokens in (1, 5):
        x = torch.randn(2, tokens, 96, generator=torch.Generator().manual_seed(tokens))
        outputs = []
        for part in (model.stack, model.head):  # each on its own: a stack's product is not its matrices'
            with torch.no_grad(), OpsRun() as ops:
                y = part(x)
            assert ("_weight_int8pack_mm" in ops.names) == (expected == "pack"), (part, ops.names)
            outputs += y if isinstance(y, tuple) else [y]
        for y, linear in zip(outputs, [model.a, model.b, model.head], strict=True):
            w = dequantize(linear.weight, linear.weight_scale).double()
            reference = torch.nn.functional.linear(x.double(), w)
            magnitude = torch.nn.functional.linear(x.double().abs(), w.abs())
            assert y.dtype == torch.float32
            assert torch.all((y.double() - reference).abs() <= (96 + 2) * UNIT * magnitude)


def test_the_measurement_leaves_out_a_kernel_that_is_missing_or_wrong(monkeypatch):
    """Timed here: the dequantized product always, PyTorch's kernel where it runs and gives the dequantized
    product; one that raises, or that gives zeros, is measured as not running (0.0), and the plan then
    dequantizes. Off a CPU nothing is measured."""
    monkeypatch.setattr(rates_module, "INT8_REPEATS", 1)
    keys = {f"{way}_{n}" for way in rates_module.INT8_WAYS for n in rates_module.INT8_TOKENS}
    assert rates_module.int8_gbps(torch.device("meta"), torch.float32) == {}

    def refused(x, weight, scale):
        raise RuntimeError("_weight_int8pack_mm: not for this dtype")

    def zeros(x, weight, scale):
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)

    for kernel in (refused, zeros):
        monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", kernel)
        rates = rates_module.int8_gbps(CPU, torch.float32)
        assert set(rates) == keys
        assert all(rates[f"pack_{n}"] == 0.0 < rates[f"dequantize_{n}"] for n in rates_module.INT8_TOKENS)
        assert choose_int8_matmul(profile_with_int8(rates), "fp32").value != "pack"
    monkeypatch.undo()
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):  # the real kernel runs, and is timed
        rates = rates_module.int8_gbps(CPU, torch.float32)
        assert all(rates[key] > 0 for key in keys)


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


def test_the_held_out_loss_holds_with_the_activations_quantized_too(trained_pair, monkeypatch):
    """Every product through the kernel's int8 x int8 form (as a decode step of one or two rows runs), the
    activations quantized per block of 32 beside the weights: still within 0.01 nats."""
    if not int8_cpu.load():
        pytest.skip(f"{int8_cpu.failure()}")
    model, valid, _ = trained_pair
    full = prepare_for_inference(copy.deepcopy(model), fp32_plan())
    int8 = prepare_for_inference(copy.deepcopy(model), fp32_plan(), quantize="int8")
    for module in int8.modules():
        stacks = [value for value in vars(module).values() if isinstance(value, LinearStack)]
        for part in [module, *stacks] if isinstance(module, Linear) else stacks:
            part.int8_form = "kernel"
    calls = []
    q8 = int8_cpu.int8_matmul_q8
    monkeypatch.setattr(int8_cpu, "int8_matmul_q8", lambda *args: calls.append(1) or q8(*args))
    monkeypatch.setattr(int8_cpu, "Q8_ROWS_AT_MOST", 2**30)
    monkeypatch.setattr(layers_module, "ROWS_AT_MOST", 2**30)
    loss, loss_q8 = evaluate(full, valid).loss, evaluate(int8, valid).loss
    assert len(calls) > 10  # the products ran through it
    assert abs(loss_q8 - loss) < 0.01, (loss, loss_q8)


def test_greedy_tokens_eager_compiled_and_batched_follow_the_unquantized_model(trained_pair):
    model, _, tokenizer = trained_pair
    full = prepare_for_inference(copy.deepcopy(model), fp32_plan())
    int8 = prepare_for_inference(copy.deepcopy(model), fp32_plan(), quantize="int8")
    prompt = tokenizer.encode("The quick brown fox jumps over the")
    eager = generate(int8, prompt, 24, temperature=0.0, compile=False)
    assert len(set(eager)) > 4
    # int8 against float32: the same tokens up to int8's rounding of the weights.
    assert_same_greedy(full, prompt, eager, "int8")
    # The compiled step and the batched engine run the same int8 model, their steps of one or two rows with
    # the activations quantized too (the kernel's int8 x int8 form): int8's rounding apart.
    compiled = generate(int8, prompt, 24, temperature=0.0, compile=True)
    assert_same_greedy(int8, prompt, compiled, "int8")
    options = SamplingOptions(max_new_tokens=24, temperature=0.0)
    prompts = [prompt, tokenizer.encode("Once upon a time")]
    batched = generate_batch(int8, [SequenceRequest(p, options) for p in prompts], eos_id=None)
    for p, tokens in zip(prompts, batched, strict=True):
        assert_same_greedy(int8, p, tokens, "int8")


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
