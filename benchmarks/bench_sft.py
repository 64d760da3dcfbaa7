"""Fine-tuning at its defaults on conversations no default was tuned on, against a sweep of fixed rates.

Three conversation sets, made here (seeded, no download), none of them the built-in set the quickstart's rate
was swept on:

    unseen-words  the built-in task kinds (scratchlm.chat.tasks) over English words of tests/fixtures/corpus.en;
                  the test conversations' words never appear in a training conversation
    german        the same kinds over German words of the gettext catalogs (corpora.py's german), a corpus
                  unlike the base's
    multi-turn    a task over the built-in words, then one or two follow-ups on the assistant's last answer
                  ("Now reverse it.", "Now count the words."); every answer is trained on, the last one scored

For each set, `scratchlm sft` runs as a user runs it: `--base`, `--data`, `--out` and the budget, every other
setting at its default (so the rate is measured on 5 % of the training conversations, `scratchlm.chat.rate`).
Then the same command at each fixed rate of `--rates`, with the same budget. Each model answers the test split
greedily; the table gives exact match, and the default's share of the sweep's best (the target: >= 90 %).

    python benchmarks/bench_sft.py --base runs/quickstart/run            # 3 sets x 5 runs of --minutes (3)
    python benchmarks/bench_sft.py --base RUN --steps 400 --sets german  # a step budget: load-independent
    python benchmarks/bench_sft.py --base RUN --lora 16                  # LoRA against full fine-tuning

`--lora RANK` compares instead of sweeping: on each set, full fine-tuning at its defaults, then `sft --lora RANK`
(`lora.targets`' default: every matrix of the base's blocks and an untied head; its rate measured the same
way) with the same budget, back to back; the table gives both exact matches, the difference in points, the
steps and tokens/s each reached and the threads it ran with (a machine busy with other work slows one run
more than another), and the target (LoRA >= full - 3 points).

Without `--base`, the quickstart's base is trained first (`scratchlm quickstart --minutes 5`). Each finished run
under --out is reused; delete it to measure again. The commands run this checkout's scratchlm (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from corpora import german_documents  # noqa: E402

from scratchlm.chat.conversations import write_conversations  # noqa: E402
from scratchlm.chat.pipeline import as_chat_model  # noqa: E402
from scratchlm.chat.tasks import conversation, exact_match, vocabulary  # noqa: E402
from scratchlm.chat.template import Message  # noqa: E402
from scratchlm.device.host import cpu_name_and_flags  # noqa: E402
from scratchlm.io import atomic_write  # noqa: E402
from scratchlm.training.config_reader import read_toml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TRAIN, TEST = 6000, 200  # the conversations of each set, as in the report that asked for this benchmark
TARGET = 0.90  # the default's exact match over the sweep's best
LORA_TARGET = 3.0  # points of exact match LoRA may trail full fine-tuning by, at the same budget

Conversations = list[list[Message]]


def english_words() -> list[str]:
    """Lower-case English words of 3 to 8 letters seen at least twice in corpus.en, less the built-in words."""
    text = (ROOT / "tests/fixtures/corpus.en").read_text(encoding="utf-8")
    counts = Counter(w for w in re.findall(r"[a-z]+", text) if 3 <= len(w) <= 8)
    return sorted(w for w, n in counts.items() if n >= 2 and w not in set(vocabulary()))


def german_words() -> list[str]:
    """German words of 3 to 10 letters seen at least three times in the gettext catalogs."""
    counts: Counter[str] = Counter()
    for document in german_documents():
        counts.update(w for w in re.findall(r"\b[a-zäöüß]+\b", document) if 3 <= len(w) <= 10)
    return sorted(w for w, n in counts.items() if n >= 3)


def _unique_tests(
    make: Callable[[random.Random], list[Message]], train: Conversations, seed: str
) -> Conversations:
    asked = {tuple(m.content for m in c[:-1]) for c in train}
    rng, test = random.Random(seed), []
    while len(test) < TEST:
        c = make(rng)
        if tuple(m.content for m in c[:-1]) not in asked:
            test.append(c)
    return test


def unseen_words() -> tuple[Conversations, Conversations]:
    words = english_words()
    random.Random("words").shuffle(words)
    seen, unseen = sorted(words[: len(words) // 2]), sorted(words[len(words) // 2 :])
    rng = random.Random("unseen-words-train")
    train = [conversation(rng, seen) for _ in range(TRAIN)]
    return train, _unique_tests(lambda r: conversation(r, unseen), train, "unseen-words-test")


def german() -> tuple[Conversations, Conversations]:
    words = german_words()
    rng = random.Random("german-train")
    train = [conversation(rng, words) for _ in range(TRAIN)]
    return train, _unique_tests(lambda r: conversation(r, words), train, "german-test")


# Follow-ups on the assistant's last answer (a list of words): the question, and the answer it asks for
# (None: not applicable to that list).
FOLLOW_UPS: list[tuple[str, Callable[[list[str]], str | None]]] = [
    ("Now reverse it.", lambda w: " ".join(reversed(w))),
    ("Now the first word.", lambda w: w[0]),
    ("Now the last word.", lambda w: w[-1]),
    ("Now count the words.", lambda w: str(len(w))),
    ("Now without the first word.", lambda w: " ".join(w[1:]) if len(w) > 1 else None),
    ("Now in capitals.", lambda w: " ".join(w).upper()),
]
STARTS = [("Repeat", lambda w: w), ("Reverse", lambda w: w[::-1]), ("Sort", sorted)]


def follow_up_conversation(rng: random.Random, words: list[str]) -> list[Message]:
    name, apply = rng.choice(STARTS)
    asked = rng.sample(words, rng.randint(2, 4))
    answer = apply(asked)
    messages = [Message("user", f"{name}: {' '.join(asked)}"), Message("assistant", " ".join(answer))]
    for _ in range(rng.randint(1, 2)):
        question, follow = rng.choice(FOLLOW_UPS)
        reply = follow(answer)
        if reply is None:
            break
        messages += [Message("user", question), Message("assistant", reply)]
        answer = reply.split()
    return messages


def multi_turn() -> tuple[Conversations, Conversations]:
    words, rng = vocabulary(), random.Random("multi-turn-train")
    train = [follow_up_conversation(rng, words) for _ in range(TRAIN)]
    return train, _unique_tests(lambda r: follow_up_conversation(r, words), train, "multi-turn-test")


SETS: dict[str, Callable[[], tuple[Conversations, Conversations]]] = {
    "unseen-words": unseen_words,
    "german": german,
    "multi-turn": multi_turn,
}


def scratchlm(*args: str) -> None:
    """`python -m scratchlm ARGS` with this checkout's package first on the path, whatever is installed."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    subprocess.run(
        [sys.executable, "-m", "scratchlm", *args], check=True, env=os.environ | {"PYTHONPATH": path}
    )


