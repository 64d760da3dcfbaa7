"""The device's profile: what it is and how fast it runs, measured once per machine and cached.

    DeviceProfile    the device's name and capabilities (`scratchlm.device.host`) and its measured rates
                     (`scratchlm.device.rates`): matmul GFLOP/s in each precision, memory bandwidth in GB/s,
                     how fast a token times a weight matrix runs each way it can, and an int8 matrix each
                     way it can (`--quantize int8`); and how it was measured
                     (when, with how many threads, in how many trials, how busy the cores were)
    device_profile   the profile of a device: from this process's memory, else the machine's cache, else
                     measured now and cached
    measurement_note when and how a profile was measured: `scratchlm doctor`'s line

The result is cached per machine, under `$XDG_CACHE_HOME/scratchlm/` (default `~/.cache/scratchlm/`;
`SCRATCHLM_CACHE_DIR` overrides), keyed by the device's name, the flags and cores that matter, the thread count
and the torch version, so later commands start at once. A measurement with no quiet trial (`provisional`) is
used by the process that took it and never cached: the next command measures again. Processes that start
together (the ranks of one torchrun job, pytest-xdist workers) measure one at a time: each takes the machine's
lock for the device (`measuring_lock`), and one that waited reads what the first one cached instead of
measuring over it.

A cached profile corrects itself (`cached_profile`): it expires after `MAX_AGE_DAYS`, and each process that
reads it first times a small matmul of each dtype (`scratchlm.device.rates.spot_check`, tens of milliseconds).
Other work can only slow that product down, so a product that runs `rates.SPOT_FACTOR` times faster than the profile
says proves the profile was measured too slow, and the device is measured again. (A run's step times cannot do
this: a run trains at the precision the profile chose and never sees how fast the other would have been, and a
step's time depends on the model as much as on the matmul rate.) `scratchlm doctor` says when and how the
profile was measured, and `scratchlm doctor --refresh` measures again at once.

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
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from scratchlm.console import console
from scratchlm.device.rates import measure_rates, spot_check
from scratchlm.device.select import identity
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write

MAX_AGE_DAYS = 7  # a cached profile older than this is measured again
LOCK_WAIT_SECONDS = 120.0  # how long a process waits for another one's measurement before measuring itself
# 2: fp16 is measured on CPUs too; 3: matrix-vector rates by weight layout; 4: how the profile was measured;
# 5: int8 products each way; 6: scratchlm's int8 kernel among them; 7: that kernel timed in the form the layers
# run (activations quantized too at one token), not its float form alone
CACHE_VERSION = 7


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
    # dtype name -> {"{way}_{tokens}": GB/s}: a few tokens times an int8 matrix, each of the `INT8_WAYS`
    int8_gbps: dict[str, dict[str, float]] = field(default_factory=dict)
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


def measure(device: torch.device, trials: int | None = None, max_trials: int | None = None) -> DeviceProfile:
    """The device's profile, measured now (`scratchlm.device.rates.measure_rates`: `trials` trials at least,
    `max_trials` at most), dated now."""
    found = identity(device)
    rates = measure_rates(device, found["native_bf16"], trials, max_trials)
    return DeviceProfile(
        **found, **asdict(rates), measured_at=datetime.now(UTC).isoformat(timespec="seconds")
    )


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
    found = identity(device)
    parts = [
        CACHE_VERSION,
        found["name"],
        found.get("flags", ()),
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
    if (why := spot_check(device, profile.matmul_gflops)) is not None:
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
        f"measuring {device} with {threads} thread{'' if threads == 1 else 's'}: matmuls, memory, "
        "matrix-vector and int8 products in each precision (a few seconds; cached for later commands)"
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


def profile_path(device: torch.device, threads: int | None = None) -> Path:
    """Where this machine caches the profile of `device` at `threads` (default: the current thread count)."""
    return cache_dir() / f"device-{_cache_key(device, threads or torch.get_num_threads())}.json"


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
