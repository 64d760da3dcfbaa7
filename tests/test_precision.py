"""Every feature at every precision, set explicitly (never what "auto" resolves to on the machine at hand): a
training step, resume, evaluation, generation, serving, export and import, in fp32, bf16 and fp16 on the CPU
with tiny models (bf16 and fp16 are slow on some CPUs but correct on all). DDP is in test_ddp.py.

Tolerances follow from the formats. A float with a p-bit significand rounds with a relative error of at most
u = 2^-p: u = 2^-24 in fp32, 2^-8 in bf16 (8 bits), 2^-11 in fp16 (11 bits). Two computations of the same
logits at one precision that differ only in how their sums are grouped (a KV cache's one-token step against
the whole sequence, a batch of 16 against one row) differ by a few such roundings at each of the model's
matmuls: for these two-layer models, a bound of `ROUNDINGS` units of the largest logit. Greedy decoding by two
such paths picks the same tokens except where the two best logits lie within that bound of each other; the
oracle checks exactly that: the tokens agree, or, where they first part, the reference's logits of the two
candidates are within the bound.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from interop_helpers import make_run, run_cli, scratch_model, small_tokenizer
from test_trainer import final_state, records, small_config

from scratchlm.device import plan
from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.generation.generate import generate
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.config import ModelConfig
from scratchlm.model.loss import cross_entropy
from scratchlm.run.load import load_trained
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.training import loss_scale
from scratchlm.training.loss_scale import LossScaler
from scratchlm.training.trainer import train

PRECISIONS = ("fp32", "bf16", "fp16")
# Unit roundoff of each format; for weight-only int8 (`--quantize int8`, test_quantize.py) and llama.cpp's Q8_0,
# a weight's largest error relative to the largest of its row (or block): half a step of 127.
UNIT = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11, "int8": 1 / 254}
ROUNDINGS = 32  # roundings of the logits' scale that two groupings of a two-layer model's sums may differ by
CPU = torch.device("cpu")


def inference_copy(run: Path, precision: str):
    """The run's model and tokenizer, its weights held in `precision` as every inference command holds them."""
    trained = load_trained(run)
    prepare_for_inference(trained.model, plan(CPU, precision, threads=1))
    return trained.model, trained.tokenizer


def logit_bound(precision: str, logits: torch.Tensor) -> float:
    return ROUNDINGS * UNIT[precision] * float(logits.float().abs().max())


def assert_same_greedy(model, prompt: list[int], got: list[int], precision: str) -> None:
    """`got` is the greedy continuation of `prompt` up to rounding: each token is the argmax of the model
    recomputed on the whole prefix, or the first one that is not lies within `logit_bound` of it."""
    with torch.no_grad():
        for i, token in enumerate(got):
            logits = model(torch.tensor([prompt + got[:i]]))[0, -1].float()
            best = int(logits.argmax())
            if token != best:
                gap = float(logits[best] - logits[token])
                assert gap <= logit_bound(precision, logits), (i, token, best, gap)
                return


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tokenizer = small_tokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=64,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    return make_run(tmp_path_factory.mktemp("precision") / "tiny", scratch_model(config, seed=3), tokenizer)


