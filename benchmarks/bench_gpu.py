"""The GPU path measured in one command: attention, training steps and peak memory, printed as a table and
written as JSON.

1. Attention forward + backward (causal, bf16): scratchlm's Triton FlashAttention-2 (`scratchlm.kernels`),
   `F.scaled_dot_product_attention` restricted to its flash backend (the anchor), and scratchlm's blocked
   implementation written from tensor operations (`causal_attention`), at batch 1, 16 heads, sequence 16,384,
   d_head 64, and over sequence 256 … 16K × d_head 32, 64, 128. Best of `--repeats`, with peak memory.
2. Training steps (bf16 autocast, compiled), tokens/s and MFU: scratchlm's model (attention "auto", fused head
   and loss, its own AdamW) against the torch.nn + SDPA reference of `bench_train_step.py` with
   `torch.optim.AdamW(fused=True)`, at the TinyStories shape (context 256, d_model 512, 4 layers) and GPT-2
   small's (context 1,024, d_model 768, 12 layers, vocab 32K). MFU is against the measured bf16 matmul peak.
3. Peak memory of each, and of the LM head + loss fused or not at 128 × 512 tokens, vocab 32K.

`--tiny` runs every row at toy shapes (on a CPU too: the Triton row then needs `TRITON_INTERPRET=1`, and is
marked "n/a" without it), which the test suite does so that the script keeps working.

    python benchmarks/bench_gpu.py --device cuda --out gpu.json
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --tiny --device cpu --no-compile
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_fused_loss import run_variant
from bench_train_step import ReferenceLM, matmul_peak, reference_loss, sync

from scratchlm import AdamW, ModelConfig, TransformerLM
from scratchlm.device import plan
from scratchlm.model.accounting import train_step_flops
from scratchlm.model.layers import causal_attention, triton_attention

FULL = {
    "leaderboard": (1, 16, 16_384, 64),
    "sweep": [(seq, d) for seq in (256, 1024, 4096, 16_384) for d in (32, 64, 128)],
    "models": {
        "tinystories": (
            ModelConfig(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16),
            64,
        ),
        "gpt2-small": (
            ModelConfig(vocab_size=32_000, context_length=1024, d_model=768, num_layers=12, num_heads=12),
            16,
        ),
    },
    "head": (128 * 512, 32_000, 768),
}
TINY = {
    "leaderboard": (1, 2, 96, 16),
    "sweep": [(seq, d) for seq in (33, 64) for d in (16, 32)],
    "models": {
        "tiny": (ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2, num_heads=4), 2)
    },
    "head": (256, 512, 32),
}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of `fn` over `repeats` calls after one warm-up call (compilation, autotuning)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def peak_memory(fn: Callable[[], object], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    return torch.cuda.max_memory_allocated(device)


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.device.type != "cuda":  # no flash backend off the GPU: the default one, still a fused reference
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_implementations(device: torch.device) -> dict[str, Callable | None]:
    kernel = triton_attention()
    runnable = kernel is not None and (device.type == "cuda" or _interpreted())
    return {
        "scratchlm triton": kernel if runnable else None,
        "sdpa flash": sdpa_flash,
        "scratchlm blocked": causal_attention,
    }


def _interpreted() -> bool:
    from scratchlm.kernels.flash import INTERPRETED

    return INTERPRETED


def bench_attention(
    shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype, repeats: int
) -> list[dict]:
    batch, heads, seq, d_head = shape
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(batch, heads, seq, d_head, generator=generator).to(device, dtype) for _ in range(4)
    )
    rows = []
    for name, attention in attention_implementations(device).items():
        row = {"impl": name, "batch": batch, "heads": heads, "seq": seq, "d_head": d_head}
        if attention is None:
            rows.append(row | {"ms": None, "peak_mib": None})
            continue
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]

        def step(attention=attention, inputs=inputs) -> None:
            attention(*inputs).backward(grad)
            for x in inputs:
                x.grad = None

        memory = peak_memory(step, device)
        rows.append(row | {"ms": timed(step, device, repeats) * 1e3, "peak_mib": memory and memory / 2**20})
    return rows


def bench_training(name: str, config: ModelConfig, batch: int, device: torch.device, args) -> list[dict]:
    torch.manual_seed(0)
    ours = TransformerLM.from_config(config, device=device)
    reference = ReferenceLM(config).to(device)
    reference.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, config.vocab_size, (batch, config.context_length + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def ours_loss(x, y):
        return ours(x, targets=y)

    def reference_forward_loss(x, y):
        return reference_loss(reference(x), y)

    fused = {"fused": True}
    bf16 = plan(device, "bf16")  # both sides run under scratchlm's bf16 autocast
    sides = {
        "scratchlm": (ours, ours_loss, AdamW(ours.parameters(), lr=1e-4)),
        "reference": (
            reference,
            reference_forward_loss,
            torch.optim.AdamW(reference.parameters(), lr=1e-4, **fused),
        ),
    }
    flops = train_step_flops(config, batch)
    rows = []
    for side, (model, loss_fn, optimizer) in sides.items():
        forward_loss = torch.compile(loss_fn) if args.compile else loss_fn

        def step(model=model, forward_loss=forward_loss, optimizer=optimizer) -> None:
            with bf16.autocast():
                loss = forward_loss(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = timed(step, device, args.repeats)
        memory = peak_memory(step, device)
        rows.append(
            {
                "model": name,
                "impl": side,
                "batch": batch,
                "tokens_per_s": batch * config.context_length / seconds,
                "mfu": flops / seconds / args.peak_flops,
                "peak_mib": memory and memory / 2**20,
            }
        )
    return rows


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (any device; the smoke test)")
    parser.add_argument("--out", default="bench_gpu.json", help="where to write the JSON results")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = TINY if args.tiny else FULL
    args.peak_flops = matmul_peak(device, torch.bfloat16, 256 if args.tiny else 8192)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict = {"device": name, "matmul_peak_tflops": args.peak_flops / 1e12, "tiny": args.tiny}

    batch, heads, _, _ = shapes["leaderboard"]
    attention = bench_attention(shapes["leaderboard"], device, torch.bfloat16, args.repeats)
    for seq, d_head in shapes["sweep"]:
        attention += bench_attention((batch, heads, seq, d_head), device, torch.bfloat16, args.repeats)
    results["attention"] = attention
    print(f"attention forward + backward, causal, bf16, on {name} (first rows: the leaderboard shape)")
    print(f"{'impl':<20}{'batch':>6}{'heads':>6}{'seq':>7}{'d_head':>7}{'ms':>10}{'peak MiB':>10}")
    for r in attention:
        print(
            f"{r['impl']:<20}{r['batch']:>6}{r['heads']:>6}{r['seq']:>7}{r['d_head']:>7}"
            f"{fmt(r['ms'], '.3f'):>10}{fmt(r['peak_mib'], '.0f'):>10}"
        )

    training = []
    for model_name, (config, model_batch) in shapes["models"].items():
        training += bench_training(model_name, config, model_batch, device, args)
    results["training"] = training
    print(
        f"\ntraining step, bf16 autocast, {'compiled' if args.compile else 'eager'}; MFU against {args.peak_flops / 1e12:.1f} TFLOP/s"
    )
    print(f"{'model':<14}{'impl':<12}{'batch':>6}{'tokens/s':>12}{'MFU':>8}{'peak MiB':>10}")
    for r in training:
        print(
            f"{r['model']:<14}{r['impl']:<12}{r['batch']:>6}{r['tokens_per_s']:>12.0f}{r['mfu']:>8.1%}"
            f"{fmt(r['peak_mib'], '.0f'):>10}"
        )

    tokens, vocab, d_model = shapes["head"]
    head = {
        variant: run_variant(variant, 1, tokens, vocab, d_model, device.type, 1)
        for variant in ("unfused", "fused")
    }
    results["head_and_loss"] = {"tokens": tokens, "vocab": vocab, "d_model": d_model, **head}
    print(f"\nLM head + cross-entropy, {tokens} tokens, vocab {vocab}: peak GPU memory (MiB) and loss")
    for variant, r in head.items():
        print(f"{variant:<10}{fmt(r['peak_gpu'] and r['peak_gpu'] / 2**20, '.0f'):>10}{r['loss']:>10.5f}")

    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
