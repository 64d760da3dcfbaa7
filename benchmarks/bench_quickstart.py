"""The quickstart's model trained by scratchlm and by a torch.nn reference, same data, same budget.

Both trainers get the quickstart's token files, tokenizer and hyperparameters (model shape, batch, AdamW,
cosine schedule with warm-up, gradient clipping, the precision "auto" resolves to, torch.compile) and the same
wall-clock training budget; each final model is evaluated on every token of the validation file with the same
consecutive windows. The reference is written with the built-ins scratchlm re-implements: nn.Linear,
nn.Embedding, nn.RMSNorm, F.scaled_dot_product_attention, F.silu, F.cross_entropy, torch.optim.AdamW,
LambdaLR, clip_grad_norm_.

    python benchmarks/bench_quickstart.py                  # 300 s of training each (about 11 minutes in all)
    python benchmarks/bench_quickstart.py --seconds 60
    python benchmarks/bench_quickstart.py --concurrent     # both at once, one thread each (a shared machine)

The data is built (or reused) in OUT/corpus and OUT/data exactly as `scratchlm quickstart --out OUT` does.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.allocator import keep_freed_memory
from scratchlm.device import Plan, plan
from scratchlm.evaluation import evaluate
from scratchlm.model.config import ModelConfig
from scratchlm.quickstart import (
    FULL,
    SMALL,
    build_data,
    train_config,
    train_within_budget,
    unigram_entropy,
)
from scratchlm.run import load_trained
from scratchlm.training.budget import CALIBRATION_STEPS
from scratchlm.training.config import TrainConfig
from scratchlm.training.schedule import cosine_lr_schedule


def cpu_plan(requested: str) -> Plan:
    """The plan for `requested` ("auto", "fp32", "bf16") on this CPU, at the thread count this process runs
    with (scratchlm.device.planning)."""
    return plan(torch.device("cpu"), requested, threads=torch.get_num_threads())


class Rotary(nn.Module):
    """RoPE on adjacent pairs (x[2k], x[2k+1]), as the CS336 assignment-1 handout defines it."""

    def __init__(self, head_dim: int, context: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads = c.num_heads
        self.ln1, self.ln2 = nn.RMSNorm(c.d_model, eps=1e-5), nn.RMSNorm(c.d_model, eps=1e-5)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model, bias=False)
        self.out = nn.Linear(c.d_model, c.d_model, bias=False)
        self.w1 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w3 = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w2 = nn.Linear(c.d_ff, c.d_model, bias=False)
        self.rope = Rotary(c.head_dim, c.context_length, c.rope_theta)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.ln_final = nn.RMSNorm(c.d_model, eps=1e-5)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        # The specification's initialisation, so that only the implementation differs.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = math.sqrt(2 / (module.in_features + module.out_features))
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.embed.weight, std=1.0, a=-3.0, b=3.0)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def train_reference(config: TrainConfig, seconds: float, fit_budget: bool) -> tuple[ReferenceLM, int, float]:
    """Train for at most `seconds` of wall-clock time (compilation included); returns (model, steps, tokens/s).

    With `fit_budget`, like the quickstart, the first `CALIBRATION_STEPS` steps measure the speed and the cosine
    is then sized to the steps that fit in the rest of the budget (here without a restart in between, which
    favours the reference slightly); otherwise the schedule is the config's step count."""
    torch.manual_seed(config.training.seed)
    c, o, t, warmup = config.model, config.optimizer, config.training, config.schedule.warmup_iters
    model = ReferenceLM(c)
    compiled = torch.compile(model) if t.compile else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )
    total = [CALIBRATION_STEPS if fit_budget else config.total_steps]  # the schedule's length
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_lr_schedule(step + 1, o.lr, o.min_lr, warmup, total[0]) / o.lr
    )
    data = np.load(config.data.train, mmap_mode="r")
    rng = np.random.default_rng(t.seed)
    context, tokens_per_step = c.context_length, t.batch_size * c.context_length
    skip = config.logging.log_interval  # steps left out of the speed measurement, as in the quickstart
    choices = cpu_plan(t.precision)  # what scratchlm trains in, for both
    steps, start = 0, time.perf_counter()
    while steps < total[0] and time.perf_counter() - start < seconds:
        if steps == skip:
            steady_start = time.perf_counter()
        starts = rng.integers(0, len(data) - context, size=t.batch_size)
        windows = torch.from_numpy(data[starts[:, None] + np.arange(context + 1)].astype(np.int64))
        with choices.autocast():
            logits = compiled(windows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if o.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        schedule.step()
        steps += 1
        if fit_budget and steps == CALIBRATION_STEPS:
            steps_per_s = (steps - skip) / (time.perf_counter() - steady_start)
            remaining = seconds - (time.perf_counter() - start)
            total[0] = steps + max(0, int(0.95 * remaining * steps_per_s))
            print(f"  reference: {total[0]:,} steps fit the budget", flush=True)
        if steps % 100 == 0:
            print(
                f"  reference step {steps}: loss {loss.item():.3f}, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    return model.eval(), steps, steps * tokens_per_step / elapsed


@torch.no_grad()
def reference_eval(model: ReferenceLM, tokens: np.ndarray, context: int, batch_size: int = 32) -> float:
    """Mean loss over every prediction of the file, in the consecutive windows `scratchlm.evaluation` uses."""
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    predictions = len(ids) - 1
    total = 0.0
    for first in range(0, predictions, batch_size * context):
        stop = min(first + batch_size * context, predictions)
        full = (stop - first) // context * context
        pieces = [(first, first + full, context)] if full else []
        if stop - first - full:
            pieces.append((first + full, stop, stop - first - full))
        for a, b, length in pieces:
            inputs, targets = ids[a:b].view(-1, length), ids[a + 1 : b + 1].view(-1, length)
            total += F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum").item()
    return total / predictions


def reference_job(config: dict, seconds: float, fit_budget: bool, valid_path: str, threads: int) -> tuple:
    """Train and evaluate the reference (in this process or a child); returns (loss, steps, tokens/s)."""
    keep_freed_memory()  # the allocator setting the quickstart uses, so that only the implementations differ
    torch.set_num_threads(threads)
    train_config = TrainConfig.from_dict(config)
    model, steps, tokens_per_s = train_reference(train_config, seconds, fit_budget)
    loss = reference_eval(model, np.load(valid_path, mmap_mode="r"), train_config.model.context_length)
    return loss, steps, tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="runs/quickstart", help="quickstart output directory (data is reused)"
    )
    parser.add_argument("--seconds", type=float, default=300.0, help="training budget of each trainer")
    parser.add_argument("--small", action="store_true", help="the quickstart's --small sizes")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="train both at the same time, one thread each: a fair race on a machine shared with other work",
    )
    args = parser.parse_args()
    size = SMALL if args.small else FULL
    out = Path(args.out)
    data = build_data(out, size)
    valid = np.load(data.valid, mmap_mode="r")
    bench_dir = out / "bench"
    shutil.rmtree(bench_dir, ignore_errors=True)  # fresh runs, not resumed ones
    run_dir = bench_dir / "scratchlm"
    config = train_config(size, data, run_dir, args.seconds, "cpu", size.max_steps or CALIBRATION_STEPS)
    fit_budget = size.max_steps is None
    threads = 1 if args.concurrent else torch.get_num_threads()
    torch.set_num_threads(threads)
    keep_freed_memory()

    pool = None
    if args.concurrent:
        print(
            f"scratchlm and the torch.nn reference: training for {args.seconds:.0f} s, side by side",
            flush=True,
        )
        pool = multiprocessing.get_context("spawn").Pool(1)
        pending = pool.apply_async(
            reference_job, (config.to_dict(), args.seconds, fit_budget, str(data.valid), threads)
        )
    else:
        print(f"scratchlm: training for {args.seconds:.0f} s ...", flush=True)
    summary = train_within_budget(size, data, run_dir, args.seconds, "cpu", bench_dir / "schedule.json")
    ours = evaluate(load_trained(run_dir).model, valid).loss
    if pool is not None:
        theirs, ref_steps, ref_tokens_per_s = pending.get()
        pool.close()
    else:
        print(f"torch.nn reference: training for {args.seconds:.0f} s ...", flush=True)
        theirs, ref_steps, ref_tokens_per_s = reference_job(
            config.to_dict(), args.seconds, fit_budget, str(data.valid), threads
        )

    entropy = unigram_entropy(valid)
    ours_tokens_per_s = summary.tokens / summary.wall_time_s
    mode = "side by side" if args.concurrent else "one after the other"
    print(
        f"\nsame data ({len(valid):,} validation tokens), same hyperparameters, {args.seconds:.0f} s of training each"
    )
    print(
        f"{mode}, {threads} thread(s) each, precision {config.training.precision} "
        f"({cpu_plan(config.training.precision).precision.value}), compile {config.training.compile}"
    )
    print("| trainer | steps | tokens/s (with compilation) | validation loss (nats/token, whole file) |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| scratchlm | {summary.steps:,} | {ours_tokens_per_s:,.0f} | {ours:.4f} |")
    print(f"| torch.nn reference | {ref_steps:,} | {ref_tokens_per_s:,.0f} | {theirs:.4f} |")
    print(f"unigram entropy of the validation tokens: {entropy:.4f} nats/token")
    print(
        f"loss difference (scratchlm - reference): {ours - theirs:+.4f}; "
        f"throughput ratio {ours_tokens_per_s / ref_tokens_per_s:.2f}x"
    )


if __name__ == "__main__":
    main()
