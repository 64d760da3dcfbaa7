"""The fine-tuning rate, measured on the user's own held-out conversations.

No one rate suits every base and every set of conversations. On the built-in tasks the quickstart's model
fine-tunes best at 8e-3 (docs/chat.md); a rate meant to be safe for any base (1e-3) leaves a small base
far from what it can reach; a larger base or a larger batch wants less. So unless the user gives
`optimizer.lr`, `scratchlm sft` measures it before it trains:

    for each rate of sft.lr_candidates (the gains' rate; the other groups keep the base's proportions):
        fine-tune the base in a short run: the run's own data, batch and schedule, sft.lr_sweep_fraction of its
        budget (of the time budget when it has one, else of max_steps) shared among the candidates
        score it by its assistant loss on the held-out conversations (a run that diverges scores infinity)
    train the run at the rate of the lowest loss, in the budget left (of the time, or of max_steps)

The held-out loss, not the training loss, decides: on conversations over words the training conversations never
use, a high rate fits the training set and copies nothing new, which only the held-out loss shows. The short
runs are ordinary runs in `RUN/lr-sweep/lr-RATE` (their metrics kept to plot, their checkpoints deleted when
they end); the choice and every loss are printed, written to `RUN/lr-sweep/sweep.json` and recorded in the
run's config (`sft.lr_chosen`). An interrupted sweep continues where it stopped with `--resume`; a resumed run
keeps the rate it chose.
"""

from __future__ import annotations

import json
import math
import shutil
import time

from scratchlm.chat.conversations import read_conversations
from scratchlm.chat.sft import at_rate
from scratchlm.console import console
from scratchlm.errors import DivergedError
from scratchlm.io import atomic_write, claim_output_dir
from scratchlm.run.directory import RUN_KIND, RunDirectory
from scratchlm.run.summary import StopReason
from scratchlm.training.config import TrainConfig
from scratchlm.training.config_reader import read_toml
from scratchlm.training.trainer import train

SWEEP_DIR = "lr-sweep"  # the short runs' directory, in the run's
# The least of the time budget left to the run itself, whatever the short runs took.
LEAST_LEFT = 0.5


def choose_rate(config: TrainConfig, resume: bool = False) -> TrainConfig:
    """`config` with `optimizer.lr` (and the rates that follow it) chosen, and the choice recorded in
    `sft.lr_chosen`: the user's, the default, the one a resumed run chose, or the measured one."""
    if config.sft.lr_chosen:
        _announce(config)
        return config
    run = RunDirectory(config.logging.run_dir)
    if resume and run.config.is_file():
        recorded = read_toml(run.config)
        values = config.to_dict()
        values["optimizer"] = recorded["optimizer"]
        values["sft"]["lr_chosen"] = recorded.get("sft", {}).get("lr_chosen", "")
        values["training"]["max_time_s"] = recorded["training"].get("max_time_s", 0.0)
        chosen = TrainConfig.from_dict(values, f"{run.config}")
        _announce(chosen)
        return chosen
    return _sweep(config, run)


