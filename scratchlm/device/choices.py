"""What scratchlm does on a device: the precision, thread count, compilation and loss path it chooses, and why.

Precision. `"auto"` (the default of every config) resolves to bf16 where the device multiplies bf16 at least
`LOW_PRECISION_GAIN` times faster than fp32 by measurement (`scratchlm.device.rates`): CUDA GPUs with native
bf16 (compute capability 8.0 and later) and CPUs with AVX-512-BF16 or AMX. On a CUDA GPU without fast bf16 (the
T4, the V100: compute capability 7.x) it resolves to fp16 where fp16 measures that much faster than fp32; fp16
training then scales its loss (`scratchlm.training.loss_scale`), since fp16 gradients underflow. Everywhere else
it is fp32: on CPUs without native bf16, where PyTorch emulates bf16 matmuls about 100x slower, on every CPU for
fp16 (emulated too), and on Apple's MPS, where support depends on the macOS version (when unsure, fp32). An
explicit "bf16" or "fp16" is obeyed anywhere, with a one-line warning when the device computes it more than
`SLOW_FACTOR` times slower than fp32.

Threads (CPU). A CPU training step uses one thread per core it may run on (`usable_cores`: the affinity mask,
capped by a cgroup CPU quota) less the cores that other processes keep busy when training starts
(`busy_cores`). PyTorch's worker threads spin while they wait for each other, so a thread that shares its core
with another busy process stalls every step: measured on 2 cores with one other busy process, a step ran at
1,711 tokens/s with 2 threads and 2,734 with 1. An explicit choice wins: `training.threads`, the
`OMP_NUM_THREADS` environment variable, or a `torch.set_num_threads` call after importing scratchlm.

Compilation. `training.compile = true` compiles where torch.compile can generate code (on a CPU it needs a C++
compiler); where it cannot, the run goes on uncompiled and says why.

The fused head and loss (`scratchlm.model.loss`) saves the logits' memory for one more head matmul: worth it
where memory is short (a GPU); on a CPU the unfused path is the faster. The peak FLOP/s that MFU divides by is
the configured one, else a known GPU's data-sheet figure at the resolved precision, else unknown (no MFU).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from scratchlm.device.compiler import compiler_found
from scratchlm.device.host import affinity_cpus, busy_cores, cpu_times, others_busy, usable_cores
from scratchlm.device.profile import DeviceProfile
from scratchlm.device.rates import INT8_TOKENS
from scratchlm.errors import ScratchlmError
from scratchlm.kernels import int8_cpu
from scratchlm.precisions import PRECISIONS

LOW_PRECISION_GAIN = 1.25  # auto picks bf16 (fp16) when its matmuls are at least this much faster than fp32's
# (autocast converts activations to the low precision and back, which costs part of the gain)
SLOW_FACTOR = 1.5  # an explicit bf16 or fp16 this many times slower than fp32 gets a warning

# torch's own thread count, before anything changes it: a different count later means someone chose one.
_TORCH_DEFAULT_THREADS = torch.get_num_threads()
_applied_threads: int | None = None  # the count scratchlm itself last set


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str
    measured: bool = False  # chosen from a measurement of the machine, not set by the user


def resolve_precision(
    requested: str, profile: DeviceProfile, option: str = "training.precision"
) -> tuple[Choice, list[str]]:
    """`requested` (one of `PRECISIONS`) on a device with `profile`: the precision, its reason, and the
    warnings an explicit slow choice deserves, naming the setting it came from (`option`)."""
    if requested not in PRECISIONS:
        raise ScratchlmError(f"{option} must be one of {', '.join(PRECISIONS)}; got {requested!r}")
    fp32 = profile.rate("fp32")

    def rates(low: str) -> str:
        return f"{low} matmul {profile.rate(low):,.1f} GFLOP/s, fp32 {fp32:,.1f}"

    if requested != "auto":
        warnings = []
        rate = profile.rate(requested)
        if requested != "fp32" and rate and rate * SLOW_FACTOR < fp32:
            auto = resolve_precision("auto", profile, option)[0].value  # what this device's plan would pick
            warnings.append(
                f"{option} = {requested} on a device that computes it {fp32 / rate:.0f}x slower than fp32 "
                f'({rates(requested)}); "auto" would choose {auto}'
            )
        return Choice(requested, f"{option} = {requested}"), warnings
    if profile.type == "mps":
        return Choice("fp32", "MPS: bf16 support depends on the macOS version, so fp32"), []
    fast = {low: profile.rate(low) >= LOW_PRECISION_GAIN * fp32 for low in ("bf16", "fp16")}
    if profile.type == "cuda" and not profile.native_bf16:
        if fast["fp16"]:
            return Choice(
                "fp16", f"compute capability {profile.compute_capability} emulates bf16; {rates('fp16')}"
            ), []
        return Choice("fp32", f"compute capability {profile.compute_capability} emulates bf16"), []
    if fast["bf16"]:
        return Choice("bf16", f"native bf16: {rates('bf16')}"), []
    return Choice("fp32", f"{'' if profile.native_bf16 else 'no native bf16: '}{rates('bf16')}"), []


def user_threads() -> tuple[int, str] | None:
    """The thread count the user chose outside scratchlm, if any: OMP_NUM_THREADS, or torch.set_num_threads."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    current = torch.get_num_threads()
    if current != _TORCH_DEFAULT_THREADS and current != _applied_threads:
        return current, "torch.set_num_threads"
    return None


