"""Fine-tuning to chat and reinforcement learning, in figures: a base model, its chat model and the chat model
after RL on the held-out built-in conversations.

Runs `scratchlm quickstart --chat` (the standard library corpus, the base model trained for `--minutes`, then
fine-tuned for `--chat-minutes` on the built-in conversations of scratchlm.chat.tasks; with `--rl-minutes M`,
`--rl` too: the chat model trained for M minutes by reinforcement learning with an exact-match reward on the same
tasks) and prints, for the base model prompted with the same chat template, the fine-tuned one and the RL one:

    exact match      the share of held-out conversations whose last answer is reproduced exactly (greedy)
    assistant loss   the mean loss of the assistant's tokens of the held-out conversations, nats/token

against the targets (at least 50 % after fine-tuning, at most 5 % before, within the quickstart's time on two
cores, RL's minutes aside), with the wall-clock time of the whole pipeline. The figures are also written as JSON.

    python benchmarks/bench_chat.py                       # 5 + 3 minutes of training, about 10 minutes in all
    python benchmarks/bench_chat.py --rl-minutes 3        # and the RL column: 3 more minutes
    python benchmarks/bench_chat.py --out runs/bench-chat --json experiments/results/chat/zen4.json

Every stage reuses what an earlier call with the same --out finished; delete --out to measure again.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from scratchlm.device.host import cpu_name_and_flags
from scratchlm.io import atomic_write
from scratchlm.quickstart import quickstart

TARGET_AFTER, TARGET_BEFORE, TARGET_MINUTES = 0.50, 0.05, 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-chat", help="the quickstart's output directory")
    parser.add_argument("--minutes", type=float, default=5.0, help="base training (default 5)")
    parser.add_argument("--chat-minutes", type=float, default=3.0, help="fine-tuning (default 3)")
    parser.add_argument(
        "--rl-minutes", type=float, default=0.0, help="reinforcement learning (default 0: none)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    rl_minutes = args.rl_minutes or None
    result = quickstart(
        args.out,
        minutes=args.minutes,
        device=args.device,
        chat_minutes=args.chat_minutes,
        rl_minutes=rl_minutes,
    )
    chat = result.chat
    assert chat is not None
    minutes = result.wall_seconds / 60
    rl = chat.rl_run_dir is not None
    rows = [
        ("exact match", chat.exact_match_before, chat.exact_match_after, chat.exact_match_rl, ".1%"),
        ("assistant loss (nats/token)", chat.loss_before, chat.loss_after, chat.loss_rl, ".4f"),
    ]
    name, flags = cpu_name_and_flags()
    print(
        f"\n{chat.test_conversations} held-out conversations; {name} ({', '.join(flags) or 'no bf16 flags'})"
    )
    print(f"{'':<28} {'base':>8} {'chat':>8}" + (f" {'RL':>8}" if rl else ""))
    for name, before, after, after_rl, shown in rows:
        print(f"{name:<28} {before:>8{shown}} {after:>8{shown}}" + (f" {after_rl:>8{shown}}" if rl else ""))
    limit = TARGET_MINUTES + (args.rl_minutes if rl else 0)
    checks = {
        f"exact match after >= {TARGET_AFTER:.0%}": chat.exact_match_after >= TARGET_AFTER,
        f"exact match before <= {TARGET_BEFORE:.0%}": chat.exact_match_before <= TARGET_BEFORE,
        f"whole pipeline <= {limit:.0f} minutes ({minutes:.1f})": minutes <= limit,
    }
    for name, held in checks.items():
        print(f"{'met' if held else 'NOT MET':>8}  {name}")
    print(
        f"base: {result.steps:,} steps in {result.training_seconds:.0f} s; chat: {chat.steps:,} steps in "
        f"{chat.training_seconds:.0f} s"
        + (f"; RL: {chat.rl_steps:,} steps in {chat.rl_training_seconds:.0f} s" if rl else "")
        + f"; the whole pipeline {minutes:.1f} minutes"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(args.json, "w") as f:
            json.dump({**asdict(result), "checks": checks}, f, indent=2)


if __name__ == "__main__":
    main()
