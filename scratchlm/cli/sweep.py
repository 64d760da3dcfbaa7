"""`scratchlm sweep CONFIG --set KEY=V1,V2,... --out DIR`: train a grid of runs, tabulate and plot them."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_config_arguments

HELP = "Train one run per combination of --set values; write a results table (markdown) and loss curves."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, sweep=True)
    parser.add_argument(
        "--mode",
        choices=["grid", "zip", "one-at-a-time"],
        default="grid",
        help="grid: every combination of the values (default); zip: run i takes value i of every --set; "
        "one-at-a-time: the base config plus one run per value, changing only that setting (ablations)",
    )
    parser.add_argument("--name", help="prefix of the run directory names and title of the plot")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="sweep directory (one run directory per run)"
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.experiments.sweep import run_sweep

    run_sweep(args.config, args.axes, args.out, name=args.name, mode=args.mode)
