"""scratchlm's CPU int8 kernel (`scratchlm.kernels.int8_cpu`, `torch.ops.scratchlm.int8_matmul`) against
independent oracles.

- Its product equals a brute-force float64 product of the activations and the dequantized matrix to float32
  rounding (`K` roundings of the dot products' magnitudes), for dot lengths that are not multiples of 8 or 32,
  1 to 16 rows, extra leading dimensions, 1 and 2 threads; bf16 activations to bf16's rounding of the result.
- Its fake implementation gives the output's shape and dtype without computing: `make_fx` traces it, and a
  decode step traced on a CPU calls it for up to 16 rows and not beyond.
- A compiled decode step of a small int8 model, which calls it from Inductor's generated code, picks the eager
  int8 model's greedy tokens up to float32 rounding, for one sequence and for a batched step.
- The plan chooses it where it measured fastest and no slower than the dequantized product, and not where it
  did not build (saying why); the layers then run it, or not, as the dispatcher sees.
"""

from __future__ import annotations

import copy

import pytest
import torch
from int8_reference import activation_rounding, blocks_of_32
from test_precision import assert_same_greedy
from test_quantize import (
    OpsRun,
    StackAndHead,
    brute_force,
    profile_with_int8,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from scratchlm.device import plan
from scratchlm.device import planning as plan_module
from scratchlm.device import rates as rates_module
from scratchlm.device.choices import choose_int8_matmul
from scratchlm.generation.engine import SequenceRequest, generate_batch
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.generation.quantize import dequantize, describe, quantize_per_channel
from scratchlm.generation.sampling import SamplingOptions
from scratchlm.kernels import int8_cpu
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import int8_matmul, tracing_step
from scratchlm.model.transformer import TransformerLM

CPU = torch.device("cpu")
UNIT = 2.0**-24  # float32's unit roundoff
NEEDS_BUILD = pytest.mark.skipif(not int8_cpu.load(), reason=f"{int8_cpu.failure()}")
pytestmark = NEEDS_BUILD


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def quantized(d_out: int, d_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return quantize_per_channel(torch.randn(d_out, d_in, generator=generator) / 20)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(("d_in", "d_out"), [(517, 1030), (100, 37), (7, 5), (1344, 512)])
def test_the_kernel_equals_the_brute_force_product(threads, rows, d_in, d_out):
    q, scale = quantized(d_out, d_in, seed=d_in * rows)
    x = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(rows))
    y = int8_cpu.int8_matmul(x, q, scale)
    reference, magnitude = brute_force(x, q, scale)
    assert y.shape == (rows, d_out) and y.dtype == torch.float32
    assert torch.all((y.double() - reference).abs() <= (d_in + 2) * UNIT * magnitude)


def q8_brute_force(x, q, scale):
    """The int8 x int8 product in float64: per block the exact integer dot product times the block's scale,
    summed, times the row's scale; and the magnitudes (the same with |q|, |w|) that bound float rounding."""
    qx, d = blocks_of_32(x)
    rows, blocks, _ = qx.shape
    w = torch.zeros(q.shape[0], blocks * 32, dtype=torch.float64)
    w[:, : q.shape[1]] = q.double()
    w = w.view(-1, blocks, 32)
    dots = torch.einsum("mbi,jbi->mjb", qx, w)  # integers, exact in float64
    magnitudes = torch.einsum("mbi,jbi->mjb", qx.abs(), w.abs())
    s, db = scale.double(), d.double()[:, None, :]
    return (dots * db).sum(-1) * s, (magnitudes * db).sum(-1) * s


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(("d_in", "d_out"), [(512, 2688), (1344, 512), (100, 37), (31, 20)])
def test_the_int8_by_int8_form_equals_its_brute_force_product(threads, rows, d_in, d_out):
    q, scale = quantized(d_out, d_in, seed=d_in + rows)
    x = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(rows)) * 3
    if d_in > 32:
        x[0, :32] = 0.0  # an all-zero block (d = 0)
    y = int8_cpu.int8_matmul_q8(x, q, scale)
    reference, magnitude = q8_brute_force(x, q, scale)
    blocks = -(-d_in // 32)
    assert y.shape == (rows, d_out) and y.dtype == torch.float32
    assert torch.all((y.double() - reference).abs() <= (blocks + 12) * UNIT * magnitude)
    # Against the float product: the activations' rounding adds at most d / 2 an activation, that is
    # s_j Σ_blocks (d_b / 2) Σ_i |q_ji|, as the module docstring says.
    exact, float_magnitude = brute_force(x, q, scale)
    bound = activation_rounding(x, q, scale) + (d_in + blocks + 12) * UNIT * float_magnitude
    assert torch.all((y.double() - exact).abs() <= bound)
    assert torch.any((y.double() - exact).abs() > (d_in + 2) * UNIT * float_magnitude)  # it is the q8 form


def test_the_layers_take_the_int8_by_int8_form_up_to_its_rows():
    q, scale = quantized(40, 96, seed=5)
    for rows in range(1, 5):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        y = int8_matmul(x, q, scale, "kernel")
        expected = int8_cpu.int8_matmul_q8 if rows <= int8_cpu.Q8_ROWS_AT_MOST else int8_cpu.int8_matmul
        assert torch.equal(y, expected(x, q, scale)), rows
        assert torch.equal(y, int8_cpu.matmul(x, q, scale))


SCALAR = """
import sys, torch
from scratchlm.kernels import int8_cpu
int8_cpu.vector_path = lambda: False
assert int8_cpu.load(), int8_cpu.failure()
x, q, scale = torch.load(sys.argv[1])
torch.save([int8_cpu.int8_matmul_q8(x, q, scale), int8_cpu.int8_matmul(x, q, scale)], sys.argv[1])
"""


@pytest.mark.skipif(not int8_cpu.vector_path(), reason="this CPU runs the scalar form already")
def test_the_scalar_form_computes_what_the_avx2_form_does(tmp_path):
    """Built without the intrinsics (in a process of its own: the operators are registered once a process),
    both forms give the AVX2 forms' products up to float rounding: the same quantized maths."""
    import subprocess
    import sys

    q, scale = quantized(37, 100, seed=6)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(6))
    torch.save([x, q, scale], tmp_path / "io.pt")
    subprocess.run([sys.executable, "-c", SCALAR, str(tmp_path / "io.pt")], check=True)
    q8, plain = torch.load(tmp_path / "io.pt")
    _, magnitude = q8_brute_force(x, q, scale)
    assert torch.all(
        (q8.double() - int8_cpu.int8_matmul_q8(x, q, scale).double()).abs() <= 30 * UNIT * magnitude
    )
    _, magnitude = brute_force(x, q, scale)
    assert torch.all(
        (plain.double() - int8_cpu.int8_matmul(x, q, scale).double()).abs() <= 204 * UNIT * magnitude
    )


