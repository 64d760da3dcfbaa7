"""`scratchlm train --config FILE [--out DIR] [--minutes M] [--set section.key=value ...] [--resume
[--allow-config-change]]`: train a language model. SIGINT (Ctrl-C), SIGTERM and SIGHUP save a checkpoint after
the current step and exit with 130 / 143 / 129 (docs/stopping.md).

`--out`, `--minutes`, `--device`, `--precision` and `--init-from` are the config keys most often changed, as
flags (docs/cli.md); `--set` overrides any key, after them.

Several processes (GPUs or machines): `torchrun --nproc_per_node K -m scratchlm train --config FILE`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from scratchlm.cli.options import (
    add_config_arguments,
    add_device_argument,
    add_minutes_argument,
    add_out_argument,
    add_precision_argument,
)

# The config key each flag sets on the commands that train (`config_flags`).
CONFIG_KEYS = {
    "out": "logging.run_dir",
    "minutes": "training.max_time_s",
    "device": "training.device",
    "precision": "training.precision",
}


def config_flags(
    args: argparse.Namespace, more: dict[str, tuple[str, Any]] | None = None
) -> dict[str, tuple[str, Any]]:
    """The config keys that the shared flags of a command that trains set (`CONFIG_KEYS`), as
    `TrainConfig.load` takes them: flag as typed -> (key, value); `--minutes` checked and in seconds. `more`:
    the command's own, by flag."""
    from scratchlm.training.config import budget_seconds

    flags = {}
    for name, key in CONFIG_KEYS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "minutes":
            value = budget_seconds(value, unlimited="leave --minutes out for no time limit")
        flags[f"--{name}"] = (key, value)
    return flags | {flag: item for flag, item in (more or {}).items() if item[1] is not None}


HELP = "Train a Transformer language model on token files (.npy), as a TOML config says."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_out_argument(parser, "the run's directory: logging.run_dir (default: the config's)")
    add_minutes_argument(
        parser,
        "time budget in minutes: training.max_time_s = 60 M; the schedule is sized to the steps that fit "
        "(default: the config's)",
    )
    add_device_argument(parser, default=None)
    add_precision_argument(parser, inference=False)
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
    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config import TrainConfig
    from scratchlm.training.config_reader import given_keys

    # Neither a config nor the token files by --set: the first error would be a missing data.train, which
    # does not say that a config is what is missing.
    if args.config is None and not {"data.train", "data.valid"} & given_keys(None, args.overrides):
        raise ScratchlmError(
            "scratchlm train needs --config FILE, a TOML training config: e.g. --config configs/tiny.toml "
            "(configs/ holds examples), or at least --set data.train=TOKENS.npy --set data.valid=TOKENS.npy"
        )
    flags = config_flags(args, {"--init-from": ("training.init_from", args.init_from)})
    if args.config is not None:
        _check_pretraining(Path(args.config))
    config = TrainConfig.load(args.config, args.overrides, flags=flags)  # reported before torch loads
    from scratchlm.training.trainer import train

    train(config, resume=args.resume, allow_config_change=args.allow_config_change)


def _check_pretraining(path: Path) -> None:
    """A config whose stage is another command's (`[sft]`: fine-tuning) is refused with that command."""
    from scratchlm.cli import COMMANDS
    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config import SECTIONS
    from scratchlm.training.config_reader import read_toml

    for section in read_toml(path):
        if section in COMMANDS and section not in SECTIONS:
            raise ScratchlmError(
                f"{path}: a config with [{section}] is for `scratchlm {section}`: run `scratchlm {section} "
                "--config FILE`"
            )
