"""What the quickstart reports: its figures (`QuickstartResult`, written to OUT/quickstart.json), the summary
table it ends with, and the commands that go on from its run, with its own paths (`next_commands`).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from scratchlm.chat.pipeline import CHAT_RUN, ChatResult
from scratchlm.console import console, format_seconds
from scratchlm.quickstart.sizes import DEFAULT_RECIPE


@dataclass(frozen=True)
class QuickstartResult:
    out_dir: str
    corpus: str
    tokenizer: str
    train_tokens: int
    valid_tokens: int
    run_dir: str
    loss_curve: str
    steps: int
    training_seconds: float
    tokens_per_s: float
    val_loss: float
    val_perplexity: float
    unigram_entropy: float
    wall_seconds: float
    chat: ChatResult | None = None  # with --chat


def next_commands(
    result: QuickstartResult,
    small: bool = False,
    recipe: str = DEFAULT_RECIPE,
    text: Sequence[str | Path] | None = None,
) -> list[tuple[str, list[str]]]:
    """The commands that go on from this run, as (what, argv) pairs with its own paths: generate from its
    model; chat with its chat model, made first when it has none by the quickstart again with `--chat` (which
    reuses what this run built, so it repeats this run's `--small`, `--recipe` and `--text`); serve and export
    its last model."""
    commands = [("generate", ["scratchlm", "generate", "--run", result.run_dir])]
    chat_run = result.chat.run_dir if result.chat is not None else str(Path(result.out_dir) / CHAT_RUN)
    if result.chat is None:
        again = ["scratchlm", "quickstart", "--out", result.out_dir]
        if small:
            again.append("--small")
        if recipe != DEFAULT_RECIPE:
            again += ["--recipe", recipe]
        if text:
            again += ["--text", *map(str, text)]
        commands.append(("chat model", [*again, "--chat"]))
    commands.append(("chat", ["scratchlm", "chat", "--run", chat_run]))
    model = chat_run if result.chat is not None else result.run_dir
    export_dir = str(Path("exports") / Path(result.out_dir).name)
    commands += [
        ("serve", ["scratchlm", "serve", "--run", model]),
        ("export", ["scratchlm", "export", "--run", model, "--format", "hf", "--out", export_dir]),
    ]
    return commands


def print_summary(result: QuickstartResult, commands: Sequence[tuple[str, list[str]]] = ()) -> None:
    rows = [
        ("corpus", result.corpus),
        ("tokenizer", result.tokenizer),
        ("token ids", f"{result.train_tokens:,} train / {result.valid_tokens:,} valid"),
        ("run", f"{result.run_dir} (config, metrics, checkpoints)"),
        ("loss curve", result.loss_curve),
        (
            "training",
            f"{result.steps:,} steps in {format_seconds(result.training_seconds)}, "
            f"{result.tokens_per_s:,.0f} tokens/s",
        ),
        ("validation loss", f"{result.val_loss:.4f} nats/token (perplexity {result.val_perplexity:.2f})"),
        ("unigram entropy", f"{result.unigram_entropy:.4f} nats/token (a model that ignores context)"),
    ]
    if (chat := result.chat) is not None:
        rows += [
            (
                "chat model",
                f"{chat.run_dir} ({chat.steps:,} steps in {format_seconds(chat.training_seconds)})",
            ),
            (
                "exact match",
                f"{chat.exact_match_after:.1%} after fine-tuning, {chat.exact_match_before:.1%} before "
                f"({chat.test_conversations} held-out conversations)",
            ),
            ("assistant loss", f"{chat.loss_after:.4f} nats/token after, {chat.loss_before:.4f} before"),
        ]
        if chat.rl_run_dir is not None:
            rows += [
                (
                    "RL model",
                    f"{chat.rl_run_dir} ({chat.rl_steps:,} steps in {format_seconds(chat.rl_training_seconds)})",
                ),
                (
                    "exact match (RL)",
                    f"{chat.exact_match_rl:.1%} after RL, {chat.exact_match_after:.1%} fine-tuned, "
                    f"{chat.exact_match_before:.1%} base",
                ),
            ]
    rows.append(("total time", format_seconds(result.wall_seconds)))
    console.rule(Text("summary", style="bold"), align="left")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        # One line per figure, never cut: paths are meant to be copied.
        console.print(f"{name:<{width}}  {value}", markup=False, soft_wrap=True)
    if not math.isfinite(result.val_loss):
        console.print("the validation loss is not finite: training diverged", style="red")
    if commands:
        console.rule(Text("next", style="bold"), align="left")
        width = max(len(name) for name, _ in commands)
        for name, argv in commands:
            console.print(f"{name:<{width}}  {shlex.join(argv)}", markup=False, soft_wrap=True)
        console.print(
            "(serve needs scratchlm[serve] and export scratchlm[hf]; each says what to install)",
            style="dim",
            markup=False,
        )
