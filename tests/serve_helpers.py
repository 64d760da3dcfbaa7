"""A server in a thread for the serving tests, and raw HTTP for what the `openai` client would not send."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import openai
import torch
from interop_helpers import make_run, scratch_model, small_tokenizer

from scratchlm.generation.generate import generate_stream
from scratchlm.model.config import ModelConfig
from scratchlm.serving.engine import Engine
from scratchlm.serving.server import build_server
from scratchlm.tokenizer import END_OF_TEXT

TIMEOUT = 30  # seconds: every request of these tests is bounded


class Running:
    """A server in a thread, its engine, the model and tokenizer it serves, and its base URL."""

    def __init__(self, trained, name: str, api_key: str | None = None, **engine_options) -> None:
        self.model, self.tokenizer, self.name = trained.model, trained.tokenizer, name
        self.eos_id = self.tokenizer.token_id(END_OF_TEXT)
        self.engine = Engine(self.model, self.eos_id, **engine_options)
        self.engine.start()
        self.server = build_server(self.engine, self.tokenizer, name, port=0, api_key=api_key)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key or "none", timeout=TIMEOUT, max_retries=0
        )

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        self.engine.stop()

    def expected(self, prompt: str | list[int], max_tokens: int, **options) -> list[int]:
        """`generate_stream`'s tokens (as `scratchlm generate` runs it): end-of-text, if the model chooses it,
        is the last, and a completion's logprobs report it too (its text does not hold it)."""
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        return list(generate_stream(self.model, ids, max_tokens, eos_id=self.eos_id, **options))

    def expected_text(self, prompt: str, max_tokens: int, **options) -> str:
        return self.tokenizer.decode(
            t for t in self.expected(prompt, max_tokens, **options) if t != self.eos_id
        )


class Reply:
    """A raw HTTP answer: status and body."""

    def __init__(self, status: int, text: str) -> None:
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def connect(url: str, timeout: float = TIMEOUT) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def request(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> Reply:
    connection = connect(url)
    try:
        connection.request(
            method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return Reply(response.status, response.read().decode())
    finally:
        connection.close()


def log_softmax_oracle(server, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each token's log-probability given those before it, and the most likely token at each position."""
    with torch.no_grad():
        logprobs = torch.log_softmax(server.model(torch.tensor([ids]))[0].double(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))], logprobs.argmax(-1).tolist()


def tiny_run(directory: Path, context: int, seed: int, **model) -> Path:
    """A run directory holding a tiny random model (2 layers, d_model 32, 4 heads) and the small tokenizer."""
    tokenizer = small_tokenizer()
    config = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=context,
        d_model=32,
        num_layers=2,
        num_heads=4,
        **model,
    )
    return make_run(directory, scratch_model(config, seed=seed), tokenizer)
