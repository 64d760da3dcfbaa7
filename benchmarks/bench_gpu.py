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
4. Decoding: one query per head against a long KV cache (grouped-query attention), forward only: the Triton
   split-key decode kernel against SDPA and the blocked implementation.

`--tiny` runs every row at toy shapes (on a CPU too: the Triton row then needs `TRITON_INTERPRET=1`, and is
marked "n/a" without it), which the test suite does so that the script keeps working.

Two more modes need no benchmark run:

- `--aot` compiles the attention kernels ahead of time for sm_70 … sm_90 (no GPU needed) and prints, per
  kernel, architecture, dtype and padded head size, the launch settings the run-time choice takes, their
  shared memory against the architecture's limit, registers, spills and instruction mix
  (`scratchlm.kernels.aot`). `--arch/--dtype/--head-dim/--kernel` narrow it, `--jobs` compiles in parallel.
- `--checklist` is what the first session with a GPU runs: versions, the GPU tests, the kernel tests compiled
  rather than interpreted, compute-sanitizer's memcheck and racecheck on one odd-length causal GQA case
  (`--case`), then this benchmark; one PASS/FAIL line per step, logs under `--logs`.

    python benchmarks/bench_gpu.py --device cuda --out gpu.json
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --tiny --device cpu --no-compile
    python benchmarks/bench_gpu.py --aot --jobs 16
    python benchmarks/bench_gpu.py --checklist
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_fused_loss import run_variant
from bench_train_step import ReferenceLM, matmul_peak, reference_loss, sync

