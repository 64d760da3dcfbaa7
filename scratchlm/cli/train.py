"""`scratchlm train --config FILE [--set section.key=value ...] [--resume]`: train a language model.

Several processes (GPUs or machines): `torchrun --nproc_per_node K -m scratchlm train --config FILE`.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_config_arguments

HELP = "Train a Transformer language model on token files (.npy), as a TOML config says."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--resume", action="store_true", help="continue the run in logging.run_dir from its latest checkpoint"
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.training.config import TrainConfig
    from scratchlm.training.trainer import train

    train(TrainConfig.load(args.config, args.overrides), resume=args.resume)
