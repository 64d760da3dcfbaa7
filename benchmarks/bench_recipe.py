"""The fast recipe against that of the CS336 assignment-1 handout (the specification), on the quickstart's corpus
(or another, `--corpus`: benchmarks/corpora.py), tokenizer, data order and budget.

Every run is the quickstart's training (`scratchlm.quickstart.train_within_budget`: calibrate the speed, then
fit the schedule to the steps that fit in the wall-clock budget, compilation included), followed by the loss on
every token of the held-out file. The specification's recipe is AdamW + cosine at its best learning rate of the
sweep (`--spec-lrs`); the fast one is `scratchlm.training.recipes.FAST` in the quickstart's shape (`RECIPES["fast"]` of
scratchlm/quickstart/sizes.py).

    python benchmarks/bench_recipe.py --spec-lr 4e-3           # both at 240 s and at 120 s
    python benchmarks/bench_recipe.py --spec-lr 4e-3 --spec-lrs 2e-3,8e-3 --fractions 0.5,0.35 \
        --ablations --ablation-fractions 0.5 --fresh              # docs/experiments.md, "A faster recipe"
    python benchmarks/bench_recipe.py --seconds 60 --spec-lrs 1e-3,2e-3,4e-3 --only-spec
    python benchmarks/bench_recipe.py --steps 100 --variant muon_lr=optimizer.muon_lr=0.05

The time-to-loss ratio is the smallest fraction of the budget at which the fast recipe, its schedule fitted to
that shorter budget, reaches the validation loss the specification's recipe reaches with the whole budget: the
fast recipe runs at each of `--fractions`, and the ratio is interpolated between the two fractions whose losses
bracket the target (loss taken as linear in log(budget)); "≤ f" when even the smallest fraction reaches it.

By default the runs go one at a time, each with the threads `scratchlm quickstart` would give it, as a user
runs them (`--threads 1`: one at a time with one thread); the fast recipe's shape is then chosen for each budget as the quickstart chooses it
(`FAST_SHAPES` of scratchlm/quickstart/sizes.py), and each run's shape is in the table. `--parallel 2` runs two
trainings at a time, one thread each, so that runs compared with each other share whatever else the machine is
doing at the time (the fair race of bench_quickstart.py --concurrent); there the specification's recipe also
runs at each of `--fractions`, as the partner of the fast recipe's shorter run.
Finished runs are reused (their directory names carry recipe and budget), `--fresh` trains everything again.
Results: a table on stdout, `results.json` and the loss curves (`curves.png` at the full budget,
`ablations-*.png` for the fast recipe and each piece removed) in `--results`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from corpora import CORPORA, write_corpus

from scratchlm.allocator import keep_freed_memory
from scratchlm.device import plan
from scratchlm.evaluation import evaluate
from scratchlm.experiments.plot import plot_runs
from scratchlm.quickstart import FULL, RECIPES, SMALL, build_data, train_within_budget
from scratchlm.run import load_trained
from scratchlm.training.config import TrainConfig
from scratchlm.training.config_reader import parse_override
from scratchlm.training.recipes import merged

#: Each piece of the fast recipe, removed on its own (the ablation table). "muon" falls back to the
#: specification's AdamW (every group at the spec's learning rate, filled in from --spec-lr).
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "no-muon": {"optimizer": {"name": "adamw", "embedding_lr": 0.0, "head_lr": 0.0}},
    "no-group-rates": {"optimizer": {"embedding_lr": 0.0, "head_lr": 0.0}},
    "no-qk-norm": {"model": {"qk_norm": False}},
    "swiglu": {"model": {"ffn": "swiglu"}},
    "no-zero-init": {"model": {"zero_init": False}},
    "no-softcap": {"model": {"logit_softcap": 0.0}},
    "no-value-embeddings": {"model": {"value_embeddings": 0}},
    "cosine": {"schedule": {"kind": "cosine"}},
    "4-layers": {"model": {"num_layers": FULL.model["num_layers"]}},
    "batch-16": {"training": {"batch_size": FULL.batch_size}},
}


def run_job(
    name: str,
    recipe: dict,
    budget: float,
    unit: str,
    out: str,
    small: bool,
    threads: int,
    compile: bool,
    text: list[str] | None,
) -> dict[str, Any]:
    """Train recipe `recipe` (registered as `name`) for `budget` seconds (unit "s") or steps (unit "steps"),
    in this process or a child, and evaluate it on the whole validation file; returns the run's figures."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    size = dataclasses.replace(SMALL if small else FULL, compile=compile)
    seconds = budget
    if unit == "steps":  # a schedule of `budget` steps and no time limit
        size, seconds = dataclasses.replace(size, max_steps=int(budget)), 0.0
    RECIPES[name] = recipe
    data = build_data(Path(out), size, text)
    kind = "warmup" if name.startswith("warmup") else ""
    run_root = Path(out) / "bench-recipe" / kind / f"{name}@{budget:g}{unit}"
    started = time.perf_counter()
    summary = train_within_budget(
        size, data, run_root / "run", seconds, "cpu", run_root / "schedule.json", recipe=name
    )
    valid = np.load(data.valid, mmap_mode="r")
    loss = math.nan if kind == "warmup" else evaluate(load_trained(run_root / "run").model, valid).loss
    trained = TrainConfig.load(run_root / "run" / "config.toml")
    shape = json.loads((run_root / "shape.json").read_text()) if (run_root / "shape.json").exists() else {}
    return {
        "name": name,
        "budget": budget,
        "unit": unit,
        "shape": f"{trained.model.num_layers} layers, batch {trained.training.batch_size}",
        "threads": threads,
        "steps": summary.steps,
        # what the shape rule predicted for the shape it chose (scratchlm.training.sizing), where it chose one
        "predicted_steps": shape.get("steps", {}).get(shape.get("shape")),
        "training_s": summary.wall_time_s,
        "tokens_per_s": summary.tokens / summary.wall_time_s,
        "val_loss": loss,
        "run_dir": str(run_root / "run"),
        "job_s": time.perf_counter() - started,
    }


