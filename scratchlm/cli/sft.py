"""`scratchlm sft --base RUN --data CONVERSATIONS.jsonl [--out DIR] [--valid FILE] [--minutes M] [--lora RANK]
[--config FILE] [--set section.key=value ...] [--resume]`: fine-tune a base run to chat (`scratchlm.chat.sft`). Ctrl-C and
SIGTERM save a checkpoint, as `train` does; `--resume` continues.

The flags set config keys (named in their help) over the config file's, and `--set` over them.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.options import (
    add_config_arguments,
    add_device_argument,
    add_minutes_argument,
    add_out_argument,
    add_precision_argument,
)
from scratchlm.cli.train import config_flags

HELP = "Fine-tune a base run on conversations (JSONL, OpenAI's messages format) into a chat model."

# SFT_DEFAULTS' logging.run_dir (scratchlm.chat.sft, which imports torch: --help answers without it).
DEFAULT_OUT = "runs/sft"

# The flags a fine-tuning run cannot do without, unless the config (or a --set) gives their key.
REQUIRED = {
    "--base": ("sft.base", "the run (or imported model) to fine-tune"),
    "--data": ("sft.train", "the conversations to fine-tune on (JSONL)"),
}


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
    add_stage_arguments(parser, "fine-tuning", DEFAULT_OUT)


def add_stage_arguments(parser: argparse.ArgumentParser, what: str, default_out: str) -> None:
    """The options every stage on top of a run shares (`sft`, `rl`): where its run goes, its time budget,
    device and precision, the config with `--set`, and resuming."""
    add_out_argument(
        parser, f"the {what} run's directory: logging.run_dir (default: the config's, else {default_out})"
    )
    add_minutes_argument(
        parser, "time budget in minutes: training.max_time_s = 60 M (default: the config's, else none)"
    )
    add_device_argument(parser, default=None)
    add_precision_argument(parser, inference=False)
    parser.add_argument(
        "--lora",
        metavar="RANK",
        type=int,
        help="train low-rank adapters of rank RANK on every block matrix of the frozen base instead of all its "
        "weights: lora.rank (default: the config's, else 0: every weight)",
    )
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although the config differs from the one the run trained with",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.chat.sft import sft_config

    own = {
        "--base": ("sft.base", args.base),
        "--data": ("sft.train", args.data),
        "--valid": ("sft.valid", args.valid),
        "--lora": lora_flag(args),
    }
    flags = config_flags(args, own)
    check_required(args, flags, REQUIRED)
    from scratchlm.chat.rate import choose_rate
    from scratchlm.training.trainer import train

    config = choose_rate(sft_config(args.config, args.overrides, flags), resume=args.resume)

    train(config, resume=args.resume, allow_config_change=args.allow_config_change)


def lora_flag(args: argparse.Namespace) -> tuple[str, int | None]:
    """`--lora RANK` as the config key it sets; a rank below 1 is refused, naming it."""
    from scratchlm.errors import ScratchlmError

    if args.lora is not None and args.lora < 1:
        raise ScratchlmError(
            f"--lora {args.lora}: the adapters' rank must be a positive integer (leave --lora out to train "
            "every weight)"
        )
    return "lora.rank", args.lora


def check_required(args: argparse.Namespace, flags: dict, required: dict[str, tuple[str, str]]) -> None:
    """Name a missing `required` flag (flag -> its key, what it is) as the flag, before the config's checks
    would name its key."""
    from scratchlm.errors import ScratchlmError
    from scratchlm.training.config_reader import given_keys

    given = given_keys(args.config, args.overrides)
    for flag, (key, what) in required.items():
        if flag not in flags and key not in given:
            raise ScratchlmError(f"{flag} is required: {what} (or {key} in the --config file)")
