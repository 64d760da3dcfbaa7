"""`scratchlm plot RUN_DIR... --out curves.png [--metric reward]`: loss curves of training runs, overlaid; or
the reward curves of reinforcement learning runs (`scratchlm rl`)."""

from __future__ import annotations

import argparse

HELP = (
    "Plot validation and train loss against steps and wall-clock time for one or more runs (PNG, SVG or PDF)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="training run directories (with metrics.jsonl)"
    )
    parser.add_argument(
        "--out", required=True, metavar="IMAGE", help="output image: .png, .svg or .pdf, e.g. curves.png"
    )
    parser.add_argument(
        "--labels", help="comma-separated legend labels, one per run (default: directory names)"
    )
    parser.add_argument("--title", help="figure title")
    parser.add_argument(
        "--metric",
        choices=("loss", "reward"),
        default="loss",
        help="loss: train and validation loss; reward: an RL run's mean reward and validation pass@1 "
        "(default: loss)",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console
    from scratchlm.experiments.plot import plot_runs

    labels = args.labels.split(",") if args.labels else None
    drawn = plot_runs(args.runs, args.out, labels=labels, title=args.title, metric=args.metric)
    for label, curves in drawn.items():
        val = curves.get("val", {}).get(args.metric)
        final = (
            f"final val loss {val[-1]:.4f}" if args.metric == "loss" else f"final val pass@1 {val[-1]:.1%}"
        )
        console.print(f"{label}: {final}" if val else f"{label}: no validation records")
    console.print(f"wrote {args.out}")