# -- training -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_training_run_learns_at_every_precision_and_records_it(tmp_path, precision):
    summary = train(small_config(tmp_path, training={"precision": precision}))
    losses = [r["train_loss"] for r in records(tmp_path / "run", "train_loss")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3
    assert math.isfinite(summary.final_val_loss)
    [setup] = [r["setup"] for r in records(tmp_path / "run", "setup")]
    assert setup["precision"] == precision
    assert torch.load(sorted((tmp_path / "run" / "checkpoints").iterdir())[-1])["precision"] == precision
    scaled = records(tmp_path / "run", "loss_scale")
    assert (len(scaled) == 12) == (precision == "fp16")  # only fp16 scales its loss


def test_bf16_and_fp16_train_like_fp32(tmp_path):
    """The same 12 steps: each logged loss within 0.01 nats of fp32's (the matmuls keep 3 significant digits
    in bf16, 4 in fp16, and the loss is a mean over 128 tokens, so its error is far smaller than one matmul
    element's; measured: 0.001 in bf16)."""
    losses = {}
    for precision in PRECISIONS:
        train(small_config(tmp_path, precision, training={"precision": precision}))
        losses[precision] = [r["train_loss"] for r in records(tmp_path / precision, "train_loss")]
    for low in ("bf16", "fp16"):
        assert losses[low] != losses["fp32"]  # the low precision did run
        assert max(abs(a - b) for a, b in zip(losses[low], losses["fp32"], strict=True)) < 0.01


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_is_bit_exact_at_every_precision(tmp_path, precision):
    train(small_config(tmp_path, "straight", training={"precision": precision}))
    half = small_config(tmp_path, "resumed", training={"precision": precision, "max_steps": 6})
    train(half)
    train(small_config(tmp_path, "resumed", training={"precision": precision}), resume=True)
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    assert straight.get("loss_scale") == resumed.get("loss_scale")
    assert [r["train_loss"] for r in records(tmp_path / "straight", "train_loss")] == [
        r["train_loss"] for r in records(tmp_path / "resumed", "train_loss")
    ]


# -- fp16 loss scaling --------------------------------------------------------------------------------------


def test_the_loss_scaler_skips_overflows_halves_and_grows():
    scaler = LossScaler(True, scale=1024.0, growth_interval=2)
    parameter = torch.nn.Parameter(torch.zeros(3))
    (scaler.scale_loss(torch.tensor(2.0)) * parameter.sum()).backward()  # d/dp = 2 * 1024
    scaler.unscale_([parameter])
    assert torch.equal(parameter.grad, torch.full((3,), 2.0))
    assert scaler.update(torch.tensor(1.0)) and scaler.scale == 1024.0
    assert scaler.update(torch.tensor(1.0)) and scaler.scale == 2048.0  # 2 clean steps: doubled
    assert not scaler.update(torch.tensor(math.inf)) and scaler.scale == 1024.0 and scaler.skipped == 1
    assert not scaler.update(torch.tensor(math.nan)) and scaler.scale == 512.0 and scaler.skipped == 2
    again = LossScaler(True)
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == {"scale": 512.0, "clean_steps": 0, "skipped": 2}
    off = LossScaler(False)
    loss = torch.tensor(3.0)
    assert off.scale_loss(loss) is loss and off.update(torch.tensor(math.inf)) and off.skipped == 0


def test_fp16_skips_overflowing_steps_counts_them_and_resumes_with_its_scale(tmp_path, monkeypatch, capsys):
    """A first scale of 2^24 overflows fp16's backward (its largest number is 65,504; this model's gradients
    fit from 2^19 on): those steps are skipped and the scale halves until the gradients fit; after 3 clean
    steps it doubles and overflows again. The log line and the metrics count the skipped steps, the run still learns, and a resume at step 6
    continues with the saved scale, bit for bit."""
    monkeypatch.setattr(loss_scale, "INIT_SCALE", 2.0**24)
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 3)
    training = {"precision": "fp16", "max_steps": 24}
    schedule = {"warmup_iters": 2, "cosine_cycle_iters": 24}
    train(small_config(tmp_path, "straight", training=training, schedule=schedule))
    logged = records(tmp_path / "straight", "skipped_steps")
    skipped = logged[-1]["skipped_steps"]
    assert skipped >= 6  # 2^24 → 2^19, and again after each doubling
    assert logged[-1]["loss_scale"] < 2.0**24
    norms = [r["grad_norm"] for r in logged]
    assert norms[0] is None  # the first step was skipped: its (infinite) norm is not averaged in
    assert all(n is None or math.isfinite(n) for n in norms) and any(n is not None for n in norms)
    assert f"{skipped} skipped" in capsys.readouterr().err
    losses = [r["train_loss"] for r in records(tmp_path / "straight", "train_loss")]
    assert losses[-1] < losses[0] - 0.3

    train(small_config(tmp_path, "resumed", training={**training, "max_steps": 6}, schedule=schedule))
    checkpoint = torch.load(sorted((tmp_path / "resumed" / "checkpoints").iterdir())[-1])
    assert checkpoint["loss_scale"]["skipped"] >= 5
    train(small_config(tmp_path, "resumed", training=training, schedule=schedule), resume=True)
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "resumed")
    assert straight["loss_scale"] == resumed["loss_scale"]
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_a_scale_that_collapses_is_a_divergence(tmp_path, monkeypatch):
    """Gradients that overflow even unscaled (a loss of 1e30) halve the scale below 1: the run stops as
    diverged, naming the step, rather than skipping forever."""
    monkeypatch.setattr(loss_scale, "INIT_SCALE", 4.0)
    from scratchlm.data import tokens as tokens_module
    from scratchlm.errors import DivergedError

    real = tokens_module.cross_entropy
    monkeypatch.setattr(
        tokens_module,
        "cross_entropy",
        lambda logits, targets, ignore=None: real(logits, targets, ignore) * 1e30,
    )
    with pytest.raises(DivergedError, match="gradient norm"):
        train(small_config(tmp_path, training={"precision": "fp16"}))


