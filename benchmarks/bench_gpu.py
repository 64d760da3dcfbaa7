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
5. Decoding a model: the TinyStories model's one-token decode steps (`scratchlm.generation.decode`), eager
   against compiled (on a GPU as CUDA graphs), tokens/s at batch 1 and 16, with the compilation's seconds.

`--tiny` runs every row at toy shapes (on a CPU too: the Triton row then needs `TRITON_INTERPRET=1`, and is
marked "n/a" without it), which the test suite does so that the script keeps working.

Two more modes need no benchmark run:

- `--aot` compiles the attention kernels ahead of time for sm_70 … sm_90 (no GPU needed) and prints, per
  kernel, architecture, dtype and padded head size, the launch settings the run-time choice takes, their
  shared memory against the architecture's limit, registers, spills and instruction mix
  (`scratchlm.kernels.aot`). `--arch/--dtype/--head-dim/--kernel` narrow it, `--jobs` compiles in parallel.
- `--checklist` is what a machine with a GPU runs first, within `--budget` seconds (8 minutes) in order of
  importance: versions, the GPU tests, the decode-model row, the training row, the other rows of this
  benchmark, the kernels' launch settings, the kernel tests compiled rather than interpreted (with their GPU
  tests), compute-sanitizer's memcheck and racecheck on one odd-length causal GQA case (`--case`); one
  PASS/FAIL/TIMEOUT/SKIP line per step, a log per step and one JSON report under `--logs`.

    python benchmarks/bench_gpu.py --device cuda --out gpu.json
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --tiny --device cpu --no-compile
    python benchmarks/bench_gpu.py --aot --jobs 16
    python benchmarks/bench_gpu.py --checklist