def choose_threads(requested: int = 0) -> Choice:
    """The CPU thread count: `requested` (> 0), else the user's own choice, else the usable cores that other
    processes leave free (at least 1)."""
    if requested > 0:
        return Choice(requested, f"training.threads = {requested}")
    if (chosen := user_threads()) is not None:
        return Choice(chosen[0], f"{chosen[1]} sets {chosen[0]} threads")
    usable = usable_cores()
    busy = busy_cores()
    free = max(1, min(usable, int(usable - busy + 0.5)))
    if free == usable:
        return Choice(usable, f"{usable} usable cores, free", measured=True)
    return Choice(free, f"{usable} usable cores, {busy:.1f} kept busy by other processes", measured=True)


class ThreadTuner:
    """Keeps the thread count fitted to the free cores while training runs (the load of a shared machine
    comes and goes). At each call of `update` (the trainer's log steps) it measures, over the interval since
    the last call, how many cores of this process's CPUs were busy (/proc/stat) less what this process itself
    used (`os.times`): the rest is other processes. The count becomes the usable cores they leave free. The
    first interval only sets the mark: it holds compilation, whose worker processes would count as others.
    Off when the user chose the count, where /proc/stat is missing, and for a compiled model: torch.compile
    specialises a CPU graph to the thread count, so a change recompiles it (measured on the quickstart: one
    interval of 5 steps took 70 s instead of 4)."""

    def __init__(self, choice: Choice, compiled: bool = False) -> None:
        self.usable = usable_cores()
        self.enabled = choice.value is not None and choice.measured and not compiled
        self.marks: tuple[dict[int, tuple[int, int]], float, float] | None = None

    def _mark(self) -> tuple[dict[int, tuple[int, int]], float, float]:
        own = os.times()
        return cpu_times(affinity_cpus()), own.user + own.system, time.monotonic()

    def update(self) -> str | None:
        """Re-choose; returns a line saying what changed, or None."""
        if not self.enabled:
            return None
        try:
            now = self._mark()
        except (OSError, ValueError):
            self.enabled = False
            return None
        before, self.marks = self.marks, now
        if before is None or now[2] - before[2] < 0.5:
            self.marks = before or now
            return None
        others = others_busy(before[0], now[0], now[1] - before[1], now[2] - before[2])
        threads = max(1, min(self.usable, int(self.usable - others + 0.5)))
        if threads == torch.get_num_threads():
            return None
        previous = torch.get_num_threads()
        apply_threads(threads)
        return (
            f"threads {previous} → {threads}: other processes keep {others:.1f} of {self.usable} cores busy"
        )


