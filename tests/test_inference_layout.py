"""How inference lays out and runs a model's weights (`prepare_for_inference`): the stacks of matrices that
read the same input (`LinearStack`), wide matrices held by columns, one-token steps without oneDNN, and the
dtype a decode step attends in. The oracle everywhere is the same model run the plain way: a `Linear` at a time,
its parameters as they were built, oneDNN on."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import settled, torch_threads

from scratchlm import TransformerLM
from scratchlm.device import planning as plan_module
from scratchlm.device.choices import MATVEC_GAIN, choose_matvec
from scratchlm.device.planning import plan
from scratchlm.device.profile import DeviceProfile
from scratchlm.device.rates import MATVEC_WAYS, matvec_gbps
from scratchlm.errors import ScratchlmError
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.kv_cache import KVCache, decode_dtype
from scratchlm.model.layers import LinearStack, by_columns

CPU = torch.device("cpu")


def profile_with(rates: dict[str, dict[str, float]]) -> DeviceProfile:
    return DeviceProfile(
        type="cpu",
        name="a CPU",
        native_bf16=True,
        matmul_gflops={"fp32": 100.0, "bf16": 400.0, "fp16": 2.0},
        matvec_gbps=rates,
    )


# As measured on an AVX-512-BF16 EPYC (Zen 4), GB/s: fp32 is fastest by columns, bf16 without oneDNN.
ZEN4 = profile_with(
    {
        "fp32": {"rows": 11.4, "columns": 21.7, "rows_no_onednn": 11.1},
        "bf16": {"rows": 14.5, "columns": 14.0, "rows_no_onednn": 30.0},
        "fp16": {"rows": 28.8, "columns": 0.6, "rows_no_onednn": 30.8},
    }
)


def tiny_model(seed: int = 0, **switches) -> TransformerLM:
    torch.manual_seed(seed)
    # 4 query heads over 2 key/value heads: q, k and v of different widths in one stack.
    return TransformerLM.from_handout(97, 16, 32, 2, 4, 64, num_kv_heads=2, **switches)


def prepared(model: TransformerLM, precision: str, monkeypatch, profile: DeviceProfile = ZEN4):
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: profile)
    choices = plan(CPU, precision, threads=1)
    return prepare_for_inference(model, choices), choices


def ids(seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 97, (2, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "rates, expected",
    [
        ({"rows": 11.4, "columns": 21.7, "rows_no_onednn": 11.1}, "columns"),
        ({"rows": 14.5, "columns": 14.0, "rows_no_onednn": 30.0}, "rows_no_onednn"),
        ({"rows": 20.0, "columns": 20.0 * MATVEC_GAIN * 0.99, "rows_no_onednn": 5.0}, "rows"),  # not enough
        (None, "rows"),  # not measured (an older profile, or a profile file without the rates)
    ],
    ids=["fp32-by-columns", "bf16-without-onednn", "too-small-a-gain", "unmeasured"],
)
def test_the_way_a_token_times_a_matrix_runs_is_the_fastest_measured(rates, expected):
    profile = profile_with({} if rates is None else {"fp32": rates})
    choice = choose_matvec(profile, "fp32")
    assert choice.value == expected and choice.value in MATVEC_WAYS
    if rates is not None:  # the reason shows every rate it was chosen from
        assert all(f"{way} {rate:g}" in choice.reason for way, rate in rates.items())
        assert choice.measured


def test_the_plan_takes_the_way_measured_at_its_precision(monkeypatch):
    for precision, way in (("fp32", "columns"), ("bf16", "rows_no_onednn"), ("fp16", "rows")):
        assert prepared(tiny_model(), precision, monkeypatch)[1].matvec.value == way


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_inference_keeps_the_state_dict_and_computes_what_the_plain_model_computes(precision, monkeypatch):
    """Keys, shapes and values of the state dict are exactly those of the plain model held in the same
    dtype. Logits agree to float rounding: only the order of the sums in each product can differ (fp32:
    1e-5; bf16: every product is accumulated in float32 then rounded to bf16, 2^-8 relative, and a
    different order can move a rounding across a step, so a logit may differ by a few bf16 steps)."""
    model = tiny_model()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    plain = copy.deepcopy(model).to(dtype).eval()
    prepared(model, precision, monkeypatch)
    mine, theirs = model.state_dict(), plain.state_dict()
    assert list(mine) == list(theirs)
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key
    with torch.no_grad():
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if precision == "fp32" else {"atol": 0.1, "rtol": 0.05}
        torch.testing.assert_close(model(ids(12)).float(), plain(ids(12)).float(), **tolerance)


def test_a_stack_is_the_only_copy_of_its_weights_and_loading_a_state_dict_writes_it(monkeypatch):
    model = prepared(tiny_model(0), "fp32", monkeypatch)[0]
    attention = model.layers[0].attn
    stack = attention.qkv
    assert stack.weight is not None
    for linear in stack.linears:  # views of the stack: one storage
        assert linear.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
    other = tiny_model(1).eval()
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids(5)), other(ids(5)), atol=1e-5, rtol=1e-5)
    assert stack.weight is not None  # still in use: the weights were written in place


def test_a_stack_lets_go_once_its_weights_are_moved(monkeypatch):
    model = prepared(tiny_model(), "fp32", monkeypatch)[0]
    plain = copy.deepcopy(model)
    model.to(torch.float64)  # `.to()` gives each parameter a new tensor: they leave the stack
    with torch.no_grad():
        out = model(ids(5))
    assert out.dtype == torch.float64
    assert all(block.attn.qkv.weight is None and block.ffn.w13.weight is None for block in model.layers)
    with torch.no_grad():
        torch.testing.assert_close(out, plain(ids(5)).double(), atol=1e-5, rtol=1e-5)


def test_with_gradients_recorded_the_linears_run_one_by_one_and_get_their_gradients(monkeypatch):
    model = prepared(tiny_model(), "fp32", monkeypatch)[0]
    plain = tiny_model()
    for m in (model, plain):
        m.train()
        m(ids(8)).square().mean().backward()
    for (name, mine), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_wide_matrices_are_held_by_columns_and_narrow_ones_by_rows(monkeypatch):
    model = prepared(tiny_model(tie_embeddings=True), "fp32", monkeypatch)[0]  # ZEN4 fp32: "columns"
    block = model.layers[0]
    assert block.attn.qkv.weight.T.is_contiguous()  # (32 + 16 + 16) × 32: wide
    assert block.ffn.w13.weight.T.is_contiguous()  # (64 + 64) × 32
    assert model.lm_head.weight.T.is_contiguous()  # 97 × 32, and the embedding table it is tied to
    assert block.ffn.w2.weight.is_contiguous()  # 32 × 64: narrow, left by rows
    assert block.attn.output_proj.weight.is_contiguous()  # square
    matrix = torch.randn(7, 3)
    held = by_columns(matrix)
    assert torch.equal(held, matrix) and held.T.is_contiguous() and held.shape == (7, 3)


def test_a_stack_unfused_or_fused_gives_its_linears_outputs():
    model = tiny_model()
    stack: LinearStack = model.layers[0].ffn.w13
    x = torch.randn(3, 32)
    expected = [linear(x) for linear in stack.linears]
    with torch.no_grad():
        for outputs in (stack(x), (stack.fuse(), stack(x))[1], (stack.fuse(True), stack(x))[1]):
            assert len(outputs) == 2
            for got, want in zip(outputs, expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def onednn_during_forward(model: TransformerLM, token_ids: torch.Tensor, **kwargs) -> list[bool]:
    """The oneDNN switch as the first block saw it during `model(token_ids)`."""
    seen: list[bool] = []
    handle = model.layers[0].register_forward_hook(lambda *_: seen.append(torch.backends.mkldnn.enabled))
    try:
        with torch.no_grad():
            model(token_ids, **kwargs)
    finally:
        handle.remove()
    return seen


def test_a_one_token_step_runs_without_onednn_and_the_switch_comes_back(monkeypatch):
    model = prepared(tiny_model(), "bf16", monkeypatch)[0]  # ZEN4 bf16: "rows_no_onednn"
    assert model.one_token_without_onednn and torch.backends.mkldnn.enabled
    assert onednn_during_forward(model, ids(1)[:1]) == [False]
    assert torch.backends.mkldnn.enabled
    assert onednn_during_forward(model, ids(4)[:1]) == [True]  # several tokens: oneDNN is the faster
    assert onednn_during_forward(model, ids(1)) == [True]  # two rows of one token each
    with pytest.raises(ScratchlmError), torch.no_grad():  # a failing step gives the switch back too
        model(ids(1)[:1], kv_cache=KVCache(2, 16, batch_size=3))
    assert torch.backends.mkldnn.enabled
    fp32 = prepared(tiny_model(), "fp32", monkeypatch)[0]
    assert not fp32.one_token_without_onednn and onednn_during_forward(fp32, ids(1)[:1]) == [True]


def test_a_one_token_step_without_onednn_computes_what_it_computes_with_it(monkeypatch):
    """The same bf16 products by another kernel: both accumulate in float32 and round to bf16, so the logits
    agree to a few bf16 steps (2^-8 relative each)."""
    model = prepared(tiny_model(), "bf16", monkeypatch)[0]
    token = ids(1)[:1]
    with torch.no_grad():
        without = model(token).float()
        model.one_token_without_onednn = False
        with_onednn = model(token).float()
    torch.testing.assert_close(without, with_onednn, atol=0.05, rtol=0.02)


def test_a_decode_step_attends_in_float32_on_a_cpu_and_in_its_own_dtype_elsewhere():
    cuda = torch.device("cuda")  # a device type only: nothing is allocated on it
    assert decode_dtype(torch.bfloat16, CPU) == decode_dtype(torch.float16, CPU) == torch.float32
    assert decode_dtype(torch.float32, CPU) == torch.float32
    assert (
        decode_dtype(torch.bfloat16, cuda) == torch.bfloat16
        and decode_dtype(torch.float16, cuda) == torch.float16
    )


def test_bf16_caches_on_a_cpu_hold_float32_and_a_prefill_gets_its_own_dtype_back(monkeypatch):
    model = prepared(tiny_model(), "bf16", monkeypatch)[0]
    cache = model.new_kv_cache(batch_size=1)
    layer = cache.layers[0]
    keys = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16)
    got, _ = layer.append(keys, keys)
    assert layer.keys.dtype == torch.float32 and got.dtype == torch.bfloat16 and torch.equal(got, keys)
    step, _ = layer.append(keys[..., :1, :], keys[..., :1, :])
    assert step.dtype == torch.float32 and step.shape[-2] == 4
    assert model.new_padded_kv_cache(2).layers[0].keys.dtype == torch.float32


def test_the_matrix_vector_rate_is_what_an_independent_timing_gives():
    """Each way's measured rate is what a timing written out here gives over the same bytes of weights (the
    measurement's `MATVEC_MIB`: more than a CPU's caches, whose size would otherwise decide the rate), for as
    long, at the same thread count, within 1.5x either way; and so is each way's rate over "rows", the ratio
    `choose_matvec` decides by. Each side is the best of five, taken in turns, at one thread (a second thread
    on a shared 2-core machine runs at whatever the other processes leave it): a rate off by 2 fails."""
    import time

    from scratchlm.device import rates

    d_out, d_in = 2048, 512
    count = rates.MATVEC_MIB * 2**20 // (d_out * d_in * 4)

    def independent(way: str) -> float:
        block = torch.randn(count, d_out, d_in)
        if way == "columns":  # each matrix held by columns: its transpose contiguous
            block = torch.randn(count, d_in, d_out).transpose(1, 2)
        matrices, x = list(block), torch.randn(1, d_in)
        enabled, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, way != "rows_no_onednn"
        try:
            x @ matrices[0].T
            passes, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < rates.MATVEC_SECONDS or passes < 1:
                for m in matrices:
                    x @ m.T
                passes += 1
            return count * d_out * d_in * 4 * passes / elapsed / 1e9
        finally:
            torch.backends.mkldnn.enabled = enabled

    def disagreements() -> list[tuple]:
        measured: dict[str, float] = {}
        timed: dict[str, float] = {}
        with torch_threads(1):
            for _ in range(5):  # in turns: other work slows both sides alike
                for way in MATVEC_WAYS:
                    measured[way] = max(measured.get(way, 0.0), matvec_gbps(CPU, torch.float32, way))
                    timed[way] = max(timed.get(way, 0.0), independent(way))
        ratios = {
            way: (measured[way] / measured["rows"]) / (timed[way] / timed["rows"]) for way in MATVEC_WAYS
        }
        return [
            (way, measured, timed)
            for way in MATVEC_WAYS
            if not (timed[way] / 1.5 < measured[way] < timed[way] * 1.5 and 1 / 1.5 < ratios[way] < 1.5)
        ]

    assert settled(disagreements) == []
