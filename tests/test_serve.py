"""`scratchlm serve`: a real server on 127.0.0.1 driven by the real `openai` client (and raw HTTP for what the
client would not send). The oracles: `generate_stream` for the tokens (greedy, alone and among 16 concurrent
requests; seeded sampling, with top-p and top-k), `torch.log_softmax` of the model's own logits for `logprobs`
and `echo`."""

from __future__ import annotations

import html.parser
import json
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("starlette", reason="starlette not installed (pip install 'scratchlm[serve]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (pip install 'scratchlm[serve]')")
openai = pytest.importorskip("openai", reason="openai not installed (the test oracle)")
from interop_helpers import make_run, scratch_model, small_tokenizer  # noqa: E402
from serve_helpers import (  # noqa: E402
    TIMEOUT,
    Reply,
    Running,
    chromium_driver,
    connect,
    log_softmax_oracle,
    request,
    serve_command,
    tiny_run,
)

from scratchlm import Tokenizer  # noqa: E402
from scratchlm.generation import on_demand  # noqa: E402
from scratchlm.generation.sampling import SamplingOptions  # noqa: E402
from scratchlm.model.config import ModelConfig  # noqa: E402
from scratchlm.run.load import load_trained  # noqa: E402
from scratchlm.serving.engine import Engine  # noqa: E402
from scratchlm.serving.requests import APIError, parse_completion_request  # noqa: E402

CONTEXT = 64
PROMPTS = [
    "Once upon a time",
    "The cat sat",
    "In the beginning there was",
    "A",
    "She said that the weather",
    "Resumption of the session",
    "It was a dark and stormy night, and",
    "1 2 3",
]


def idle_after(engine: Engine, limit: float) -> float:
    """Seconds until the engine has no sequence left (at most `limit`, then the test fails on the count)."""
    started = time.monotonic()
    while engine.in_flight() and time.monotonic() - started < limit:
        time.sleep(0.005)
    assert engine.in_flight() == 0
    return time.monotonic() - started


def token_ids(choice) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]


def ids_body(**options) -> dict:
    return {"logprobs": 0, "extra_body": {"return_tokens_as_token_ids": True}, **options}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("serve") / "tiny-run", CONTEXT, seed=3, num_kv_heads=2)


@pytest.fixture(scope="module")
def server(run_dir):
    running = Running(load_trained(run_dir), "tiny-run")
    yield running
    running.close()


@pytest.fixture(scope="module")
def slow_server(run_dir):
    """A server with a key, room for 2 sequences in the batch and 2 in the queue, and a model slowed to 20 ms
    a forward pass, so that a request of 60 tokens takes over a second."""
    trained = load_trained(run_dir)
    trained.model.register_forward_pre_hook(lambda module, inputs: time.sleep(0.02))
    running = Running(trained, "tiny-run", api_key="sesame", max_batch=2, max_queue=2)
    yield running
    running.close()


def test_models_lists_the_served_model(server) -> None:
    assert [model.id for model in server.client.models.list().data] == ["tiny-run"]
    info = request(server.url, "GET", "/info").json()
    assert info["parameters"] == server.model.num_parameters() and info["context_length"] == CONTEXT


def test_an_idle_connection_outlives_the_clients_own_keep_alive(server) -> None:
    """The `openai` client keeps an idle connection for reuse for 5 s (httpx's default): one idle for longer
    than that still takes a request, so the server never closes a connection a client is sending on."""
    connection = connect(server.url)
    for _ in range(2):
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == "tiny-run"
        time.sleep(6)
    connection.close()


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_tokens_equal_generate_alone(server, stream: bool) -> None:
    for prompt in PROMPTS[:3]:
        expected = server.expected(prompt, 40, temperature=0)
        if stream:
            chunks = list(
                server.client.completions.create(
                    model="tiny-run", prompt=prompt, max_tokens=40, temperature=0, stream=True, **ids_body()
                )
            )
            text = "".join(chunk.choices[0].text for chunk in chunks)
            got = [i for chunk in chunks for i in token_ids(chunk.choices[0])]
            reason = chunks[-1].choices[0].finish_reason
        else:
            response = server.client.completions.create(
                model="tiny-run", prompt=prompt, max_tokens=40, temperature=0, **ids_body()
            )
            choice = response.choices[0]
            text, got, reason = choice.text, token_ids(choice), choice.finish_reason
            assert response.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
            assert response.usage.completion_tokens == len(expected) + (len(expected) < 40)  # + end-of-text
        assert got == expected
        assert text == server.tokenizer.decode(expected)
        assert reason == ("length" if len(expected) == 40 else "stop")


