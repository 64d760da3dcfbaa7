"""Fine-tuning to chat, in figures: a base model and its chat model on the held-out built-in conversations.

Runs `scratchlm quickstart --chat` (the standard library corpus, the base model trained for `--minutes`, then
fine-tuned for `--chat-minutes` on the built-in conversations of scratchlm.chat.tasks) and prints, for the base
model prompted with the same chat template and for the fine-tuned one:

    exact match      the share of held-out conversations whose last answer is reproduced exactly (greedy)
    assistant loss   the mean loss of the assistant's tokens of the held-out conversations, nats/token

against the targets (at least 50 % after fine-tuning, at most 5 % before, within the quickstart's time on two
cores), with the wall-clock time of the whole pipeline. The figures are also written as JSON.

    python benchmarks/bench_chat.py                       # 5 + 3 minutes of training, about 10 minutes in all
    python benchmarks/bench_chat.py --out runs/bench-chat --json experiments/results/chat/zen4.json

Every stage reuses what an earlier call with the same --out finished; delete --out to measure again.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from scratchlm.device.profile import cpu_name_and_flags
from scratchlm.io import atomic_write
from scratchlm.quickstart import quickstart

TARGET_AFTER, TARGET_BEFORE, TARGET_MINUTES = 0.50, 0.05, 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-chat", help="the quickstart's output directory")
    parser.add_argument("--minutes", type=float, default=5.0, help="base training (default 5)")
    parser.add_argument("--chat-minutes", type=float, default=3.0, help="fine-tuning (default 3)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    result = quickstart(args.out, minutes=args.minutes, device=args.device, chat_minutes=args.chat_minutes)
    chat = result.chat
    assert chat is not None
    minutes = result.wall_seconds / 60
    rows = [
        ("exact match", f"{chat.exact_match_before:.1%}", f"{chat.exact_match_after:.1%}"),
        ("assistant loss (nats/token)", f"{chat.loss_before:.4f}", f"{chat.loss_after:.4f}"),
    ]
    name, flags = cpu_name_and_flags()
    print(
        f"\n{chat.test_conversations} held-out conversations; {name} ({', '.join(flags) or 'no bf16 flags'})"
    )
    print(f"{'':<28} {'base':>8} {'chat':>8}")
    for name, before, after in rows:
        print(f"{name:<28} {before:>8} {after:>8}")
    checks = {
        f"exact match after >= {TARGET_AFTER:.0%}": chat.exact_match_after >= TARGET_AFTER,
        f"exact match before <= {TARGET_BEFORE:.0%}": chat.exact_match_before <= TARGET_BEFORE,
        f"whole pipeline <= {TARGET_MINUTES:.0f} minutes ({minutes:.1f})": minutes <= TARGET_MINUTES,
    }
    for name, held in checks.items():
        print(f"{'met' if held else 'NOT MET':>8}  {name}")
    print(
        f"base: {result.steps:,} steps in {result.training_seconds:.0f} s; chat: {chat.steps:,} steps in "
        f"{chat.training_seconds:.0f} s; the whole pipeline {minutes:.1f} minutes"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.json, "w") as f:
            json.dump({**asdict(result), "checks": checks}, f, indent=2)


if __name__ == "__main__":
    main()
