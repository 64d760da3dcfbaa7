"""The thread count scratchlm picks on a busy machine against using every core, on the quickstart's step.

The quickstart's model (the fast recipe, in the precision "auto" resolves to) takes training steps with torch's
intra-op threads at every usable core, and at the count `scratchlm.device.choices.choose_threads` picks, first
on the machine as it is, then while `--busy` other processes spin on a core each (started here and stopped by
their own time limit). PyTorch's threads spin-wait for each other, so a thread whose core is taken by another
process holds up every step; the benchmark prints what choosing fewer threads gains.

    python benchmarks/bench_threads.py               # one other busy process
    python benchmarks/bench_threads.py --busy 2 --seconds 20
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from scratchlm.allocator import keep_freed_memory
from scratchlm.data.prepare import PreparedData
from scratchlm.device import apply_threads, plan, usable_cores
from scratchlm.device.choices import choose_threads
from scratchlm.model.loss import cross_entropy
from scratchlm.model.transformer import TransformerLM
from scratchlm.quickstart import FULL, train_config
from scratchlm.training.grad import clip_grad_norm
from scratchlm.training.optimizers import build_optimizer


def tokens_per_s(threads: int, seconds: float) -> float:
    """Median tokens/s of the quickstart's training step at `threads` threads, over about `seconds`."""
    # Set as scratchlm sets them, so that the next choose_threads() does not take the count for the user's.
    apply_threads(threads)
    data = PreparedData(Path("unused"), Path("unused"), Path("unused"))
    config = train_config(FULL, data, Path("unused"), 0.0, "cpu", 1, "fast")
    choices = plan(torch.device("cpu"), "auto", threads=threads)  # "auto" at the threads that run
    precision = choices.precision.value
    torch.manual_seed(0)
    model = TransformerLM.from_config(config.model)
    optimizer = build_optimizer(config.optimizer, model, precision=precision)
    batch, context = config.training.batch_size, config.model.context_length
    ids = torch.randint(0, config.model.vocab_size, (batch, context + 1))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 4 or time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        with choices.autocast():
            loss = cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - begin)
    return batch * context / float(np.median(times[1:]))


def spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes that keep a core busy each for `seconds`, then exit on their own."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--busy", type=int, default=1, help="other busy processes in the second part (default 1)"
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="seconds of steps per measurement")
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_flush_denormal(True)
    cores = usable_cores()
    print(f"{cores} usable cores; {args.busy} other busy process(es) in the second part")
    rows = []
    for busy in (0, args.busy):
        procs = spinners(busy, seconds=4 * args.seconds + 30)
        try:
            time.sleep(1.0 if busy else 0.0)
            chosen = choose_threads()
            every = tokens_per_s(cores, args.seconds)
            picked = every if chosen.value == cores else tokens_per_s(chosen.value, args.seconds)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        rows.append((busy, chosen, every, picked))
    print(f"{'busy':>4} {'all cores':>16} {'chosen':>22} {'gain':>6}  reason")
    for busy, chosen, every, picked in rows:
        print(
            f"{busy:>4} {cores:>3} thr {every:>8,.0f} t/s {chosen.value:>3} thr {picked:>12,.0f} t/s "
            f"{picked / every:>5.2f}x  {chosen.reason}"
        )


if __name__ == "__main__":
    main()