def test_greedy_tokens_equal_generate_among_16_concurrent(server) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    # Different lengths: requests leave the batch at different steps.
    lengths = [20 + 2 * i for i in range(16)]

    def ask(i: int) -> list[int]:
        options = ids_body(model="tiny-run", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        if i % 2:
            chunks = server.client.completions.create(stream=True, **options)
            return [t for chunk in chunks for t in token_ids(chunk.choices[0])]
        return token_ids(server.client.completions.create(**options).choices[0])

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16), timeout=TIMEOUT))
    for i in range(16):
        assert got[i] == server.expected(prompts[i], lengths[i], temperature=0), i
    assert server.engine.batch.peak_batch >= 4  # they really shared forward passes
    idle_after(server.engine, 1.0)


def test_a_compiled_engine_gives_the_tokens_of_an_eager_one(run_dir, monkeypatch) -> None:
    """Decode steps compiled at batch sizes 1 and 2 (the rows in use rounded up) as the requests first need
    them, and kept however they measure: six concurrent requests of different lengths join and leave the
    batch, and each gets the tokens `generate` gives eagerly."""
    monkeypatch.setattr(on_demand, "MIN_GAIN", 0.0)
    compiled = Running(load_trained(run_dir), "tiny-run", max_batch=2, compiled=True, background=False)
    try:
        decoder = compiled.engine.batch.decoder
        lengths = [12 + 3 * i for i in range(6)]

        def ask(i: int) -> list[int]:
            options = ids_body(model="tiny-run", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=lengths[i])
            return token_ids(compiled.client.completions.create(temperature=0, **options).choices[0])

        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, range(6), timeout=TIMEOUT * 4))
        for i in range(6):
            expected = compiled.expected(PROMPTS[i % len(PROMPTS)], lengths[i], temperature=0, compile=False)
            assert got[i] == expected, i
        assert compiled.engine.batch.peak_batch == 2
        assert {size for size, _, _ in decoder._steps} == {1, 2} and not decoder.eager_buckets
    finally:
        compiled.close()


def test_seeded_sampling_is_reproducible_and_equals_generate(server) -> None:
    options = dict(model="tiny-run", prompt="The cat sat", max_tokens=30, temperature=1.0, top_p=0.9)
    first = server.client.completions.create(seed=7, **ids_body(**options)).choices[0]
    again = server.client.completions.create(seed=7, **ids_body(**options)).choices[0]
    other = server.client.completions.create(seed=8, **ids_body(**options)).choices[0]
    assert token_ids(first) == token_ids(again) and first.text == again.text
    assert token_ids(first) != token_ids(other)
    oracle = server.expected(
        "The cat sat", 30, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7)
    )
    assert token_ids(first) == oracle
    streamed = server.client.completions.create(seed=7, stream=True, **options)
    assert "".join(chunk.choices[0].text for chunk in streamed) == first.text


def sampled_ids(
    server, prompt: str, seed: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None
) -> list[int]:
    """The token ids of a 24-token completion, `top_k` sent as vLLM takes it: an extra field of the body."""
    extra = {"return_tokens_as_token_ids": True, "top_k": top_k}
    choice = server.client.completions.create(
        model=server.name,
        prompt=prompt,
        max_tokens=24,
        seed=seed,
        temperature=temperature,
        top_p=top_p,
        logprobs=0,
        extra_body=extra,
    ).choices[0]
    return token_ids(choice)


