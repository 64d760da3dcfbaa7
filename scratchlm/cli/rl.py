"""`scratchlm rl --base CHAT_RUN --data PROMPTS.jsonl [--out DIR] [--valid FILE] [--reward NAME] [--minutes M]
[--config FILE] [--set section.key=value ...] [--resume]`: teach a chat run to get answers right by
reinforcement learning with verifiable rewards (`scratchlm.chat.rl`, docs/rl.md). Ctrl-C and SIGTERM save a
checkpoint, as `train` does; `--resume` continues.

The flags set config keys (named in their help) over the config file's, and `--set` over them.
"""

from __future__ import annotations

import argparse

from scratchlm.cli.sft import add_stage_arguments, check_required, lora_flag
from scratchlm.cli.train import config_flags

HELP = "Train a chat run on prompts with answers, rewarding the replies a program scores right (GRPO)."

# RL_DEFAULTS' logging.run_dir (scratchlm.chat.rl.stage, which imports torch: --help answers without it).
DEFAULT_OUT = "runs/rl"

REQUIRED = {
    "--base": ("rl.base", "the chat run to train"),
    "--data": ("rl.train", "the prompts with their answers (JSONL)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base", metavar="CHAT_RUN", help="the chat run to train (`scratchlm sft`'s): rl.base"
    )
    parser.add_argument(
        "--data",
        metavar="JSONL",
        help='prompts, one {"messages": [... the question last], "answer": "..."} a line: rl.train',
    )
    parser.add_argument(
        "--valid", metavar="JSONL", help="held-out prompts (default: 5%% of --data): rl.valid"
    )
    parser.add_argument(
        "--reward",
        metavar="NAME",
        help="exact, contains, number, regex, or module:function (reply, answer, messages) -> float: rl.reward "
        "(default: the config's, else exact)",
    )
    add_stage_arguments(parser, "RL", DEFAULT_OUT)


def run(args: argparse.Namespace) -> None:
    from scratchlm.chat.rl.stage import rl_config

    own = {
        "--base": ("rl.base", args.base),
        "--data": ("rl.train", args.data),
        "--valid": ("rl.valid", args.valid),
        "--reward": ("rl.reward", args.reward),
        "--lora": lora_flag(args),
    }
    flags = config_flags(args, own)
    check_required(args, flags, REQUIRED)
    config = rl_config(args.config, args.overrides, flags)
    from scratchlm.training.trainer import train

    train(config, resume=args.resume, allow_config_change=args.allow_config_change)
