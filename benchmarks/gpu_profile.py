"""Where a GPU step's time goes: `torch.profiler` with CUDA activity over a few calls of a step, summarised as
the wall time a call takes, the GPU's busy time within it (the kernels' summed durations), the launches, and the
kernels' time by kind and the longest kernels by name.

The gap between wall time and busy time is time the GPU waited for the host (launch overhead, Python, syncs,
allocations); the kinds say whether the busy time is in the matrix products, attention, the optimizer, or the
element-wise kernels that Inductor fuses. `bench_gpu.py --profile` attaches one summary to each training row
and to the attention rows at short sequences.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# A kernel's kind from its name (cuBLAS and CUTLASS name their products gemm/xmma/nvjet; Inductor's kernels
# start with triton_; PyTorch's foreach optimizers launch multi_tensor_apply kernels).
KINDS = [
    (
        "attention",
        re.compile(r"flash|fmha|attention|_forward_kernel|_backward_kv|_backward_q|_decode_kernel", re.I),
    ),
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|sm90_|sm80_|splitk", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
    ("memory", re.compile(r"memcpy|memset", re.I)),
    ("inductor", re.compile(r"^triton_", re.I)),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def _device_time(event) -> float:
    """The event's own time on the device, microseconds (the attribute's name changed across versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_step(fn: Callable[[], object], calls: int = 3, top: int = 12) -> dict:
    """Profile `calls` calls of `fn` (already warmed up: compiled, autotuned) on the current CUDA device."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / calls * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if _device_time(e) > 0 and e.device_type.name == "CUDA"]
    if not kernels:  # older versions list kernels as CPU-side keys with device time
        kernels = [e for e in prof.key_averages() if _device_time(e) > 0 and not e.key.startswith("aten::")]
    busy_ms = sum(_device_time(e) for e in kernels) / calls / 1e3
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + _device_time(e) / calls / 1e3
    longest = sorted(kernels, key=_device_time, reverse=True)[:top]
    return {
        "wall_ms": wall_ms,
        "gpu_busy_ms": busy_ms,
        "idle_ms": max(wall_ms - busy_ms, 0.0),
        "launches": sum(e.count for e in kernels) / calls,
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "kernels": [
            {
                "name": e.key[:90],
                "kind": kind_of(e.key),
                "ms": _device_time(e) / calls / 1e3,
                "count": e.count / calls,
            }
            for e in longest
        ],
    }


def print_profile(label: str, summary: dict) -> None:
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in summary["by_kind_ms"].items())
    print(
        f"  profile {label}: wall {summary['wall_ms']:.2f} ms, GPU busy {summary['gpu_busy_ms']:.2f} ms, "
        f"{summary['launches']:.0f} launches; by kind (ms): {kinds}",
        flush=True,
    )
    for k in summary["kernels"][:6]:
        print(f"    {k['ms']:8.3f} ms  x{k['count']:<5.0f} {k['kind']:<10} {k['name']}", flush=True)
