"""A server in a thread for the serving tests, raw HTTP for what the `openai` client would not send, tiny runs
(base and chat models) to serve, and headless Chromium for the page."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from interop_helpers import make_run, scratch_model, small_tokenizer

from scratchlm.chat.template import (
    ChatTemplate,
    JinjaChatTemplate,
    Message,
    chat_template,
    end_ids,
    with_chat_tokens,
)
from scratchlm.generation.generate import generate, generate_stream
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.serving.engine import Engine
from scratchlm.serving.server import build_server
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.tokenizer import Tokenizer

TIMEOUT = 30  # seconds: every request of these tests is bounded


class Running:
    """A server in a thread, its engine, the model and tokenizer it serves, and its base URL. The engine stops
    where `scratchlm serve` makes it stop (a chat model's end of turn too) unless `stop_ids` says otherwise."""

    def __init__(self, trained, name: str, api_key: str | None = None, **engine_options) -> None:
        self.model, self.tokenizer, self.name = trained.model, trained.tokenizer, name
        self.eos_id = self.tokenizer.token_id(END_OF_TEXT)
        engine_options.setdefault("stop_ids", end_ids(self.tokenizer))
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


def serve_command(run_dir: Path, *options: str, compile: bool = False) -> tuple[subprocess.Popen, str]:
    """`scratchlm serve --run RUN_DIR --port P --no-compile *options` started as a process, once it answers
    `/info`: the process (stdout and stderr together, as text) and its URL. The caller stops it. `compile`:
    without `--no-compile` (the plan's choice: the decode steps compile in the background)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = [
        sys.executable,
        "-m",
        "scratchlm",
        "serve",
        "--run",
        str(run_dir),
        "--port",
        str(port),
        *([] if compile else ["--no-compile"]),
        *options,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if request(url, "GET", "/info").status_code == 200:
                    return process, url
            except OSError:
                time.sleep(0.1)
    except BaseException:
        process.kill()
        process.wait()
        raise


def run_lm_eval(*arguments: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m lm_eval ARGUMENTS --log_samples` offline (the tests' tasks are local), which must succeed."""
    command = [sys.executable, "-m", "lm_eval", *arguments, "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def log_softmax_oracle(server, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each token's log-probability given those before it, and the most likely token at each position."""
    with torch.no_grad():
        logprobs = torch.log_softmax(server.model(torch.tensor([ids]))[0].double(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))], logprobs.argmax(-1).tolist()


def tiny_config(tokenizer: Tokenizer, context: int, **model) -> ModelConfig:
    """A tiny model (2 layers, d_model 32, 4 heads) over `tokenizer`'s vocabulary."""
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        context_length=context,
        d_model=32,
        num_layers=2,
        num_heads=4,
        **model,
    )


def tiny_run(directory: Path, context: int, seed: int, **model) -> Path:
    """A run directory holding a tiny random model (`tiny_config`) and the small tokenizer."""
    tokenizer = small_tokenizer()
    return make_run(directory, scratch_model(tiny_config(tokenizer, context, **model), seed=seed), tokenizer)


# Conversations whose greedy replies choose the token that a `chat_run`'s model ends its turns with.
PROBES = ["Hello there", "Reverse: a b c", "What is the weather like today?", "Tell me a story", "1 2 3"]


def turn_ending(model: TransformerLM, template: ChatTemplate | JinjaChatTemplate, end: int) -> None:
    """Make `model` end its turns with the token `end`: a random model seldom writes it, so its head's row for
    it becomes a copy, 5 % larger, of the row of the token its greedy replies to `PROBES` write most often (the
    smallest id among equals). A reply then ends where it would have written that token with a positive logit,
    at different places in different conversations."""
    counts: dict[int, int] = {}
    for probe in PROBES:
        ids = template.encode([Message("user", probe)])
        for token in set(generate(model, ids, 40, temperature=0)):
            counts[token] = counts.get(token, 0) + 1
    common = min(counts, key=lambda token: (-counts[token], token))
    with torch.no_grad():
        model.lm_head.weight[end] = 1.05 * model.lm_head.weight[common]


def chat_run(directory: Path, context: int, seed: int, tokenizer: Tokenizer | None = None, **model) -> Path:
    """A run directory of a tiny random chat model (as `tiny_run`): `tokenizer` (default: the small tokenizer
    carrying scratchlm's chat template, its chat tokens added), and a model over its vocabulary that ends its
    turns with the template's end-of-turn token (`turn_ending`)."""
    tokenizer = tokenizer or with_chat_tokens(small_tokenizer())[0]
    chat_model = scratch_model(tiny_config(tokenizer, context, **model), seed=seed)
    template = chat_template(tokenizer)
    (end,) = template.stop_ids - {tokenizer.eos_id}
    turn_ending(chat_model, template, end)
    return make_run(directory, chat_model, tokenizer)


def chromium_driver(width: int = 420, height: int = 860):
    """Headless Chromium through Selenium and chromium-driver (Debian's packages; nothing is downloaded)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