def test_leading_dimensions_and_bf16_activations():
    q, scale = quantized(260, 100, seed=1)
    x = torch.randn(2, 3, 100, generator=torch.Generator().manual_seed(2))
    y = int8_cpu.int8_matmul(x, q, scale)
    reference, magnitude = brute_force(x.reshape(6, 100), q, scale)
    assert y.shape == (2, 3, 260)
    assert torch.all((y.reshape(6, 260).double() - reference).abs() <= 102 * UNIT * magnitude)
    xb = x.to(torch.bfloat16)
    yb = int8_cpu.int8_matmul(xb, q, scale)
    reference, magnitude = brute_force(xb.float().reshape(6, 100), q, scale)  # bf16 values are exact in fp64
    error = (yb.reshape(6, 260).double() - reference).abs()
    assert yb.dtype == torch.bfloat16
    assert torch.all(error <= 2.0**-8 * reference.abs() + 102 * UNIT * magnitude)  # bf16: 8 bits


def test_the_fake_implementation_gives_the_shape_and_make_fx_traces_the_op():
    with FakeTensorMode():
        x = torch.empty(4, 1, 96)
        y = int8_cpu.int8_matmul(x, torch.empty(40, 96, dtype=torch.int8), torch.empty(40))
        assert y.shape == (4, 1, 40) and y.dtype == torch.float32
        yb = int8_cpu.int8_matmul(x.bfloat16(), torch.empty(40, 96, dtype=torch.int8), torch.empty(40))
        assert yb.dtype == torch.bfloat16
        yq = int8_cpu.int8_matmul_q8(x, torch.empty(40, 96, dtype=torch.int8), torch.empty(40))
        assert yq.shape == (4, 1, 40) and yq.dtype == torch.float32
    q, scale = quantized(40, 96, seed=3)
    for rows, traced in ((1, True), (16, True), (17, False)):
        x = torch.randn(rows, 1, 96)
        with tracing_step():
            graph = make_fx(lambda x, q, s: int8_matmul(x, q, s), tracing_mode="fake")(x, q, scale)
        names = {str(node.target) for node in graph.graph.nodes}
        op = (
            "scratchlm.int8_matmul_q8.default"
            if rows <= int8_cpu.Q8_ROWS_AT_MOST
            else "scratchlm.int8_matmul.default"
        )
        assert (op in names) == traced, (rows, names)


