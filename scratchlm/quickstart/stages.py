"""The quickstart's stages, each reusing what an earlier run finished: the corpus, tokenizer and token ids
(`build_data`); the model trained within the time budget (`train_within_budget`), in the shape the budget
buys (`choose_fast_shape`); then, from the trained model (`load_for_inference`), its validation loss beside
the unigram entropy (`unigram_entropy`) and samples after a few prompts (`print_samples`). `Stages`
announces each in turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from rich.text import Text

from scratchlm.console import console
from scratchlm.data.corpus import build_corpus, build_text_corpus
from scratchlm.data.prepare import PreparedData, prepare_data
from scratchlm.device import plan
from scratchlm.errors import ScratchlmError
from scratchlm.generation.generate import generate_stream
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.io import atomic_write
from scratchlm.quickstart.sizes import FAST_SHAPES, QuickstartSize, train_config
from scratchlm.run import RunDirectory, RunSummary, StopReason, load_trained, read_metrics
from scratchlm.run.load import TrainedModel
from scratchlm.tokenizer import END_OF_TEXT
from scratchlm.training.budget import BudgetDecision
from scratchlm.training.config import TrainConfig
from scratchlm.training.sizing import Shape, ShapeChoice, choose_shape, record_run
from scratchlm.training.start import config_changes
from scratchlm.training.trainer import train


class Stages:
    """Announces each stage in turn: a rule reading "3/6  training ..."."""

    def __init__(self, total: int) -> None:
        self.total, self.started = total, 0

    def __call__(self, title: str) -> None:
        self.started += 1
        console.rule(Text(f"{self.started}/{self.total}  {title}", style="bold"), align="left")


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
    decided = [r["time_budget"] for r in read_metrics(run_dir) if "time_budget" in r]
    with atomic_write(schedule_file, "w") as f:
        json.dump(
            {"max_steps": decided[-1]["total_steps"] if decided else config.total_steps or summary.steps}, f
        )
    if shape is not None and decided:
        record_taken(schedule_file.with_name("shape.json"), summary.steps, decided[0])
        first = BudgetDecision.from_dict(decided[0])
        choices = plan(torch.device(device), "auto", compile=size.compile)
        record_run(config, choices, first.step, first.step_s, first.elapsed_s)
    return summary


def record_taken(record: Path, steps: int, decision: dict) -> None:
    """Beside the steps the shape rule predicted (shape.json), the steps the run took and the step time its
    budget measured."""
    try:
        values = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    values["taken"] = {"steps": steps, "step_s": decision["step_s"], "decided_at_s": decision["elapsed_s"]}
    with atomic_write(record, "w") as f:
        json.dump(values, f, indent=2)


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
        rate = f"{precision}, {'compiled' if choices.compile.value else 'eager'}" + (
            f", {threads} thread{'' if threads == 1 else 's'}" if threads else ""
        )
        console.print(f"timing the fast recipe's shapes on this machine ({rate}; once, then cached)")
        choice = choose_shape(ladder, seconds, choices, rate)
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


def load_for_inference(run_dir: Path, device: str, tokenizer: Path) -> TrainedModel:
    """The trained model for evaluation and samples, held in the precision its run recorded (what "auto"
    resolved to when it trained), not resolved anew."""
    trained = load_trained(run_dir, device=device, tokenizer=tokenizer)
    prepare_for_inference(trained.model, plan(torch.device(device), trained.precision or "auto"))
    return trained


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy in nats of the token frequencies of `ids`: the loss of a model that ignores context."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64))
    p = counts[counts > 0] / len(ids)
    return float(-(p * np.log(p)).sum())


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
