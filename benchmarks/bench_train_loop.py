"""What the training loop costs around the bare step: `train()` against forward/backward/clip/AdamW alone.

The bare step is the work no loop can avoid: forward, cross-entropy, backward, gradient clipping and the AdamW
update, on batches sampled beforehand and already on the device. The loop is `scratchlm.train` itself on the
same model (same initial weights) and the same batches: it also samples and copies the batches, sets the
learning rate, accumulates and logs metrics (console + metrics.jsonl every 10 steps), evaluates and
checkpoints. Both are timed over windows of 10 steps (the default log interval; each loop window holds one
log, where the loop waits for the device), the loop's windows marked at the start of each of its steps.

Evaluation and checkpoints come every 500 and 1,000 steps by default, more steps than a benchmark can run on
a CPU, so their costs are measured once each (the run's final evaluation and checkpoint) and spread over those
default intervals:

    overhead = (loop window + eval / 500 × 10 + checkpoint / 1,000 × 10) / bare window - 1     (target: < 5 %)

Bare runs and loop runs alternate for `--rounds` rounds and the fastest window of each side is compared. On a
CPU the clock is the process's CPU time (other work on a shared machine then hardly matters); on a GPU, wall
time.

    python benchmarks/bench_train_loop.py                                  # the TinyStories model, batch 8
    python benchmarks/bench_train_loop.py --d-model 128 --layers 2 --heads 4 --context 128 --batch-size 16
    python benchmarks/bench_train_loop.py --device cuda --batch-size 128 --precision bf16 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from scratchlm import AdamW, TransformerLM, clip_grad_norm, cosine_lr_schedule, cross_entropy, train
from scratchlm.data.tokens import gather_batch, sample_starts
from scratchlm.device import plan
from scratchlm.training.config import CheckpointConfig, EvalConfig, LoggingConfig, TrainConfig
from scratchlm.training.step import TrainStep
from scratchlm.training.trainer import _Run

WINDOW = LoggingConfig().log_interval


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_windows(
    config: TrainConfig, tokens: np.ndarray, warmup: int, steps: int, device: torch.device, clock: Callable
) -> list[float]:
    """Seconds per step of forward/backward/clip/AdamW on the loop's model and batches, per window of steps."""
    t, o = config.training, config.optimizer
    torch.manual_seed(t.seed)
    model = TransformerLM.from_config(config.model, device=device)
    optimizer = AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    step_model = torch.compile(model) if t.compile else model
    generator = np.random.default_rng(t.seed)  # the loop's sampling generator: the same batches
    context = config.model.context_length
    batches = [
        gather_batch(tokens, sample_starts(len(tokens), t.batch_size, context, generator), context, device)
        for _ in range(warmup + steps)
    ]
    choices = plan(device, t.precision, threads=torch.get_num_threads())
    marks = []
    for step, (inputs, targets) in enumerate(batches, start=1):
        if (step - 1 - warmup) % WINDOW == 0 and step > warmup:
            sync(device)
            marks.append(clock())
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr_schedule(step, o.lr, o.min_lr, config.schedule.warmup_iters, len(batches))
        with choices.autocast():
            loss = cross_entropy(step_model(inputs), targets)
        loss.backward()
        clip_grad_norm(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    marks.append(clock())
    return [(b - a) / WINDOW for a, b in zip(marks, marks[1:], strict=False)]


@contextlib.contextmanager
def instrumented(clock: Callable) -> Iterator[dict[str, list[float]]]:
    """Mark the start of every loop step, and time the evaluations and checkpoints."""
    marks: dict[str, list[float]] = {"step": [], "eval": [], "save": []}
    step, evaluate, save = _Run._take_step, TrainStep.validation_loss, _Run._save

    def marked_step(self):
        marks["step"].append(clock())
        return step(self)

    def timed(name: str, method: Callable) -> Callable:
        def wrapper(self, *args):
            start = clock()
            result = method(self, *args)
            marks[name].append(clock() - start)
            return result

        return wrapper

    with (
        mock.patch.object(_Run, "_take_step", marked_step),
        mock.patch.object(TrainStep, "validation_loss", timed("eval", evaluate)),
        mock.patch.object(_Run, "_save", timed("save", save)),
    ):
        yield marks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=10_000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps (a multiple of {WINDOW})")
    parser.add_argument(
        "--warmup", type=int, default=10, help=f"untimed steps first (a multiple of {WINDOW})"
    )
    parser.add_argument("--rounds", type=int, default=2, help="bare runs and loop runs, alternating")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.steps % WINDOW or args.warmup % WINDOW:
        parser.error(f"--steps and --warmup must be multiples of the log interval, {WINDOW}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    total, context = args.warmup + args.steps, args.context

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tokens = np.random.default_rng(0).integers(
            0, args.vocab, (total + 1) * args.batch_size * context + 1000
        )
        np.save(tmp_path / "train.npy", tokens.astype(np.uint16))
        np.save(tmp_path / "valid.npy", tokens[: 100 * context].astype(np.uint16))
        config = TrainConfig.from_dict(
            {
                "data": {"train": str(tmp_path / "train.npy"), "valid": str(tmp_path / "valid.npy")},
                "model": {
                    "vocab_size": args.vocab,
                    "context_length": context,
                    "d_model": args.d_model,
                    "num_layers": args.layers,
                    "num_heads": args.heads,
                },
                "training": {
                    # one step more than timed: its start closes the last window
                    "max_steps": total + 1,
                    "batch_size": args.batch_size,
                    "device": args.device,
                    "precision": args.precision,
                    "compile": args.compile,
                },
            }  # eval, checkpoint and logging at their defaults
        )
        train_tokens = np.load(tmp_path / "train.npy", mmap_mode="r")
        print(
            f"model d_model {args.d_model}, {args.layers} layers, {args.heads} heads, context {context}, vocab "
            f"{args.vocab}; batch {args.batch_size}; {args.warmup} warm-up + {args.steps} timed steps, "
            f"{args.rounds} rounds; {args.device}, {args.precision}{', compiled' if args.compile else ''}; "
            f"{torch.get_num_threads()} threads; clock: {'wall' if clock is time.perf_counter else 'CPU'} time"
        )
        bare, loop, eval_times, save_times = [], [], [], []
        for round_index in range(args.rounds):
            bare += bare_windows(config, train_tokens, args.warmup, args.steps, device, clock)
            with instrumented(clock) as marks:
                train(config.replace(logging={"run_dir": str(tmp_path / f"run{round_index}")}))
            starts = marks["step"][args.warmup :: WINDOW]
            loop += [(b - a) / WINDOW for a, b in zip(starts, starts[1:], strict=False)]
            eval_times += marks["eval"]
            save_times += marks["save"]

    bare_step, loop_step, eval_time, save_time = min(bare), min(loop), min(eval_times), min(save_times)
    eval_interval, save_interval = EvalConfig().interval, CheckpointConfig().interval
    amortized = loop_step + eval_time / eval_interval + save_time / save_interval
    tokens_per_step = args.batch_size * context

    def ms(values: list[float]) -> str:
        return ", ".join(f"{v * 1e3:.1f}" for v in values)

    print(
        f"bare step       {bare_step * 1e3:9.2f} ms  ({tokens_per_step / bare_step:,.0f} tokens/s; windows {ms(bare)})"
    )
    print(
        f"loop step       {loop_step * 1e3:9.2f} ms  (+ sampling, copying, a log every {WINDOW}; windows {ms(loop)})"
    )
    print(
        f"one evaluation  {eval_time * 1e3:9.2f} ms  / {eval_interval} steps = {eval_time / eval_interval * 1e3:.3f} ms per step"
    )
    print(
        f"one checkpoint  {save_time * 1e3:9.2f} ms  / {save_interval} steps = {save_time / save_interval * 1e3:.3f} ms per step"
    )
    print(f"loop, amortized {amortized * 1e3:9.2f} ms  ({tokens_per_step / amortized:,.0f} tokens/s)")
    overhead = amortized / bare_step - 1
    print(
        f"overhead of the loop: {overhead:+.1%} of the bare step ({'meets' if overhead < 0.05 else 'misses'} the < 5% target)"
    )


if __name__ == "__main__":
    main()
