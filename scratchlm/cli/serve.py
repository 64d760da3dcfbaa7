"""`scratchlm serve --run DIR`: a trained model behind OpenAI's completions API and a web page; a chat model
(one whose tokenizer carries a chat template) behind the chat completions API too.

Concurrent requests share the model's forward passes (see `scratchlm.serving`). The server listens on
127.0.0.1 unless `--host` says otherwise; with `--api-key KEY`, every API request needs
`Authorization: Bearer KEY`. Ctrl-C or SIGTERM stops it: requests in flight get an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scratchlm.cli.options import add_model_source_arguments, load_for_inference

HELP = (
    "Serve a trained model: an OpenAI-compatible completions API (and chat completions for a chat model) and "
    "a web page, with batched generation."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser, tokenizer=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--api-key", metavar="KEY", default=None, help="require 'Authorization: Bearer KEY' on API requests"
    )
    parser.add_argument(
        "--max-batch", type=int, default=16, help="sequences generated together at most (default 16)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="sequences waiting for the batch at most; more are refused with 429 (default 64)",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.errors import ScratchlmError

    try:
        from scratchlm.serving.server import build_server, listen
    except ImportError as e:
        raise ScratchlmError(
            f"serving needs Starlette and uvicorn ({e.name} is not installed): pip install 'scratchlm[serve]'"
        ) from None
    from scratchlm.chat.template import end_ids
    from scratchlm.console import console
    from scratchlm.serving.engine import Engine

    if args.max_batch < 1 or args.max_queue < 1:
        raise ScratchlmError(
            f"--max-batch and --max-queue must be at least 1, got {args.max_batch}, {args.max_queue}"
        )
    if not 0 <= args.port <= 65535:
        raise ScratchlmError(f"--port must be in 0..65535, got {args.port}")
    # Bound before anything loads: a port in use is a one-line error, not a page address and then uvicorn's.
    with listen(args.host, args.port) as sock:
        port = sock.getsockname()[1]  # the free one the system chose for --port 0
        trained, choices = load_for_inference(args, require_tokenizer=True)
        tokenizer = trained.tokenizer
        name = model_name(args.run, trained.checkpoint)
        console.print(choices.summary(), markup=False)
        engine = Engine(
            trained.model,
            tokenizer.eos_id,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            stop_ids=end_ids(tokenizer),
            compiled=choices.decode.value,
            announce=lambda line: console.print(line, style="dim"),
        )
        console.print(f"decode step: {choices.decode.reason}", style="dim")
        if choices.decode.value:
            console.print(
                "the decode steps compile as requests first need them, in the background; until each is "
                "ready its steps run eagerly (--no-compile: always eager)",
                style="dim",
            )
        server = build_server(engine, tokenizer, name, args.host, port, args.api_key)
        engine.start()
        try:
            parameters = trained.model.num_parameters()
            url = f"http://{args.host}:{port}"
            console.print(f"serving {name} ({parameters / 1e6:.1f}M parameters) from {trained.checkpoint}")
            console.print(f"  page: {url}/")
            chat = " and chat completions" if tokenizer.chat_template is not None else ""
            console.print(f"  API:  {url}/v1  (OpenAI completions{chat}; model name '{name}')")
            console.print("Ctrl-C to stop", style="dim")
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:  # uvicorn raises the Ctrl-C it caught again once it has shut down
                if server.stopped_by != "SIGINT":
                    raise
        finally:
            engine.stop()
        if server.stopped_by is not None:
            print(f"stopped serving {name}: {server.stopped_by} received", file=sys.stderr)


def model_name(run: str | None, checkpoint: Path) -> str:
    """The name the API serves the model under: the run directory's name, else the checkpoint's stem."""
    return Path(run).resolve().name if run is not None else Path(checkpoint).stem
