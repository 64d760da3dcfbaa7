"""`scratchlm sweep CONFIG --set KEY=V1,V2,... --out DIR`: train a grid of runs, tabulate and plot them. The
config may also be given as `--config CONFIG`, as to `train`. An interrupted sweep continues when the same
command runs again."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_config_arguments, add_out_argument, rerun_to_continue

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
    add_out_argument(parser, "sweep directory (one run directory per run)", required=True)


def run(args: argparse.Namespace) -> None:
    from scratchlm.errors import ScratchlmError
    from scratchlm.experiments.sweep import run_sweep
    from scratchlm.training.report import resume_hint

    if (args.config is None) == (args.config_option is None):
        raise ScratchlmError("give the base config once: as CONFIG or as --config CONFIG")
    with resume_hint(rerun_to_continue(args)):
        run_sweep(args.config or args.config_option, args.axes, args.out, name=args.name, mode=args.mode)