"""

from __future__ import annotations

import argparse
import itertools
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
from gpu_profile import print_profile, profile_step

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
    "decode_model": (
        ModelConfig(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16),
        (1, 16),
        200,
    ),
}
TINY = {
    "leaderboard": (1, 2, 96, 16),
    "sweep": [(seq, d) for seq in (33, 64) for d in (16, 32)],
    "models": {
        "tiny": (ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2, num_heads=4), 2)
    },
    "head": (256, 512, 32),
    "decode": [(2, 4, 2, 100, 16)],
    "decode_model": (
        ModelConfig(vocab_size=128, context_length=32, d_model=64, num_layers=2, num_heads=4),
        (1, 4),
        8,
    ),
}
ROOT = Path(__file__).resolve().parent.parent
SECTION_NAMES = ["attention", "training", "head", "decode", "decode_model"]


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
    shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype, repeats: int, args
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
        row |= {"ms": timed(step, device, repeats) * 1e3, "peak_mib": memory and memory / 2**20}
        if seq <= 1024 and d_head == 64:  # the short sequences, where a fixed cost per call shows
            row |= profiled(step, device, args, f"attention {name} {seq} x {d_head}")
        rows.append(row)
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


def bench_decode_model(
    config: ModelConfig, batches: tuple[int, ...], steps: int, device: torch.device, args
) -> list[dict]:
    """Tokens/s of the model's decode steps at each batch size, eager and (`--compile`) compiled: `steps`
    steps from half the context, every row its own sequence; the first compiled step (the compilation) is
    timed apart. bf16 weights on a GPU, as `prepare_for_inference` holds them there."""
    import copy

    from scratchlm.generation.decode import Decoder
    from scratchlm.generation.quantize import quantize_weights

    torch.manual_seed(0)
    model = TransformerLM.from_config(config, device=device).eval()
    if device.type == "cuda":
        model.to(torch.bfloat16)
    dtype = next(model.parameters()).dtype
    models = {None: model, "int8": quantize_weights(copy.deepcopy(model), "int8", dtype)}
    rows = []
    start_length = config.context_length // 2
    for (quantize, weights), batch, compiled in itertools.product(
        models.items(), batches, (False, True) if args.compile else (False,)
    ):
        decoder = Decoder(weights, batch, compiled)
        tokens = torch.zeros(batch, dtype=torch.long, device=device)

        def run(n: int, decoder=decoder, tokens=tokens, batch=batch) -> float:
            decoder.cache.lengths[:batch] = [start_length] * batch
            sync(device)
            start = time.perf_counter()
            for _ in range(n):
                decoder.step(tokens)
            sync(device)
            return time.perf_counter() - start

        with torch.inference_mode():
            first = run(1)
            seconds = min(run(min(steps, start_length - 1)) for _ in range(2))
        rows.append(
            {
                "batch": batch,
                "weights": quantize or str(dtype).removeprefix("torch."),
                "decode": "compiled" if compiled else "eager",
                "tokens_per_s": batch * min(steps, start_length - 1) / seconds,
                "first_step_s": first,
            }
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
            | profiled(step, device, args, f"{name} {side}")
        )
    return rows


def profiled(step: Callable[[], object], device: torch.device, args, label: str) -> dict:
    """`{"profile": ...}` (`gpu_profile.profile_step`) with `--profile` on a GPU, else nothing."""
    if not (args.profile and device.type == "cuda"):
        return {}
    summary = profile_step(step)
    print_profile(label, summary)
    return {"profile": summary}


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
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTION_NAMES,
        default=SECTION_NAMES,
        help="what to measure (default all)",
    )
    parser.add_argument(
        "--models", nargs="+", help="training: which of the models (default all: tinystories, gpt2-small)"
    )
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="a torch.profiler summary of each training row (gpu_profile.py)",
    )
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
    parser.add_argument(
        "--budget", type=float, default=480, help="--checklist: seconds for all its steps (default 480)"
    )
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
    for section in args.sections:
        SECTIONS[section](shapes, device, name, args, results)
        with open(args.out, "w") as f:  # after every section: a run cut short keeps what it measured
            json.dump(results, f, indent=2)
    print(f"\nwritten to {args.out}")


def attention_section(shapes: dict, device: torch.device, name: str, args, results: dict) -> None:
    batch, heads, _, _ = shapes["leaderboard"]
    attention = bench_attention(shapes["leaderboard"], device, torch.bfloat16, args.repeats, args)
    for seq, d_head in shapes["sweep"]:
        attention += bench_attention((batch, heads, seq, d_head), device, torch.bfloat16, args.repeats, args)
    results["attention"] = attention
    print(f"attention forward + backward, causal, bf16, on {name} (first rows: the leaderboard shape)")
    print(f"{'impl':<20}{'batch':>6}{'heads':>6}{'seq':>7}{'d_head':>7}{'ms':>10}{'peak MiB':>10}")
    for r in attention:
        print(
            f"{r['impl']:<20}{r['batch']:>6}{r['heads']:>6}{r['seq']:>7}{r['d_head']:>7}"
            f"{fmt(r['ms'], '.3f'):>10}{fmt(r['peak_mib'], '.0f'):>10}"
        )


def training_section(shapes: dict, device: torch.device, name: str, args, results: dict) -> None:
    models = {name: shape for name, shape in shapes["models"].items() if name in (args.models or [name])}
    if not models:
        raise SystemExit(f"--models: none of {args.models} is one of {', '.join(shapes['models'])}")
    print(
        f"\ntraining step, bf16 autocast, {'compiled' if args.compile else 'eager'}; MFU against {args.peak_flops / 1e12:.1f} TFLOP/s"
    )
    print(f"{'model':<14}{'impl':<12}{'batch':>6}{'tokens/s':>12}{'MFU':>8}{'peak MiB':>10}", flush=True)
    results["training"] = []
    for model_name, (config, model_batch) in models.items():
        for r in bench_training(model_name, config, model_batch, device, args):
            results["training"].append(r)  # each row as it comes: a step cut short still shows some
            print(
                f"{r['model']:<14}{r['impl']:<12}{r['batch']:>6}{r['tokens_per_s']:>12.0f}{r['mfu']:>8.1%}"
                f"{fmt(r['peak_mib'], '.0f'):>10}",
                flush=True,
            )


def head_section(shapes: dict, device: torch.device, name: str, args, results: dict) -> None:
    tokens, vocab, d_model = shapes["head"]
    head = {
        variant: run_variant(variant, 1, tokens, vocab, d_model, device.type, 1)
        for variant in ("unfused", "fused")
    }
    results["head_and_loss"] = {"tokens": tokens, "vocab": vocab, "d_model": d_model, **head}
    print(f"\nLM head + cross-entropy, {tokens} tokens, vocab {vocab}: peak GPU memory (MiB) and loss")
    for variant, r in head.items():
        print(f"{variant:<10}{fmt(r['peak_gpu'] and r['peak_gpu'] / 2**20, '.0f'):>10}{r['loss']:>10.5f}")


def decode_section(shapes: dict, device: torch.device, name: str, args, results: dict) -> None:
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


def decode_model_section(shapes: dict, device: torch.device, name: str, args, results: dict) -> None:
    config, batches, steps = shapes["decode_model"]
    results["decode_model"] = bench_decode_model(config, batches, steps, device, args)
    print(
        f"\ndecoding the {config.d_model}-wide, {config.num_layers}-layer model: tokens/s, eager and compiled"
    )
    print(f"{'weights':>8}{'batch':>6}{'decode':>10}{'tokens/s':>12}{'first step s':>14}")
    for r in results["decode_model"]:
        print(
            f"{r['weights']:>8}{r['batch']:>6}{r['decode']:>10}{r['tokens_per_s']:>12,.0f}{r['first_step_s']:>14.2f}"
        )


SECTIONS = {
    "attention": attention_section,
    "training": training_section,
    "head": head_section,
    "decode": decode_section,
    "decode_model": decode_model_section,
}


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
    """The steps in order of importance, each in its own process and within its own time limit, all within
    `--budget` seconds; a step's output goes to `--logs/<step>.log`, one PASS/FAIL/TIMEOUT/SKIP line per step
    is printed, and `--logs/report.json` holds the whole: each step's status, seconds and log, the versions,
    and the benchmark's results. The report is rewritten after every step, so a run cut short still has
    one."""
    logs = Path(args.logs).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    python = [sys.executable]
    kernel_tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernel_*.py"))
    compiled_tests = ["tests/test_flash_attention.py", "tests/test_model_attention.py", *kernel_tests]
    bench = [*python, "benchmarks/bench_gpu.py", "--repeats", "5"]
    case = [*python, "benchmarks/bench_gpu.py", "--case"]
    # (name, command, its own limit in seconds): correctness first, then the figures, then the slow checks.
    # Measured on an H200 (the first run, caches cold): versions 5 s, gpu tests 20-66 s, decode model 35 s,
    # training of both models 105 s to over 180 s, the kernels' launch settings 25 s a dtype; the kernel
    # tests take minutes.
    steps = [
        ("versions", [*python, "-c", VERSIONS], 60),
        ("gpu tests", [*python, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], 120),
        (
            "training",
            # the TinyStories model only: GPT-2 small's compilation alone takes minutes (the full run has it)
            [
                *bench,
                "--sections",
                "training",
                "--models",
                "tinystories",
                "--repeats",
                "3",
                "--profile",
                "--out",
                str(logs / "training.json"),
            ],
            150,
        ),
        (
            "benchmark",
            [
                *bench,
                "--sections",
                "attention",
                "head",
                "decode",
                "--profile",
                "--out",
                str(logs / "benchmark.json"),
            ],
            150,
        ),
        (
            "decode model",
            [*bench, "--sections", "decode_model", "--out", str(logs / "decode_model.json")],
            120,
        ),
        (
            "training gpt2-small",
            [*bench, "--sections", "training", "--models", "gpt2-small", "--repeats", "3", "--profile"]
            + ["--out", str(logs / "training_gpt2.json")],
            240,
        ),
        ("launch settings", [*python, "-c", LAUNCH_SETTINGS], 120),
        ("kernel tests compiled", [*python, "-m", "pytest", "-q", "-n", "4", *compiled_tests], 300),
        ("memcheck", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1", *case], 90),
        ("racecheck", ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode", "1", *case], 90),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    report: dict = {"budget_s": args.budget, "steps": [], "results": {}}
    deadline = time.monotonic() + args.budget
    for name, command, limit in steps:
        log = logs / f"{name.replace(' ', '_')}.log"
        left = deadline - time.monotonic()
        entry = {"step": name, "command": " ".join(command), "log": str(log), "seconds": 0.0}
        if shutil.which(command[0]) is None:
            entry |= {"status": "SKIP", "why": f"{command[0]} not found"}
        elif left < 10:
            entry |= {"status": "SKIP", "why": f"the {args.budget:.0f} s budget is spent"}
        else:
            entry |= run_step(command, log, env, min(limit, left))
        print(
            f"{entry['status']:<8}{name:<24}{entry['seconds']:7.0f} s  " + (entry.get("why") or str(log)),
            flush=True,
        )
        report["steps"].append(entry)
        if name == "versions" and log.exists():
            report["versions"] = log.read_text()
        for source in ("decode_model", "training", "benchmark", "training_gpt2"):
            if (logs / f"{source}.json").exists():
                results = json.loads((logs / f"{source}.json").read_text())
                if source == "training_gpt2":
                    results = {"training_gpt2_small": results.get("training", [])}
                report["results"] |= results
        (logs / "report.json").write_text(json.dumps(report, indent=2))
    passed = [e["step"] for e in report["steps"] if e["status"] == "PASS"]
    failed = [e["step"] for e in report["steps"] if e["status"] != "PASS"]
    print(f"\n{len(passed)} of {len(steps)} steps passed" + (f"; not: {', '.join(failed)}" if failed else ""))
    print(f"report: {logs / 'report.json'}")
    if failed:
        raise SystemExit(1)


def run_step(command: list[str], log: Path, env: dict, limit: float) -> dict:
    """Run one step, its output to `log`, killed with its children (pytest's, compile workers) at `limit`."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            return {"status": "TIMEOUT", "seconds": time.perf_counter() - start, "why": f"over {limit:.0f} s"}
    status = "PASS" if code == 0 else "FAIL"
    return {"status": status, "seconds": time.perf_counter() - start, "returncode": code}


VERSIONS = """
import platform, shutil, subprocess, torch, triton
from scratchlm.kernels.launch import device_limits
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "cuda", torch.version.cuda)
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
device = torch.device("cuda", torch.cuda.current_device())
arch, limit = device_limits(device)
print(torch.cuda.get_device_name(device), f"sm_{arch}", f"shared memory per block {limit:,} B",
      torch.cuda.get_device_properties(device).multi_processor_count, "SMs")
"""
# The run-time launch settings of each kernel: choosing compiles candidates, about 25 s a dtype the first time.
LAUNCH_SETTINGS = """
import torch
from scratchlm.kernels.launch import DTYPES, choose, device_limits, LADDERS
arch, limit = device_limits(torch.device("cuda", torch.cuda.current_device()))
for dtype in DTYPES:
    for d in (64, 128):
        print(DTYPES[dtype], d, {k: str(choose(k, arch, limit, dtype, d, True)) for k in LADDERS}, flush=True)
"""


if __name__ == "__main__":
    main()