def test_the_compiled_step_gives_the_eager_int8_models_greedy_tokens():
    config = ModelConfig(vocab_size=300, context_length=64, d_model=64, num_layers=2, num_heads=4, d_ff=176)
    torch.manual_seed(0)
    model = TransformerLM.from_config(config)
    int8 = prepare_for_inference(copy.deepcopy(model), plan(CPU, "fp32", threads=1), quantize="int8")
    prompt = [5, 17, 250, 3, 99, 42]
    eager = generate(int8, prompt, 20, temperature=0.0, compile=False)
    compiled = generate(int8, prompt, 20, temperature=0.0, compile=True)
    assert len(set(eager)) > 3
    assert_same_greedy(int8, prompt, eager, "int8")
    assert_same_greedy(int8, prompt, compiled, "int8")
    options = SamplingOptions(max_new_tokens=12, temperature=0.0)
    prompts = [prompt, [7, 8, 9], [200, 1]]
    batched = generate_batch(int8, [SequenceRequest(p, options) for p in prompts], eos_id=None)
    for p, tokens in zip(prompts, batched, strict=True):
        assert_same_greedy(int8, p, tokens, "int8")


# fp32 int8 rates, GB/s: scratchlm's kernel the fastest (as measured on a 2-core AVX2 EPYC), and not built.
KERNEL_FASTEST = {
    "pack_1": 1.07,
    "dequantize_1": 4.4,
    "kernel_1": 14.6,
    "pack_16": 0.0655,
    "dequantize_16": 1.47,
    "kernel_16": 1.7,
}
NOT_BUILT = {**KERNEL_FASTEST, "kernel_1": 0.0, "kernel_16": 0.0}


