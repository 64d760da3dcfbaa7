"""`scratchlm quickstart --small`: the whole pipeline end to end, every artifact checked, and a second run that
reuses what the first one built."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from doc_commands import parse_cli

from scratchlm.chat.pipeline import CHAT_RUN, ChatResult
from scratchlm.cli import main
from scratchlm.data.prepare import PreparedData
from scratchlm.quickstart import (
    RECIPES,
    SMALL,
    QuickstartResult,
    next_commands,
    train_config,
    train_within_budget,
    unigram_entropy,
)
from scratchlm.run import RunDirectory, load_trained
from scratchlm.tokenizer import CHAT_TOKENS, DEFAULT_SPECIAL_TOKENS, END_OF_TEXT
from scratchlm.tokenizer.serialization import load_tokenizer_files
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.training.budget import CALIBRATION_STEPS


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("quickstart")
    # One thread: this tiny model gains nothing from two, and when test processes share the cores, threads
    # that wait for each other are what makes a CPU run slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["quickstart", "--small", "--out", str(out)]) == 0
        yield out
    finally:
        torch.set_num_threads(threads)


def test_corpus_is_stdlib_source_split_into_documents(out: Path) -> None:
    train = (out / "corpus" / "train.txt").read_text(encoding="utf-8")
    valid = (out / "corpus" / "valid.txt").read_text(encoding="utf-8")
    assert 0 < len(train.encode()) <= SMALL.corpus_bytes
    assert train.count(END_OF_TEXT) >= 5 and valid
    assert "def " in train and "import " in train
    assert all(document.strip() for document in train.split(END_OF_TEXT))  # no empty documents
    assert not set(train.split(END_OF_TEXT)) & set(
        valid.split(END_OF_TEXT)
    )  # held-out files are not in train


def test_tokenizer_and_token_files(out: Path) -> None:
    data = out / "data"
    vocab, merges, special = load_tokenizer_files(data / "tokenizer")
    # 256 bytes, the merges, and the special tokens: <|endoftext|> and the chat template's, reserved
    assert len(vocab) == SMALL.vocab_size and len(merges) == SMALL.vocab_size - 256 - len(
        DEFAULT_SPECIAL_TOKENS
    )
    assert special == [END_OF_TEXT, *CHAT_TOKENS]
    tokenizer = Tokenizer.from_dir(data / "tokenizer")
    for split in ("train", "valid"):
        ids = np.load(data / f"{split}.npy", mmap_mode="r")
        assert ids.dtype == np.uint16 and ids.ndim == 1
        assert int(ids.max()) < SMALL.vocab_size
        # The ids are the text, whole: decoding gives back the corpus file byte for byte.
        assert tokenizer.decode(ids.tolist()) == (out / "corpus" / f"{split}.txt").read_text(encoding="utf-8")
    valid = np.load(data / "valid.npy")
    assert int((valid == tokenizer.token_id(END_OF_TEXT)).sum()) == (out / "corpus" / "valid.txt").read_text(
        encoding="utf-8"
    ).count(END_OF_TEXT)


def test_training_run_and_loss_went_down(out: Path) -> None:
    run = out / "run"
    assert (run / "config.toml").is_file()
    assert RunDirectory(run).checkpoints()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train_loss"] for r in records if "train_loss" in r]
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(train_losses) >= 3 and val_losses
    assert train_losses[0] > math.log(SMALL.vocab_size) - 0.5  # starts near uniform guessing
    assert train_losses[-1] < train_losses[0] - 1.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == SMALL.max_steps


def test_reported_validation_loss_matches_an_independent_evaluation(out: Path) -> None:
    """Recompute the whole-file loss with torch's cross_entropy over the same consecutive windows."""
    report = json.loads((out / "quickstart.json").read_text())
    model = load_trained(out / "run").model
    ids = torch.from_numpy(np.load(out / "data" / "valid.npy").astype(np.int64))
    context = model.config.context_length
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            window = ids[start : start + context + 1]
            logits = model(window[:-1].unsqueeze(0))[0]
            total += F.cross_entropy(logits.float(), window[1:], reduction="sum").item()
    assert report["val_loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-4)
    assert report["val_loss"] < math.log(SMALL.vocab_size) - 1.0  # learnt something beyond uniform guessing
    assert report["valid_tokens"] == len(ids)


def test_unigram_entropy_against_a_direct_count(out: Path) -> None:
    report = json.loads((out / "quickstart.json").read_text())
    ids = np.load(out / "data" / "valid.npy").tolist()
    counts = Counter(ids)
    expected = -sum(c / len(ids) * math.log(c / len(ids)) for c in counts.values())
    assert report["unigram_entropy"] == pytest.approx(expected, rel=1e-9)
    assert unigram_entropy(np.array([3, 3, 5, 5])) == pytest.approx(math.log(2))


def test_loss_curve_png(out: Path, tmp_path: Path) -> None:
    """loss.png is the picture of the run's metrics: drawn again from `run/metrics.jsonl`, every pixel is the
    same, and what that drawing plots is every train and validation record of the run."""
    from matplotlib.image import imread

    from scratchlm.experiments.plot import plot_runs
    from scratchlm.run import read_metrics

    again = tmp_path / "again.png"
    drawn = plot_runs([out / "run"], again, labels=["quickstart"])
    assert np.array_equal(imread(out / "loss.png"), imread(again))
    metrics = read_metrics(out / "run")
    for key, name in (("train_loss", "train"), ("val_loss", "val")):
        points = [r for r in metrics if key in r]
        assert len(points) >= 2
        assert drawn["quickstart"][name]["step"] == [r["step"] for r in points]
        assert drawn["quickstart"][name]["loss"] == [r[key] for r in points]


def test_second_run_reuses_everything(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept = [
        out / "corpus" / "train.txt",
        out / "data" / "tokenizer" / "merges.txt",
        out / "data" / "train.npy",
    ]
    kept += RunDirectory(out / "run").checkpoints() + [out / "run" / "metrics.jsonl"]
    before = {path: path.stat().st_mtime_ns for path in kept}
    first = json.loads((out / "quickstart.json").read_text())
    capsys.readouterr()
    assert main(["quickstart", "--small", "--out", str(out)]) == 0
    assert {path: path.stat().st_mtime_ns for path in kept} == before
    err = capsys.readouterr().err
    assert "reusing the finished model" in err
    assert json.loads((out / "quickstart.json").read_text())["val_loss"] == pytest.approx(first["val_loss"])


def test_the_summary_ends_with_the_commands_that_go_on_from_this_run(
    out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each printed command is a real sub-command whose flags parse, names this run's own paths, and runs:
    `generate` is run for a few tokens."""
    capsys.readouterr()
    assert main(["quickstart", "--small", "--out", str(out)]) == 0  # reuses everything: seconds
    printed = capsys.readouterr().err.split("summary")[-1]
    lines = re.findall(r"^(\S.*?) {2,}(scratchlm .+)$", printed.split("next", 1)[1], re.M)
    shown = {name: parse_cli(shlex.split(command)[1:]) for name, command in lines}
    assert list(shown) == ["generate", "chat model", "chat", "serve", "export"]
    assert [args.command for args in shown.values()] == ["generate", "quickstart", "chat", "serve", "export"]
    run = str(out / "run")
    assert RunDirectory(out / "run").latest_checkpoint() is not None
    assert shown["generate"].run == shown["serve"].run == shown["export"].run == run
    assert shown["export"].format == "hf"
    # The chat model comes from this same run: the quickstart again, in the same directory, at the same size.
    again = shown["chat model"]
    assert again.out == str(out) and again.small and again.chat
    assert again.recipe == "fast" and again.text is None
    assert shown["chat"].run == str(out / CHAT_RUN)
    generate = shlex.split(dict(lines)["generate"])[1:]
    assert main([*generate, "--max-new-tokens", "5", "--seed", "0"]) == 0
    assert "tokens/s" in capsys.readouterr().err


def test_the_next_commands_follow_the_chat_model_and_repeat_the_runs_inputs(out: Path) -> None:
    """With a chat model, chat, serve and export use it; without one, the quickstart that makes it repeats the
    run's recipe and text, since it reuses what they built."""
    result = QuickstartResult(**json.loads((out / "quickstart.json").read_text()))
    chat = ChatResult(str(out / CHAT_RUN), 30, 1.0, 0.0, 0.5, 8.0, 1.0, 20)
    commands = {
        name: parse_cli(argv[1:]) for name, argv in next_commands(dataclasses.replace(result, chat=chat))
    }
    assert list(commands) == ["generate", "chat", "serve", "export"]
    assert commands["generate"].run == result.run_dir
    assert commands["chat"].run == commands["serve"].run == commands["export"].run == chat.run_dir

    commands = dict(next_commands(result, recipe="spec", text=["notes/", "my book.txt"]))
    again = parse_cli(commands["chat model"][1:])
    assert (again.recipe, again.text, again.small, again.chat) == (
        "spec",
        ["notes/", "my book.txt"],
        False,
        True,
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_speed_is_measured_inside_the_warm_up(out: Path, tmp_path: Path, recipe: str) -> None:
    """The first steps of a time-budgeted run measure the speed before the schedule's length is known: they
    must run at the rates the fitted schedule gives them, which only the warm-up guarantees (a WSD schedule
    sized to the measured steps alone would decay among them)."""
    size = dataclasses.replace(SMALL, max_steps=None, warmup_iters=CALIBRATION_STEPS)  # as FULL's
    data = PreparedData(*(out / "data" / name for name in ("tokenizer", "train.npy", "valid.npy")))
    train_within_budget(size, data, tmp_path / "run", 3.0, "cpu", tmp_path / "schedule.json", recipe=recipe)
    total = json.loads((tmp_path / "schedule.json").read_text())["max_steps"]
    config = train_config(size, data, tmp_path / "run", 3.0, "cpu", total, recipe)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    lrs = {r["step"]: r["lr"] for r in map(json.loads, lines) if "lr" in r}
    peak = config.optimizer.muon_lr if config.optimizer.name == "muon" else config.optimizer.lr
    warmup = config.schedule.warmup_iters
    measured = [step for step in lrs if step <= CALIBRATION_STEPS]
    assert warmup >= CALIBRATION_STEPS and measured
    assert all(lrs[step] == pytest.approx(step / warmup * peak) for step in measured)


@pytest.mark.slow
def test_the_full_quickstart_learns_in_two_minutes(tmp_path: Path) -> None:
    """The default quickstart (the whole standard library, 4,096-token vocabulary, the compiled model, the fast
    recipe) with two minutes of training, about half of which the first compilation takes: the
    model must have learnt from context, ending at least 1.5 nats/token below the unigram entropy (a model
    that ignores context), within the budget and a little over (the budget is checked between steps)."""
    out = tmp_path / "quickstart"
    assert main(["quickstart", "--out", str(out), "--minutes", "2"]) == 0
    report = json.loads((out / "quickstart.json").read_text())
    assert report["steps"] > 50 and report["training_seconds"] <= 120 * 1.1
    assert report["val_loss"] < report["unigram_entropy"] - 1.5
