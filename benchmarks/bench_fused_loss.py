"""Peak memory of the LM head + cross-entropy, forward and backward: unfused (the whole tokens × vocab logits,
then `cross_entropy`) against `fused_linear_cross_entropy` (chunks of tokens, logits recomputed in backward).

Each variant runs in a child process of its own, and its peak resident set size is read from
`resource.getrusage(RUSAGE_CHILDREN)` after it exits, so neither sees the other's allocations; the baseline is a
child that builds the same inputs and stops. Step times (best of `--repeats`) are printed too. On a CUDA
device, `--device cuda` reports `torch.cuda.max_memory_allocated` instead.

    python benchmarks/bench_fused_loss.py                         # 8 x 512 tokens, vocab 32K, d_model 512
    python benchmarks/bench_fused_loss.py --device cuda --batch 128
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from scratchlm.model.loss import cross_entropy, fused_linear_cross_entropy


def run_variant(
    variant: str, batch: int, seq: int, vocab: int, d_model: int, device: str, repeats: int
) -> dict:
    """In this (child) process: inputs, then `repeats` forward + backward passes of `variant`."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, d_model, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=generator) * d_model**-0.5).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    times, loss = [], None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats if variant != "baseline" else 0):
        start = time.perf_counter()
        if variant == "fused":
            loss = fused_linear_cross_entropy(hidden, weight, targets)
        else:
            loss = cross_entropy(hidden @ weight.T, targets)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        hidden.grad = weight.grad = None
    peak_gpu = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {
        "loss": None if loss is None else loss.item(),
        "best_s": min(times, default=None),
        "peak_gpu": peak_gpu,
    }


def measure(variant: str, args: argparse.Namespace) -> dict:
    """`variant` in a child process; its peak RSS in MiB (Linux reports kilobytes)."""
    command = [sys.executable, __file__, "--child", variant] + [
        f"--{name}={getattr(args, name)}"
        for name in ("batch", "seq", "vocab", "d_model", "device", "repeats")
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result = json.loads(output.splitlines()[-1])
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=("baseline", "unfused", "fused"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(
                run_variant(
                    args.child, args.batch, args.seq, args.vocab, args.d_model, args.device, args.repeats
                )
            )
        )
        return

    # RUSAGE_CHILDREN's maximum covers every child so far, so the variants run from the smallest peak up:
    # baseline, fused, unfused; each reading is then that variant's own peak.
    results = {variant: measure(variant, args) for variant in ("baseline", "fused", "unfused")}
    tokens = args.batch * args.seq
    print(
        f"head + cross-entropy, forward + backward: {tokens} tokens, vocab {args.vocab}, d_model {args.d_model}, {args.device}"
    )
    print(f"{'variant':<10}{'peak RSS MiB':>14}{'above inputs':>14}{'best step s':>13}{'loss':>10}")
    base = results["baseline"]["peak_rss_mib"]
    for variant, r in results.items():
        step = "" if r["best_s"] is None else f"{r['best_s']:.3f}"
        loss = "" if r["loss"] is None else f"{r['loss']:.5f}"
        print(f"{variant:<10}{r['peak_rss_mib']:>14.0f}{r['peak_rss_mib'] - base:>14.0f}{step:>13}{loss:>10}")
    fused, unfused = results["fused"]["peak_rss_mib"] - base, results["unfused"]["peak_rss_mib"] - base
    print(f"peak above inputs: fused / unfused = {fused / unfused:.3f} ({1 - fused / unfused:.0%} lower)")
    if args.device == "cuda":
        ratio = results["fused"]["peak_gpu"] / results["unfused"]["peak_gpu"]
        print(f"peak GPU memory: fused / unfused = {ratio:.3f}")


if __name__ == "__main__":
    main()
