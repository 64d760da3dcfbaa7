"""Sweeps: train one run per combination of setting values, then tabulate and plot them together.

    scratchlm sweep experiments/base.toml --set optimizer.lr=1e-3,3e-3,1e-2 --set training.batch_size=16,64 \\
        --out runs/lr-batch

Each `--set KEY=V1,V2,...` is one axis of the grid (commas inside `[...]`, `{...}` or quotes do not split, so
`--set optimizer.betas=[0.9,0.95],[0.9,0.99]` has two values); an axis with one value is a fixed override of
every run. `--mode zip` varies the axes together instead (run i takes value i of each), for settings that go
together; `--mode one-at-a-time` runs the base configuration and one run per value with only that setting
changed, an ablation study:

    scratchlm sweep experiments/base.toml --mode zip --set training.batch_size=4,16,64 \\
        --set eval.interval=80,20,5 --out runs/batch      # evaluate every 320 sequences at every batch size
    scratchlm sweep experiments/base.toml --mode one-at-a-time --set model.norm=none,post \\
        --set model.positions=none --set model.ffn=silu --out runs/ablations   # 5 runs: base and 4 ablations

The runs are trained one after another by `scratchlm.training.trainer.train`, each in its own run directory
`OUT/NAME` named after its values (`lr=1e-3_batch_size=16`); OUT must be new, empty or an earlier sweep's
directory. Afterwards `OUT/results.md` holds a markdown table of the final train and validation losses and
`OUT/curves.png` the loss curves of all runs.

A run whose loss becomes non-finite stops, is recorded as diverged, and the sweep goes on (the learning-rate
sweep looks for exactly that edge); a run that ends with a loss above ln(vocab_size), no better than predicting
every token as equally likely, is flagged in the table. The sweep resumes: a run with a `summary.json` is finished and not trained again,
a diverged run stays diverged (its outcome is kept in `OUT/sweep.json`), and an interrupted run continues from
its latest checkpoint. Every configuration is checked before the first run starts, so a mistyped key fails at
once rather than after hours of training.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from scratchlm.console import console, format_seconds
from scratchlm.errors import DivergedError, ScratchlmError
from scratchlm.io import atomic_write, claim_output_dir
from scratchlm.run.summary import StopReason

SWEEP_FILE = "sweep.json"
SWEEP_KIND = "sweep"  # the output marker of a sweep directory (scratchlm.io)
# A run's status in sweep.json is the value of its `StopReason`: "diverged" when training raised DivergedError.
DIVERGED = StopReason.DIVERGED.value
TABLE_FILE = "results.md"
PLOT_FILE = "curves.png"


@dataclass(frozen=True)
class SweepRun:
    name: str  # run directory name under the sweep's output directory
    settings: tuple[tuple[str, str], ...]  # (key, value text) of every axis, fixed ones included
    varied: tuple[tuple[str, str], ...]  # the settings that differ between runs (the table's columns)

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.settings]


def split_values(text: str) -> list[str]:
    """`"1e-3,3e-3"` -> `["1e-3", "3e-3"]`; commas inside brackets, braces or quotes do not split."""
    values, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    values.append("".join(current).strip())
    return values


def parse_axis(spec: str) -> tuple[str, list[str]]:
    """`"optimizer.lr=1e-3,3e-3"` -> `("optimizer.lr", ["1e-3", "3e-3"])`."""
    key, sep, raw = spec.partition("=")
    key = key.strip()
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        raise ScratchlmError(
            f"--set {spec!r} must look like section.key=value1,value2,... (e.g. optimizer.lr=1e-3,3e-3)"
        )
    values = split_values(raw)
    if any(not v for v in values):
        raise ScratchlmError(f"--set {spec!r} has an empty value")
    if len(set(values)) != len(values):
        raise ScratchlmError(f"--set {spec!r} lists a value twice")
    return key, values


def _slug(text: str) -> str:
    """A value as a file-name fragment: `[0.9, 0.95]` -> `0.9-0.95`, `runs/a b` -> `runs-a-b`."""
    return re.sub(r"[^A-Za-z0-9.+_-]+", "-", text).strip("-") or "empty"


MODES = ("grid", "zip", "one-at-a-time")


def build_grid(axes: list[str], name: str | None = None, mode: str = "grid") -> list[SweepRun]:
    """The runs of a sweep, in order. An axis with one value is a fixed setting of every run.

    - "grid": every combination of the axes' values, the last axis varying fastest.
    - "zip": the axes vary together, run i taking value i of every axis (they must have equal lengths);
      for settings that go together, such as a batch size and the step intervals measured in batches.
    - "one-at-a-time" (an ablation study): the base configuration's run, named "base", then one run per
      value of each axis with only that setting changed.
    """
    if mode not in MODES:
        raise ScratchlmError(f"sweep mode must be one of {', '.join(MODES)}; got {mode!r}")
    parsed = [parse_axis(spec) for spec in axes]
    keys = [key for key, _ in parsed]
    if len(set(keys)) != len(keys):
        raise ScratchlmError(f"a key is set twice: {', '.join(keys)}")
    # In an ablation every value is a variation; otherwise a single value is the same for every run.
    varying = [(key, values) for key, values in parsed if len(values) > 1 or mode == "one-at-a-time"]
    fixed = [(key, values[0]) for key, values in parsed if (key, values) not in varying]

    if mode == "grid":
        combinations = [
            tuple(zip([k for k, _ in varying], c, strict=True))
            for c in itertools.product(*(v for _, v in varying))
        ]
    elif mode == "zip":
        lengths = {len(values) for _, values in varying}
        if len(lengths) > 1:
            raise ScratchlmError(
                "--mode zip needs the same number of values for every varied key; got "
                + ", ".join(f"{key}: {len(values)}" for key, values in varying)
            )
        combinations = [
            tuple((key, values[i]) for key, values in varying) for i in range(lengths.pop() if lengths else 1)
        ]
    else:
        combinations = [()] + [((key, value),) for key, values in varying for value in values]
    # Run names use the last part of a key (`lr`) unless two varied keys end the same way. In zip mode the
    # first varied key names the runs (its values are distinct, so the names are too).
    named = [key for key, _ in varying][: 1 if mode == "zip" else None]
    short = {key: key.rpartition(".")[2] for key in named}
    if len(set(short.values())) != len(short):
        short = {key: key for key in named}

    runs = []
    for varied in combinations:
        parts = [f"{short[key]}={_slug(value)}" for key, value in varied if key in short]
        if mode == "one-at-a-time" and not varied:
            parts = ["base"]
        run_name = "_".join(([name] if name else []) + parts) or "run"
        runs.append(SweepRun(run_name, (*fixed, *varied), tuple(varied)))
    return runs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ScratchlmError(f"cannot read {path}: {e}") from None


def run_sweep(
    config_path: str | Path | None,
    axes: list[str],
    out_dir: str | Path,
    name: str | None = None,
    mode: str = "grid",
) -> list[dict[str, Any]]:
    """Train the sweep's runs (skipping finished ones), write `results.md` and `curves.png`; return the rows.

    `axes` are `--set` strings (`"optimizer.lr=1e-3,3e-3"`); see `build_grid` for the modes.
    """
    from scratchlm.experiments.plot import plot_runs
    from scratchlm.run import RunDirectory
    from scratchlm.training.config import TrainConfig
    from scratchlm.training.trainer import train

    out_dir = Path(out_dir)
    runs = build_grid(axes, name, mode)
    configs = [
        TrainConfig.load(
            config_path, [*run.overrides, f"logging.run_dir={json.dumps(str(out_dir / run.name))}"]
        )
        for run in runs
    ]
    claim_output_dir(out_dir, SWEEP_KIND, [config_path] if config_path else [])
    status_path = out_dir / SWEEP_FILE
    outcomes: dict[str, dict[str, Any]] = _read_json(status_path) if status_path.exists() else {}

    for index, (run, config) in enumerate(zip(runs, configs, strict=True), start=1):
        run_dir = RunDirectory(out_dir / run.name)
        # An interrupted run writes its summary too, but it still has steps to train.
        summary = run_dir.summary()
        if summary is not None and summary.stopped is not StopReason.INTERRUPTED:
            outcomes[run.name] = {"status": summary.stopped.value, "summary": summary.to_dict()}
        elif outcomes.get(run.name, {}).get("status") != DIVERGED:
            console.rule(Text(f"run {index}/{len(runs)}: {run.name}", style="bold"))
            try:
                summary = train(config, resume=run_dir.latest_checkpoint() is not None)
                outcomes[run.name] = {"status": summary.stopped.value, "summary": summary.to_dict()}
            except DivergedError as e:
                console.print(f"{run.name}: {e}; going on with the sweep", style="yellow", markup=False)
                outcomes[run.name] = {"status": DIVERGED, "quantity": e.quantity, "step": e.step}
        with atomic_write(status_path, "w") as f:
            json.dump(outcomes, f, indent=2)

    rows = [
        _row(run, outcomes[run.name], config.model.vocab_size)
        for run, config in zip(runs, configs, strict=True)
    ]
    with atomic_write(out_dir / TABLE_FILE, "w") as f:
        f.write(results_table(rows))
    plotted = [(out_dir / run.name, row) for run, row in zip(runs, rows, strict=True)]
    plotted = [(d, row) for d, row in plotted if RunDirectory(d).metrics.exists()]
    if plotted:
        plot_runs(
            [d for d, _ in plotted],
            out_dir / PLOT_FILE,
            labels=[
                row["run"] + (f" ({DIVERGED})" if row["status"] == DIVERGED else "") for _, row in plotted
            ],
            title=name,
        )
    console.print(f"results: {out_dir / TABLE_FILE}, curves: {out_dir / PLOT_FILE}")
    return rows


def _row(run: SweepRun, outcome: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A table row. A run whose loss became non-finite is "diverged"; one that ended above ln(vocab_size), the
    loss of the uniform distribution, gets a note: it is no better than a model that has learnt nothing."""
    row: dict[str, Any] = {"run": run.name, "settings": dict(run.varied), "status": outcome["status"]}
    if outcome["status"] == DIVERGED:
        # A run found diverged by its summary (a sweep started again) has the step there.
        steps = outcome["step"] if "step" in outcome else outcome.get("summary", {}).get("steps")
        step = f" by step {steps}" if steps is not None else ""
        row["note"] = f"non-finite {outcome.get('quantity', 'loss')}{step}"
        return row
    summary = outcome["summary"]
    for key in ("steps", "tokens", "wall_time_s", "final_train_loss", "final_val_loss", "tokens_per_s"):
        row[key] = summary.get(key)
    losses = [row[k] for k in ("final_train_loss", "final_val_loss") if row[k] is not None]
    uniform = math.log(vocab_size)
    if not all(_finite(loss) for loss in losses):
        row["status"], row["note"] = DIVERGED, "non-finite loss"
    elif losses and losses[-1] > uniform:
        row["note"] = f"ended above ln {vocab_size} = {uniform:.2f}: no better than uniform"
    return row


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _loss(value: Any, best: bool = False) -> str:
    if value is None:
        return "–"
    text = f"{value:.4f}" if _finite(value) else str(value)
    return f"**{text}**" if best else text


def results_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one row per run, its varied settings, final losses (best validation loss in bold)."""
    keys = list(dict.fromkeys(key for row in rows for key in row["settings"]))
    finite_val = [row["final_val_loss"] for row in rows if _finite(row.get("final_val_loss"))]
    best = min(finite_val) if finite_val else None
    header = ["run", *keys, "steps", "final train loss", "final val loss", "time", "tokens/s", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row in rows:
        settings = [row["settings"].get(key, "") for key in keys]
        status = f"{row['status']} ({row['note']})" if "note" in row else row["status"]
        if "steps" not in row:  # stopped by a non-finite loss: no summary
            cells = [row["run"], *settings, "–", "–", "–", "–", "–", status]
        else:
            val = row["final_val_loss"]
            cells = [
                row["run"],
                *settings,
                str(row["steps"]),
                _loss(row["final_train_loss"]),
                _loss(val, best=val is not None and val == best),
                format_seconds(row["wall_time_s"]) if _finite(row["wall_time_s"]) else "–",
                f"{row['tokens_per_s']:,.0f}" if _finite(row["tokens_per_s"]) else "–",
                status,
            ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"