def sft(base: Path, train_file: Path, out: Path, budget: list[str], extra: list[str]) -> dict:
    """`scratchlm sft` as a user runs it (reused when it finished); its summary."""
    summary = out / "summary.json"
    if not (summary.exists() and json.loads(summary.read_text())["stopped"] != "interrupted"):
        resume = ["--resume"] if out.exists() else []
        scratchlm(
            "sft", "--base", str(base), "--data", str(train_file), "--out", str(out), *budget, *extra, *resume
        )
    return json.loads(summary.read_text())


def chosen_rate(run: Path) -> float | None:
    """The `optimizer.lr` a run trained at (measured, unless given), from its config."""
    chosen = re.search(r"^lr = (.+)$", (run / "config.toml").read_text(), re.M)
    return float(chosen.group(1)) if chosen else None


def sweep_losses(run: Path) -> dict[str, float | None]:
    """The held-out losses of the run's rate measurement (`RUN/lr-sweep/sweep.json`); {} when it made none."""
    sweep = run / "lr-sweep" / "sweep.json"
    return json.loads(sweep.read_text())["losses"] if sweep.exists() else {}


def score(run: Path, test: Conversations) -> float:
    model, template = as_chat_model(run, "cpu")
    return exact_match(model, template, test)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, help="the base run (default: train the quickstart's)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-sft"))
    parser.add_argument("--minutes", type=float, default=3.0, help="each run's time budget (default 3)")
    parser.add_argument("--steps", type=int, help="each run's steps instead of a time budget")
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    parser.add_argument("--rates", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2, 3e-2])
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="instead of the sweep: full fine-tuning against LoRA of this rank, both at their defaults",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    base = args.base
    if base is None:
        scratchlm("quickstart", "--out", str(args.out / "base"))
        base = args.out / "base" / "run"
    budget = (
        ["--set", f"training.max_steps={args.steps}"] if args.steps else ["--minutes", f"{args.minutes:g}"]
    )
    results: dict[str, dict] = {}
    for name in args.sets:
        folder = args.out / name
        train_file, test_file = folder / "train.jsonl", folder / "test.jsonl"
        train, test = SETS[name]()
        if not test_file.exists():
            write_conversations(train_file, train)
            write_conversations(test_file, test)
        default = sft(base, train_file, folder / "default", budget, [])
        if args.lora:
            lora = sft(base, train_file, folder / f"lora-{args.lora}", budget, ["--lora", str(args.lora)])
            results[name] = compared(folder, default, lora, args.lora, test)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
            continue
        row = {"default": score(folder / "default", test), "default_lr": chosen_rate(folder / "default")}
        row["default_steps"] = default["steps"]
        for lr in args.rates:
            sft(base, train_file, folder / f"lr-{lr:g}", budget, ["--set", f"optimizer.lr={lr}"])
            row[f"{lr:g}"] = score(folder / f"lr-{lr:g}", test)
        best = max(row[f"{lr:g}"] for lr in args.rates)
        row["share_of_best"] = row["default"] / best if best else 1.0
        results[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)

    cpu, flags = cpu_name_and_flags()
    print(
        f"\nexact match on {TEST} test conversations; {cpu} ({', '.join(flags) or 'no bf16 flags'}); base {base}"
    )
    if args.lora:
        print_comparison(results, args.lora)
        if args.json:
            write_json(
                args.json,
                {
                    "cpu": cpu,
                    "base": str(base),
                    "budget": budget,
                    "lora": {"rank": args.lora},
                    "sets": results,
                },
            )
        return
    header = f"{'set':<14} {'default':>8} {'its lr':>7}" + "".join(f" {f'lr {lr:g}':>9}" for lr in args.rates)
    print(header + f" {'share of best':>14}")
    for name, row in results.items():
        rates = "".join(f" {row[f'{lr:g}']:>9.1%}" for lr in args.rates)
        held = "met" if row["share_of_best"] >= TARGET else "NOT MET"
        print(
            f"{name:<14} {row['default']:>8.1%} {row['default_lr']:>7.2g}{rates} {row['share_of_best']:>9.0%} {held}"
        )
    if args.json:
        write_json(args.json, {"cpu": cpu, "base": str(base), "budget": budget, "sets": results})


