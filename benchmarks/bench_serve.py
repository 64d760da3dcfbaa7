"""Serving throughput: 16 concurrent clients against the same requests one at a time, and one request against
`generate_stream`, at the TinyStories model of the CS336 assignment-1 handout.

The model (vocab 10,000, context 256, d_model 512, 4 layers, 16 heads) has random weights: the cost of a token
does not depend on what the weights are. It is held as `scratchlm serve` holds it (`prepare_for_inference`
at `--precision`, default auto: bf16 on a CPU with native bf16, else fp32), with the threads serve chooses. The
tokenizer is GPT-2's (a test fixture); the prompts are short English sentences whose tokens all fall inside the
model's vocabulary. The server runs in this process (uvicorn in a thread, on 127.0.0.1 and a free port); the
clients are threads speaking HTTP and reading the streamed events, each asking for `--tokens` new tokens
(end-of-text cannot come: GPT-2's is outside the model's vocabulary). Reported:

- aggregate tokens/s: all new tokens over the wall time, with all clients at once and one client at a time;
- time to first token, p50 and p95, with all clients at once (from sending a request to its first token);
- one request's tokens/s through the server against `generate_stream` in the process (the same sampling);

each with the engine's decode steps eager and compiled (`scratchlm.generation.decode`), side by side with their
ratio. The figures are the steady state's: the compiled engine compiles each step at once where the traffic
first needs it (`scratchlm serve` compiles them in the background, serving eagerly meanwhile), and a round of
the same traffic runs before anything is timed.

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --clients 8 --tokens 64 --threads 1
    python benchmarks/bench_serve.py --decode int8     # compiled steps, the plan's precision against int8
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from scratchlm.device import apply_threads, plan
from scratchlm.generation.generate import generate_stream
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
from scratchlm.precisions import PRECISIONS
from scratchlm.serving.engine import Engine
from scratchlm.serving.server import build_server
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.tokenizer.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
SENTENCES = [
    "Once upon a time there was a little girl",
    "The dog ran into the park and",
    "One day, a small bird found",
    "He and his sister wanted to play",
    "The sun was bright and the sky",
    "There was a big tree near the house",
    "She looked at the box and said",
    "After school, the children went to",
    "A little boy had a red ball",
    "The cat was very sad, so",
    "It was a cold night in the town",
    "His mother gave him a box and",
    "The old man lived by the sea",
    "They found a map in the house",
    "Every morning the man would",
    "She saw a small stone on the road",
]


def stream_request(port: int, body: dict) -> tuple[float, float, int]:
    """Send one streamed completion; return (seconds to the first token, seconds in all, tokens)."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response = connection.getresponse()
    first, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        choice = json.loads(line[6:])["choices"]
        if choice and choice[0]["finish_reason"] is None:  # one event per token; the last one only ends
            tokens += 1
            first = first or time.perf_counter() - start
    connection.close()
    return first or 0.0, time.perf_counter() - start, tokens


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: what `scratchlm serve` chooses here)"
    )
    parser.add_argument("--precision", choices=("auto", *PRECISIONS), default="auto")
    parser.add_argument(
        "--decode",
        choices=("both", "eager", "compiled", "int8"),
        default="both",
        help="the engine's decode steps: both side by side (default), or one; int8: compiled steps with the "
        "weights in the plan's precision against the same with int8 weights (--quantize int8)",
    )
    args = parser.parse_args()
    # As `scratchlm serve` does: the plan's precision and threads (the free cores, or --threads).
    choices = plan(torch.device("cpu"), args.precision, threads=args.threads, option="--precision")
    apply_threads(choices.threads.value)
    print(choices.summary())

    torch.manual_seed(0)
    config = ModelConfig()
    model = prepare_for_inference(TransformerLM.from_config(config), choices)
    tokenizer = Tokenizer.from_files(
        FIXTURES / "gpt2_vocab.json", FIXTURES / "gpt2_merges.txt", [END_OF_TEXT]
    )
    prompts = [SENTENCES[i % len(SENTENCES)] for i in range(args.clients)]
    assert all(max(tokenizer.encode(p)) < config.vocab_size for p in prompts)
    print(
        f"TinyStories-shape model: {model.num_parameters():,} parameters, {choices.precision.value} "
        f"(a token times a matrix: {choices.matvec.value}), {torch.get_num_threads()} "
        f"threads; {args.clients} clients × {args.tokens} new tokens, temperature {args.temperature}, "
        f"top-p {args.top_p}"
    )
    ways = {"eager": (model, False), "compiled": (model, True)}
    if args.decode == "int8":
        # The same weights, each matrix held in int8 (`--quantize int8`), served with compiled steps.
        torch.manual_seed(0)
        int8 = prepare_for_inference(TransformerLM.from_config(config), choices, quantize="int8")
        ways = {"compiled": ways["compiled"], "int8 compiled": (int8, True)}
    elif args.decode != "both":
        ways = {args.decode: ways[args.decode]}
    measured = {way: measure(m, tokenizer, prompts, compiled, args) for way, (m, compiled) in ways.items()}
    names = list(measured)
    print(
        f"\n| measure | {' | '.join(names)} |" + (f" {names[-1]} / {names[0]} |" if len(names) == 2 else "")
    )
    print("|---" * (len(measured) + 1 + (len(measured) == 2)) + "|")
    for label, key, unit, higher in ROWS:
        values = [m[key] for m in measured.values()]
        cells = " | ".join(f"{v:,.1f} {unit}".strip() for v in values)
        ratio = (
            f" **{values[1] / values[0]:.2f}×** |"
            if len(values) == 2 and higher is not None
            else (" |" if len(values) == 2 else "")
        )
        print(f"| {label.format(clients=args.clients)} | {cells} |{ratio}")


