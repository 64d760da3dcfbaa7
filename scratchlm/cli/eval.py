"""`scratchlm eval`: how good a trained model is.

    scratchlm eval --run DIR --data valid.npy        loss and perplexity on a whole token file
    scratchlm eval --run DIR --tasks hellaswag,...   lm-evaluation-harness's tasks, in-process
                                                     (scratchlm.harness; the optional extra scratchlm[eval])

The tasks' results are printed as lm-eval's table and written, as lm-eval's JSON with what was evaluated
added, to `lm_eval/results_<time>.json` in the run directory (beside the checkpoint with `--checkpoint`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scratchlm.cli.options import add_model_source_arguments, load_for_inference

HELP = "Evaluate a trained model: loss on a token file (.npy), or lm-evaluation-harness tasks."
INSTALL_HINT = 'pip install "scratchlm[eval]"'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_arguments(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", metavar="FILE", help="token file (.npy), e.g. data/valid.npy")
    what.add_argument(
        "--tasks",
        metavar="NAMES",
        help="lm-evaluation-harness tasks or groups, comma-separated (e.g. hellaswag,arc_easy)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (default 32)")
    parser.add_argument(
        "--context-length",
        type=int,
        help="with --data: window length (default: the model's context length)",
    )
    parser.add_argument(
        "--include-path", metavar="DIR", help="with --tasks: a directory of local task YAML files"
    )
    parser.add_argument(
        "--limit",
        type=float,
        help="with --tasks: at most this many documents per task (or, below 1, this share of them)",
    )
    parser.add_argument(
        "--num-fewshot",
        type=int,
        help="with --tasks: examples in each prompt (default: the task's)",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.errors import ScratchlmError

    # Checked before the model loads, and named by their flags.
    if args.batch_size < 1:
        raise ScratchlmError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.limit is not None and not args.limit > 0:
        raise ScratchlmError(
            f"--limit must be positive (documents, or below 1 a share of them), got {args.limit}"
        )
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ScratchlmError(f"--num-fewshot must be at least 0, got {args.num_fewshot}")
    if args.tasks is not None:
        return run_tasks(args)
    import time

    from scratchlm.console import console
    from scratchlm.data.tokens import load_tokens
    from scratchlm.evaluation import evaluate

    model = load_for_inference(args)[0].model
    longest = model.config.context_length
    if args.context_length is not None and not 1 <= args.context_length <= longest:
        raise ScratchlmError(
            f"--context-length must be between 1 and the model's context length {longest}, got "
            f"{args.context_length}"
        )
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


def run_tasks(args: argparse.Namespace) -> None:
    import importlib.util
    import json
    import time

    from scratchlm.console import console
    from scratchlm.errors import ScratchlmError
    from scratchlm.io import atomic_write

    if importlib.util.find_spec("lm_eval") is None:
        raise ScratchlmError(f"--tasks needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise ScratchlmError(f"--include-path {args.include_path}: not a directory of task YAML files")
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not tasks:
        raise ScratchlmError("--tasks needs at least one task name")
    from scratchlm.harness import ScratchlmLM, evaluate_tasks, results_table

    trained, plan = load_for_inference(args, require_tokenizer=True)
    try:
        lm = ScratchlmLM(trained.model, trained.tokenizer, batch_size=args.batch_size)
        results = evaluate_tasks(lm, tasks, args.include_path, args.limit, args.num_fewshot)
    except ValueError as e:
        raise ScratchlmError(str(e)) from None
    print(results_table(results))
    results["scratchlm"] = {
        "checkpoint": str(trained.checkpoint),
        "precision": plan.precision.value,
        "quantize": args.quantize,
    }
    out_dir = Path(args.run) if args.run else trained.checkpoint.parent
    out = out_dir / "lm_eval" / f"results_{time.strftime('%Y-%m-%dT%H-%M-%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    console.print(f"results: {out}", style="dim")
