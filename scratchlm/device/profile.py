"""What the device can do, measured: the facts scratchlm's choices of precision, threads and compilation rest on.

    DeviceProfile    the device's name and relevant capabilities, and its measured rates:
                     matmul GFLOP/s in fp32 and bf16 (and fp16 on a GPU), memory bandwidth in GB/s, and
                     how fast a token times a weight matrix runs each way it can (`MATVEC_WAYS`)
    usable_cores     the cores this process may run on: its CPU affinity, capped by a cgroup CPU quota
    busy_cores       how many of those other processes keep busy right now (from /proc/stat)
    compiler_found   whether torch.compile can generate code here (a C++ compiler on a CPU, Triton on CUDA)

Why measure rather than read a table: a CPU's name does not say how fast it multiplies bfloat16. On an AVX2-only
x86 CPU (no AVX-512) PyTorch emulates bf16 matmuls about 100x slower than fp32; on one with AVX-512-BF16 or
AMX they run 2-10x faster than fp32. A short matmul of each dtype (a fraction of a second) tells the two apart
on any machine, including ones no table lists. The result is cached per machine, under
`$XDG_CACHE_HOME/scratchlm/` (default `~/.cache/scratchlm/`; `SCRATCHLM_CACHE_DIR` overrides), keyed by the
device's name, the flags and cores that matter, and the torch version, so later commands start at once. A
measurement taken while other processes keep the cores busy is used but not cached.

`SCRATCHLM_DEVICE_PROFILE=FILE` (a profile as `scratchlm doctor --json` prints it under "profile", or as the
cache stores it) replaces the measurement for a device of the file's type: the test suite runs once as if the
CPU had native bf16 and once as if it had not, whichever CPU it is on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

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
BUSY_NOT_CACHED = 0.5  # cores kept busy by other processes above which a measurement is not cached
MEASURE_SECONDS = 0.15  # each rate is timed over at least this long (or one multiplication, if slower)
MATVEC_SECONDS = 0.05  # each matrix-vector rate: dozens of passes over its matrices on a CPU
# The dtype of each precision (`scratchlm.precisions`): a profile measures the matmul rate of every one.
DTYPES = {precision: getattr(torch, name) for precision, name in DTYPE_NAMES.items()}
CACHE_VERSION = 3  # 2: fp16 is measured on CPUs too; 3: matrix-vector rates by weight layout


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


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int | None = None) -> float:
    """Measured rate of a square matmul of `size` in `dtype`, in GFLOP/s (2 size³ FLOPs per product)."""
    size = size or (GPU_MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    _synchronize(device)
    start = time.perf_counter()
    a @ b  # warm-up; its time says how many repetitions fit
    _synchronize(device)
    once = time.perf_counter() - start
    reps = max(1, min(1000, int(MEASURE_SECONDS / max(once, 1e-6))))
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize(device)
    return 2 * size**3 * reps / (time.perf_counter() - start) / 1e9


def memory_gbps(device: torch.device, mib: int = 256) -> float:
    """Measured bandwidth of copying `mib` MiB (bytes read plus bytes written per second), in GB/s."""
    if device.type == "cpu":
        mib = 64  # a CPU reaches its bandwidth well before; keep the measurement's memory small
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


def matvec_gbps(device: torch.device, dtype: torch.dtype, way: str, mib: int = 64) -> float:
    """Measured rate of one token times wide matrices, `x @ W.T` with `W` of (2048, 512) in `dtype`, run the
    `MATVEC_WAYS` way `way`, in GB/s of weights read: decoding's product, whose speed on a CPU depends on the
    layout and the library (each picks a different kernel). The matrices add up to `mib` MiB, more than a
    CPU's caches hold, as a model's weights do."""
    d_out, d_in = 2048, 512
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
        for w in matrices:  # warm-up
            x @ w.T
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


def measure(device: torch.device) -> DeviceProfile:
    """The device's profile, measured now (about a second)."""
    identity = _identity(device)
    rates: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    for name, dtype in DTYPES.items():
        try:
            rates[name] = round(matmul_gflops(device, dtype), 2)
            layouts[name] = {way: round(matvec_gbps(device, dtype, way), 1) for way in MATVEC_WAYS}
        except (RuntimeError, TypeError):  # a dtype the device does not multiply at all
            rates[name] = 0.0
    return DeviceProfile(
        **identity,
        matmul_gflops=rates,
        memory_gbps=round(memory_gbps(device), 1),
        matvec_gbps=layouts,
    )


# -- the per-machine cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    if "SCRATCHLM_CACHE_DIR" in os.environ:
        return Path(os.environ["SCRATCHLM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scratchlm"


def _cache_key(device: torch.device, threads: int) -> str:
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


def device_profile(device: torch.device, refresh: bool = False) -> DeviceProfile:
    """The device's profile: from this process's memory, else the per-machine cache, else measured now (with
    the current thread count) and cached. `refresh` measures again. `$SCRATCHLM_DEVICE_PROFILE` overrides all
    of these (`profile_override`)."""
    if (override := profile_override(device)) is not None:
        return override
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _cache_key(device, torch.get_num_threads())
    if not refresh and key in _in_process:
        return _in_process[key]
    path = cache_dir() / f"device-{key}.json"
    profile = None
    if not refresh:
        try:
            profile = DeviceProfile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            profile = None
    if profile is None:
        # Other work on the cores slows each dtype by its own factor (bf16 kernels more than fp32 ones, seen
        # 6x against 2x): such a measurement serves this process, but is measured again next time rather than
        # steering every later choice from the cache.
        busy = busy_cores() if device.type == "cpu" else 0.0
        profile = measure(device)
        if busy >= BUSY_NOT_CACHED:
            print(
                f"note: other processes kept {busy:.1f} cores busy while the device was measured; "
                "the measurement is not cached",
                file=sys.stderr,
            )
        else:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_write(path, "w") as f:
                    json.dump(profile.to_dict(), f, indent=1)
            except (OSError, ScratchlmError) as e:  # a read-only home must not stop training
                print(f"note: could not cache the device profile in {path}: {e}", file=sys.stderr)
    _in_process[key] = profile
    return profile