# -- inference ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", PRECISIONS)
def test_eval_runs_in_the_precision_and_stays_within_its_rounding_of_fp32(
    run_dir, tmp_path, capsys, precision
):
    """`scratchlm eval --precision P` equals `evaluate` of the model held in P, which stays within P's rounding
    of the float32 loss. The bound: the cross-entropy moves by at most twice the largest change of a logit
    (it is 1-Lipschitz in each logit), and a logit by `logit_bound`."""
    trained = load_trained(run_dir)
    tokens = np.random.default_rng(1).integers(0, trained.model.config.vocab_size, 700).astype(np.uint16)
    np.save(tmp_path / "valid.npy", tokens)
    status, out, err = run_cli(
        ["eval", "--run", str(run_dir), "--data", str(tmp_path / "valid.npy"), "--device", "cpu",
         "--precision", precision],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    model, _ = inference_copy(run_dir, precision)
    expected = evaluate(model, tokens, batch_size=32)
    assert out == f"loss {expected.loss:.4f}  perplexity {expected.perplexity:.3f}\n"
    full = evaluate(trained.model, tokens, batch_size=32).loss
    window = torch.from_numpy(tokens[:65].astype(np.int64))
    with torch.no_grad():
        logits = trained.model(window[None, :-1])
    assert abs(expected.loss - full) <= 2 * logit_bound(precision, logits)
    if precision != "fp32":
        assert expected.loss != full  # the weights were held in the low precision
        cast = model(window[None, :-1])
        assert cast.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        assert cross_entropy(cast, window[None, 1:]).dtype == torch.float32


@pytest.mark.parametrize("precision", PRECISIONS)
def test_generation_with_the_kv_cache_equals_recomputation_at_every_precision(run_dir, precision):
    model, tokenizer = inference_copy(run_dir, precision)
    for text in ("Once upon a time", "The cat sat", "A"):
        prompt = tokenizer.encode(text)
        cached = generate(model, prompt, 40, temperature=0.0)
        assert_same_greedy(model, prompt, cached, precision)
        recomputed = generate(model, prompt, 40, temperature=0.0, use_cache=False)
        assert_same_greedy(model, prompt, recomputed, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_generate_command_streams_what_generate_gives_at_the_precision(run_dir, capsys, precision):
    model, tokenizer = inference_copy(run_dir, precision)
    eos = tokenizer.token_id(END_OF_TEXT)
    expected = generate(model, tokenizer.encode("The cat"), 24, temperature=0.0, eos_id=eos)
    status, out, err = run_cli(
        ["generate", "--run", str(run_dir), "--prompt", "The cat", "--temperature", "0", "--max-new-tokens",
         "24", "--device", "cpu", "--precision", precision],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    assert out == "The cat" + tokenizer.decode([t for t in expected if t != eos]) + "\n"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_serving_at_every_precision(run_dir, precision):
    """The engine as `scratchlm serve --precision P` builds it (the model held in P, its KV cache too): greedy
    completions equal `generate` alone and among 16 concurrent requests, and echoed prompt log-probabilities
    equal the float32 log-softmax of the model's own logits at P."""
    pytest.importorskip("starlette", reason="starlette not installed (pip install 'scratchlm[serve]')")
    pytest.importorskip("openai", reason="openai not installed (the test oracle)")
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import PROMPTS, Running, token_ids

    trained = load_trained(run_dir)
    prepare_for_inference(trained.model, plan(CPU, precision, threads=1))
    server = Running(trained, "tiny")
    try:
        # The cache holds what a decode step attends in: float32 on a CPU whatever the weights' dtype.
        assert server.engine.batch.cache.layers[0].keys.dtype == torch.float32
        model, tokenizer = server.model, server.tokenizer

        def complete(prompt: str) -> list[int]:
            body = {"logprobs": 0, "extra_body": {"return_tokens_as_token_ids": True}}
            reply = server.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=0, **body
            )
            return token_ids(reply.choices[0])

        alone = complete(PROMPTS[0])
        expected = server.expected(PROMPTS[0], 24, temperature=0.0)  # generate_stream, the same model
        if precision == "fp32":
            assert alone == expected
        else:  # the engine's masked batch-of-rows attention rounds differently: equal up to near-ties
            assert_same_greedy(model, tokenizer.encode(PROMPTS[0]), alone, precision)
            assert_same_greedy(model, tokenizer.encode(PROMPTS[0]), expected, precision)
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(complete, [PROMPTS[i % len(PROMPTS)] for i in range(16)]))
        for i, tokens in enumerate(together):
            prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
            eos = server.eos_id
            assert_same_greedy(model, prompt, [t for t in tokens if t != eos], precision)
        ids = tokenizer.encode(PROMPTS[2])
        reply = server.client.completions.create(
            model="tiny", prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=0
        )
        got = reply.choices[0].logprobs.token_logprobs[1:]
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, :-1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        np.testing.assert_allclose(got, expected.tolist(), atol=1e-5)
    finally:
        server.close()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_run_trained_at_every_precision_exports_and_imports(tmp_path, capsys, precision):
    """The weights a run saves are float32 master weights whatever it trained in; exported to Hugging Face
    format and imported back, the model gives the same logits as the run's, held in the same precision."""
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'scratchlm[hf]')")
    tokenizer = small_tokenizer()
    tokenizer.save(tmp_path / "tokenizer")
    config = small_config(tmp_path, training={"precision": precision, "max_steps": 4})
    model = {"vocab_size": tokenizer.vocab_size}  # the tokens (< 64) are ids of this tokenizer too
    train(config.replace(model=model, data={"tokenizer": str(tmp_path / "tokenizer")}))
    run = tmp_path / "run"
    assert {v.dtype for v in final_state(run)["model"].values()} == {torch.float32}
    status, _, err = run_cli(
        ["export", "--run", str(run), "--format", "hf", "--out", str(tmp_path / "hf")], capsys
    )
    assert status == 0, err
    status, _, err = run_cli(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")], capsys)
    assert status == 0, err
    ids = torch.arange(16)[None] % 32
    outputs = []
    for source in (run, tmp_path / "back"):
        trained = load_trained(source)
        prepare_for_inference(trained.model, plan(CPU, precision, threads=1))
        with torch.no_grad():
            outputs.append(trained.model(ids))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_an_unknown_precision_on_the_command_line_is_one_line(run_dir, capsys):
    status, _, err = run_cli(["generate", "--run", str(run_dir), "--precision", "fp8"], capsys)
    assert status == 2 and "fp8" in err and "Traceback" not in err
    with pytest.raises(ScratchlmError, match="must be one of auto, fp32, bf16, fp16"):
        plan(CPU, "fp64", threads=1)


def test_the_quickstart_samples_in_the_precision_its_run_recorded(tmp_path, monkeypatch):
    """The quickstart holds its model in the precision the run's checkpoint recorded, not in what "auto"
    resolves to now: a run trained in bf16 is sampled in bf16 on a device whose "auto" would be fp32."""
    from test_device import AVX2_CPU

    from scratchlm.device import planning
    from scratchlm.quickstart import load_for_inference

    monkeypatch.setattr(planning, "device_profile", lambda device, refresh=False: AVX2_CPU)  # auto: fp32
    train(small_config(tmp_path, training={"precision": "bf16", "max_steps": 2}))
    trained = load_for_inference(tmp_path / "run", "cpu", None)
    assert trained.precision == "bf16" and next(trained.model.parameters()).dtype == torch.bfloat16
