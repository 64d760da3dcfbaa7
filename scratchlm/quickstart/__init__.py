"""The whole pipeline in one call, on a corpus every Python installation carries (no download needed), or on
the user's own text (`text`: files or directories).

    corpus (stdlib sources) -> BPE tokenizer -> train.npy / valid.npy -> a small model trained for a time budget
    -> its loss on the whole validation file -> samples -> loss-curve PNG -> summary

Everything goes under one output directory, which must be new, empty or an earlier quickstart's (anything else
there is refused, never overwritten):

    OUT/corpus/       train.txt, valid.txt, source.json (scratchlm.data.corpus)
    OUT/data/         tokenizer/, train.npy, valid.npy  (scratchlm.data.prepare)
    OUT/run/          config.toml, metrics.jsonl, checkpoints/, summary.json  (scratchlm.training)
    OUT/shape.json    the fast recipe's shape for the budget on this machine, and why (scratchlm.training.sizing)
    OUT/schedule.json the number of steps that fit the time budget on this machine (the run decides it)
    OUT/loss.png      the learning curve
    OUT/quickstart.json  the final figures

Each stage reuses what an earlier run finished (every output is written atomically, so one that exists is
whole): a second run skips straight to evaluation and samples, and an interrupted training run resumes from
its last checkpoint.

The model trains with one of `RECIPES`: "fast" (the default; docs/experiments.md, "A faster recipe") or
"spec", that of the CS336 assignment-1 handout.

The validation loss is printed beside the unigram entropy of the validation tokens: the loss, in nats per
token, of the best model that ignores context. The distance between the two is what the model learnt from
context.

`quickstart` below runs the stages in order; how big each is lives in `sizes` (`FULL`, `SMALL`, the fast
recipe's ladder `FAST_SHAPES`, `train_config`), the stages themselves in `stages`, and the figures and summary
it ends with in `report`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from scratchlm.chat.pipeline import CHAT_FULL, CHAT_SMALL, chat_stages
from scratchlm.console import console, format_seconds
from scratchlm.device import resolve_device
from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.experiments.plot import plot_runs
from scratchlm.io import atomic_write, claim_output_dir
from scratchlm.quickstart.report import QuickstartResult, next_commands, print_summary
from scratchlm.quickstart.sizes import (
    DEFAULT_RECIPE,
    FAST_SHAPES,
    FULL,
    RECIPES,
    SMALL,
    QuickstartSize,
    train_config,
)
from scratchlm.quickstart.stages import (
    PROMPTS,
    Stages,
    build_data,
    choose_fast_shape,
    load_for_inference,
    print_samples,
    text_prompts,
    train_within_budget,
    unigram_entropy,
)
from scratchlm.training.config import budget_seconds

__all__ = [
    "DEFAULT_RECIPE",
    "FAST_SHAPES",
    "FULL",
    "QUICKSTART_KIND",
    "RECIPES",
    "SMALL",
    "QuickstartResult",
    "QuickstartSize",
    "build_data",
    "choose_fast_shape",
    "load_for_inference",
    "next_commands",
    "quickstart",
    "train_config",
    "train_within_budget",
    "unigram_entropy",
]

QUICKSTART_KIND = "quickstart"  # the output marker of its directory (scratchlm.io)


def quickstart(
    out_dir: str | Path = "runs/quickstart",
    minutes: float = 5.0,
    small: bool = False,
    device: str = "auto",
    recipe: str = DEFAULT_RECIPE,
    text: list[str | Path] | None = None,
    chat_minutes: float | None = None,
    rl_minutes: float | None = None,
) -> QuickstartResult:
    """Build the corpus (the standard library's sources, or the files and directories of `text`), tokenizer
    and token files, train for `minutes` with `recipe`, evaluate, sample and plot; with `chat_minutes`, then
    fine-tune the model to chat for that long on the built-in conversations, and with `rl_minutes` go on by
    reinforcement learning on the same tasks for that long (`scratchlm.chat.pipeline`)."""
    # Every argument is checked before any work starts: the chat stages' too, which run last.
    seconds = budget_seconds(minutes, "--minutes")
    chat_seconds = None if chat_minutes is None else budget_seconds(chat_minutes, "--chat-minutes")
    rl_seconds = None if rl_minutes is None else budget_seconds(rl_minutes, "--rl-minutes")
    if rl_seconds is not None and chat_seconds is None:
        raise ScratchlmError("--rl goes on from the chat model of --chat: add --chat")
    stage = Stages(6 if chat_seconds is None else 9 if rl_seconds is None else 10)
    if recipe not in RECIPES:
        raise ScratchlmError(f"--recipe must be one of {', '.join(RECIPES)}; got {recipe!r}")
    device = str(resolve_device(device))
    started = time.perf_counter()
    size = SMALL if small else FULL
    out_dir = claim_output_dir(out_dir, QUICKSTART_KIND, text or ())

    data = build_data(out_dir, size, text, stage)
    train_ids, valid_ids = np.load(data.train, mmap_mode="r"), np.load(data.valid, mmap_mode="r")
    console.print(f"train {len(train_ids):,} tokens, valid {len(valid_ids):,} tokens")

    stage(f"training (at most {format_seconds(seconds)})")
    run_dir = out_dir / "run"
    summary = train_within_budget(size, data, run_dir, seconds, device, out_dir / "schedule.json", recipe)

    stage("validation loss on the whole validation file")
    trained = load_for_inference(run_dir, device, data.tokenizer)
    result = evaluate(trained.model, valid_ids, show_progress=True)
    entropy = unigram_entropy(valid_ids)
    console.print(
        f"loss {result.loss:.4f} nats/token (perplexity {result.perplexity:.1f}); unigram entropy {entropy:.4f}"
    )

    stage("samples (temperature 0.8, top-p 0.95)")
    prompts = PROMPTS if text is None else text_prompts(out_dir / "corpus" / "valid.txt")
    print_samples(trained, prompts, size.sample_tokens, device)

    stage("loss curve")
    loss_curve = out_dir / "loss.png"
    plot_runs([run_dir], loss_curve, labels=["quickstart"])
    console.print(f"wrote {loss_curve}")

    chat = None
    if chat_seconds is not None:
        chat_size = CHAT_SMALL if small else CHAT_FULL
        chat = chat_stages(run_dir, out_dir, chat_seconds, device, chat_size, stage, rl_seconds)

    quick = QuickstartResult(
        out_dir=str(out_dir),
        corpus=str(out_dir / "corpus"),
        tokenizer=str(data.tokenizer),
        train_tokens=len(train_ids),
        valid_tokens=len(valid_ids),
        run_dir=str(run_dir),
        loss_curve=str(loss_curve),
        steps=summary.steps,
        training_seconds=summary.wall_time_s,
        tokens_per_s=summary.tokens / summary.wall_time_s,
        val_loss=result.loss,
        val_perplexity=result.perplexity,
        unigram_entropy=entropy,
        wall_seconds=time.perf_counter() - started,
        chat=chat,
    )
    with atomic_write(out_dir / "quickstart.json", "w") as f:
        json.dump(asdict(quick), f, indent=2)
    print_summary(quick, next_commands(quick, small=small, recipe=recipe, text=text))
    return quick
