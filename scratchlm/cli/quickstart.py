"""`scratchlm quickstart`: from nothing to a model that writes text, in one command and without a download."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_device_argument

HELP = (
    "Train a tokenizer and a small model on the Python standard library's sources (or on your own text), "
    "evaluate and sample."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="runs/quickstart", metavar="DIR", help="output directory (default: runs/quickstart)"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=5.0,
        metavar="M",
        help="training time of the model in minutes (default: 5)",
    )
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
        default=3.0,
        metavar="M",
        help="with --chat: fine-tuning time in minutes (default: 3)",
    )
    add_device_argument(parser)


def run(args: argparse.Namespace) -> None:
    from scratchlm.quickstart import quickstart

    quickstart(
        args.out,
        minutes=args.minutes,
        small=args.small,
        device=args.device,
        recipe=args.recipe,
        text=args.text,
        chat_minutes=args.chat_minutes if args.chat else None,
    )
