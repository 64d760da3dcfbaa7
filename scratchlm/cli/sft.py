"""`scratchlm sft --base RUN --data CONVERSATIONS.jsonl --out RUN [--valid FILE] [--minutes M] [--config FILE]
[--set section.key=value ...] [--resume]`: fine-tune a base run to chat (`scratchlm.chat.sft`). Ctrl-C and
SIGTERM save a checkpoint, as `train` does; `--resume` continues.
"""

from __future__ import annotations

import argparse
import json

from scratchlm.cli.options import add_config_arguments

HELP = "Fine-tune a base run on conversations (JSONL, OpenAI's messages format) into a chat model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", metavar="RUN", help="the run (or imported model) to fine-tune: sft.base")
    parser.add_argument(
        "--data",
        metavar="JSONL",
        help='conversations, one {"messages": [{"role": ..., "content": ...}, ...]} a line: sft.train',
    )
    parser.add_argument(
        "--valid", metavar="JSONL", help="held-out conversations (default: 5%% of --data): sft.valid"
    )
    parser.add_argument("--out", metavar="DIR", help="the fine-tuning run's directory: logging.run_dir")
    parser.add_argument(
        "--minutes", type=float, metavar="M", help="time budget in minutes: training.max_time_s = 60 M"
    )
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the config differs from the one the run trained with",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.errors import ScratchlmError

    flags = {
        "sft.base": args.base,
        "sft.train": args.data,
        "sft.valid": args.valid,
        "logging.run_dir": args.out,
    }
    overrides = [f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    if args.minutes is not None:
        if not args.minutes > 0:
            raise ScratchlmError(f"--minutes must be positive, got {args.minutes}")
        overrides.append(f"training.max_time_s={args.minutes * 60}")
    from scratchlm.chat.sft import sft_config

    config = sft_config(args.config, [*overrides, *args.overrides])
    from scratchlm.training.trainer import train

    train(config, resume=args.resume, allow_config_change=args.allow_config_change)
