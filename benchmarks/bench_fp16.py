"""fp16 with dynamic loss scaling against fp32: the quickstart's model, the same data, seed and steps.

Both runs train the quickstart's model (the fast recipe by default: 2 layers, d_model 256, context 256, batch
8, Muon) for the same number of steps on the quickstart's data, one with `training.precision = "fp32"` and one
with "fp16" (fp16 autocast, the loss scaled and the gradients unscaled before clipping, overflowing steps
skipped: `scratchlm.training.loss_scale`). Each final model is then evaluated the same way, in float32, on every
token of the validation file. The target: fp16 within 0.05 nats of fp32.

CPUs emulate fp16 matmuls (about 2.5 GFLOP/s on an AVX-512 EPYC, against 100+ in fp32), so on a CPU the fp16
run is slow; it is the arithmetic that is compared here, not the speed. `auto` never picks fp16 on a CPU.

    python benchmarks/bench_fp16.py                        # 150 steps each
    python benchmarks/bench_fp16.py --steps 60 --small     # the small quickstart, a quick look

The data is built (or reused) in OUT/corpus and OUT/data exactly as `scratchlm quickstart --out OUT` does.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from scratchlm.evaluation import evaluate
from scratchlm.quickstart import FULL, RECIPES, SMALL, build_data, train_config
from scratchlm.run import load_trained, read_metrics
from scratchlm.training.trainer import train

TARGET = 0.05  # nats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/bench-fp16", help="where the data and both runs go")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="fast")
    parser.add_argument("--small", action="store_true", help="the small quickstart (seconds, not minutes)")
    args = parser.parse_args()

    out = Path(args.out)
    size = SMALL if args.small else FULL
    data = build_data(out, size)
    valid = np.load(data.valid, mmap_mode="r")
    results = {}
    for precision in ("fp32", "fp16"):
        run_dir = out / f"run-{precision}-{args.recipe}-{args.steps}"
        config = train_config(size, data, run_dir, 0.0, "cpu", args.steps, args.recipe).replace(
            training={"precision": precision, "compile": False, "max_time_s": 0.0},
            checkpoint={"interval": 0},
        )
        start = time.perf_counter()
        train(config, resume=run_dir.exists())
        seconds = time.perf_counter() - start
        model = load_trained(run_dir).model  # float32 weights: both models evaluated alike
        loss = evaluate(model, valid, batch_size=16).loss
        scaled = [r for r in read_metrics(run_dir) if "skipped_steps" in r]
        skipped = scaled[-1]["skipped_steps"] if scaled else 0
        scale = scaled[-1]["loss_scale"] if scaled else None
        results[precision] = (loss, seconds, skipped, scale)

    print(
        f"\nthe quickstart's model, {args.recipe} recipe, {args.steps} steps, threads {torch.get_num_threads()}"
    )
    print(f"{'precision':<10} {'val loss':>9} {'seconds':>9} {'skipped':>8} {'final scale':>12}")
    for precision, (loss, seconds, skipped, scale) in results.items():
        shown = "-" if scale is None else f"{scale:g}"
        print(f"{precision:<10} {loss:>9.4f} {seconds:>9.1f} {skipped:>8} {shown:>12}")
    gap = results["fp16"][0] - results["fp32"][0]
    print(f"fp16 - fp32: {gap:+.4f} nats (target: within ±{TARGET})")


if __name__ == "__main__":
    main()