def _sweep(config: TrainConfig, run: RunDirectory) -> TrainConfig:
    for conversations in filter(None, (config.sft.train, config.sft.valid)):
        read_conversations(conversations)  # a bad line is named before anything is written
    claim_output_dir(run.path, RUN_KIND)
    sweep_dir = run.path / SWEEP_DIR
    candidates = sorted(set(config.sft.lr_candidates))
    share = config.sft.lr_sweep_fraction / len(candidates)
    budget = config.training.max_time_s
    console.print(
        f"choosing the rate: a short run at each of {', '.join(f'{lr:g}' for lr in candidates)}, "
        f"{share:.0%} of the {'time budget' if budget else 'steps'} each, scored by held-out assistant loss"
    )
    started, losses, steps = time.monotonic(), {}, None
    for lr in candidates:  # the first sets the steps of the others: each the same miniature of the run
        losses[lr], steps = _short_run(config, RunDirectory(sweep_dir / f"lr-{lr:g}"), lr, share, steps)
    spent = time.monotonic() - started
    best = min(candidates, key=lambda lr: losses[lr])
    if not math.isfinite(losses[best]):
        best = min(candidates)  # every one diverged: the most cautious
    table = ", ".join(f"{lr:g}: {_shown(loss)}" for lr, loss in losses.items())
    with atomic_write(sweep_dir / "sweep.json", "w") as f:
        shown = {
            f"{lr:g}": loss if math.isfinite(loss) else None for lr, loss in losses.items()
        }  # None: diverged
        json.dump({"losses": shown, "chosen": best}, f, indent=2)
    values = config.to_dict()
    values["optimizer"] = at_rate(values["optimizer"], best)
    values["sft"]["lr_chosen"] = f"the lowest held-out loss of a sweep ({table})"
    t = values["training"]  # the budget left: `sft --minutes 3` takes three minutes in all
    if budget:
        t["max_time_s"] = max(budget - spent, LEAST_LEFT * budget)
    else:
        t["max_steps"] = max(
            t["max_steps"] - (steps or 0) * len(candidates), math.ceil(LEAST_LEFT * t["max_steps"])
        )
    chosen = TrainConfig.from_dict(values, "sft config")
    console.print(f"held-out assistant loss after the short runs: {table} -> lr {best:g}")
    _announce(chosen)
    return chosen


def _short_run(
    config: TrainConfig, run: RunDirectory, lr: float, share: float, steps: int | None
) -> tuple[float, int | None]:
    """The held-out loss after fine-tuning at `lr` in `run` for `steps`, or when None for `share` of
    `config`'s budget (reused when it finished before, continued when it was interrupted), infinity when it
    diverged; and the steps it took (None when it diverged)."""
    summary = run.summary()
    if summary is not None and summary.stopped is not StopReason.INTERRUPTED:
        loss = _score(summary.final_val_loss, summary.stopped)
        return loss, summary.steps if math.isfinite(loss) else steps
    values = config.to_dict()
    values["optimizer"] = at_rate(values["optimizer"], lr)
    values["logging"]["run_dir"] = str(run.path)
    values["sft"]["lr_chosen"] = "sweep"
    t, schedule = values["training"], values["schedule"]
    t["max_steps"] = steps or max(1, math.ceil(t["max_steps"] * share))
    t["max_time_s"] = t["max_time_s"] * share if t["max_time_s"] and not steps else 0.0
    schedule["warmup_iters"] = max(1, round(schedule["warmup_iters"] * share))  # the run's, in miniature
    values["checkpoint"]["interval"] = 0  # one checkpoint, at its end (for --resume), deleted once scored
    console.rule(f"lr {lr:g}")
    short = TrainConfig.from_dict(values, "sft config")
    try:
        summary = train(short, resume=run.latest_checkpoint() is not None)
        if summary.final_val_loss is None:  # stopped by a signal after its last step, before its evaluation
            shutil.rmtree(run.path)
            summary = train(short)
    except DivergedError:
        loss, taken = math.inf, steps
    else:
        loss, taken = _score(summary.final_val_loss, summary.stopped), summary.steps
    shutil.rmtree(run.checkpoints_dir, ignore_errors=True)
    console.print(f"lr {lr:g}: held-out assistant loss {_shown(loss)}")
    return loss, taken


def _score(loss: float | None, stopped: StopReason) -> float:
    if stopped is StopReason.DIVERGED or loss is None or not math.isfinite(loss):
        return math.inf
    return loss


def _shown(loss: float) -> str:
    return f"{loss:.4f}" if math.isfinite(loss) else "diverged"


def _announce(config: TrainConfig) -> None:
    """Say which optimizer, at which rates, and why."""
    o, why = config.optimizer, config.sft.lr_chosen
    rates = {"gains": o.lr, "embeddings": o.embedding_lr or o.lr, "head": o.head_lr or o.lr}
    rates["matrices"] = o.muon_lr if o.name == "muon" else o.lr
    reason = {"given": "as given", "default": "the default (sft.lr_sweep_fraction = 0)"}.get(why, why)
    console.print(
        f"optimizer: {o.name}, peak rates "
        + ", ".join(f"{g} {r:g}" for g, r in rates.items())
        + f"; lr: {reason}"
    )
