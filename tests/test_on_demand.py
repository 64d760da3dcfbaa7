"""A server's decode steps (`scratchlm.generation.on_demand`): compiled in the background as the rows first need
them, eager steps meanwhile, a larger compiled window standing in for a smaller one, and each compiled step kept
only where it measured faster. Every test checks the greedy tokens against an eager decoder's."""

import dataclasses
import threading

import pytest
import torch

from scratchlm import ModelConfig, TransformerLM
from scratchlm.device import decode_timings
from scratchlm.generation import decode, on_demand
from scratchlm.generation.decode import Decoder

SMALL = ModelConfig(
    vocab_size=97, context_length=64, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=192
)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Timings recorded by one test are not read by another."""
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM.from_config(SMALL).eval()


def fill(decoder: Decoder, model: TransformerLM, lengths: list[int]) -> None:
    """Prefill row r with a prompt of `lengths[r]` tokens."""
    for row, length in enumerate(lengths):
        cache = model.new_kv_cache(1)
        prompt = torch.randint(0, SMALL.vocab_size, (1, length), generator=torch.Generator().manual_seed(row))
        with torch.no_grad():
            model(prompt, kv_cache=cache)
        decoder.cache.store(row, cache)


def greedy(decoder: Decoder, steps: int, rows: int, between=lambda step: None) -> list[list[int]]:
    last = torch.arange(1, rows + 1)
    tokens = []
    with torch.no_grad():
        for step in range(steps):
            between(step)
            last = decoder.step(last).argmax(-1)
            tokens.append(last.tolist())
    return tokens


def eager_tokens(model: TransformerLM, lengths: list[int], steps: int) -> list[list[int]]:
    decoder = Decoder(model, 4, compiled=False)
    fill(decoder, model, lengths)
    return greedy(decoder, steps, len(lengths))


class HeldCompiler:
    """`compile_traced` held until `release`: the compilation in flight for as long as a test needs."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls = 0

    def __call__(self, traced, threads):
        self.calls += 1
        assert self.go.wait(60)
        return decode.compile_traced(traced, threads)


def test_a_step_compiles_in_the_background_while_the_rows_decode_eagerly(model, monkeypatch):
    """The first step of two rows starts their compilation and runs eagerly, and so does every step until it
    is done; `compiling` names it meanwhile. Then the compiled step is timed against the eager one, kept
    (a gain of 0 is asked), recorded for this machine, and used; the rows' lengths are where the steps left
    them, and the tokens are the eager decoder's."""
    monkeypatch.setattr(on_demand, "MIN_GAIN", 0.0)
    held = HeldCompiler()
    monkeypatch.setattr(on_demand, "compile_traced", held)
    said: list[str] = []
    decoder = on_demand.OnDemandDecoder(model, 4, background=True, announce=said.append)
    fill(decoder, model, [5, 3])
    seen: list[list[str]] = []

    def between(step: int) -> None:
        seen.append(decoder.compiling())
        if step == 5:
            held.go.set()
            decoder.settle(60)

    tokens = greedy(decoder, 12, 2, between)
    assert tokens == eager_tokens(model, [5, 3], 12)
    assert seen[1:6] == [["2 sequences"]] * 5 and seen[-1] == [] and held.calls == 1
    assert decoder.cache.lengths[:2] == [17, 15]
    assert len(decoder.step_seconds) >= 12 - 6  # the steps after it was done ran compiled
    assert said[0].startswith("compiling the decode step for 2 sequences in the background")
    assert said[1].startswith("compiled the decode step for 2 sequences in ")
    assert said[2].startswith("  2 sequences: compiled; a step ")
    ((shape, timings),) = decode_timings.device_timings(torch.device("cpu")).items()
    assert shape.endswith("rows=2") and timings.compile_s > 0 and timings.compiled_ms > 0