from scratchlm import AdamW, ModelConfig, TransformerLM
from scratchlm.device import plan
from scratchlm.model.accounting import train_step_flops
from scratchlm.model.attention import causal_attention, triton_attention

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
    # (batch, heads, kv_heads, cached keys, d_head): one new token per sequence, Llama-3-8B's attention shape
    "decode": [(8, 32, 8, 4096, 128), (1, 32, 8, 32_768, 128), (32, 16, 16, 1024, 64)],
}
TINY = {
    "leaderboard": (1, 2, 96, 16),
    "sweep": [(seq, d) for seq in (33, 64) for d in (16, 32)],
    "models": {
        "tiny": (ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2, num_heads=4), 2)
    },
    "head": (256, 512, 32),
    "decode": [(2, 4, 2, 100, 16)],
}
ROOT = Path(__file__).resolve().parent.parent


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


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One new query attends to every cached key: no mask. SDPA wants K and V repeated over each group."""
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def blocked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    grouped = q.unflatten(1, (k.shape[1], group))
    return causal_attention(grouped, k.unsqueeze(2), v.unsqueeze(2)).flatten(1, 2)


def bench_decode(
    shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype, repeats: int
) -> list[dict]:
    """Forward only, as in generation: one query per (sequence, head) against `seq_k` cached keys."""
    batch, heads, kv_heads, seq_k, d_head = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d_head, generator=generator).to(device, dtype)
    k, v = (
        torch.randn(batch, kv_heads, seq_k, d_head, generator=generator).to(device, dtype) for _ in range(2)
    )
    kernel = attention_implementations(device)["scratchlm triton"]
    implementations = {"scratchlm triton": kernel, "sdpa": sdpa_decode, "scratchlm blocked": blocked_decode}
    rows = []
    for name, attention in implementations.items():
        row = {
            "impl": name,
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "seq_k": seq_k,
            "d_head": d_head,
        }
        if attention is None:
            rows.append(row | {"us": None})
            continue
        with torch.no_grad():
            rows.append(
                row | {"us": timed(lambda attention=attention: attention(q, k, v), device, repeats) * 1e6}
            )
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
    parser.add_argument("--aot", action="store_true", help="the ahead-of-time table of the attention kernels")
    parser.add_argument("--arch", type=int, nargs="+", help="--aot: compute capabilities (default: 70 … 90)")
    parser.add_argument("--dtype", nargs="+", choices=["fp32", "bf16", "fp16"], help="--aot: dtypes")
    parser.add_argument("--head-dim", type=int, nargs="+", help="--aot: padded head sizes (16 … 256)")
    parser.add_argument(
        "--kernel", nargs="+", help="--aot: kernels (forward, decode, combine, backward_kv, …)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="--aot: compiling processes")
    parser.add_argument("--json", help="--aot: also write the rows to this file")
    parser.add_argument("--checklist", action="store_true", help="the first-GPU checklist (see above)")
    parser.add_argument("--logs", default="gpu_checklist", help="--checklist: where each step's log goes")
    parser.add_argument("--case", action="store_true", help="one odd-length causal GQA case (for sanitizers)")
    args = parser.parse_args()
    if args.aot:
        return aot(args)
    if args.checklist:
        return checklist(args)
    if args.case:
        return sanitizer_case()
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

    decode = []
    for shape in shapes["decode"]:
        decode += bench_decode(shape, device, torch.bfloat16, args.repeats)
    results["decode"] = decode
    print("\ndecode: one query per sequence and head against a KV cache, bf16, forward")
    print(f"{'impl':<20}{'batch':>6}{'heads':>6}{'kv':>4}{'seq_k':>8}{'d_head':>7}{'us':>10}")
    for r in decode:
        print(
            f"{r['impl']:<20}{r['batch']:>6}{r['heads']:>6}{r['kv_heads']:>4}{r['seq_k']:>8}{r['d_head']:>7}"
            f"{fmt(r['us'], '.1f'):>10}"
        )

    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwritten to {args.out}")


def aot(args) -> None:
    """Print (and with --json write) the ahead-of-time table of the attention kernels."""
    from scratchlm.kernels.aot import HEAD_DIMS, as_dicts, sweep, table
    from scratchlm.kernels.flash_kernels import KERNELS
    from scratchlm.kernels.launch import ARCHITECTURES, DTYPES

    dtypes = {name: dtype for dtype, name in DTYPES.items()}
    rows = sweep(
        args.kernel or list(KERNELS),
        args.arch or list(ARCHITECTURES),
        [dtypes[d] for d in args.dtype or dtypes],
        args.head_dim or HEAD_DIMS,
        args.jobs,
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(as_dicts(rows), indent=2))


def sanitizer_case() -> None:
    """Forward, backward and decode of one odd-length causal grouped-query case, for compute-sanitizer: the
    sequence ends, the padded head size and the group indexing are where an out-of-bounds access would be."""
    from scratchlm.kernels import flash_attention

    generator = torch.Generator().manual_seed(0)
    for seq_q, seq_k in ((77, 77), (3, 201)):
        q = torch.randn(2, 4, seq_q, 80, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
        k, v = (
            torch.randn(2, 2, seq_k, 80, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2)
        )
        flash_attention(q, k, v, causal=True).square().sum().backward()
    torch.cuda.synchronize()
    print("case ran")


def checklist(args) -> None:
    """Each step in its own process, its output to `--logs/<step>.log`; one PASS/FAIL line per step."""
    logs = Path(args.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    python = [sys.executable]
    kernel_tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernel_*.py"))
    compiled_tests = [
        "tests/test_flash_attention.py",
        "tests/test_model_attention.py",
        "tests/test_bench_gpu.py",
    ]
    compiled_tests += kernel_tests
    case = [*python, "benchmarks/bench_gpu.py", "--case"]
    steps = {
        "versions": [*python, "-c", VERSIONS],
        "gpu tests": [*python, "-m", "pytest", "-m", "gpu", "-n", "4", "tests/test_gpu.py", *kernel_tests],
        "kernel tests compiled": [*python, "-m", "pytest", "-n", "4", *compiled_tests],
        "memcheck": ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", *case],
        "racecheck": ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1", *case],
        "benchmark": [*python, "benchmarks/bench_gpu.py", "--out", str(logs / "bench_gpu.json")],
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    failed = []
    for name, command in steps.items():
        log = logs / f"{name.replace(' ', '_')}.log"
        if shutil.which(command[0]) is None:
            print(f"SKIP  {name:<24} {command[0]} not found")
            failed.append(name)
            continue
        start = time.perf_counter()
        with open(log, "w") as out:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        print(f"{'PASS' if code == 0 else 'FAIL'}  {name:<24} {time.perf_counter() - start:7.0f} s  {log}")
        if code:
            failed.append(name)
    print(
        f"\n{len(steps) - len(failed)} of {len(steps)} steps passed"
        + (f"; not: {', '.join(failed)}" if failed else "")
    )
    if failed:
        raise SystemExit(1)


VERSIONS = """
import platform, shutil, subprocess, torch, triton
from scratchlm.kernels.launch import DTYPES, choose, device_limits, LADDERS
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda)
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
device = torch.device("cuda", torch.cuda.current_device())
arch, limit = device_limits(device)
print(torch.cuda.get_device_name(device), f"sm_{arch}", f"shared memory per block {limit:,} B",
      torch.cuda.get_device_properties(device).multi_processor_count, "SMs")
for dtype in DTYPES:
    for d in (64, 128):
        print(DTYPES[dtype], d, {k: str(choose(k, arch, limit, dtype, d, True)) for k in LADDERS})
"""


if __name__ == "__main__":
    main()
