"""The host's facts, read rather than measured: which CPU (or GPU) this is, which of its features matter, how
much memory new allocations can have, which cores this process may use, and how busy other processes keep them.

    cpu_name_and_flags   a CPU's model name and the flags that decide how fast low-precision matmuls can be
    usable_cores      the cores this process may run on: its CPU affinity, capped by a cgroup CPU quota
    busy_cores        how many of those other processes keep busy right now (from /proc/stat)
    LoadWatch         what other work ran on those cores during a stretch of this process's own work
    available_ram_bytes   the memory new allocations can have without swapping, within a cgroup's limit

Nothing here times anything: the measured rates are `scratchlm.device.rates`, and the probes of the compiler
`scratchlm.device.compiler`. On Linux the facts come from /proc and /sys; elsewhere from the platform module and
`os`, with fewer of them known.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

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
