"""The options that pick a trained model, shared by the commands that load one (`eval`, `generate`)."""

from __future__ import annotations

import argparse


def add_model_source_arguments(parser: argparse.ArgumentParser) -> None:
    """`--run DIR` or `--checkpoint FILE` (exactly one), and `--device`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="training run directory (its latest checkpoint)")
    source.add_argument("--checkpoint", metavar="FILE", help="checkpoint file (.pt)")
    parser.add_argument(
        "--device", default="auto", help="auto (cuda, mps, cpu), cpu, cuda, ... (default auto)"
    )
