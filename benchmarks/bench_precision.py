"""What precision "auto" picks against the best of fp32 and bf16, on the quickstart's training step.

For each recipe of the quickstart (its model, batch, optimizer: Muon's iteration included), the trainer's step
(forward and backward under the precision's autocast, clipping, the optimizer) is timed in fp32, in bf16 and
in what `training.precision = "auto"` resolves to on this device, in turns so that all three see the same
machine load. The target: "auto" is never more than 1.5x slower than the faster of fp32 and bf16.

    python benchmarks/bench_precision.py                 # eager, both recipes
    python benchmarks/bench_precision.py --compile       # compiled (adds a compilation per precision)
    python benchmarks/bench_precision.py --device cuda

A bf16 step on a CPU without native bf16 takes seconds; each precision is timed for at least `--seconds` (and
two steps) in each of `--rounds` turns.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from scratchlm.allocator import keep_freed_memory
from scratchlm.data.prepare import PreparedData
from scratchlm.device import apply_threads, plan, resolve_device
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.quickstart import FULL, RECIPES, train_config
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.optimizers import build_optimizer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """The quickstart's `recipe` model and optimizer, stepping in `precision` (random tokens)."""

    def __init__(self, recipe: str, precision: str, device: torch.device, compile_: bool) -> None:
        data = PreparedData(Path("unused"), Path("unused"), Path("unused"))
        config = train_config(FULL, data, Path("unused"), 0.0, str(device), 1, recipe)
        torch.manual_seed(0)
        self.model = TransformerLM.from_config(config.model, device=device)
        self.forward = torch.compile(self.model) if compile_ else self.model
        self.optimizer = build_optimizer(config.optimizer, self.model, precision=precision)
        batch, context = config.training.batch_size, config.model.context_length
        self.ids = torch.randint(0, config.model.vocab_size, (batch, context + 1), device=device)
        # Its own plan for `precision`, at the thread count main applied (the profile measured with it).
        self.plan = plan(device, precision, compile_, threads=torch.get_num_threads())
        self.precision, self.device = precision, device
        self.step()  # warm-up (and compilation)

    def step(self) -> None:
        with self.plan.autocast():
            loss = cross_entropy(self.forward(self.ids[:, :-1]), self.ids[:, 1:])
        loss.backward()
        clip_grad_norm(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def seconds_per_step(self, seconds: float) -> float:
        """Median seconds per step over at least `seconds` (and at least 2 steps)."""
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 2 or (time.perf_counter() - start < seconds and len(times) < 50):
            begin = time.perf_counter()
            self.step()
            sync(self.device)
            times.append(time.perf_counter() - begin)
        return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--compile", action="store_true", help="torch.compile each model")
    parser.add_argument("--seconds", type=float, default=5.0, help="time each precision at least this long")
    parser.add_argument("--rounds", type=int, default=3, help="turns of fp32, bf16 and auto (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    device = resolve_device(args.device)
    keep_freed_memory()
    torch.set_flush_denormal(True)
    choices = plan(device, "auto", args.compile)
    apply_threads(choices.threads.value)
    print(choices.summary())
    rows = []
    print(f"{'recipe':<7} {'fp32 ms':>9} {'bf16 ms':>9} {'auto':>5} {'auto ms':>9} {'auto / best':>12}")
    for recipe in args.recipes:
        picked = choices.precision.value
        trainers = {name: Trainer(recipe, name, device, args.compile) for name in ("fp32", "bf16")}
        trainers["auto"] = Trainer(recipe, picked, device, args.compile)  # its own model, timed in its turn
        # In turns, so that every precision sees the same machine load; the median of the rounds.
        rounds: dict[str, list[float]] = {name: [] for name in trainers}
        for _ in range(args.rounds):
            for name, trainer in trainers.items():
                rounds[name].append(1e3 * trainer.seconds_per_step(args.seconds))
        ms = {name: float(np.median(values)) for name, values in rounds.items()}
        slowdown = ms["auto"] / min(ms["fp32"], ms["bf16"])
        rows.append(
            {"recipe": recipe, "auto": picked, "slowdown": slowdown, **{f"{k}_ms": v for k, v in ms.items()}}
        )
        print(
            f"{recipe:<7} {ms['fp32']:>9.1f} {ms['bf16']:>9.1f} {picked:>5} {ms['auto']:>9.1f} "
            f"{slowdown:>11.2f}x  (target <= 1.5x)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"device": choices.to_dict(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
