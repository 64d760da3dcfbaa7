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
"""

from __future__ import annotations

import json
import math
import shlex
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.text import Text

from scratchlm.chat.pipeline import CHAT_FULL, CHAT_RUN, CHAT_SMALL, ChatResult, chat_stages
from scratchlm.console import console, format_seconds
from scratchlm.data.corpus import build_corpus, build_text_corpus
from scratchlm.data.prepare import PreparedData, prepare_data
from scratchlm.device import plan, resolve_device
from scratchlm.errors import ScratchlmError
from scratchlm.evaluation import evaluate
from scratchlm.experiments.plot import plot_runs
from scratchlm.generation.generate import generate_stream
from scratchlm.io import atomic_write, claim_output_dir
from scratchlm.run import RunDirectory, RunSummary, StopReason, load_trained, read_metrics
from scratchlm.run.load import TrainedModel
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.training.budget import CALIBRATION_STEPS
from scratchlm.training.config import TrainConfig, budget_seconds, config_changes
from scratchlm.training.recipes import RECIPES as TRAINING_RECIPES
from scratchlm.training.recipes import merged
from scratchlm.training.sizing import Shape, ShapeChoice, choose_shape
from scratchlm.training.trainer import train


@dataclass(frozen=True)
class QuickstartSize:
    """How big each stage is."""

    corpus_bytes: int | None  # cap on the training text; None: the whole standard library (~10 MB)
    vocab_size: int
    model: dict[str, Any]  # ModelConfig fields
    batch_size: int
    lr: float
    warmup_iters: int
    max_steps: int | None  # the schedule's length; None: as many steps as fit in the time budget
    eval_interval: int
    sample_tokens: int
    compile: bool  # torch.compile on a CPU too (always on a GPU)


FULL = QuickstartSize(
    corpus_bytes=None,
    vocab_size=4096,
    model={"context_length": 256, "d_model": 256, "num_layers": 4, "num_heads": 8, "rope_theta": 10_000.0},
    batch_size=16,
    lr=2e-3,
    warmup_iters=30,
    max_steps=None,
    eval_interval=50,
    sample_tokens=200,
    # Measured on two cores in bf16: 276 ms per compiled step against 382 ms eager, for about 10 s of
    # compilation.
    compile=True,
)
# Seconds per stage: for tests and a first look at the output.
SMALL = QuickstartSize(
    corpus_bytes=300_000,
    vocab_size=512,
    model={"context_length": 64, "d_model": 64, "num_layers": 2, "num_heads": 4, "rope_theta": 10_000.0},
    batch_size=16,
    lr=3e-3,
    warmup_iters=10,
    max_steps=100,
    eval_interval=50,
    sample_tokens=40,
    compile=False,  # compiling would take longer than this whole run
)

# No prompt ends in a space: BPE tokens carry their leading space (" os"), so a trailing one is a rare token.
PROMPTS = ("import", "def read_config(path):\n", "class Stack:\n")


def text_prompts(valid_text: Path, count: int = 3, words: int = 4) -> list[str]:
    """Prompts for the user's text: the first `words` words of each of the first `count` held-out documents."""
    prompts: list[str] = []
    for document in valid_text.read_text(encoding="utf-8").split(END_OF_TEXT):
        prompt = " ".join(document.split()[:words])
        if prompt and prompt not in prompts:
            prompts.append(prompt)
        if len(prompts) == count:
            break
    return prompts


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy in nats of the token frequencies of `ids`: the loss of a model that ignores context."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64))
    p = counts[counts > 0] / len(ids)
    return float(-(p * np.log(p)).sum())


#: The fast recipe's shapes for a budget (`scratchlm.training.sizing`), smallest first, each with the steps of
#: its own it needs in the budget to beat the one before it (measured: docs/experiments.md, "The shape for
#: the budget"). The smallest fits minutes on a CPU: 2 layers rather than the specification's 4 (so one
#: value-embedding table) and 8 sequences a step rather than 16, about three times the steps. Given the steps,
#: 16 sequences a step learn more from the same time: with the batch twice as large a step takes less than
#: twice as long, and its gradient is less noisy. 4 layers at 16 sequences measured worse than both at every
#: budget tried, so they are not on the ladder.
FAST_SHAPES: tuple[Shape, ...] = (
    Shape(
        "2 layers, 8 sequences a step",
        {"model": {"num_layers": 2, "value_embeddings": 1}, "training": {"batch_size": 8}},
    ),
    Shape(
        "2 layers, 16 sequences a step",
        {"model": {"num_layers": 2, "value_embeddings": 1}, "training": {"batch_size": 16}},
        min_steps=300,
    ),
)
#: The training recipes of `--recipe`, as changes to `train_config`'s sections: those of
#: `scratchlm.training.recipes`, each in the quickstart's shape. "fast" is in the smallest of `FAST_SHAPES`
#: here (where no budget chooses: a run of a fixed step count, a variant of a benchmark); its warm-up is the
#: steps that measure the speed.
QUICKSTART_SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "fast": merged(FAST_SHAPES[0].changes, {"schedule": {"warmup_iters": CALIBRATION_STEPS}}),
}
RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    name: merged(recipe, QUICKSTART_SHAPES.get(name, {})) for name, recipe in TRAINING_RECIPES.items()
}
DEFAULT_RECIPE = "fast"