def test_top_k_reaches_the_engine_and_equals_generate(server) -> None:
    """Seeded, the tokens of `generate_stream(top_k=...)` with that seed; top-k 1 is greedy at any
    temperature; vLLM's -1 and 0 are no limit."""
    prompt = "The cat sat"
    oracle = server.expected(prompt, 24, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    assert sampled_ids(server, prompt, 7, top_k=5) == oracle
    assert sampled_ids(server, prompt, 7) != oracle  # top-k changed what was drawn
    assert sampled_ids(server, prompt, 7, top_k=1) == server.expected(prompt, 24, temperature=0)
    assert sampled_ids(server, prompt, 7, top_k=-1) == sampled_ids(server, prompt, 7, top_k=0)
    assert sampled_ids(server, prompt, 7, top_k=0) == sampled_ids(server, prompt, 7)


def test_rows_with_different_settings_share_the_batch_and_each_equals_generate(server) -> None:
    """Concurrent requests whose temperature, top-p and top-k differ (some alike, which the engine samples
    together): each gets `generate_stream`'s tokens with its own settings and seed."""
    settings = [
        (1.0, 1.0, None),
        (1.0, 1.0, 4),
        (0.7, 0.9, 4),
        (0.7, 0.9, None),
        (0.0, 1.0, 3),
        (1.0, 1.0, 4),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(settings))]

    def ask(i: int) -> list[int]:
        return sampled_ids(server, prompts[i], 100 + i, *settings[i])

    with ThreadPoolExecutor(len(settings)) as pool:
        got = list(pool.map(ask, range(len(settings)), timeout=TIMEOUT))
    for i, (temperature, top_p, top_k) in enumerate(settings):
        generator = torch.Generator().manual_seed(100 + i)
        expected = server.expected(
            prompts[i], 24, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator
        )
        assert got[i] == expected, i


def test_the_sampling_fields_keep_their_messages_and_parameters() -> None:
    """A field out of range is named as the API names it, with `SamplingOptions`'s reason."""

    def refusal(body: dict) -> tuple[str, str | None]:
        with pytest.raises(APIError) as caught:
            parse_completion_request({"prompt": "a", **body}, "m", CONTEXT, 100)
        return caught.value.message, caught.value.param

    temperature = "temperature must be a finite number >= 0 (0 = greedy), got -0.5"
    assert refusal({"temperature": -0.5}) == (temperature, "temperature")
    assert refusal({"top_p": 1.5}) == ("top_p must be in (0, 1], got 1.5", "top_p")
    top_k = "top_k must be a positive integer (or None for no limit), got -2"
    assert refusal({"top_k": -2}) == (top_k, "top_k")
    assert refusal({"top_k": "5"}) == ("'top_k' must be an integer, got \"5\"", "top_k")
    max_tokens = f"'max_tokens' must be between 0 and the context length {CONTEXT}, got -1"
    assert refusal({"max_tokens": -1}) == (max_tokens, "max_tokens")
    body = {"prompt": "a", "stop": "\n", "top_k": 3, "temperature": 0, "seed": None}
    parsed = parse_completion_request(body, "m", CONTEXT, 100).options
    assert parsed == SamplingOptions(16, temperature=0.0, top_k=3, stop=("\n",))  # OpenAI's max_tokens
    assert parse_completion_request({"prompt": "a", "top_k": -1}, "m", CONTEXT, 100).options.top_k is None