def test_a_bucket_measured_no_faster_runs_eagerly_and_is_not_compiled_again(model, monkeypatch):
    """Asked for a gain no step reaches, the first use of the compiled step (compiled at once: no background)
    finds it too slow and the bucket runs eagerly; a second decoder reads the recorded timings and never
    compiles it."""
    monkeypatch.setattr(on_demand, "MIN_GAIN", 1e9)
    said: list[str] = []
    decoder = on_demand.OnDemandDecoder(model, 4, background=False, announce=said.append)
    fill(decoder, model, [4])
    assert greedy(decoder, 6, 1) == eager_tokens(model, [4], 6)
    assert decoder.eager_buckets == {1} and any(line.startswith("  1 sequence: eager;") for line in said)

    def refuse(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(on_demand, "compile_traced", refuse)
    monkeypatch.setattr(decode, "compile_traced", refuse)
    again = on_demand.OnDemandDecoder(model, 4, background=True)
    assert again.eager_buckets == {1}
    fill(again, model, [4])
    assert greedy(again, 6, 1) == eager_tokens(model, [4], 6)


def test_a_failed_compilation_leaves_its_bucket_eager_and_says_so(model, monkeypatch):
    def broken(traced, threads):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(on_demand, "compile_traced", broken)
    said: list[str] = []
    decoder = on_demand.OnDemandDecoder(model, 4, background=True, announce=said.append)
    fill(decoder, model, [4, 6, 2])

    def between(step: int) -> None:
        if step == 1:
            decoder.settle(60)

    assert greedy(decoder, 8, 3, between) == eager_tokens(model, [4, 6, 2], 8)
    assert decoder.eager_buckets == {4}
    assert any("failed (no C compiler); it runs eagerly" in line for line in said)


def test_a_larger_compiled_window_stands_in_while_the_smaller_one_compiles(model, monkeypatch):
    """Windows follow the lengths (the caches' size rule set aside): rows 20 long run compiled over 32
    positions; rows of 5 then need 8 positions, whose step compiles in the background while the 32-position
    step, already compiled, runs them (no eager step)."""
    monkeypatch.setattr(decode, "WINDOW_BYTES", 0)
    monkeypatch.setattr(on_demand, "MIN_GAIN", 0.0)
    decoder = on_demand.OnDemandDecoder(model, 2, background=False)
    assert decoder._windows[2] == [8, 16, 32, 64]
    fill(decoder, model, [20, 18])
    assert greedy(decoder, 3, 2) == eager_tokens(model, [20, 18], 3)
    threads = torch.get_num_threads()
    assert set(decoder._steps) == {(2, 32, threads)}

    decoder.background = True
    held = HeldCompiler()
    monkeypatch.setattr(on_demand, "compile_traced", held)
    eager_calls = []
    monkeypatch.setattr(decoder, "eager_step", lambda tokens: eager_calls.append(tokens))
    fill(decoder, model, [5, 4])
    assert greedy(decoder, 3, 2) == eager_tokens(model, [5, 4], 3)
    assert decoder.compiling() == ["2 sequences, 8 positions"] and eager_calls == []
    held.go.set()
    decoder.settle(60)


def test_the_steps_of_a_long_context_compile_at_the_window_the_lengths_need(monkeypatch):
    """A 1,024-position context whose keys and values outweigh its weights (the caches' size rule set aside):
    a row of 40 tokens compiles the step over the smallest window past it, not a quarter of the context."""
    monkeypatch.setattr(decode, "WINDOW_BYTES", 0)
    torch.manual_seed(0)
    model = TransformerLM.from_config(dataclasses.replace(SMALL, context_length=1024)).eval()
    decoder = on_demand.OnDemandDecoder(model, 1, background=False)
    windows = decoder._windows[1]
    assert windows[0] < 64 and windows[-1] == 1024
    fill(decoder, model, [40])
    greedy(decoder, 2, 1)
    ((_, window, _),) = decoder._steps
    assert window == 64


def test_a_step_traced_beside_the_serving_steps_reads_the_layout_the_plan_gave(model, monkeypatch):
    """The background trace runs on fake tensors, beside steps that go on writing the cache: a model laid out
    for inference (its attention projections and SwiGLU's W1 and W3 fused into stacks, held beside the
    parameters) compiles there and gives the eager tokens, and the rows' keys and values are those of an
    eager decoder after the same steps."""
    from scratchlm.device.planning import plan
    from scratchlm.generation.layout import prepare_for_inference

    monkeypatch.setattr(on_demand, "MIN_GAIN", 0.0)
    prepare_for_inference(model, plan(torch.device("cpu"), "fp32"))
    decoder = on_demand.OnDemandDecoder(model, 4, background=True)
    fill(decoder, model, [7, 2, 5])

    def between(step: int) -> None:
        if step == 2:
            decoder.settle(120)

    assert greedy(decoder, 10, 3, between) == eager_tokens(model, [7, 2, 5], 10)
    assert len(decoder.step_seconds) >= 7  # compiled from the fourth step on
    eager = Decoder(model, 4, compiled=False)
    fill(eager, model, [7, 2, 5])
    greedy(eager, 10, 3)
    for mine, theirs in zip(decoder.cache.layers, eager.cache.layers, strict=True):
        for row, length in enumerate([17, 12, 15]):
            torch.testing.assert_close(mine.keys[row, :, :length], theirs.keys[row, :, :length])
