"""`scratchlm train --config FILE [--set section.key=value ...] [--resume [--allow-config-change]]`: train a
language model. SIGINT (Ctrl-C), SIGTERM and SIGHUP save a checkpoint after the current step and exit with
130 / 143 / 129 (docs/stopping.md).

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
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the config differs from the one the run trained with (beyond "
        "the step/token/time budget, device, eval, checkpoint and logging settings, which may always change)",
    )
    parser.add_argument(
        "--init-from",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="start from these weights with a fresh optimizer (fine-tuning, continued pretraining; e.g. a run "
        "written by `scratchlm import-hf`); the same as --set training.init_from=PATH",
    )


def run(args: argparse.Namespace) -> None:
    import json

    from scratchlm.training.config import TrainConfig

    overrides = list(args.overrides)
    if args.init_from is not None:
        # As a TOML string, whatever the path looks like.
        overrides.append(f"training.init_from={json.dumps(args.init_from)}")
    config = TrainConfig.load(args.config, overrides)  # a mistake in it is reported before torch loads
    if config.sft.train:
        from scratchlm.errors import ScratchlmError

        raise ScratchlmError(
            f"{args.config}: a config with [sft] fine-tunes: run `scratchlm sft --config FILE`"
        )
    from scratchlm.training.trainer import train

    train(config, resume=args.resume, allow_config_change=args.allow_config_change)
