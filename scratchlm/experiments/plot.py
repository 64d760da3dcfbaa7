"""Loss curves of one or more training runs, read from each run's `metrics.jsonl`, drawn as one image (PNG, SVG or PDF); or, for
reinforcement learning runs (`metric="reward"`), their reward curves.

Two panels share the loss axis: loss against gradient steps (compares sample efficiency) and against training
wall-clock time in minutes (compares what a run costs). Each run has one colour: its validation loss is the
solid line with markers, its training loss the faint line behind it. Points whose loss is not finite (a
diverged run) are left out and the run's label says "diverged"; the loss axis is capped a little above the
runs' typical initial loss, so one run that blew up does not flatten the others into a line.

The metrics are read by `scratchlm.run.read_metrics`, which skips a record still being written, so a run can
be plotted while it trains; each curve takes the records of its kind (`TrainRecord` or `EvalRecord`).

The reward curves are drawn alike: the validation's greedy pass@1 solid, the sampled replies' mean reward faint,
and no cap (a reward does not blow up).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write, check_output_file
from scratchlm.run.metrics import EvalRecord, Record, TrainRecord, read_records

# metric -> curve name -> the record kind and its field
CURVES: dict[str, dict[str, tuple[type[Record], str]]] = {
    "loss": {"train": (TrainRecord, "train_loss"), "val": (EvalRecord, "val_loss")},
    "reward": {"train": (TrainRecord, "reward"), "val": (EvalRecord, "val_pass1")},
}
# metric -> the y axis, and the titles' words for the solid and the faint line
AXES = {
    "loss": ("loss (nats/token)", "validation", "train"),
    "reward": ("reward", "validation pass@1", "train mean reward"),
}


def loss_curves(records: list[Record], metric: str = "loss") -> dict[str, dict[str, list[float]]]:
    """`{"train": {"step", "time", "loss"}, "val": {...}}` from metrics records, all points, file order; with
    `metric="reward"`, the reward curves, under the key "reward"."""
    curves: dict[str, dict[str, list[float]]] = {}
    for name, (kind, field) in CURVES[metric].items():
        points = [r for r in records if isinstance(r, kind) and getattr(r, field) is not None]
        curves[name] = {
            "step": [float(r.step) for r in points],
            "time": [float(r.time) for r in points],
            metric: [float(getattr(r, field)) for r in points],
        }
    return curves


# The image formats a plot is written in, named by the output's suffix, each with the bytes its files begin with
# (how an earlier plot, which may be replaced, is told from other data).
IMAGE_FORMATS = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<?xml", ".pdf": b"%PDF-"}


def image_format(out: str | Path) -> str:
    """The format `out`'s suffix names ("png", "svg" or "pdf"); a one-line error for any other suffix, which
    would otherwise hold an image its name does not say (a PNG named `curves.txt`)."""
    suffix = Path(out).suffix.lower()
    if suffix not in IMAGE_FORMATS:
        raise ScratchlmError(
            f"{out}: a plot is written as {', '.join(IMAGE_FORMATS)}, chosen by the file's suffix; "
            f"got {f'{suffix!r}' if suffix else 'no suffix'}"
        )
    return suffix[1:]


def _is_image(path: Path) -> bool:
    """Whether `path` is an image of its suffix's format (an earlier plot) rather than other data."""
    with open(path, "rb") as f:
        return f.read(16).startswith(IMAGE_FORMATS[path.suffix.lower()])


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    size: tuple[float, float] = (12.0, 4.5),
    dpi: int = 100,
    metric: str = "loss",
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Draw the runs' loss curves (or, `metric="reward"`, reward curves) into the image `out` (PNG, SVG or PDF by its suffix; `size` inches ×
    `dpi` pixels per inch).

    Returns what was drawn, read back from the figure's lines: `{label: {"train"|"val": {"step": [...],
    "minutes": [...], "loss" (or "reward"): [...]}}}` (only the curves a run has, only finite points).
    """
    kind = image_format(out)
    check_output_file(out, previous=_is_image, what=f"a {kind.upper()} image")  # a metrics.jsonl, mistyped
    # A bare Figure on the Agg canvas: no pyplot global state, no display and no GUI toolkit needed.
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise ScratchlmError("plot needs at least one run directory")
    labels = list(labels) if labels is not None else [Path(d).resolve().name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ScratchlmError(f"got {len(labels)} labels for {len(run_dirs)} runs")
    if len(set(labels)) != len(labels):
        raise ScratchlmError(f"run labels must be distinct, got {', '.join(labels)}")

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    by_step, by_time = fig.subplots(1, 2, sharey=True)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(run_dirs) > len(colors):  # a colour each, not a cycle that repeats
        colors = [matplotlib.colormaps["tab20"](i) for i in range(20)]
    drawn: dict[str, dict[str, dict[str, list[float]]]] = {}
    initial_losses: list[float] = []
    finite_min, finite_max = math.inf, -math.inf
    for index, (run_dir, label) in enumerate(zip(run_dirs, labels, strict=True)):
        curves = loss_curves(read_records(run_dir), metric)
        diverged = any(not math.isfinite(v) for curve in curves.values() for v in curve[metric])
        color = colors[index % len(colors)]
        legend = f"{label} (diverged)" if diverged else label
        drawn[label] = {}
        for name, curve in curves.items():
            finite = [i for i, v in enumerate(curve[metric]) if math.isfinite(v)]
            if not finite:
                continue
            steps = [curve["step"][i] for i in finite]
            minutes = [curve["time"][i] / 60 for i in finite]
            losses = [curve[metric][i] for i in finite]
            initial_losses.append(losses[0])
            finite_min, finite_max = min(finite_min, *losses), max(finite_max, *losses)
            # Validation carries the legend entry; a run without validation records shows its training loss.
            is_main = name == "val" or not curves["val"][metric]
            style: dict[str, Any] = (
                {"linewidth": 1.8, "marker": "o", "markersize": 3, "label": legend}
                if name == "val"
                else {"linewidth": 1.0, "alpha": 0.35, "label": legend if is_main else None}
            )
            (step_line,) = by_step.plot(steps, losses, color=color, **style)
            (time_line,) = by_time.plot(minutes, losses, color=color, **style)
            drawn[label][name] = {
                "step": [float(x) for x in step_line.get_xdata()],
                "minutes": [float(x) for x in time_line.get_xdata()],
                metric: [float(y) for y in step_line.get_ydata()],
            }
    if not initial_losses:
        fields = " or ".join(field for _, field in CURVES[metric].values())
        raise ScratchlmError(f"none of the runs has a finite {fields} record to plot")
    # A run that blew up leaves through the top; the others keep the axis. The cap is set by the typical
    # initial loss (the median: a run can blow up before its first record).
    cap = 1.1 * statistics.median(initial_losses)
    if metric == "loss" and finite_max > cap:
        by_step.set_ylim(finite_min - 0.05 * (cap - finite_min), cap)

    _label(fig, by_step, by_time, title, metric)
    with atomic_write(out, "wb") as f:
        fig.savefig(f, format=kind, dpi=dpi)
    return drawn


def _label(fig: Any, by_step: Any, by_time: Any, title: str | None, metric: str) -> None:
    """Axis labels, titles, grid and legend of the two panels."""
    axis_label, solid, faint = AXES[metric]
    by_step.set_xlabel("gradient step")
    by_time.set_xlabel("training wall-clock time (minutes)")
    by_step.set_ylabel(axis_label)
    by_step.set_title(f"{metric} vs steps (solid: {solid}, faint: {faint})", fontsize=10)
    by_time.set_title(f"{metric} vs wall-clock time", fontsize=10)
    for axis in (by_step, by_time):
        axis.grid(True, alpha=0.3)
    by_time.legend(fontsize=8, loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