def compared(folder: Path, full: dict, lora: dict, rank: int, test: Conversations) -> dict:
    """Full fine-tuning (`folder/default`) against LoRA (`folder/lora-RANK`): exact match, rate, steps and
    tokens/s of each, the difference in points and whether it holds the target."""
    row: dict = {}
    for side, run, summary in (("full", folder / "default", full), ("lora", folder / f"lora-{rank}", lora)):
        row[side] = {
            "exact_match": score(run, test),
            "lr": chosen_rate(run),
            "lr_sweep": sweep_losses(run),
            "steps": summary["steps"],
            "tokens_per_s": summary["tokens_per_s"],
            "held_out_loss": summary["final_val_loss"],  # the assistant tokens' of the held-out conversations
            "seconds": summary["wall_time_s"],
            "plan": plan(run),
        }
    row["lora"]["targets"] = read_toml(folder / f"lora-{rank}" / "config.toml")["lora"]["targets"]
    row["points"] = round(100 * (row["lora"]["exact_match"] - row["full"]["exact_match"]), 6)
    row["met"] = row["points"] >= -LORA_TARGET
    return row


def plan(run: Path) -> str:
    """How the run's last session executed: its plan line's precision, threads and compilation, then each
    change of threads the load of a shared machine made during it (from `RUN/log.txt`)."""
    lines = (run / "log.txt").read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"(cpu|cuda|mps)[:\d]*: .* → ", line)]
    if not starts:
        return ""
    shown = lines[starts[-1]].split(" → ", 1)[1].split(" (", 1)[0]
    changes = [m.group(1) for line in lines[starts[-1] :] if (m := re.search(r"threads \d+ → (\d+)", line))]
    return shown + "".join(f", then {n}" for n in changes)


def print_comparison(results: dict[str, dict], rank: int) -> None:
    targets = {", ".join(row["lora"]["targets"]) for row in results.values()}
    print(f"full fine-tuning against LoRA rank {rank} on {' | '.join(sorted(targets))}, each at its defaults")
    print(
        f"{'set':<14} {'full':>7} {f'LoRA {rank}':>8} {'points':>7} {'lr full':>8} {'lr LoRA':>8}"
        f" {'steps':>11} {'tokens/s':>13}  target (>= -{LORA_TARGET:g})"
    )
    for name, row in results.items():
        full, lora = row["full"], row["lora"]
        print(
            f"{name:<14} {full['exact_match']:>7.1%} {lora['exact_match']:>8.1%} {row['points']:>+7.1f}"
            f" {full['lr']:>8.2g} {lora['lr']:>8.2g} {full['steps']:>5} / {lora['steps']:<5}"
            f" {full['tokens_per_s'] or 0:>6.0f} / {lora['tokens_per_s'] or 0:<6.0f}"
            f"  {'met' if row['met'] else 'NOT MET'}"
        )
    for name, row in results.items():
        print(f"{name}: full ran {row['full']['plan']}; LoRA {row['lora']['plan']}")


def write_json(path: Path, figures: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w") as f:
        json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