def run_threads(args: argparse.Namespace) -> int:
    """Each training's threads: `--threads`, else this machine's split evenly between the trainings at a time."""
    return args.threads or max(1, torch.get_num_threads() // args.parallel)


def run_all(jobs: list[tuple[str, dict, float, str]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The jobs, `args.parallel` at a time, each in a fresh process (a fresh torch.compile state)."""
    threads = run_threads(args)
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.parallel, maxtasksperchild=1) as pool:
        pending = [
            pool.apply_async(
                run_job,
                (name, recipe, budget, unit, args.out, args.small, threads, not args.no_compile, args.text),
            )
            for name, recipe, budget, unit in jobs
        ]
        results = []
        for job in pending:
            result = job.get()
            print(
                f"  {result['name']} @ {result['budget']:g} {result['unit']}: {result['steps']} steps, "
                f"val loss {result['val_loss']:.4f}",
                flush=True,
            )
            results.append(result)
    return results


def step_cost(
    args: argparse.Namespace, variants: dict[str, dict], rounds: int = 3, steps: int = 2
) -> dict[str, float]:
    """Seconds per training step of each recipe and variant (the trainer's step: forward and backward in the
    precision "auto" resolves to, clipping, the optimizer), measured in turns in one process so that all see
    the same machine load; median of `rounds` turns of `steps` steps each, after a compiled warm-up."""
    from scratchlm.data.prepare import PreparedData
    from scratchlm.data.tokens import gather_batch, load_tokens, sample_starts
    from scratchlm.model.loss import cross_entropy
    from scratchlm.model.transformer import TransformerLM
    from scratchlm.quickstart import train_config
    from scratchlm.training.grad import clip_grad_norm
    from scratchlm.training.optimizers import build_optimizer

    keep_freed_memory()
    torch.set_flush_denormal(True)
    size = SMALL if args.small else FULL
    data = PreparedData(*(Path(args.out) / "data" / n for n in ("tokenizer", "train.npy", "valid.npy")))
    tokens = load_tokens(data.train, size.vocab_size, size.model["context_length"])
    rng = np.random.default_rng(0)
    trainers = {}
    names = ["spec", "fast"]
    # "auto" as the runs train, at the thread count this process runs with.
    choices = plan(torch.device("cpu"), "auto", threads=torch.get_num_threads())
    precision = choices.precision.value
    if args.ablations:  # each piece's own cost: the fast recipe without it
        variants = {name: merged(RECIPES["fast"], changes) for name, changes in ABLATIONS.items()} | variants
    for name, recipe in variants.items():
        RECIPES[name] = recipe
        names.append(name)
    batch_sizes = {}
    for name in names:
        config = train_config(size, data, Path("unused"), 0.0, "cpu", 1, name)
        batch_sizes[name] = config.training.batch_size
        torch.manual_seed(0)
        model = TransformerLM.from_config(config.model)
        compiled = model if args.no_compile else torch.compile(model)
        trainers[name] = (model, compiled, build_optimizer(config.optimizer, model, precision=precision))

    def one_step(name: str) -> None:
        model, compiled, optimizer = trainers[name]
        starts = sample_starts(len(tokens), batch_sizes[name], size.model["context_length"], rng)
        inputs, targets = gather_batch(tokens, starts, size.model["context_length"], torch.device("cpu"))
        with choices.autocast():
            loss = cross_entropy(compiled(inputs), targets)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for name in trainers:
        for _ in range(3):
            one_step(name)  # compilation and warm-up
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name in trainers:
            start = time.perf_counter()
            for _ in range(steps):
                one_step(name)
            times[name].append((time.perf_counter() - start) / steps)
    print({name: [round(t, 3) for t in ts] for name, ts in times.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


def time_to_loss(target: float, by_fraction: dict[float, float]) -> str:
    """The smallest budget fraction reaching `target`, interpolated linearly in log(budget) between the two
    measured fractions that bracket it."""
    points = sorted(by_fraction.items())
    if points[0][1] <= target:
        return f"≤ {points[0][0]:.2f}"
    for (f0, l0), (f1, l1) in zip(points, points[1:], strict=False):
        if l1 <= target < l0:
            t = (l0 - target) / (l0 - l1)
            return f"{math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0))):.2f}"
    return f"> {points[-1][0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=None,
        help="output directory, data reused (default: runs/quickstart, or runs/recipe-CORPUS)",
    )
    parser.add_argument(
        "--corpus",
        choices=CORPORA,
        default="stdlib",
        help="the text to race on (benchmarks/corpora.py; default stdlib, the quickstart's own corpus)",
    )
    parser.add_argument(
        "--seconds", type=float, default=240.0, help="the full training budget of each recipe"
    )
    parser.add_argument("--fractions", default="0.5", help="budget fractions the fast recipe also runs at")
    parser.add_argument("--spec-lr", type=float, default=FULL.lr, help="the specification recipe's lr")
    parser.add_argument(
        "--spec-lrs", default="", help="a sweep of the specification recipe's lr at the budget"
    )
    parser.add_argument("--only-spec", action="store_true", help="run only the specification's recipe(s)")
    parser.add_argument(
        "--ablations", action="store_true", help="also each piece removed from the fast recipe"
    )
    parser.add_argument("--ablation-fractions", default="1", help="budget fractions the ablations run at")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=section.key=value[,section.key=value]",
        help="a variant of the fast recipe to run at the budget (repeatable)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="a budget of steps instead of seconds (tuning, whatever the load)",
    )
    parser.add_argument(
        "--parallel", type=int, default=1, help="trainings at a time (threads split evenly; default 1)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="each training's threads (default: the cores split evenly)"
    )
    parser.add_argument("--small", action="store_true", help="the quickstart's --small sizes")
    parser.add_argument(
        "--step-cost", action="store_true", help="only measure each recipe's seconds per step, in turns"
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="eager mode: no compilation inside the budgets (on a busy machine it takes a minute of each)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs of this benchmark first")
    parser.add_argument(
        "--warmup",
        type=float,
        default=40.0,
        help="seconds of an untimed training per distinct model (0: none)",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="where results and curves go (default experiments/results/recipe[/CORPUS])",
    )
    args = parser.parse_args()
    stdlib = args.corpus == "stdlib"
    args.out = args.out or ("runs/quickstart" if stdlib else f"runs/recipe-{args.corpus}")
    args.results = args.results or "experiments/results/recipe" + ("" if stdlib else f"/{args.corpus}")
    args.text = None  # the quickstart's own corpus, built by build_data
    if not stdlib:
        source = Path(args.out) / "source" / f"{args.corpus}.txt"
        if not source.exists():
            write_corpus(args.corpus, source)
        args.text = [str(source)]
    variants = {}
    for variant in args.variant:
        name, _, settings = variant.partition("=")
        changes: dict[str, dict[str, Any]] = {}
        for setting in settings.split(","):
            section, key, value = parse_override(setting)
            changes.setdefault(section, {})[key] = value
        variants[name] = merged(RECIPES["fast"], changes)
    if args.step_cost:
        cost = step_cost(args, variants)
        print(f"seconds per step ({torch.get_num_threads()} threads), and relative to the fast recipe's:")
        for name, seconds in cost.items():
            print(f"| {name} | {seconds:.3f} | {seconds / cost['fast']:.2f} |")
        return
    if args.fresh:
        shutil.rmtree(Path(args.out) / "bench-recipe", ignore_errors=True)
    build_data(
        Path(args.out), SMALL if args.small else FULL, args.text
    )  # once, before the processes reuse it

    spec = {"optimizer": {"lr": args.spec_lr, "min_lr": args.spec_lr / 10}}
    fast = RECIPES["fast"]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    ablation_fractions = [float(f) for f in args.ablation_fractions.split(",") if f]
    unit = "steps" if args.steps else "s"
    T = args.steps or args.seconds

    def at(fraction: float) -> float:
        return round(fraction * T) if args.steps else fraction * T

    jobs: list[tuple[str, dict, float, str]] = [("spec", spec, T, unit)]
    for lr in [float(x) for x in args.spec_lrs.split(",") if x]:
        jobs.append((f"spec-lr{lr:g}", {"optimizer": {"lr": lr, "min_lr": lr / 10}}, T, unit))
    if not args.only_spec:
        # The specification's recipe at the shorter budgets too: its own loss against budget, and a partner
        # for each shorter run of the fast recipe when two run at a time.
        jobs.insert(1, ("fast", fast, T, unit))
        for f in fractions:
            jobs += [("spec", spec, at(f), unit)] if args.parallel > 1 else []
            jobs.append(("fast", fast, at(f), unit))
    jobs += [(name, recipe, T, unit) for name, recipe in variants.items()]
    if args.ablations:
        for name, changes in ABLATIONS.items():
            if name == "no-muon":
                changes = merged(changes, {"optimizer": {"lr": args.spec_lr}})
            for f in ablation_fractions:
                jobs.append((name, merged(fast, changes), at(f), unit))

    if args.warmup and not args.no_compile:
        # torch.compile's first compilation of a model is 30-60 s on two cores, later ones in any process a
        # few seconds (inductor's on-disk cache): compile every distinct model once, untimed, so that no run's
        # budget pays for being first. A batch of another size is another compilation too.
        models = {
            json.dumps([recipe.get("model", {}), recipe.get("training", {})], sort_keys=True): recipe
            for _, recipe, _, _ in jobs
        }
        warmups = [(f"warmup{i}", recipe, args.warmup, "s") for i, recipe in enumerate(models.values())]
        shutil.rmtree(Path(args.out) / "bench-recipe" / "warmup", ignore_errors=True)
        print(
            f"compiling {len(warmups)} distinct models ({args.warmup:g} s trainings, not timed)", flush=True
        )
        run_all(warmups, args)
    print(f"{len(jobs)} trainings of at most {T:g} {unit}, {args.parallel} at a time", flush=True)
    results = run_all(jobs, args)
    by_key = {(r["name"], r["budget"]): r for r in results}
    # The specification's recipe at its best learning rate of the sweep: the loss to beat.
    spec_runs = [r for r in results if r["name"].startswith("spec") and r["budget"] == T]
    best_spec = min(spec_runs, key=lambda r: r["val_loss"])
    best_lr = (
        args.spec_lr if best_spec["name"] == "spec" else float(best_spec["name"].removeprefix("spec-lr"))
    )
    target = best_spec["val_loss"]

    threads = run_threads(args)
    print(f"\ncorpus {args.corpus}, seed 0, {args.parallel} training(s) at a time, {threads} thread(s) each")
    print(
        "| recipe | shape | budget | steps | predicted (taken / predicted) | training time | tokens/s "
        "| validation loss (whole file) | time-to-loss |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    names = list(dict.fromkeys(r["name"] for r in results))
    summary: dict[str, Any] = {
        "corpus": args.corpus,
        "budget_s": T,
        "spec_loss": target,
        "spec_best_lr": best_lr,
        "runs": results,
        "time_to_loss": {},
    }
    for name in names:
        mine = {r["budget"] / T: r["val_loss"] for r in results if r["name"] == name}
        ratio = time_to_loss(target, mine) if not name.startswith("spec") else ""
        summary["time_to_loss"][name] = ratio
        for r in (r for r in results if r["name"] == name):
            predicted = r.get("predicted_steps")
            prediction = f"{predicted:,} ({r['steps'] / predicted:.2f})" if predicted else ""
            print(
                f"| {name} | {r['shape']} | {r['budget']:g} {unit} | {r['steps']:,} | {prediction} "
                f"| {r['training_s']:.0f} s | "
                f"{r['tokens_per_s']:,.0f} | {r['val_loss']:.4f} | "
                f"{ratio if r['budget'] == max(mine) * T else ''} |"
            )
    print(f"the specification's best learning rate of the sweep: {best_lr:g} (loss {target:.4f})")
    if ("fast", T) in by_key:
        summary["fast_minus_spec"] = by_key[("fast", T)]["val_loss"] - target
        print(f"fast - spec at {T:g} {unit}: {summary['fast_minus_spec']:+.4f} nats")
    for f in fractions:
        if ("fast", at(f)) in by_key:
            print(
                f"fast at {at(f):g} {unit} - spec at {T:g} {unit}: {by_key[('fast', at(f))]['val_loss'] - target:+.4f} nats"
            )

    results_dir = Path(args.results)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    full = [r for r in results if r["budget"] == T]
    plot_runs([r["run_dir"] for r in full], results_dir / "curves.png", labels=[r["name"] for r in full])
    print(f"wrote {results_dir / 'results.json'} and {results_dir / 'curves.png'}")
    if args.ablations:  # the fast recipe and each piece removed, at each budget the ablations ran at
        for f in ablation_fractions:
            runs = [r for r in results if r["budget"] == at(f) and r["name"] in ("fast", *ABLATIONS)]
            path = results_dir / f"ablations-{at(f):g}{unit}.png"
            plot_runs([r["run_dir"] for r in runs], path, labels=[r["name"] for r in runs])
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
