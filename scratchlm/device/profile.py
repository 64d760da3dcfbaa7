"""What the device can do, measured: the facts scratchlm's choices of precision, threads and compilation rest on.

    DeviceProfile    the device's name and relevant capabilities, and its measured rates:
                     matmul GFLOP/s in fp32 and bf16 (and fp16 on a GPU), memory bandwidth in GB/s, and
                     how fast a token times a weight matrix runs each way it can (`MATVEC_WAYS`); and how it
                     was measured (when, with how many threads, in how many trials, how busy the cores were)
    usable_cores     the cores this process may run on: its CPU affinity, capped by a cgroup CPU quota
    busy_cores       how many of those other processes keep busy right now (from /proc/stat)
    compiler_found   whether torch.compile can generate code here (a C++ compiler on a CPU, Triton on CUDA)

Why measure rather than read a table: a CPU's name does not say how fast it multiplies bfloat16. On an AVX2-only
x86 CPU (no AVX-512) PyTorch emulates bf16 matmuls about 100x slower than fp32; on one with AVX-512-BF16 or
AMX they run 2-10x faster than fp32. A short matmul of each dtype (a fraction of a second) tells the two apart
on any machine, including ones no table lists. The result is cached per machine, under
`$XDG_CACHE_HOME/scratchlm/` (default `~/.cache/scratchlm/`; `SCRATCHLM_CACHE_DIR` overrides), keyed by the
device's name, the flags and cores that matter, the thread count and the torch version, so later commands start
at once.

A measurement spoiled by other work would steer every later run (a bf16 rate measured 27x too low makes "auto"
train in fp32), so a measurement guards against it (`measure`):

- It is taken in trials (`TRIALS`), each rate the best of them: other work only slows a trial down, so the
  fastest trial is the closest to the device's own rate.
- The cores are watched during each trial, not only before it: /proc/stat's busy time of this process's CPUs
  less this process's own CPU time is the other processes' work, and the measuring thread's CPU time over the
  wall time falls below 1 when it had to wait for its core (the one signal where /proc/stat is missing). A
  trial is quiet when other work left this process's threads their cores (`quiet_enough`). The best rates are
  trustworthy when at least one trial was quiet: the quiet trial is a true measurement, and no busy trial beats
  the truth. While none is, it measures again, up to `MAX_TRIALS`.
- A result that contradicts the CPU's flags (native bf16 measured slower than fp32, where the flags promise it
  2-10x faster) is measured again, up to `MAX_TRIALS`, before it is believed.
- A measurement with no quiet trial is used by the process that took it, marked `provisional`, and never
  cached: the next command measures again.
- Processes that start together (the ranks of one torchrun job, pytest-xdist workers) measure one at a time:
  each takes the machine's lock for the device (`measuring_lock`), and one that waited reads what the first one
  cached instead of measuring over it.

A cached profile corrects itself (`cached_profile`): it expires after `MAX_AGE_DAYS`, and each process that
reads it first times a small matmul of each dtype (`spot_check`, tens of milliseconds). Other work can only slow
that product down, so a product that runs `SPOT_FACTOR` times faster than the profile says proves the profile
was measured too slow, and the device is measured again. (A run's step times cannot do this: a run trains at
the precision the profile chose and never sees how fast the other would have been, and a step's time depends
on the model as much as on the matmul rate.) `scratchlm doctor` says when and how the profile was measured, and
`scratchlm doctor --refresh` measures again at once.

`SCRATCHLM_DEVICE_PROFILE=FILE` (a profile as `scratchlm doctor --json` prints it under "profile", or as the
cache stores it) replaces the measurement for a device of the file's type: the test suite runs once as if the
CPU had native bf16 and once as if it had not, whichever CPU it is on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write
from scratchlm.precisions import DTYPE_NAMES

# CPU flags (as /proc/cpuinfo spells them) that decide how fast low-precision matmuls can be.
RELEVANT_CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "amx_bf16",
    "amx_tile",
    "amx_fp16",
    "asimd",
    "bf16",
)

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
MAX_AGE_DAYS = 7  # a cached profile older than this is measured again
SPOT_FACTOR = 2.0  # a spot check this many times faster than the cached rate: the cache is measured again
SPOT_SECONDS = 0.02  # each dtype's spot check is timed over about this long
LOCK_WAIT_SECONDS = 120.0  # how long a process waits for another one's measurement before measuring itself
# The dtype of each precision (`scratchlm.precisions`): a profile measures the matmul rate of every one.
DTYPES = {precision: getattr(torch, name) for precision, name in DTYPE_NAMES.items()}
# 2: fp16 is measured on CPUs too; 3: matrix-vector rates by weight layout; 4: how the profile was measured
CACHE_VERSION = 4


@dataclass(frozen=True)
class DeviceProfile:
    type: str  # cpu | cuda | mps
    name: str  # the CPU's model name, or the GPU's
    flags: tuple[str, ...] = ()  # the RELEVANT_CPU_FLAGS this CPU has
    cpu_capability: str = ""  # the vector instructions PyTorch's CPU kernels use (DEFAULT, AVX2, AVX512, ...)
    native_bf16: bool = (
        False  # bf16 is computed by the hardware (CUDA: compute capability >= 8.0; CPU: flags)
    )
    matmul_gflops: dict[str, float] = field(default_factory=dict)  # dtype name -> measured rate
    memory_gbps: float = 0.0  # measured copy bandwidth (read + write)
    # dtype name -> {way: GB/s}: a token times wide matrices, each of the `MATVEC_WAYS`
    matvec_gbps: dict[str, dict[str, float]] = field(default_factory=dict)
    gpu_memory_gib: float | None = None
    compute_capability: str | None = None  # CUDA: "9.0"
    torch_version: str = torch.__version__
    # How it was measured (a profile given by a file has none of these):
    measured_at: str = ""  # when, ISO 8601 in UTC
    threads: int = 0  # torch's intra-op threads during the measurement
    trials: int = 0  # how many trials it took the best of
    busy: float = 0.0  # cores other processes kept busy during its quietest trial
    provisional: bool = False  # no trial was quiet: used by the process that measured it, never cached

    def rate(self, dtype: str) -> float:
        return self.matmul_gflops.get(dtype, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DeviceProfile:
        return cls(**{**values, "flags": tuple(values.get("flags", ()))})


# -- the device's identity ----------------------------------------------------------------------------------


def cpu_name_and_flags() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and which of RELEVANT_CPU_FLAGS it has (Linux: /proc/cpuinfo; elsewhere the
    platform's name and no flags)."""
    name, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    if not name:
        import platform

        name = platform.processor() or platform.machine() or "unknown CPU"
    return name, tuple(flag for flag in RELEVANT_CPU_FLAGS if flag in flags)


