"""`scratchlm quickstart`: from nothing to a model that writes text, in one command and without a download."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import (
    add_device_argument,
    add_minutes_argument,
    add_out_argument,
    rerun_to_continue,
)

CHAT_MINUTES = 3.0  # --chat's fine-tuning time
RL_MINUTES = 3.0  # --rl's reinforcement learning time
HELP = (
    "Train a tokenizer and a small model on the Python standard library's sources (or on your own text), "
    "evaluate and sample."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_out_argument(parser, "output directory", default="runs/quickstart")
    add_minutes_argument(parser, "training time of the model in minutes", default=5.0)
    parser.add_argument(
        "--small",
        action="store_true",
        help="a tiny corpus, vocabulary and model: the whole pipeline in seconds",
    )
    parser.add_argument(
        "--recipe",
        choices=("fast", "spec"),
        default="fast",
        help="fast: Muon, QK-norm, ReLU², zero init, logit soft-capping, WSD schedule (docs/experiments.md); "
        "spec: the AdamW + cosine of the CS336 assignment-1 handout (default: fast)",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        metavar="PATH",
        help="train on your own UTF-8 text: files or directories; documents are separated by <|endoftext|> "
        "where it appears, else one per file; about 5%% of them are held out for validation",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="then fine-tune the model to chat on built-in conversations, score it and show a conversation",
    )
    parser.add_argument(
        "--chat-minutes",
        type=float,
        metavar="M",
        help=f"with --chat: fine-tuning time in minutes (default: {CHAT_MINUTES:g})",
    )
    parser.add_argument(
        "--rl",
        action="store_true",
        help="with --chat: then train the chat model by reinforcement learning on the same tasks (exact-match "
        "reward) and score the base, chat and RL models on the same held-out conversations",
    )
    parser.add_argument(
        "--rl-minutes",
        type=float,
        metavar="M",
        help=f"with --rl: its time in minutes (default: {RL_MINUTES:g})",
    )
    add_device_argument(parser)


def run(args: argparse.Namespace) -> None:
    from scratchlm.errors import ScratchlmError
    from scratchlm.quickstart import quickstart
    from scratchlm.training.report import resume_hint

    if args.chat_minutes is not None and not args.chat:
        raise ScratchlmError("--chat-minutes is the fine-tuning time of --chat: add --chat, or leave it out")
    if args.rl_minutes is not None and not args.rl:
        raise ScratchlmError("--rl-minutes is the time of --rl: add --rl, or leave it out")
    # An interrupted quickstart resumes when the same command runs again (it has no --resume).
    with resume_hint(rerun_to_continue(args)):
        quickstart(
            args.out,
            minutes=args.minutes,
            small=args.small,
            device=args.device,
            recipe=args.recipe,
            text=args.text,
            chat_minutes=(args.chat_minutes or CHAT_MINUTES) if args.chat else None,
            rl_minutes=(args.rl_minutes or RL_MINUTES) if args.rl else None,
        )
