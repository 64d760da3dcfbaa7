"""The decode step, eager and compiled (`scratchlm.generation.decode`): the whole-window layout against the
padded cache, compiled tokens against eager ones, and when a generation compiles."""

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from scratchlm import ModelConfig, TransformerLM
from scratchlm.device import choices as device_choices
from scratchlm.device import decode_timings
from scratchlm.device.decode_timings import ASSUMED, DecodeTimings, worth_compiling
from scratchlm.device.planning import plan
from scratchlm.generation import compile_policy, decode
from scratchlm.generation.decode import Decoder, bucket, window_buckets
from scratchlm.generation.generate import generate, generate_stream
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.kv_cache import WholeWindowKVCache

SMALL = ModelConfig(
    vocab_size=97, context_length=24, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48
)


def small_model(**changes) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM.from_config(dataclasses.replace(SMALL, **changes)).eval()


def prompts(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Timings recorded by one test are not read by another."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))


def test_buckets_are_powers_of_two_up_to_the_rows():
    assert [bucket(rows, 16) for rows in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert [bucket(rows, 6) for rows in (3, 5, 6)] == [4, 6, 6]


@torch.no_grad()
def test_the_whole_window_step_equals_the_padded_step_row_by_row():
    """Rows of different lengths, a bucket larger than the rows in use: each row's logits are those of its
    own sequence, whatever the padding rows and the stale keys past each row's length hold."""
    model = small_model()
    lengths = [3, 9, 5]
    padded = model.new_padded_kv_cache(4)
    whole = model.new_padded_kv_cache(4)
    for cache in (padded, whole):
        for layer in cache.layers:  # stale values past each row's length must not be read
            layer.keys.normal_()
            layer.values.normal_()
    for row, length in enumerate(lengths):
        prefill = model.new_kv_cache(1)
        model(prompts(1, length, seed=row), kv_cache=prefill)
        padded.store(row, prefill)
        whole.store(row, prefill)
    new = prompts(3, 1, seed=9)
    padded.batch_size = 3
    expected = model(new, kv_cache=padded)[:, -1]
    view = WholeWindowKVCache(whole, 4)
    view.set_positions(lengths)
    got = model.decode(torch.cat([new, torch.zeros(1, 1, dtype=torch.long)]), view)[:3]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The new keys were written at each row's length, as the padded cache writes them.
    for mine, theirs in zip(whole.layers, padded.layers, strict=True):
        for row, length in enumerate(lengths):
            torch.testing.assert_close(mine.keys[row, :, : length + 1], theirs.keys[row, :, : length + 1])


@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_greedy_tokens_equal_eager_ones_in_fp32(rows):
    model = small_model()
    batch = prompts(rows, 4)
    eager = generate(model, batch, 18, temperature=0, compile=False)
    compiled = generate(model, batch, 18, temperature=0, compile=True)
    assert compiled == eager
    assert compile_policy._DECODERS[model][rows].compile_seconds > 0  # it did compile
    # Past the context the generation recomputes on the window, compiled decoder or not.
    assert generate(model, batch, 30, temperature=0, compile=True) == generate(
        model, batch, 30, temperature=0, compile=False
    )


def test_compiled_sampling_follows_the_seed_and_stops_at_eos():
    model = small_model()
    first = list(
        generate_stream(model, [5, 6, 7], 15, temperature=0.9, top_p=0.9, options=None, compile=True)
    )
    again = generate(model, [5, 6, 7], 15, temperature=0.9, top_p=0.9, compile=True)
    assert len(first) == 15 and len(again) == 15  # no seed: just that sampling runs through the decoder
    seeded = [
        generate(model, [5, 6, 7], 15, temperature=0.9, generator=torch.Generator().manual_seed(3), compile=c)
        for c in (False, True)
    ]
    assert seeded[0] == seeded[1]
    eos = seeded[0][4]
    stopped = generate(
        model,
        [5, 6, 7],
        15,
        temperature=0.9,
        eos_id=eos,
        generator=torch.Generator().manual_seed(3),
        compile=True,
    )
    assert stopped == seeded[0][: seeded[0].index(eos) + 1]


def test_a_short_generation_never_compiles(monkeypatch):
    """With the plan's consent (`compiled_decode`) but no measured timings, a few tokens are not worth a
    compilation: it is never started (on a CPU a step compiles through `compile_traced`, refused here)."""
    model = small_model()
    model.compiled_decode = True

    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(decode, "compile_traced", refuse)
    assert generate(model, [1, 2, 3], 20, temperature=0) == generate(
        model, [1, 2, 3], 20, temperature=0, compile=False
    )
    assert model not in compile_policy._DECODERS


def test_worth_compiling_weighs_the_time_saved_against_compiling():
    # Assumed: a 2x speed-up and 30 s to compile, so 60 s of eager steps must be left.
    assert not worth_compiling(None, eager_step_s=0.01, steps_left=5_000)
    assert worth_compiling(None, eager_step_s=0.01, steps_left=7_000)
    measured = DecodeTimings(eager_ms=10.0, compiled_ms=2.5, compile_s=3.0)  # saves 7.5 ms a step
    assert not worth_compiling(measured, eager_step_s=0.01, steps_left=300)  # 2.25 s < 3 s
    assert worth_compiling(measured, eager_step_s=0.01, steps_left=500)  # 3.75 s > 3 s
    slower = DecodeTimings(eager_ms=10.0, compiled_ms=9.5, compile_s=0.1)
    assert not worth_compiling(slower, eager_step_s=0.01, steps_left=10**9)
    assert ASSUMED.speedup == 2.0


def test_a_measured_generation_records_its_timings_and_the_next_one_uses_them(monkeypatch):
    model = small_model()
    generate(small_model(), prompts(1, 3), 12, temperature=0, compile=True)  # at once: no eager steps timed
    assert decode_timings.device_timings(torch.device("cpu")) == {}
    # Told that compiling pays, a plan-driven generation switches after its warm-up steps and records.
    model.compiled_decode = True
    monkeypatch.setattr(compile_policy, "worth_compiling", lambda *args: True)
    assert generate(model, prompts(1, 3), 12, temperature=0) == generate(
        model, prompts(1, 3), 12, temperature=0, compile=False
    )
    ((shape, timings),) = decode_timings.device_timings(torch.device("cpu")).items()
    assert shape.startswith("fp32|2,32,4,2,48,97,24|rows=1")
    assert timings.eager_ms > 0 and timings.compiled_ms > 0


def _prefilled(model: TransformerLM, length: int, seed: int = 1):
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(prompts(1, length, seed), kv_cache=cache)
    return cache


@pytest.mark.parametrize("found", [True, False])
def test_the_plan_allows_compiled_decode_only_with_a_compiler_and_without_no_compile(monkeypatch, found):
    monkeypatch.setattr(device_choices, "compiler_found", lambda device: (found, "mocked"))
    choices = plan(torch.device("cpu"), "fp32")
    assert choices.decode.value is found
    assert ("compiled" in choices.decode.reason) is found
    assert plan(torch.device("cpu"), "fp32", compile_decode=False).decode.value is False
    model = small_model()
    prepare_for_inference(model, choices)
    assert model.compiled_decode is found
    assert choices.to_dict()["decode"]["value"] is found


def test_a_cuda_plan_compiles_as_cuda_graphs(monkeypatch):
    """A CUDA plan allows compiled decode steps, and a decoder whose cache lives on a GPU compiles its step
    with `torch.compile` in "reduce-overhead" mode (CUDA graphs), one graph per fixed shape. No GPU is needed:
    the cache only has to say it is on one, and `torch.compile` is recorded rather than run."""
    monkeypatch.setattr(device_choices, "compiler_found", lambda device: (True, "Triton 3"))
    assert device_choices.choose_decode(True, torch.device("cuda")).value is True
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: calls.append(options) or fn)
    model = small_model()
    on_gpu = SimpleNamespace(layers=[SimpleNamespace(keys=SimpleNamespace(is_cuda=True))])
    monkeypatch.setattr(model, "new_padded_kv_cache", lambda rows: on_gpu)
    Decoder(model, 4, compiled=True)
    [options] = calls
    assert options["mode"] == "reduce-overhead" and options["dynamic"] is False and options["fullgraph"]
    calls.clear()
    Decoder(model, 4, compiled=False)  # eager: nothing compiled
    assert calls == []


def test_weights_held_by_columns_get_a_copy_by_rows_for_the_compiled_step():
    """Where the plan holds wide matrices by columns (the eager one-token product's fastest layout on some
    CPUs), the compiled step reads a copy by rows; the parameters, their layout and the state dict stay."""
    from scratchlm.model.layers import lay_out_for_inference

    model = small_model(vocab_size=97, d_ff=96)
    keys = set(model.state_dict())
    lay_out_for_inference(model, wide_by_columns=True)
    head = model.lm_head.weight
    assert head.stride(-1) != 1  # held by columns
    batch = prompts(2, 4)
    eager = generate(model, batch, 16, temperature=0, compile=False)
    assert generate(model, batch, 16, temperature=0, compile=True) == eager
    assert model.lm_head.weight_by_rows is not None and model.lm_head.weight_by_rows.is_contiguous()
    torch.testing.assert_close(model.lm_head.weight_by_rows, head, rtol=0, atol=0)
    assert model.lm_head.weight.stride() == head.stride() and set(model.state_dict()) == keys


def test_the_compiled_step_reads_the_weights_where_they_lie():
    """The compiled step (on a CPU, compiled without Dynamo from a traced graph) reads the parameters at
    each call, as the eager step does: weights changed in place after compiling are seen."""
    model = small_model()
    batch = prompts(1, 4)
    generate(model, batch, 8, temperature=0, compile=True)  # compiles the step
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
        model.layers[0].ffn.w2.weight.add_(0.05)
    eager = generate(model, batch, 12, temperature=0, compile=False)
    assert generate(model, batch, 12, temperature=0, compile=True) == eager


def test_a_step_is_compiled_again_for_another_thread_count():
    """Inductor writes a step's loops for the threads it has: run with more threads, the step compiled for
    one would still use one."""
    model = small_model()
    batch = prompts(1, 4)
    eager = generate(model, batch, 10, temperature=0, compile=False)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert generate(model, batch, 10, temperature=0, compile=True) == eager
    finally:
        torch.set_num_threads(threads)
    window = SMALL.context_length  # one row of this model: no window buckets
    assert set(compile_policy._DECODERS[model][1]._steps) == {(1, window, 1), (1, window, 2)}


def test_windows_follow_the_lengths_where_the_rows_keys_and_values_weigh_a_quarter_of_the_weights():
    """By hand: the TinyStories shape holds 17,576,448 weights past the embedding, 70.3 MB in fp32; a row's
    keys and values take 4 layers x 2 x 512 x 4 bytes = 16,384 bytes a position, 4.19 MB over the context.
    Four rows (16.8 MB) stay under a quarter of the weights (17.6 MB), eight (33.6 MB) do not. The smallest
    window is the largest power of two whose keys and values weigh at most a sixteenth of the weights
    (4,394,112 bytes): 4,394,112 / (8 x 16,384) = 33.5 positions for eight rows, so 32; 16.8 for sixteen, so
    16. From there the windows double up to the context."""
    model = TransformerLM.from_config(ModelConfig())
    assert model.num_parameters(non_embedding=True) == 17_576_448
    assert [window_buckets(model, rows) for rows in (1, 4, 8, 16)] == [
        [256],
        [256],
        [32, 64, 128, 256],
        [16, 32, 64, 128, 256],
    ]


def test_a_long_context_gets_windows_up_to_it_and_a_context_of_any_length_ends_them():
    """A 30-layer model of 576 wide, 3 key/value heads of 64, 8,192 positions, a tied head (a small downloaded
    chat model's shape): a layer holds, by hand, 2 x 576^2 + 2 x 576 x 192 = 884,736 attention + 2,654,208
    SwiGLU + 1,152 norm weights; 30 of them, the final norm and the head a step reads (the tied embedding,
    28,311,552) make 134,515,008 weights, 538.1 MB in fp32. One row's keys and values take 30 x 2 x 3 x 64 x 4
    = 46,080 bytes a position, 377 MB over the context, more than a quarter of the weights, so the windows
    follow the lengths from the largest power of two under 33.63 MB / 46,080 = 730 positions: 512. Two rows:
    under 365, so 256; a context that is not a power of two is the last window."""
    config = ModelConfig(
        vocab_size=49_152,
        context_length=8_192,
        d_model=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        d_ff=1_536,
        tie_embeddings=True,
    )
    with torch.device("meta"):
        model = TransformerLM.from_config(config)
        assert model.num_parameters(non_embedding=True) == 134_515_008
        assert window_buckets(model, 1) == [512, 1024, 2048, 4096, 8192]
        odd = TransformerLM.from_config(dataclasses.replace(config, context_length=3_000))
        assert window_buckets(odd, 2) == [256, 512, 1024, 2048, 3000]


def test_a_small_models_windows_are_whole_however_many_rows():
    """Sixteen rows of the LONG model's keys and values (16 x 2 layers x 2 x 64 positions x 16 x 4 bytes =
    256 KB) outweigh its weights but stay under `WINDOW_BYTES`: one window, one compilation a bucket."""
    model = small_model(**LONG)
    assert window_buckets(model, 16) == [64]


# Few weights and a long context: from two rows on, a step's keys and values outweigh a quarter of them.
LONG = dict(context_length=64, d_model=16, num_heads=2, num_kv_heads=2, d_ff=192)


@pytest.fixture
def windows_at_any_size(monkeypatch):
    """The LONG model's keys and values are a few KB: windows as if they were past the caches."""
    monkeypatch.setattr(decode, "WINDOW_BYTES", 0)


@pytest.mark.usefixtures("windows_at_any_size")
def test_a_window_that_follows_the_lengths_gives_the_eager_tokens_across_its_bounds():
    """Three sequences whose lengths cross 8, 16 and 32 positions: the compiled step moves to the next window
    at each bound and gives the eager step's greedy tokens; a generation compiles only the window that holds
    its whole length (`reach`)."""
    model = small_model(**LONG)
    assert window_buckets(model, 1) == [64] and window_buckets(model, 4) == [4, 8, 16, 32, 64]
    threads = torch.get_num_threads()
    tokens = {}
    for compiled in (False, True):
        decoder = Decoder(model, 4, compiled=compiled)
        for row, length in enumerate([6, 3, 5]):
            decoder.cache.store(row, _prefilled(model, length, seed=row))
        last = torch.tensor([1, 2, 3])
        steps = []
        with torch.no_grad():
            for _ in range(40):
                last = decoder.step(last).argmax(-1)
                steps.append(last.tolist())
        tokens[compiled] = steps
    assert tokens[True] == tokens[False]
    assert set(decoder._steps) == {(4, w, threads) for w in (8, 16, 32, 64)}
    batch = prompts(3, 5)
    assert generate(model, batch, 20, temperature=0, compile=True) == generate(
        model, batch, 20, temperature=0, compile=False
    )
    assert set(compile_policy._DECODERS[model][3]._steps) == {(3, 32, threads)}  # 5 + 19 positions


def test_the_private_torch_apis_the_cpu_compiled_decode_uses_are_where_it_expects_them():
    """`compile_traced` rests on PyTorch APIs that are not public: `make_fx` (torch.fx.experimental.
    proxy_tensor) traces the step with `tracing_mode="real"`, Inductor's `standalone_compile` compiles the
    graph with `dynamic_shapes="from_example_inputs"`, and the decoder marks its tensors with
    `torch._dynamo.mark_static_address`. A torch upgrade that moves or changes one of them fails here, by
    name. Each is used as the decoder uses it, on a step of the same form (weights as inputs, a cache written
    in place), against the eager function."""
    from torch.fx.experimental.proxy_tensor import make_fx

    assert decode.make_fx is make_fx  # the one the decoder imports
    assert "tracing_mode" in inspect.signature(make_fx).parameters
    standalone_compile = torch._inductor.standalone_compile
    assert "dynamic_shapes" in inspect.signature(standalone_compile).parameters
    torch._dynamo.mark_static_address(torch.zeros(1))

    def step(tokens: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[:, 1] = weight[tokens[:, 0]]  # the new position's row, written in place
        return torch.tanh(cache.sum(1)) @ weight.T

    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[4], [1]])
    cache = torch.zeros(2, 2, 3)
    cache[:, 0] = 1.0
    inputs = [tokens, weight, cache.clone()]
    with torch.no_grad():
        graph = make_fx(step, tracing_mode="real")(*[t.clone() for t in inputs])
        compiled = standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs")
        expected_cache = cache.clone()
        expected = step(tokens, weight, expected_cache)
        got = compiled(*inputs)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(inputs[2], expected_cache)  # the cache was written where it lies