def _identity(device: torch.device) -> dict[str, Any]:
    """Name and capabilities (no measurement)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": props.name,
            "native_bf16": props.major >= 8,  # Ampere and later; older GPUs emulate bf16
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
        }
    if device.type == "mps":
        import platform

        return {"type": "mps", "name": f"Apple GPU (macOS {platform.mac_ver()[0]})", "native_bf16": False}
    name, flags = cpu_name_and_flags()
    return {
        "type": "cpu",
        "name": name,
        "flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16")),
    }


def available_ram_bytes(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory that new allocations can have without swapping: the kernel's `MemAvailable` (free memory plus
    the caches it can drop), capped by what a cgroup v2 memory limit leaves this container. Elsewhere than
    Linux: the free physical pages."""
    try:
        lines = (proc / "meminfo").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024  # the file says kB and means KiB
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit here
    return available


# -- cores --------------------------------------------------------------------------------------------------


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup, in cores (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None
    when there is none. A container limited to 1.5 CPUs on a 64-core host reports 64 CPUs everywhere else."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        own = []
    paths = [line.split(":", 2)[2] for line in own if line.count(":") >= 2]
    candidates = [root / p.lstrip("/") for p in paths] + [root]
    for directory in candidates:
        try:
            quota, _, period = (directory / "cpu.max").read_text().partition(" ")
            if quota.strip() != "max":
                return int(quota) / int(period)
        except (OSError, ValueError):
            pass
        for v1 in (directory, root / "cpu", root / "cpu,cpuacct"):
            try:
                quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
                period_us = int((v1 / "cpu.cfs_period_us").read_text())
                if quota_us > 0:
                    return quota_us / period_us
            except (OSError, ValueError):
                pass
    return None


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (rounded up)."""
    cores = len(affinity_cpus())
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each CPU in `cpus` so far, from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            numbers = [int(v) for v in values[:8]]
            idle = numbers[3] + numbers[4]  # idle + iowait
            times[int(name[3:])] = (sum(numbers) - idle, sum(numbers))
    return times


def busy_between(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> float:
    """Cores kept busy between two `cpu_times` readings (the sum of each CPU's busy fraction)."""
    busy = 0.0
    for cpu, (busy_after, total_after) in after.items():
        busy_before, total_before = before.get(cpu, (busy_after, total_after))
        if total_after > total_before:
            busy += (busy_after - busy_before) / (total_after - total_before)
    return busy


def busy_cores(seconds: float = 0.3) -> float:
    """How many of this process's CPUs other work keeps busy, measured over `seconds` (this process sleeps
    meanwhile, so what is busy is someone else). Without /proc/stat: the 1-minute load average."""
    cpus = affinity_cpus()
    try:
        before = cpu_times(cpus)
        time.sleep(seconds)
        return busy_between(before, cpu_times(cpus))
    except (OSError, ValueError):
        return min(float(len(cpus)), os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0


def others_busy(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], own_cpu_seconds: float, wall: float
) -> float:
    """Cores that other processes kept busy between two `cpu_times` readings, `wall` seconds apart, during
    which this process itself used `own_cpu_seconds` of CPU time: all that was busy, less this process."""
    return max(0.0, busy_between(before, after) - own_cpu_seconds / wall) if wall > 0 else 0.0


@dataclass(frozen=True)
class Load:
    """What else ran on this process's cores during a stretch of work (`LoadWatch`)."""

    others: float  # cores other processes kept busy; NaN where /proc/stat is missing
    thread_share: float  # the watching thread's CPU time over the wall time: below 1 when it waited


class LoadWatch:
    """Watches the cores from its creation to `load()`: /proc/stat's busy time of this process's CPUs, this
    process's CPU time (every thread's), the watching thread's own CPU time and the wall clock."""

    def __init__(self) -> None:
        self.start = self._mark()

    @staticmethod
    def _mark() -> tuple[dict[int, tuple[int, int]] | None, float, float, float]:
        try:
            cpus: dict[int, tuple[int, int]] | None = cpu_times(affinity_cpus())
        except (OSError, ValueError):
            cpus = None
        own = os.times()
        return cpus, own.user + own.system, time.thread_time(), time.monotonic()

    def load(self) -> Load:
        cpus, own, thread, wall = self._mark()
        cpus0, own0, thread0, wall0 = self.start
        seconds = max(wall - wall0, 1e-9)
        others = math.nan if cpus is None or cpus0 is None else others_busy(cpus0, cpus, own - own0, seconds)
        return Load(others, min(1.0, (thread - thread0) / seconds))


def quiet_enough(load: Load, threads: int, cores: int) -> bool:
    """Whether a trial measured with `threads` threads on `cores` usable cores ran undisturbed: other work
    left those threads their cores (within `BUSY_NOT_CACHED`), and the measuring thread was not kept waiting.
    Work on cores this process's threads do not need (one thread on a 2-core machine) does not count."""
    free = max(0, cores - threads)  # more threads than cores is the user's choice, not other work
    crowded = not math.isnan(load.others) and load.others > free + BUSY_NOT_CACHED
    return not crowded and load.thread_share >= MIN_THREAD_SHARE


def compiler_found(device: torch.device) -> tuple[bool, str]:
    """Whether torch.compile can generate code for `device`, and what it would use: on a CPU, inductor
    compiles C++ and needs a compiler (`CXX`, or c++ / g++ / clang++ on PATH); on CUDA it writes Triton."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "Triton is not installed"
        return True, "Triton"
    if device.type == "mps":
        return True, "Metal"
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")):
        if shutil.which(name):
            return True, f"C++ compiler {shutil.which(name)}"
    return False, "no C++ compiler found (torch.compile needs one on a CPU: install g++ or clang)"


def compile_works(device: torch.device, timeout: float = 300.0) -> tuple[bool, str]:
    """Whether torch.compile really compiles and runs a small function on `device` (in a child process, so a
    compiler crash cannot take this one down), and in how long, or the first line of its error."""
    import subprocess

    code = (
        "import torch\n"
        f"x = torch.randn(64, 64, device={str(device)!r})\n"
        "f = torch.compile(lambda x: torch.tanh(x @ x).sum() + 1)\n"
        "assert torch.allclose(f(x), torch.tanh(x @ x).sum() + 1, rtol=1e-4, atol=1e-3)\n"
    )
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return False, f"a test function did not compile within {timeout:.0f} s"
    if done.returncode == 0:
        return True, f"compiled and ran a test function in {time.perf_counter() - start:.1f} s"
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return False, f"compiling a test function failed: {lines[-1] if lines else f'exit {done.returncode}'}"


# -- measurements -------------------------------------------------------------------------------------------


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


def _one_trial(device: torch.device) -> tuple[dict[str, float], dict[str, dict[str, float]], float]:
    """One trial of every rate: matmul GFLOP/s and matrix-vector GB/s per dtype, and the memory bandwidth."""
    rates: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    for name, dtype in DTYPES.items():
        try:
            rates[name] = matmul_gflops(device, dtype)
            layouts[name] = {way: matvec_gbps(device, dtype, way) for way in MATVEC_WAYS}
        except (RuntimeError, TypeError):  # a dtype the device does not multiply at all
            rates[name] = 0.0
    return rates, layouts, memory_gbps(device)


def contradicts_flags(native_bf16: bool, rates: dict[str, float]) -> bool:
    """Whether measured rates contradict the device's capability by a wide margin: native bf16 (2-10x faster
    than fp32 on a CPU, far more on a GPU) measured slower than fp32. Other work is the usual cause; a CPU
    whose kernels really are that slow measures the same again."""
    return native_bf16 and 0 < rates.get("bf16", 0.0) < rates.get("fp32", 0.0)


def measure(device: torch.device, trials: int | None = None, max_trials: int | None = None) -> DeviceProfile:
    """The device's profile, measured now: each rate the best of `trials` trials (default `TRIALS`), and more
    trials, up to `max_trials` (default `MAX_TRIALS`), while no trial was quiet (`quiet_enough`) or the rates
    contradict the CPU's flags (`contradicts_flags`). A profile with no quiet trial is `provisional`. About a
    second per trial on a CPU."""
    trials = trials or TRIALS
    max_trials = max(trials, max_trials or MAX_TRIALS)
    identity = _identity(device)
    threads, cores = torch.get_num_threads(), usable_cores()
    rates: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    bandwidth, loads = 0.0, []
    while True:
        watch = LoadWatch()
        trial_rates, trial_layouts, trial_bandwidth = _one_trial(device)
        loads.append(watch.load())
        # The best of the trials: other work only slows a trial down.
        for name, rate in trial_rates.items():
            rates[name] = max(rates.get(name, 0.0), rate)
        for name, ways in trial_layouts.items():
            best = layouts.setdefault(name, {})
            for way, rate in ways.items():
                best[way] = max(best.get(way, 0.0), rate)
        bandwidth = max(bandwidth, trial_bandwidth)
        # Another process's CPU work does not slow an accelerator's kernels.
        quiet = device.type != "cpu" or any(quiet_enough(load, threads, cores) for load in loads)
        settled = quiet and not contradicts_flags(identity["native_bf16"], rates)
        if len(loads) >= max_trials or (len(loads) >= trials and settled):
            break
    known = [load.others for load in loads if not math.isnan(load.others)]
    return DeviceProfile(
        **identity,
        matmul_gflops={name: round(rate, 2) for name, rate in rates.items()},
        memory_gbps=round(bandwidth, 1),
        matvec_gbps={
            name: {way: round(rate, 1) for way, rate in ways.items()} for name, ways in layouts.items()
        },
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        threads=threads,
        trials=len(loads),
        busy=round(min(known), 2) if known else 0.0,
        provisional=not quiet,
    )


def spot_check(device: torch.device, profile: DeviceProfile) -> str | None:
    """Why `profile` must have been measured too slow, or None: a small matmul of some dtype (half the
    measurement's size, about `SPOT_SECONDS`) ran `SPOT_FACTOR` times faster than the profile's rate. Other
    work can only slow the spot check down, so a fast one is proof, and a slow one proves nothing. A dtype
    whose one product would take longer than that by the profile (an emulated one) is left to the expiry:
    every command pays for the check."""
    size = (GPU_MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE) // 2
    for name, cached in profile.matmul_gflops.items():
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


def profile_age_days(profile: DeviceProfile) -> float:
    """Days since `profile` was measured (infinite when it does not say)."""
    try:
        measured = datetime.fromisoformat(profile.measured_at)
    except (TypeError, ValueError):
        return math.inf
    return (datetime.now(UTC) - measured).total_seconds() / 86400


# -- the per-machine cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    if "SCRATCHLM_CACHE_DIR" in os.environ:
        return Path(os.environ["SCRATCHLM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scratchlm"


def _cache_key(device: torch.device, threads: int) -> str:
    """What the cache's file name keys a profile by: the device and the thread count it was measured with."""
    identity = _identity(device)
    parts = [
        CACHE_VERSION,
        identity["name"],
        identity.get("flags", ()),
        torch.__version__,
        threads,
        str(device),
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


_in_process: dict[str, DeviceProfile] = {}
PROFILE_OVERRIDE = "SCRATCHLM_DEVICE_PROFILE"


def profile_override(device: torch.device) -> DeviceProfile | None:
    """The profile the file of `$SCRATCHLM_DEVICE_PROFILE` describes, for a device of its type; else None."""
    name = os.environ.get(PROFILE_OVERRIDE)
    if not name:
        return None
    try:
        values = json.loads(Path(name).read_text(encoding="utf-8"))
        profile = DeviceProfile.from_dict(values.get("profile", values))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ScratchlmError(
            f"{PROFILE_OVERRIDE}={name}: not a readable device profile ({type(e).__name__}: {e})"
        ) from None
    return profile if profile.type == device.type else None


def cached_profile(path: Path, device: torch.device) -> DeviceProfile | None:
    """The profile cached in `path`, or None when there is none, or it has expired (`MAX_AGE_DAYS`), or a spot
    check proves it measured too slow (`spot_check`); the last two say so."""
    try:
        profile = DeviceProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if (age := profile_age_days(profile)) > MAX_AGE_DAYS:
        days = "a date it does not give" if math.isinf(age) else f"{age:.0f} days ago"
        console.print(f"note: the cached device profile was measured {days}; measuring again")
        return None
    if (why := spot_check(device, profile)) is not None:
        console.print(f"note: the cached device profile is too slow ({why}); measuring again")
        return None
    return profile


def _acquire(lock: Any, fcntl: Any, seconds: float) -> bool:
    """Take `lock` (an open file) exclusively, waiting up to `seconds` for the process that holds it."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        except OSError:
            return False


@contextlib.contextmanager
def measuring_lock(device: torch.device) -> Iterator[bool]:
    """Holds this machine's lock on measuring `device` (a file in the cache directory): processes that start
    together measure one at a time instead of slowing each other's measurement down. Yields whether it had to
    wait for another process, and says so; after `LOCK_WAIT_SECONDS` (a holder stopped with Ctrl-Z) it goes
    on without the lock. Where there is no `fcntl` or the cache directory cannot be written, there is no lock."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield False
        return
    path = cache_dir() / f"device-{str(device).replace(':', '-')}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")  # noqa: SIM115 (held across the yield)
    except OSError:
        yield False
        return
    with lock:
        waited = False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            waited = True
            console.print("another process is measuring this device; waiting for its result")
            held = _acquire(lock, fcntl, LOCK_WAIT_SECONDS)
            if not held:
                console.print(f"note: still measuring after {LOCK_WAIT_SECONDS:.0f} s; measuring here too")
        except OSError:  # a file system without locks
            held = False
        try:
            yield waited
        finally:
            if held:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _measure_and_cache(device: torch.device, path: Path) -> DeviceProfile:
    """Measure the device, saying so (it takes seconds); cache the profile unless it is provisional."""
    threads = torch.get_num_threads()
    console.print(
        f"measuring {device} with {threads} thread{'' if threads == 1 else 's'}: matmuls, memory and "
        "matrix-vector products in each precision (a few seconds; cached for later commands)"
    )
    profile = measure(device)
    if profile.provisional:
        # Other work slows each dtype by its own factor (bf16 kernels more than fp32 ones, seen 6x against
        # 2x): such a measurement serves this process, but is measured again next time rather than steering
        # every later choice from the cache.
        console.print(
            f"note: other processes took the cores in each of the {profile.trials} trials of the device "
            f"measurement ({profile.busy:.1f} cores busy in the quietest); it is used now but not cached"
        )
        return profile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, "w") as f:
            json.dump(profile.to_dict(), f, indent=1)
    except (OSError, ScratchlmError) as e:  # a read-only home must not stop training
        console.print(f"note: could not cache the device profile in {path}: {e}")
    return profile


def profile_path(device: torch.device) -> Path:
    """Where this machine caches the profile of `device` at the current thread count."""
    return cache_dir() / f"device-{_cache_key(device, torch.get_num_threads())}.json"


def device_profile(device: torch.device, refresh: bool = False) -> DeviceProfile:
    """The device's profile: from this process's memory, else the per-machine cache (`cached_profile`), else
    measured now (with the current thread count, one process at a time: `measuring_lock`) and cached.
    `refresh` measures again. `$SCRATCHLM_DEVICE_PROFILE` overrides all of these (`profile_override`)."""
    if (override := profile_override(device)) is not None:
        return override
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = profile_path(device)
    key = path.stem
    if not refresh and key in _in_process:
        return _in_process[key]
    profile = None if refresh else cached_profile(path, device)
    if profile is None:
        with measuring_lock(device) as waited:
            if waited and not refresh:  # the process this one waited for may have just measured it
                profile = cached_profile(path, device)
            if profile is None:
                profile = _measure_and_cache(device, path)
    _in_process[key] = profile
    return profile


def measurement_note(profile: DeviceProfile) -> str:
    """When and how `profile` was measured, and how to measure it again: `scratchlm doctor`'s line."""
    if not profile.measured_at:
        source = os.environ.get(PROFILE_OVERRIDE)
        return f"given by {PROFILE_OVERRIDE}={source}, not measured" if source else "not measured"
    how = (
        f"{profile.threads} thread{'' if profile.threads == 1 else 's'}, best of {profile.trials} "
        f"trial{'' if profile.trials == 1 else 's'}, {profile.busy:.1f} cores kept busy by other processes"
    )
    if profile.provisional:
        return (
            f"measured now while other processes took the cores ({how} in the quietest trial): used now, "
            "not cached; the next command measures again"
        )
    when = profile.measured_at.replace("T", " ").replace("+00:00", " UTC")
    return (
        f"measured {when} ({how}); measured again after {MAX_AGE_DAYS} days, or now with "
        "`scratchlm doctor --refresh`"
    )