# (label, key, unit, whether higher is better: None for figures that are not compared)
ROWS = [
    ("aggregate, {clients} concurrent", "batched", "tokens/s", True),
    ("aggregate, one at a time", "one_by_one", "tokens/s", True),
    ("batched / one at a time", "batched_gain", "×", None),
    ("time to first token, {clients} concurrent, p50", "ttft_p50_ms", "ms", False),
    ("time to first token, {clients} concurrent, p95", "ttft_p95_ms", "ms", False),
    ("one request through the server", "single", "tokens/s", True),
    ("`generate_stream`, same model and sampling", "direct", "tokens/s", True),
    ("server / generate_stream", "server_share", "", None),
    ("largest batch run", "peak_batch", "", None),
]


def measure(model: TransformerLM, tokenizer: Tokenizer, prompts: list[str], compiled: bool, args) -> dict:
    """One server's figures, its engine's decode steps eager or compiled (each at once where the traffic first
    needs it, and kept where it measures faster), after a round of the same traffic."""
    engine = Engine(
        model,
        tokenizer.token_id(END_OF_TEXT),
        max_batch=max(16, args.clients),
        compiled=compiled,
        background=False,
        announce=print,
    )
    engine.start()
    server = build_server(engine, tokenizer, "tinystories-shape", port=0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def body(prompt: str, seed: int) -> dict:
        return {
            "prompt": prompt,
            "max_tokens": args.tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": seed,
        }

    # Warm-up: the allocator, the kernels, and every step the traffic below needs, compiled.
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(lambda i: stream_request(port, body(prompts[i], i)), range(args.clients)))
    stream_request(port, body(prompts[0], 0))

    # One request through the server against generate_stream in this process, best of three each.
    single = min(stream_request(port, body(prompts[0], i))[1] for i in range(3))
    ids = tokenizer.encode(prompts[0])

    def direct(seed: int) -> float:
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        options = dict(temperature=args.temperature, top_p=args.top_p, generator=generator, compile=compiled)
        count = sum(1 for _ in generate_stream(model, ids, args.tokens, **options))
        assert count == args.tokens
        return time.perf_counter() - start

    direct_s = min(direct(i) for i in range(3))

    start = time.perf_counter()
    sequential = [stream_request(port, body(p, i)) for i, p in enumerate(prompts)]
    sequential_s = time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        concurrent = list(pool.map(lambda i: stream_request(port, body(prompts[i], i)), range(args.clients)))
    concurrent_s = time.perf_counter() - start

    server.should_exit = True
    thread.join()
    engine.stop()

    total = sum(tokens for _, _, tokens in concurrent)
    assert total == sum(tokens for _, _, tokens in sequential) == args.clients * args.tokens
    batched, one_by_one = total / concurrent_s, total / sequential_s
    first = [ttft for ttft, _, _ in concurrent]
    return {
        "batched": batched,
        "one_by_one": one_by_one,
        "batched_gain": batched / one_by_one,
        "ttft_p50_ms": statistics.median(first) * 1000,
        "ttft_p95_ms": percentile(first, 0.95) * 1000,
        "single": args.tokens / single,
        "direct": args.tokens / direct_s,
        "server_share": direct_s / single,
        "peak_batch": engine.batch.peak_batch,
    }


if __name__ == "__main__":
    main()