def apply_threads(threads: int | None) -> None:
    """Set torch's intra-op thread count (None: leave it)."""
    global _applied_threads
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    if threads is not None:
        _applied_threads = threads


def choose_compile(requested: bool, device: torch.device) -> Choice:
    if not requested:
        return Choice(False, "training.compile = false")
    found, what = compiler_found(device)
    if not found:
        return Choice(False, what)
    return Choice(True, f"training.compile = true ({what})")


def choose_decode(requested: bool, device: torch.device) -> Choice:
    """Whether inference may compile its decode steps: where torch.compile can generate code and the user
    did not turn it off. Whether a model's steps are then compiled is measured per shape, and whether a
    generation is long enough to pay for compiling them is decided per call (`scratchlm.device.decode_timings`)."""
    if not requested:
        return Choice(False, "--no-compile: eager decode steps")
    found, what = compiler_found(device)
    if not found:
        return Choice(False, f"eager decode steps: {what}")
    graphs = " as CUDA graphs" if device.type == "cuda" else ""
    return Choice(
        True,
        f"decode steps compiled{graphs} ({what}) where they measure faster and the tokens left pay for "
        "compiling; eager otherwise",
    )


def choose_fused_loss(requested: str, device: torch.device) -> Choice:
    """`training.fused_loss` ("auto", "on", "off"): auto is on for a CUDA device, where memory is short."""
    if requested != "auto":
        return Choice(requested == "on", f"training.fused_loss = {requested}")
    on = device.type == "cuda"
    return Choice(on, "a GPU: the logits' memory is saved" if on else "unfused is faster off a GPU")


MATVEC_GAIN = 1.2  # how much faster than the default way another must measure before inference takes it


def choose_matvec(profile: DeviceProfile, precision: str) -> Choice:
    """How inference runs a token times a weight matrix (`rates.MATVEC_WAYS`): the way that measured fastest
    at `precision`, if at least `MATVEC_GAIN` times faster than "rows" (the parameters' layout, the default
    kernels). On an AVX-512-BF16 EPYC: fp32 12 GB/s by rows, 22 by columns (the BLAS's kernel for the
    transposed product is the slow one); bf16 15 GB/s with oneDNN, 29 with PyTorch's own kernel, which
    reaches the memory bandwidth. The values are the same every way; only the memory order or the kernel
    differs."""
    rates = profile.matvec_gbps.get(precision)
    if not rates:
        return Choice("rows", f"no matrix-vector rates measured at {precision}: the default")
    fastest = max(rates, key=rates.__getitem__)
    way = fastest if rates[fastest] >= MATVEC_GAIN * rates["rows"] else "rows"
    measured = ", ".join(f"{name} {rate:g}" for name, rate in rates.items())
    return Choice(way, f"a token times a {precision} matrix, GB/s: {measured}", measured=True)


# The eager int8 forms other than the dequantized product, and what they are called in a plan's reason.
INT8_KERNELS = {"kernel": "scratchlm's int8 kernel", "pack": "aten._weight_int8pack_mm"}