def train_config(
    size: QuickstartSize,
    data: PreparedData,
    run_dir: Path,
    seconds: float,
    device: str,
    max_steps: int,
    recipe: str = "spec",
    shape: Shape | None = None,
) -> TrainConfig:
    """The training configuration of the quickstart's model, trained with `recipe` (a key of `RECIPES`), in
    `shape` when given (one of `FAST_SHAPES`, for the fast recipe) rather than the recipe's own."""
    if recipe not in RECIPES:
        raise ScratchlmError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    values: dict[str, dict[str, Any]] = {
        "data": {"train": str(data.train), "valid": str(data.valid), "tokenizer": str(data.tokenizer)},
        "model": {"vocab_size": size.vocab_size, **size.model},
        "optimizer": {"lr": size.lr, "min_lr": size.lr / 10, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"warmup_iters": size.warmup_iters},
        "training": {
            "batch_size": size.batch_size,
            "max_steps": max_steps,
            "max_time_s": seconds,
            "device": device,
            "precision": "auto",
            "compile": size.compile or device.startswith("cuda"),
            "seed": 0,
        },
        "eval": {"interval": size.eval_interval, "iters": 5},
        "checkpoint": {"interval": 100},
        "logging": {"run_dir": str(run_dir), "log_interval": 5},
    }
    for section, changes in merged(RECIPES[recipe], shape.changes if shape else {}).items():
        values[section] = values[section] | changes
    return TrainConfig.from_dict(values)


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


def load_for_inference(run_dir: Path, device: str, tokenizer: Path) -> TrainedModel:
    """The trained model for evaluation and samples, held in the precision its run recorded (what "auto"
    resolved to when it trained), not resolved anew."""
    trained = load_trained(run_dir, device=device, tokenizer=tokenizer)
    plan(torch.device(device), trained.precision or "auto").for_inference(trained.model)
    return trained


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
    _print_summary(quick, next_commands(quick, small=small, recipe=recipe, text=text))
    return quick


def print_samples(trained: TrainedModel, prompts: Sequence[str], tokens: int, device: str) -> None:
    """A sample after each prompt (temperature 0.8, top-p 0.95, seed 0), shown as it is sampled."""
    model, tokenizer = trained.model, trained.tokenizer
    eos = tokenizer.eos_id
    generator = torch.Generator(device=device).manual_seed(0)
    for prompt in prompts:
        console.rule(f"prompt {prompt!r}")
        console.out(prompt, end="")  # `out`: the text as it is, never read as markup or emoji codes
        sample = tokenizer.detokenizer()
        stream = generate_stream(
            model,
            tokenizer.encode(prompt),
            tokens,
            temperature=0.8,
            top_p=0.95,
            eos_id=eos,
            generator=generator,
        )
        ended = False
        for token in stream:
            ended = token == eos
            if not ended:
                console.out(sample.add(token), end="")
        console.out(sample.flush())
        if ended:
            console.print("(end of document)", style="dim")
    console.rule()


QUICKSTART_KIND = "quickstart"  # the output marker of its directory (scratchlm.io)


def build_data(
    out_dir: Path, size: QuickstartSize, text: list[str | Path] | None = None, stage: Stages | None = None
) -> PreparedData:
    """Stages 1 and 2: the corpus in `out_dir/corpus` (the standard library's sources, or the user's `text`
    files and directories), the tokenizer and token ids in `out_dir/data`."""
    stage = stage or Stages(6)
    stage("corpus: " + ("the Python standard library's sources" if text is None else "your text"))
    corpus_dir = out_dir / "corpus"
    train_text, valid_text = corpus_dir / "train.txt", corpus_dir / "valid.txt"
    # Where the corpus came from, so that a directory built from one source is never reused for another.
    source = {"text": None if text is None else [str(Path(t).resolve()) for t in text]}
    source_file = corpus_dir / "source.json"
    if train_text.exists() and valid_text.exists():
        built = json.loads(source_file.read_text()) if source_file.exists() else {"text": None}
        if built != source:
            raise ScratchlmError(
                f"{corpus_dir} was built from {built['text'] or 'the standard library'}, not from "
                f"{source['text'] or 'the standard library'}; use another --out"
            )
        console.print(f"reusing {corpus_dir}")
    else:
        if text is None:
            corpus = build_corpus(corpus_dir, max_bytes=size.corpus_bytes)
        else:
            corpus = build_text_corpus(text, corpus_dir, max_bytes=size.corpus_bytes)
        with atomic_write(source_file, "w") as f:
            json.dump(source, f)
        console.print(
            f"{corpus.train_documents:,} training documents, {corpus.valid_documents:,} held-out documents"
        )
    console.print(
        f"train {train_text.stat().st_size / 1e6:.1f} MB, valid {valid_text.stat().st_size / 1e6:.2f} MB "
        f"(files joined by {END_OF_TEXT})"
    )
    stage(f"tokenizer ({size.vocab_size:,} tokens) and token ids")
    return prepare_data(train_text, valid_text, out_dir / "data", size.vocab_size)


