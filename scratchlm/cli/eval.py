"""`scratchlm eval --run DIR --data valid.npy`: loss and perplexity of a model on a whole token file."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_model_source_arguments, load_for_inference

HELP = "Evaluate a trained model on a whole token file (.npy): loss and perplexity."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser)
    parser.add_argument(
        "--data", required=True, metavar="FILE", help="token file (.npy), e.g. data/valid.npy"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="windows per forward pass (default 32)")
    parser.add_argument(
        "--context-length", type=int, default=None, help="window length (default: the model's context length)"
    )


def run(args: argparse.Namespace) -> None:
    import time

    from scratchlm.console import console
    from scratchlm.data.tokens import load_tokens
    from scratchlm.evaluation import evaluate

    model = load_for_inference(args)[0].model
    tokens = load_tokens(args.data, model.config.vocab_size, 1)
    start = time.perf_counter()
    result = evaluate(
        model,
        tokens,
        batch_size=args.batch_size,
        context_length=args.context_length,
        show_progress=True,
    )
    seconds = time.perf_counter() - start
    perplexity = f"{result.perplexity:.3f}" if result.perplexity < 1e6 else f"{result.perplexity:.3e}"
    print(f"loss {result.loss:.4f}  perplexity {perplexity}")
    console.print(
        f"{args.data}: {result.tokens:,} predicted tokens in {result.windows:,} windows, "
        f"{seconds:.1f} s ({result.tokens / max(seconds, 1e-9):,.0f} tokens/s)",
        style="dim",
    )