def choose_int8_matmul(profile: DeviceProfile, precision: str) -> Choice:
    """How an eager product by an int8 matrix (`--quantize int8`) runs with activations at `precision`: the
    fastest of the `INT8_KERNELS` that ran, gave the dequantized product and was no slower than the
    dequantized product at every size measured (`rates.INT8_TOKENS`: one token and a batch of them both run
    eagerly), by its mean speed-up over it: "kernel", scratchlm's CPU kernel (`scratchlm.kernels.int8_cpu`;
    0.0 where it did not build), or "pack", PyTorch's `aten._weight_int8pack_mm`; else "dequantize", the
    weight converted to the activations' dtype inside the product, which runs everywhere. None of them is the
    faster everywhere: on a 2-core Zen 3 EPYC (AVX2) PyTorch's kernel took 1.7 ms for one float32 token
    through a 2688 x 512 matrix, the dequantized product 0.40 ms and scratchlm's 0.09 ms, while PyTorch's
    took a bf16 token through a 1024 x 512 matrix 5x faster than the dequantized product. All give the same
    product to rounding."""
    rates = profile.int8_gbps.get(precision)
    if not rates:
        where = "" if profile.type == "cpu" else f" (measured on a CPU only, not a {profile.type})"
        return Choice("dequantize", f"no int8 rates measured at {precision}{where}: the dequantized product")
    plain = {tokens: rates.get(f"dequantize_{tokens}", 0.0) for tokens in INT8_TOKENS}
    speedups: dict[str, float] = {}
    absent = []
    for way, name in INT8_KERNELS.items():
        found = [rates.get(f"{way}_{tokens}", 0.0) for tokens in INT8_TOKENS]
        if not any(rate > 0 for rate in found):
            why = int8_cpu.failure() if way == "kernel" else None
            absent.append(f"{name} does not run for {precision} here" + (f": {why}" if why else ""))
        elif all(rate >= plain[tokens] > 0 for tokens, rate in zip(INT8_TOKENS, found, strict=True)):
            ratios = [rate / plain[tokens] for tokens, rate in zip(INT8_TOKENS, found, strict=True)]
            speedups[way] = math.prod(ratios) ** (1 / len(ratios))
    measured = "; ".join(
        f"{tokens} token{'' if tokens == 1 else 's'}: "
        + ", ".join(f"{way} {rates.get(f'{way}_{tokens}', 0.0):g}" for way in (*INT8_KERNELS, "dequantize"))
        for tokens in INT8_TOKENS
    )
    way = max(speedups, key=speedups.__getitem__) if speedups else "dequantize"
    reason = f"int8 weights times {precision} activations, GB/s: {measured}"
    if absent:
        reason += " (" + "; ".join(absent) + ")"
    return Choice(way, reason, measured=True)


# Dense peak FLOP/s (no sparsity) per (GPU name fragment, precision), from the vendors' data sheets. fp16 and
# bf16 run on the same tensor cores; a GPU without fast bf16 lists fp16 only.
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("H200", "bf16"): 989e12,
    ("H100 PCIe", "bf16"): 756e12,
    ("H100", "bf16"): 989e12,
    ("A100", "bf16"): 312e12,
    ("L40S", "bf16"): 362e12,
    ("A10G", "bf16"): 70e12,
    ("4090", "bf16"): 165e12,
    ("3090", "bf16"): 71e12,
    ("H200", "fp16"): 989e12,
    ("H100 PCIe", "fp16"): 756e12,
    ("H100", "fp16"): 989e12,
    ("A100", "fp16"): 312e12,
    ("L40S", "fp16"): 362e12,
    ("A10G", "fp16"): 70e12,
    ("4090", "fp16"): 165e12,
    ("3090", "fp16"): 71e12,
    ("V100", "fp16"): 125e12,
    ("T4", "fp16"): 65e12,
    ("H200", "fp32"): 67e12,
    ("H100 PCIe", "fp32"): 51e12,
    ("H100", "fp32"): 67e12,
    ("A100", "fp32"): 19.5e12,
    ("L40S", "fp32"): 91.6e12,
    ("A10G", "fp32"): 31.2e12,
    ("4090", "fp32"): 82.6e12,
    ("3090", "fp32"): 35.6e12,
    ("V100", "fp32"): 15.7e12,
    ("T4", "fp32"): 8.1e12,
}


def choose_peak_flops(profile: DeviceProfile, precision: str, peak_tflops: float = 0.0) -> Choice:
    """The peak FLOP/s that MFU divides by: `logging.peak_tflops`, else the data-sheet peak of a known GPU at
    `precision`, else None (no MFU is reported)."""
    if peak_tflops:
        return Choice(peak_tflops * 1e12, f"logging.peak_tflops = {peak_tflops:g}")
    if profile.type == "cuda":
        for (fragment, table_precision), value in PEAK_FLOPS.items():  # first match: specific names first
            if fragment in profile.name and table_precision == precision:
                return Choice(value, f"the {fragment} data sheet, {precision}")
    return Choice(None, "no data-sheet peak for this device (set logging.peak_tflops for MFU)")
