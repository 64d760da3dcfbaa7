"""What the device does, measured: the matmul, bandwidth, matrix-vector and int8 rates scratchlm's choices of
precision and inference layout rest on, and how a measurement guards against other work.

    matmul_gflops    a square matmul's rate in a dtype, GFLOP/s (2 n³ FLOPs a product)
    memory_gbps      a large copy's bandwidth, GB/s read plus written
    matvec_gbps      one token times wide weight matrices, each of the `MATVEC_WAYS`, GB/s of weights read
    int8_gbps        a few tokens times an int8 matrix, each of the `INT8_WAYS`, GB/s of int8 weights read
    measure_rates    all of them, in trials, as `Rates`: what `scratchlm.device.profile` caches
    spot_check       a quick product that proves a cached rate was measured too slow

Why measure rather than read a table: a CPU's name does not say how fast it multiplies bfloat16. On an AVX2-only
x86 CPU (no AVX-512) PyTorch emulates bf16 matmuls about 100x slower than fp32; on one with AVX-512-BF16 or
AMX they run 2-10x faster than fp32. A short matmul of each dtype (a fraction of a second) tells the two apart
on any machine, including ones no table lists.

A measurement spoiled by other work would steer every later run (a bf16 rate measured 27x too low makes "auto"
train in fp32), so a measurement guards against it (`measure_rates`):

- It is taken in trials (`TRIALS`), each rate the best of them: other work only slows a trial down, so the
  fastest trial is the closest to the device's own rate.
- The cores are watched during each trial, not only before it (`scratchlm.device.host.LoadWatch`): /proc/stat's
  busy time of this process's CPUs less this process's own CPU time is the other processes' work, and the
  measuring thread's CPU time over the wall time falls below 1 when it had to wait for its core (the one signal
  where /proc/stat is missing). A trial is quiet when other work left this process's threads their cores
  (`quiet_enough`). The best rates are trustworthy when at least one trial was quiet: the quiet trial is a true
  measurement, and no busy trial beats the truth. While none is, it measures again, up to `MAX_TRIALS`.
- A result that contradicts the CPU's flags (native bf16 measured slower than fp32, where the flags promise it
  2-10x faster) is measured again, up to `MAX_TRIALS`, before it is believed.
- A measurement with no quiet trial is `provisional`: used by the process that took it, never cached.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scratchlm.device.host import Load, LoadWatch, usable_cores
from scratchlm.kernels import int8_cpu
from scratchlm.precisions import DTYPE_NAMES

# Square matmul sizes of the rate measurement: large enough to reach a device's rate, small enough that the
# slowest case (emulated bf16 on a CPU, ~1 GFLOP/s) takes a fraction of a second.
CPU_MATMUL_SIZE = 512
GPU_MATMUL_SIZE = 4096
CPU_MEMORY_MIB = 64  # the copy of the bandwidth measurement: a CPU reaches its bandwidth well before
GPU_MEMORY_MIB = 256
MATVEC_MIB = 64  # a matrix-vector rate's matrices: more than a CPU's caches hold, as a model's weights
MEASURE_SECONDS = 0.15  # each rate is timed over at least this long (or one multiplication, if slower)
MATVEC_SECONDS = 0.05  # each matrix-vector rate: dozens of passes over its matrices on a CPU
TRIALS = 2  # trials of a measurement, each rate the best of them
MAX_TRIALS = 3  # one more while no trial was quiet, or while the rates contradict the CPU's flags
BUSY_NOT_CACHED = 0.5  # cores of other work beyond the ones this process's threads leave free: a busy trial
MIN_THREAD_SHARE = 0.8  # a measuring thread that ran less of the wall time than this waited for its core
SPOT_FACTOR = 2.0  # a spot check this many times faster than the cached rate: the cache is measured again
SPOT_SECONDS = 0.02  # each dtype's spot check is timed over about this long
# The dtype of each precision (`scratchlm.precisions`): a profile measures the matmul rate of every one.
DTYPES = {precision: getattr(torch, name) for precision, name in DTYPE_NAMES.items()}


def quiet_enough(load: Load, threads: int, cores: int) -> bool:
    """Whether a trial measured with `threads` threads on `cores` usable cores ran undisturbed: other work
    left those threads their cores (within `BUSY_NOT_CACHED`), and the measuring thread was not kept waiting.
    Work on cores this process's threads do not need (one thread on a 2-core machine) does not count."""
    free = max(0, cores - threads)  # more threads than cores is the user's choice, not other work
    crowded = not math.isnan(load.others) and load.others > free + BUSY_NOT_CACHED
    return not crowded and load.thread_share >= MIN_THREAD_SHARE