def train_within_budget(
    size: QuickstartSize,
    data: PreparedData,
    run_dir: Path,
    seconds: float,
    device: str,
    schedule_file: Path,
    recipe: str = "spec",
) -> RunSummary:
    """Train (or resume, or reuse) the quickstart's model with `recipe`; returns the run's summary.

    The time budget is the trainer's own (`scratchlm.training.budget`): when `size.max_steps` is None the run
    measures this machine's speed over its first `CALIBRATION_STEPS` steps and sizes its schedule to the steps
    that fit. The length it chose is copied to `schedule_file` for the reader. The fast recipe's shape is
    chosen for the budget first (`choose_fast_shape`), and the choice written beside it, in shape.json."""
    run = RunDirectory(run_dir)
    shape = None
    if recipe == "fast" and size.max_steps is None and seconds > 0:
        shape = choose_fast_shape(size, data, run, seconds, device, schedule_file.with_name("shape.json"))
    config = train_config(size, data, run_dir, seconds, device, size.max_steps or 0, recipe, shape)
    _check_recipe(run, config, recipe)
    summary = run.summary()
    if summary is not None and summary.stopped not in (StopReason.INTERRUPTED, StopReason.DIVERGED):
        console.print(f"reusing the finished model in {run_dir} (delete it to train again)")
        return summary
    summary = train(config, resume=run.latest_checkpoint() is not None)
    decided = [r["time_budget"]["total_steps"] for r in read_metrics(run_dir) if "time_budget" in r]
    with atomic_write(schedule_file, "w") as f:
        json.dump({"max_steps": decided[-1] if decided else config.total_steps or summary.steps}, f)
    return summary


def choose_fast_shape(
    size: QuickstartSize, data: PreparedData, run: RunDirectory, seconds: float, device: str, record: Path
) -> Shape:
    """The shape of `FAST_SHAPES` for `seconds` of training on `device`, with the precision and threads the
    run will have (the plan the trainer makes), printed with its reason and written to `record`. A run that
    already started keeps the shape it started with, whatever this machine measures now."""
    ladder = [
        (shape, train_config(size, data, run.path, seconds, device, 0, "fast", shape))
        for shape in FAST_SHAPES
    ]
    started = TrainConfig.load(run.config) if run.config.exists() else None
    kept = [shape for shape, config in ladder if started and _same_shape(started, config)]
    if kept:
        choice = ShapeChoice(kept[0], {}, f"{kept[0].name}, as the run in {run} started")
    else:
        choices = plan(torch.device(device), "auto", compile=size.compile)
        precision, threads = choices.precision.value, choices.threads.value
        gflops = choices.profile.rate(precision)
        rate = f"{precision} matmuls at {gflops:,.1f} GFLOP/s" + (
            f" with {threads} thread{'' if threads == 1 else 's'}" if threads else ""
        )
        choice = choose_shape(ladder, seconds, gflops, rate)
    console.print(f"shape: {choice.reason}")
    with atomic_write(record, "w") as f:
        json.dump(choice.to_dict(), f, indent=2)
    return choice.shape


def _same_shape(a: TrainConfig, b: TrainConfig) -> bool:
    return (a.model.num_layers, a.model.value_embeddings, a.training.batch_size) == (
        b.model.num_layers,
        b.model.value_embeddings,
        b.training.batch_size,
    )


def _check_recipe(run: RunDirectory, config: TrainConfig, recipe: str) -> None:
    """A run directory holds one recipe's model: reusing or resuming it with another would mix the two."""
    if not run.config.exists():
        return
    trained = TrainConfig.load(run.config)
    changes = config_changes(
        trained.to_dict(), config, sections=("model", "optimizer", "schedule"), changeable=()
    )
    if changes:
        raise ScratchlmError(
            f"{run} holds a model trained with another recipe or size than --recipe {recipe} "
            f"({'; '.join(changes)}); use another --out, or delete it to train again"
        )


class Stages:
    """Announces each stage in turn: a rule reading "3/6  training ..."."""

    def __init__(self, total: int) -> None:
        self.total, self.started = total, 0

    def __call__(self, title: str) -> None:
        self.started += 1
        console.rule(Text(f"{self.started}/{self.total}  {title}", style="bold"), align="left")


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


def _print_summary(result: QuickstartResult, commands: Sequence[tuple[str, list[str]]] = ()) -> None:
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