def test_n_and_a_list_of_prompts(server) -> None:
    response = server.client.completions.create(
        model="tiny-run", prompt=PROMPTS[:2], n=2, max_tokens=12, temperature=0, **ids_body()
    )
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        assert token_ids(choice) == server.expected(PROMPTS[choice.index // 2], 12, temperature=0)
    sampled = server.client.completions.create(
        model="tiny-run", prompt="A", n=3, max_tokens=12, temperature=1.0, seed=1
    )
    assert len({choice.text for choice in sampled.choices}) == 3  # choice i samples with seed + i


def test_the_choices_of_one_prompt_share_its_prefill_and_each_equals_generate(server, monkeypatch) -> None:
    """`n` sampled choices of one prompt are prefilled once (one fresh KV cache for all), and choice i still
    gets `generate_stream`'s tokens with seed + i, as it would alone."""
    made = []
    new_kv_cache = server.model.new_kv_cache
    monkeypatch.setattr(server.model, "new_kv_cache", lambda *a, **k: made.append(a) or new_kv_cache(*a, **k))
    sampled = server.client.completions.create(
        model="tiny-run", prompt="The cat", n=4, max_tokens=16, temperature=1.0, seed=5, **ids_body()
    )
    assert len(made) == 1
    monkeypatch.undo()
    for choice in sampled.choices:
        generator = torch.Generator().manual_seed(5 + choice.index)
        assert token_ids(choice) == server.expected("The cat", 16, temperature=1.0, generator=generator)


def test_echo_with_no_new_tokens_scores_the_prompt(server) -> None:
    prompt = "It was a dark and stormy night, and the cat sat"
    ids = server.tokenizer.encode(prompt)
    response = server.client.completions.create(
        model="tiny-run", prompt=prompt, max_tokens=0, echo=True, logprobs=1, **{"extra_body": {}}
    )
    choice = response.choices[0]
    expected, best = log_softmax_oracle(server, ids)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert choice.logprobs.tokens == [server.tokenizer.decode([i]) for i in ids]
    tops = choice.logprobs.top_logprobs[1:]
    assert [list(top) for top in tops] == [[server.tokenizer.decode([b])] for b in best[:-1]]
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0


def test_completion_logprobs_equal_the_model_log_softmax(server) -> None:
    prompt = "Once upon a time"
    response = server.client.completions.create(
        model="tiny-run", prompt=prompt, max_tokens=10, echo=True, temperature=1.0, seed=3, **ids_body()
    )
    choice = response.choices[0]
    ids = token_ids(choice)  # the prompt's, then the completion's
    assert ids[: len(server.tokenizer.encode(prompt))] == server.tokenizer.encode(prompt)
    expected, _ = log_softmax_oracle(server, ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert choice.text == server.tokenizer.decode(ids)


def test_stop_strings_end_the_text_before_them(server) -> None:
    full = server.client.completions.create(
        model="tiny-run", prompt="The cat sat", max_tokens=40, temperature=0
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for stream in (False, True):
        response = server.client.completions.create(
            model="tiny-run",
            prompt="The cat sat",
            max_tokens=40,
            temperature=0,
            stop=[stop, "\x00never"],
            stream=stream,
        )
        if stream:
            chunks = list(response)
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got, reason = response.choices[0].text, response.choices[0].finish_reason
        assert got == text[: text.index(stop)] and reason == "stop"
        idle_after(server.engine, 1.0)


def test_chat_completions_is_a_clear_404(server) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        server.client.chat.completions.create(model="tiny-run", messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in caught.value.body["message"]


def post(url: str, content: bytes, headers: dict | None = None) -> Reply:
    return request(url, "POST", "/v1/completions", content, headers)


BAD_BODIES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "tiny-run"}).encode(), 400, "prompt"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": []}).encode(), 400, "prompt"),
    (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    (json.dumps({"prompt": ["a", 3]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "a", "max_tokens": "10"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": 1.5}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "max_tokens": CONTEXT + 1}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "a", "temperature": -0.5}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "a", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "a", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "a", "top_p": 1.5}).encode(), 400, "top_p"),
    (json.dumps({"prompt": "a", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": "a", "n": 0}).encode(), 400, "n"),
    (json.dumps({"prompt": "a", "logprobs": 6}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": "a", "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"prompt": "a", "seed": "x"}).encode(), 400, "seed"),
    (json.dumps({"prompt": "a", "seed": 2**64}).encode(), 400, "seed"),
    (json.dumps({"prompt": "a", "top_k": "5"}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "a", "top_k": 1.5}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "a", "top_k": -2}).encode(), 400, "top_k"),
    (json.dumps({"prompt": "a " * 200}).encode(), 400, "prompt"),  # longer than the context
    (json.dumps({"prompt": "a", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "a" * (1 << 20)}).encode(), 413, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, body, status, param) -> None:
    response = post(server.url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert "Traceback" not in response.text
    ok = server.client.completions.create(model="tiny-run", prompt="A", max_tokens=2, temperature=0)
    assert len(ok.choices) == 1


def test_the_openai_client_sees_the_errors_as_such(server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.completions.create(model="tiny-run", prompt="a", max_tokens=-1)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="a")


def test_a_prompt_near_the_context_gets_the_rest_of_it(server) -> None:
    words = " ".join(PROMPTS * 4).split()
    prompt = ""
    while len(server.tokenizer.encode(prompt)) < CONTEXT - 6:
        prompt += " " + words.pop(0)
    room = CONTEXT - len(server.tokenizer.encode(prompt))  # a few tokens
    assert 0 < room <= 6
    choice = server.client.completions.create(
        model="tiny-run", prompt=prompt, max_tokens=CONTEXT, temperature=0, **ids_body()
    ).choices[0]
    expected = server.expected(prompt, room, temperature=0)
    assert token_ids(choice) == expected
    assert choice.finish_reason == ("length" if len(expected) == room else "stop")


def test_the_key_is_required_when_set(slow_server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = post(slow_server.url, json.dumps({"prompt": "a"}).encode(), headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert request(slow_server.url, "GET", "/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    ok = slow_server.client.completions.create(model="tiny-run", prompt="A", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_full_queue_is_429(slow_server) -> None:
    with pytest.raises(openai.RateLimitError):  # 3 sequences for a queue of 2
        slow_server.client.completions.create(model="tiny-run", prompt="A", max_tokens=2, n=3)
    assert slow_server.client.completions.create(model="tiny-run", prompt="A", max_tokens=1).choices


def test_a_client_that_disconnects_frees_its_place_at_once(slow_server) -> None:
    body = {"model": "tiny-run", "prompt": "Once", "max_tokens": 60, "temperature": 0, "stream": True}
    connection = connect(slow_server.url)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": "Bearer sesame"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    assert slow_server.engine.in_flight() == 1
    connection.close()
    # 60 tokens at 20 ms each would take over a second; the place is free within a few steps.
    assert idle_after(slow_server.engine, 1.0) < 0.3
    ok = slow_server.client.completions.create(model="tiny-run", prompt="A", max_tokens=2)
    assert ok.choices


def test_a_non_streaming_client_that_disconnects_frees_its_place(slow_server) -> None:
    body = {"model": "tiny-run", "prompt": "Once", "max_tokens": 60, "temperature": 0}
    connection = connect(slow_server.url, timeout=0.3)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": "Bearer sesame"})
    with pytest.raises(TimeoutError):
        connection.getresponse()
    assert slow_server.engine.in_flight() == 1
    connection.close()
    assert idle_after(slow_server.engine, 1.0) < 0.3


def test_the_command_serves_and_sigterm_stops_it_cleanly(tmp_path) -> None:
    """The command line: it prints the URLs, serves, and on SIGTERM fails the request in flight and exits."""
    # Without an end-of-text token the stream can end only by the shutdown (or max_tokens): a random model
    # picks it about once in 600 tokens, and so could end the request itself before the signal reached it.
    base = small_tokenizer()
    tokenizer = Tokenizer(base.vocab, base.merges, [])
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size, context_length=1024, d_model=64, num_layers=2, num_heads=4
    )
    run = make_run(tmp_path / "medium", scratch_model(config), tokenizer)
    process, url = serve_command(run, "--device", "cpu")
    try:
        body = {"model": "medium", "prompt": "Once", "max_tokens": 1000, "temperature": 1.0, "stream": True}
        events = []
        connection = connect(url)
        connection.request("POST", "/v1/completions", json.dumps(body))
        response = connection.getresponse()
        for line in response:  # ends when the server closes the stream
            if line.startswith(b"data: "):
                events.append(line.decode().removeprefix("data: ").strip())
                if len(events) == 2:
                    process.send_signal(signal.SIGTERM)
        connection.close()
        assert process.wait(TIMEOUT) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = process.stdout.read()
    assert f"{url}/" in output and f"{url}/v1" in output
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"]
    assert len(events) < 1000  # it stopped early


def test_the_command_answers_at_once_while_its_decode_steps_compile(run_dir, tmp_path, monkeypatch) -> None:
    """`serve` with the plan's compiled decoding, on an empty Inductor cache: the first request is answered
    while its decode step compiles in the background, `/info` names the step in flight, the output says when
    it is compiled and how it measured, and a request after that gets the same greedy tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path / "cache"))
    process, url = serve_command(run_dir, "--device", "cpu", "--precision", "fp32", compile=True)
    body = {"model": "tiny-run", "prompt": "Once", "max_tokens": 6, "temperature": 0}
    try:
        first = request(url, "POST", "/v1/completions", json.dumps(body).encode()).json()["choices"][0][
            "text"
        ]
        assert request(url, "GET", "/info").json()["compiling"] == ["1 sequence"]
        deadline = time.monotonic() + 240
        while request(url, "GET", "/info").json()["compiling"]:
            assert time.monotonic() < deadline, "the decode step did not compile"
            time.sleep(0.5)
        second = request(url, "POST", "/v1/completions", json.dumps(body).encode()).json()["choices"][0][
            "text"
        ]
        assert second == first
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(TIMEOUT)
    output = process.stdout.read()
    assert "compiling the decode step for 1 sequence in the background" in output, output
    assert "compiled the decode step for 1 sequence in " in output
    assert re.search(r"  1 sequence: (compiled|eager); a step", output), output


def test_ctrl_c_stops_the_command_saying_so_in_one_line(run_dir) -> None:
    """SIGINT (Ctrl-C) ends `serve` with status 0 and a last line that says it stopped and why; no traceback."""
    process, _ = serve_command(run_dir, "--device", "cpu")
    try:
        process.send_signal(signal.SIGINT)
        status = process.wait(TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = process.stdout.read()
    assert status == 0, output
    assert "Traceback" not in output
    assert output.strip().splitlines()[-1] == f"stopped serving {run_dir.name}: SIGINT received"


def test_the_command_says_what_to_install_without_the_extra(run_dir, monkeypatch, capsys) -> None:
    from scratchlm.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails, as when it is absent
    monkeypatch.delitem(sys.modules, "scratchlm.serving.server")
    assert main(["serve", "--run", str(run_dir)]) == 2
    captured = capsys.readouterr()
    message = captured.out + captured.err
    assert "pip install 'scratchlm[serve]'" in message and "uvicorn" in message


class PageInputs(html.parser.HTMLParser):
    """The attributes of a page's `<input>` elements, in the order of the page."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "input":
            self.inputs.append(dict(attrs))


def test_the_page_has_a_top_k_control_beside_temperature_and_top_p(server) -> None:
    """Without a browser: the control is on the page and the script sends it (the Chromium test below
    drives it)."""
    page = PageInputs()
    page.feed(request(server.url, "GET", "/").text)
    ids = [attributes.get("id") for attributes in page.inputs]
    assert ids[ids.index("temperature") :][:3] == ["temperature", "top-p", "top-k"]
    top_k = page.inputs[ids.index("top-k")]
    assert top_k["type"] == "number" and top_k["min"] == "1" and top_k.get("value") is None  # empty: no limit
    script = request(server.url, "GET", "/static/app.js").text
    assert 'body.top_k = Number($("top-k").value)' in script


def test_the_page_streams_a_completion_in_chromium(server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium_driver()
    try:
        browser.set_page_load_timeout(TIMEOUT)
        browser.get(f"{server.url}/")
        wait = WebDriverWait(browser, TIMEOUT)
        wait.until(lambda b: "parameters" in b.find_element(By.ID, "model").text)
        assert "tiny-run" in browser.find_element(By.ID, "model").text
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("The cat sat")
        # Sampling at temperature 1 among the top 1 token: the greedy text, whatever is drawn, if and only if
        # the page sent top-k and the server applied it.
        for field, value in (("max-tokens", "30"), ("temperature", "1"), ("top-k", "1")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        browser.find_element(By.ID, "generate").click()
        wait.until(
            lambda b: (
                "tokens/s" in b.find_element(By.ID, "status").text
                and "stopped" in b.find_element(By.ID, "status").text
            )
        )
        shown = browser.find_element(By.ID, "completion").get_attribute("textContent")
        expected = server.expected_text("The cat sat", 30, temperature=0)
        assert shown == expected and shown
        assert browser.find_element(By.ID, "prompt-echo").get_attribute("textContent") == "The cat sat"
        # Nothing but the server's own files was requested.
        urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert urls and all(url.startswith(server.url) for url in urls)
    finally:
        browser.quit()
