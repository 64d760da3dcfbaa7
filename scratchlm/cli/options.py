"""Options shared by several commands, defined once: the trained model to load (`eval`, `generate`), the
device, and the repeatable `--set` of the commands that take a training config (`train`, `sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scratchlm.run.load import TrainedModel


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps (default: auto)",
    )


def add_model_source_arguments(parser: argparse.ArgumentParser) -> None:
    """`--run DIR` or `--checkpoint FILE` (exactly one), and `--device`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="training run directory (its latest checkpoint)")
    source.add_argument("--checkpoint", metavar="FILE", help="checkpoint file (.pt)")
    add_device_argument(parser)


def add_set_argument(parser: argparse.ArgumentParser, dest: str, metavar: str, help: str) -> None:
    parser.add_argument("--set", dest=dest, metavar=metavar, action="append", default=[], help=help)


def load_model_source(args: argparse.Namespace, tokenizer: str | None = None) -> TrainedModel:
    """The model `--run` or `--checkpoint` names, on `--device`, with its tokenizer (`tokenizer`, else the
    run's own; see `scratchlm.run.load_trained`)."""
    from scratchlm.device import resolve_device
    from scratchlm.errors import ScratchlmError
    from scratchlm.run.load import load_trained

    if args.run is not None and not Path(args.run).is_dir():
        what = "is not a directory" if Path(args.run).exists() else "not found"
        raise ScratchlmError(f"run directory {args.run} {what} (--run takes a training run directory)")
    if args.checkpoint is not None and not Path(args.checkpoint).is_file():
        what = "is not a file" if Path(args.checkpoint).exists() else "not found"
        raise ScratchlmError(f"checkpoint {args.checkpoint} {what} (--checkpoint takes a .pt file)")
    device = resolve_device(args.device)
    return load_trained(args.run or args.checkpoint, device=device, tokenizer=tokenizer)
