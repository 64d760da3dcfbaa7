"""What scratchlm does on a device: the precision, thread count and compilation it chooses, and why.

Precision. `"auto"` (the default of every config) resolves to bf16 where the device multiplies bf16 at least
`BF16_GAIN` times faster than fp32 by measurement (`scratchlm.device.profile`): CUDA GPUs with native bf16
(compute capability 8.0 and later) and CPUs with AVX-512-BF16 or AMX. Everywhere else it is fp32: on CPUs
without native bf16, where PyTorch emulates bf16 matmuls about 100x slower, on GPUs that emulate it, and on
Apple's MPS, where support depends on the macOS version (when unsure, fp32). The same resolved precision
decides every other bf16 choice: Muon's Newton–Schulz iteration (`optimizer.muon_bf16` follows it), evaluation
and generation. An explicit "bf16" is obeyed, with a one-line warning when the device computes it more than
`SLOW_FACTOR` times slower than fp32.

Threads (CPU). A CPU training step uses one thread per core it may run on (`usable_cores`: the affinity mask,
capped by a cgroup CPU quota) less the cores that other processes keep busy when training starts
(`busy_cores`). PyTorch's worker threads spin while they wait for each other, so a thread that shares its core
with another busy process stalls every step: measured on 2 cores with one other busy process, a step ran at
1,711 tokens/s with 2 threads and 2,734 with 1. An explicit choice wins: `training.threads`, the
`OMP_NUM_THREADS` environment variable, or a `torch.set_num_threads` call after importing scratchlm.

Compilation. `training.compile = true` compiles where torch.compile can generate code (on a CPU it needs a C++
compiler); where it cannot, the run goes on uncompiled and says why.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from scratchlm.device.profile import (
    DeviceProfile,
    affinity_cpus,
    busy_between,
    busy_cores,
    compiler_found,
    cpu_times,
    device_profile,
    usable_cores,
)

PRECISIONS = ("auto", "fp32", "bf16")
BF16_GAIN = 1.25  # auto picks bf16 when its matmuls are at least this much faster than fp32's (autocast
# converts activations to bf16 and back, which costs part of the gain)
SLOW_FACTOR = 1.5  # an explicit bf16 this many times slower than fp32 gets a warning

# torch's own thread count, before anything changes it: a different count later means someone chose one.
_TORCH_DEFAULT_THREADS = torch.get_num_threads()
_applied_threads: int | None = None  # the count scratchlm itself last set


@dataclass(frozen=True)
class Choice:
    value: Any
    reason: str
    measured: bool = False  # chosen from a measurement of the machine, not set by the user


@dataclass(frozen=True)
class Plan:
    """The choices for one device, each with its reason; `warnings` for explicit choices that are slow here."""

    device: str
    profile: DeviceProfile
    precision: Choice  # "fp32" | "bf16"
    threads: Choice  # an int (CPU), or None (an accelerator: left to torch)
    compile: Choice  # bool
    warnings: tuple[str, ...] = ()

    def summary(self) -> str:
        """The one line a command prints when it starts."""
        p = self.profile
        name = p.name if p.type != "cpu" else f"{p.name} ({'native' if p.native_bf16 else 'no native'} bf16)"
        n = self.threads.value
        threads = "" if n is None else f", {n} thread{'' if n == 1 else 's'}"
        return (
            f"{self.device}: {name} → {self.precision.value}{threads}, "
            f"{'compiled' if self.compile.value else 'not compiled'} "
            f"({self.precision.reason}{'; ' + self.threads.reason if self.threads.value is not None else ''})"
        )

    def to_dict(self) -> dict[str, Any]:
        """What a run records and `scratchlm doctor --json` prints."""
        return {
            "device": self.device,
            "profile": self.profile.to_dict(),
            **{name: asdict(getattr(self, name)) for name in ("precision", "threads", "compile")},
            "warnings": list(self.warnings),
        }


def resolve_precision(requested: str, profile: DeviceProfile) -> tuple[Choice, list[str]]:
    """`requested` ("auto", "fp32", "bf16") on a device with `profile`: the precision, its reason, and the
    warnings an explicit slow choice deserves."""
    fp32, bf16 = profile.rate("fp32"), profile.rate("bf16")
    rates = f"bf16 matmul {bf16:,.1f} GFLOP/s, fp32 {fp32:,.1f}"
    if requested == "fp32":
        return Choice("fp32", "training.precision = fp32"), []
    if requested == "bf16":
        warnings = []
        if bf16 * SLOW_FACTOR < fp32:
            warnings.append(
                f"training.precision = bf16 on a device that computes it {fp32 / max(bf16, 1e-9):.0f}x slower "
                f'than fp32 ({rates}); "auto" would choose fp32'
            )
        return Choice("bf16", "training.precision = bf16"), warnings
    if profile.type == "mps":
        return Choice("fp32", "MPS: bf16 support depends on the macOS version, so fp32"), []
    if profile.type == "cuda" and not profile.native_bf16:
        return Choice("fp32", f"compute capability {profile.compute_capability} emulates bf16"), []
    if bf16 >= BF16_GAIN * fp32:
        return Choice("bf16", f"native bf16: {rates}"), []
    return Choice("fp32", f"{'' if profile.native_bf16 else 'no native bf16: '}{rates}"), []


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
        busy = busy_between(before[0], now[0])
        ours = (now[1] - before[1]) / (now[2] - before[2])
        others = max(0.0, busy - ours)
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


def plan(device: torch.device, precision: str = "auto", compile: bool = False, threads: int = 0) -> Plan:
    """The choices for training (or inference) on `device` with the config's requests."""
    threads_choice = choose_threads(threads) if device.type == "cpu" else Choice(None, "")
    # Measured with the threads that will run (a rate at 2 threads is not one at 1).
    previous = torch.get_num_threads()
    if threads_choice.value is not None and threads_choice.value != previous:
        torch.set_num_threads(threads_choice.value)
    try:
        profile = device_profile(device)
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
    precision_choice, warnings = resolve_precision(precision, profile)
    compile_choice = choose_compile(compile, device)
    if compile and not compile_choice.value:
        warnings.append(f"training.compile = true, but {compile_choice.reason}: running uncompiled")
    return Plan(str(device), profile, precision_choice, threads_choice, compile_choice, tuple(warnings))


def autocast(device: torch.device, precision: str) -> torch.autocast:
    """The autocast context of a resolved precision: bf16 matmuls with float32 weights, or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