# -- one rate each ------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_gflops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, seconds: float | None = None
) -> float:
    """Measured rate of a square matmul of `size` in `dtype`, in GFLOP/s (2 size³ FLOPs per product), timed over
    about `seconds` (default `MEASURE_SECONDS`). A first product that alone takes that long is the measurement:
    an emulated dtype's, where a first call's setup is small beside it."""
    size = size or (GPU_MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE)
    seconds = MEASURE_SECONDS if seconds is None else seconds
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    _synchronize(device)
    start = time.perf_counter()
    a @ b  # warm-up; its time says how many repetitions fit
    _synchronize(device)
    once = time.perf_counter() - start
    if once >= seconds:
        return 2 * size**3 / once / 1e9
    reps = max(1, min(1000, int(seconds / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e9


def memory_gbps(device: torch.device, mib: int | None = None) -> float:
    """Measured bandwidth of copying `mib` MiB (bytes read plus bytes written per second), in GB/s."""
    mib = mib or (CPU_MEMORY_MIB if device.type == "cpu" else GPU_MEMORY_MIB)
    source = torch.ones(mib * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _synchronize(device)
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < MEASURE_SECONDS or reps < 2:
        target.copy_(source)
        _synchronize(device)
        reps += 1
        elapsed = time.perf_counter() - start
    return 2 * source.numel() * 4 * reps / elapsed / 1e9


# The ways a token times a weight matrix can run (`DeviceProfile.matvec_gbps`, `choices.choose_matvec`): the
# matrix held by rows (the parameters' layout) or by columns (`W.T` contiguous), and by rows with PyTorch's
# own kernels instead of oneDNN's (which PyTorch uses for bf16 where the CPU has native bf16).
MATVEC_WAYS = ("rows", "columns", "rows_no_onednn")


def matvec_gbps(device: torch.device, dtype: torch.dtype, way: str, mib: int | None = None) -> float:
    """Measured rate of one token times wide matrices, `x @ W.T` with `W` of (2048, 512) in `dtype`, run the
    `MATVEC_WAYS` way `way`, in GB/s of weights read: decoding's product, whose speed on a CPU depends on the
    layout and the library (each picks a different kernel). The matrices add up to `mib` MiB, more than a
    CPU's caches hold, as a model's weights do (default `MATVEC_MIB`)."""
    d_out, d_in = 2048, 512
    mib = mib or MATVEC_MIB
    count = max(1, mib * 2**20 // (d_out * d_in * dtype.itemsize))
    # Any values serve (the time of a product does not depend on them, short of subnormals): filled, not drawn.
    block = torch.full((count, d_out, d_in), 0.01, dtype=dtype, device=device)
    if way == "columns":
        block = block.transpose(1, 2).contiguous().transpose(1, 2)
    matrices = list(block)
    x = torch.full((1, d_in), 0.5, dtype=dtype, device=device)
    onednn = torch.backends.mkldnn  # a process-wide switch (its `flags()` context warns on every CPU)
    enabled, onednn.enabled = onednn.enabled, way != "rows_no_onednn"
    try:
        x @ matrices[0].T  # warm-up: the kernel's first call sets it up
        _synchronize(device)
        passes, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < MATVEC_SECONDS or passes < 1:
            for w in matrices:
                x @ w.T
            _synchronize(device)
            passes += 1
    finally:
        onednn.enabled = enabled
    return count * d_out * d_in * dtype.itemsize * passes / elapsed / 1e9


# The ways an int8 matrix with one scale a row (`--quantize int8`, `scratchlm.generation.quantize`) multiplies
# activations eagerly (`DeviceProfile.int8_gbps`, `choices.choose_int8_matmul`): PyTorch's kernel
# `aten._weight_int8pack_mm`, the weight dequantized into the activations' dtype and multiplied by the BLAS, or
# scratchlm's CPU kernel (`scratchlm.kernels.int8_cpu`, built at its first use) in the form the layers run for
# the rows (`int8_cpu.matmul`: the int8 x int8 form at one token, the float form at 16).
INT8_WAYS = ("pack", "dequantize", "kernel")
# The products timed: one token (a decode step), and 16 (a batched step, a short prefill).
INT8_TOKENS = (1, 16)
INT8_REPEATS = 5  # each product's time is the best of this many, after a first call


def int8_gbps(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Measured rates of activations in `dtype` times an int8 (1024, 512) matrix with a scale a row, each of
    the `INT8_WAYS` at each of `INT8_TOKENS`, in GB/s of int8 weights read, keyed `"{way}_{tokens}"`
    ("pack_1", "dequantize_16", "kernel_1", ...); each the best of `INT8_REPEATS`. "pack" and "kernel" are
    0.0 where their kernel is missing (scratchlm's did not build), refuses `dtype`, or gives something other
    than the dequantized product (within 2 % of its largest output). "kernel" is timed in the form a layer
    runs for that many rows (`int8_cpu.matmul`), activations quantized too at one token. Measured on a CPU
    only: {} on another device, where inference keeps the dequantized product. The matrix fits a CPU's caches
    (0.5 MiB): both ways read the same bytes, and what is compared is how fast each turns them into the
    product."""
    if device.type != "cpu":
        return {}
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (1024, 512), generator=generator, dtype=torch.int8)
    scale = (torch.rand(1024, generator=generator) / 100).to(dtype)
    kernels = {
        "pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, weight, scale),
        # Only where it is built already (`int8_cpu.ready`): `--quantize int8` builds it at its first use.
        "kernel": lambda x: (
            int8_cpu.matmul(x, weight, scale) if int8_cpu.ready() and int8_cpu.load() else None
        ),
    }
    rates: dict[str, float] = {}
    for tokens in INT8_TOKENS:
        x = torch.randn(tokens, 512, generator=generator).to(dtype)
        reference = (x.float() @ weight.float().T) * scale.float()
        with torch.no_grad():
            seconds = _best_seconds(lambda x=x: (x @ weight.to(dtype).T) * scale)
            rates[f"dequantize_{tokens}"] = weight.numel() / seconds / 1e9
            for way, kernel in kernels.items():
                rates[f"{way}_{tokens}"] = 0.0
                try:
                    y = kernel(x)
                except (AttributeError, RuntimeError, NotImplementedError):  # no kernel, or none for `dtype`
                    continue
                tolerance = 2e-2 * float(reference.abs().max())
                if y is None or not torch.allclose(y.float(), reference, rtol=2e-2, atol=tolerance):
                    continue
                seconds = _best_seconds(lambda x=x, kernel=kernel: kernel(x))
                rates[f"{way}_{tokens}"] = weight.numel() / seconds / 1e9
    return rates


def _best_seconds(run: Callable[[], object]) -> float:
    """The shortest of `INT8_REPEATS` runs of `run`, after one that sets it up: other work only slows a run."""
    run()
    best = math.inf
    for _ in range(INT8_REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


@dataclass(frozen=True)
class _Trial:
    """One trial of every rate (`Rates`' fields of these names)."""

    matmul_gflops: dict[str, float]
    memory_gbps: float
    matvec_gbps: dict[str, dict[str, float]]
    int8_gbps: dict[str, dict[str, float]]


def _one_trial(device: torch.device) -> _Trial:
    """One trial of every rate: matmul GFLOP/s, matrix-vector and int8 GB/s per dtype, and the bandwidth."""
    rates: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    int8: dict[str, dict[str, float]] = {}
    for name, dtype in DTYPES.items():
        try:
            rates[name] = matmul_gflops(device, dtype)
            layouts[name] = {way: matvec_gbps(device, dtype, way) for way in MATVEC_WAYS}
            if found := int8_gbps(device, dtype):
                int8[name] = found
        except (RuntimeError, TypeError):  # a dtype the device does not multiply at all
            rates[name] = 0.0
    return _Trial(rates, memory_gbps(device), layouts, int8)


def _keep_best(best: dict[str, dict[str, float]], trial: dict[str, dict[str, float]]) -> None:
    """Each rate of `trial` into `best` (dtype name -> {what: rate}) where it is higher."""
    for name, found in trial.items():
        kept = best.setdefault(name, {})
        for what, rate in found.items():
            kept[what] = max(kept.get(what, 0.0), rate)


def _significant(rate: float, digits: int = 3) -> float:
    """`rate` to `digits` significant digits: int8 rates span 0.05 to 50 GB/s, and are compared."""
    return float(f"{rate:.{digits}g}")


def contradicts_flags(native_bf16: bool, rates: dict[str, float]) -> bool:
    """Whether measured rates contradict the device's capability by a wide margin: native bf16 (2-10x faster
    than fp32 on a CPU, far more on a GPU) measured slower than fp32. Other work is the usual cause; a CPU
    whose kernels really are that slow measures the same again."""
    return native_bf16 and 0 < rates.get("bf16", 0.0) < rates.get("fp32", 0.0)


# -- a measurement ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """Every rate of a device, the best of the trials, and how they were measured (`DeviceProfile`'s fields
    of these names)."""

    matmul_gflops: dict[str, float]  # dtype name -> GFLOP/s
    memory_gbps: float
    matvec_gbps: dict[str, dict[str, float]]  # dtype name -> {way: GB/s}
    int8_gbps: dict[str, dict[str, float]]  # dtype name -> {"{way}_{tokens}": GB/s}; {} off a CPU
    threads: int  # torch's intra-op threads during the measurement
    trials: int
    busy: float  # cores other processes kept busy during the quietest trial
    provisional: bool  # no trial was quiet


def measure_rates(
    device: torch.device, native_bf16: bool, trials: int | None = None, max_trials: int | None = None
) -> Rates:
    """The device's rates, measured now: each the best of `trials` trials (default `TRIALS`), and more
    trials, up to `max_trials` (default `MAX_TRIALS`), while no trial was quiet (`quiet_enough`) or the rates
    contradict a device whose flags promise `native_bf16` (`contradicts_flags`). Rates with no quiet trial are
    `provisional`. About a second per trial on a CPU."""
    trials = trials or TRIALS
    max_trials = max(trials, max_trials or MAX_TRIALS)
    threads, cores = torch.get_num_threads(), usable_cores()
    rates: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    int8: dict[str, dict[str, float]] = {}
    bandwidth, loads = 0.0, []
    while True:
        watch = LoadWatch()
        trial = _one_trial(device)
        loads.append(watch.load())
        # The best of the trials: other work only slows a trial down.
        for name, rate in trial.matmul_gflops.items():
            rates[name] = max(rates.get(name, 0.0), rate)
        _keep_best(layouts, trial.matvec_gbps)
        _keep_best(int8, trial.int8_gbps)
        bandwidth = max(bandwidth, trial.memory_gbps)
        # Another process's CPU work does not slow an accelerator's kernels.
        quiet = device.type != "cpu" or any(quiet_enough(load, threads, cores) for load in loads)
        settled = quiet and not contradicts_flags(native_bf16, rates)
        if len(loads) >= max_trials or (len(loads) >= trials and settled):
            break
    known = [load.others for load in loads if not math.isnan(load.others)]
    return Rates(
        matmul_gflops={name: round(rate, 2) for name, rate in rates.items()},
        memory_gbps=round(bandwidth, 1),
        matvec_gbps={
            name: {way: round(rate, 1) for way, rate in ways.items()} for name, ways in layouts.items()
        },
        int8_gbps={
            name: {what: _significant(rate) for what, rate in found.items()} for name, found in int8.items()
        },
        threads=threads,
        trials=len(loads),
        busy=round(min(known), 2) if known else 0.0,
        provisional=not quiet,
    )


def spot_check(device: torch.device, matmul_rates: dict[str, float]) -> str | None:
    """Why `matmul_rates` (dtype name -> GFLOP/s, a cached profile's) must have been measured too slow, or
    None: a small matmul of some dtype (half the measurement's size, about `SPOT_SECONDS`) ran `SPOT_FACTOR`
    times faster than its rate. Other work can only slow the spot check down, so a fast one is proof, and a
    slow one proves nothing. A dtype whose one product would take longer than that by its rate (an emulated
    one) is left to the profile's expiry: every command pays for the check."""
    size = (GPU_MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE) // 2
    for name, cached in matmul_rates.items():
        if cached <= 0 or name not in DTYPES or 2 * size**3 / (cached * 1e9) > SPOT_SECONDS:
            continue
        try:
            rate = matmul_gflops(device, DTYPES[name], size, SPOT_SECONDS)
        except (RuntimeError, TypeError):
            continue
        if rate > SPOT_FACTOR * cached:
            return (
                f"a {name} matmul ran at {rate:,.1f} GFLOP/s, {rate / cached:.1f}x the cached {cached:,.1f}"
            )
    return None