@pytest.mark.parametrize(("rates", "expected"), [(KERNEL_FASTEST, "kernel"), (NOT_BUILT, "dequantize")])
def test_the_plan_chooses_the_kernel_where_it_is_fastest_and_the_layers_run_it(rates, expected, monkeypatch):
    if rates is NOT_BUILT:
        monkeypatch.setitem(int8_cpu._STATE, "failure", "the int8 CPU kernel did not build: no compiler")
    choice = choose_int8_matmul(profile_with_int8(rates), "fp32")
    assert choice.value == expected and choice.measured
    assert all(f"{key.split('_')[0]} {rate:g}" in choice.reason for key, rate in rates.items())
    if rates is NOT_BUILT:
        assert "scratchlm's int8 kernel does not run for fp32 here: the int8 CPU kernel did not build" in (
            choice.reason
        )
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: profile_with_int8(rates))
    choices = plan(CPU, "fp32", threads=1)
    assert choices.int8_matmul == choice
    assert ("scratchlm's int8 kernel up to 16 rows" in describe("int8", choices)) == (expected == "kernel")
    torch.manual_seed(0)
    model = prepare_for_inference(StackAndHead(), choices, quantize="int8")
    for tokens, kernel in ((1, True), (8, True), (9, False)):  # 2 x 9 rows: beyond the kernel's 16
        x = torch.randn(2, tokens, 96, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad(), OpsRun() as ops:
            outputs = [*model.stack(x), model.head(x)]
        q8 = kernel and expected == "kernel" and 2 * tokens <= int8_cpu.Q8_ROWS_AT_MOST
        ran = "int8_matmul_q8" if q8 else "int8_matmul"
        assert (ran in ops.names) == (kernel and expected == "kernel"), (tokens, ops.names)
        for y, linear in zip(outputs, [model.a, model.b, model.head], strict=True):
            w = dequantize(linear.weight, linear.weight_scale).double()
            reference = torch.nn.functional.linear(x.double(), w)
            magnitude = torch.nn.functional.linear(x.double().abs(), w.abs())
            bound = (96 + 2) * UNIT * magnitude
            if (
                q8
            ):  # the activations' rounding too (test_the_int8_by_int8_form_equals_its_brute_force_product)
                rounding = activation_rounding(x, linear.weight, linear.weight_scale).view(y.shape)
                bound = bound + rounding + 15 * UNIT * magnitude
            assert torch.all((y.double() - reference).abs() <= bound)


def test_a_layer_whose_kernel_does_not_load_dequantizes_and_the_measurement_says_zero(monkeypatch):
    monkeypatch.setattr(rates_module, "INT8_REPEATS", 1)
    q, scale = quantized(40, 96, seed=4)
    x = torch.randn(1, 96)
    with OpsRun() as ops:
        int8_matmul(x, q, scale, "kernel")
    assert "int8_matmul_q8" in ops.names
    monkeypatch.setattr(int8_cpu, "load", lambda: False)
    with OpsRun() as ops:
        y = int8_matmul(x, q, scale, "kernel")
    assert not any(name.startswith("int8_matmul") for name in ops.names)
    reference, magnitude = brute_force(x, q, scale)
    assert torch.all((y.double() - reference).abs() <= 98 * UNIT * magnitude)
    rates = rates_module.int8_gbps(CPU, torch.float32)
    assert all(rates[f"kernel_{n}"] == 0.0 < rates[f"dequantize_{n}"] for n in rates_module.INT8_TOKENS)


def test_measuring_the_machine_never_builds_the_kernel(monkeypatch):
    """The device profile (every command's first measurement of the machine) times the kernel only where it
    is built already: a build would make that command wait a minute for `--quantize int8`, which it may
    never be asked for."""
    from scratchlm.device.rates import int8_gbps

    monkeypatch.setattr(int8_cpu, "ready", lambda: False)
    monkeypatch.setattr(int8_cpu, "load", lambda: pytest.fail("the kernel was built"))
    rates = int8_gbps(torch.device("cpu"), torch.float32)
    assert rates["kernel_1"] == rates["kernel_16"] == 0.0 and rates["dequantize_1"] > 0


def test_the_measurement_times_the_form_the_layers_run(monkeypatch):
    """The profile's "kernel" rates are those of the form a layer runs for that many rows (`int8_cpu.matmul`):
    the int8 x int8 form at one token, the float form at 16, and nothing else of the kernel's."""
    monkeypatch.setattr(rates_module, "INT8_REPEATS", 1)
    monkeypatch.setattr(rates_module, "INT8_TOKENS", (1,))
    with OpsRun() as ops:
        one = rates_module.int8_gbps(CPU, torch.float32)
    assert "int8_matmul_q8" in ops.names and "int8_matmul" not in ops.names and one["kernel_1"] > 0
    monkeypatch.setattr(rates_module, "INT8_TOKENS", (16,))
    with OpsRun() as ops:
        sixteen = rates_module.int8_gbps(CPU, torch.float32)
    assert "int8_matmul" in ops.names and "int8_matmul_q8" not in ops.names and sixteen["kernel_16"] > 0
