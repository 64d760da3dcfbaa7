"""The device's profile and what scratchlm chooses on it: precision "auto" with the device's capability and
measured rates mocked both ways (CPU with and without native bf16, CUDA with and without, with fast fp16 only,
MPS), the warning for an explicit slow bf16 or fp16, the plan's dtype, autocast, fused loss and MFU peak, the
profile override for tests, Muon's iteration dtype, the thread count under a restricted affinity mask and a
cgroup quota, the doctor's report, and that training runs with what the doctor says. The measurement against
other work, with real processes: two that measure at once, one that other processes' spinning interrupts, one
that waits for another's measurement; the re-measurement of a native bf16 measured slower than fp32 (the flag
mocked both ways), and a cached profile that expires or that a spot check proves too slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from helpers import PROJECT_ROOT, settled, torch_threads
from test_trainer import records, small_config

from scratchlm.cli import main
from scratchlm.device import choices as choices_module
from scratchlm.device import compiler as compiler_module
from scratchlm.device import host as host_module
from scratchlm.device import planning as plan_module
from scratchlm.device import profile as profile_module
from scratchlm.device import rates as rates_module
from scratchlm.device import select as select_module
from scratchlm.device.choices import PEAK_FLOPS, choose_threads, resolve_precision
from scratchlm.device.host import cgroup_cpu_limit
from scratchlm.device.planning import plan
from scratchlm.device.profile import DeviceProfile, device_profile
from scratchlm.errors import ScratchlmError
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.precisions import PRECISIONS
from scratchlm.training.config import TrainConfig
from scratchlm.training.optimizers import build_optimizer
from scratchlm.training.trainer import train

# Rates as measured on real machines (GFLOP/s, 2 cores): an AVX2-only EPYC emulates bf16 ~100x slower than
# fp32; a CPU with AVX-512-BF16 runs bf16 ~3x faster.
AVX2_CPU = DeviceProfile(
    type="cpu",
    name="AMD EPYC (AVX2)",
    flags=("avx2", "fma"),
    cpu_capability="AVX2",
    native_bf16=False,
    matmul_gflops={"fp32": 156.0, "bf16": 1.1},
)
BF16_CPU = DeviceProfile(
    type="cpu",
    name="Intel Xeon (AVX-512-BF16)",
    flags=("avx2", "fma", "avx512f", "avx512_bf16"),
    cpu_capability="AVX512",
    native_bf16=True,
    matmul_gflops={"fp32": 170.0, "bf16": 520.0},
)
AMPERE = DeviceProfile(
    type="cuda",
    name="NVIDIA A100",
    native_bf16=True,
    matmul_gflops={"fp32": 19_000.0, "bf16": 250_000.0, "fp16": 250_000.0},
    compute_capability="8.0",
)
VOLTA = DeviceProfile(
    type="cuda",
    name="Tesla V100",
    native_bf16=False,
    matmul_gflops={"fp32": 14_000.0, "bf16": 9_000.0, "fp16": 100_000.0},
    compute_capability="7.0",
)
PASCAL = DeviceProfile(  # consumer Pascal: fp16 runs at 1/64 of fp32
    type="cuda",
    name="NVIDIA GeForce GTX 1080",
    native_bf16=False,
    matmul_gflops={"fp32": 8_000.0, "bf16": 500.0, "fp16": 130.0},
    compute_capability="6.1",
)
FAST_FP16_CPU = DeviceProfile(  # a CPU that multiplies fp16 fast (AVX-512-FP16): auto still never picks it
    type="cpu",
    name="Intel Xeon (AVX-512-FP16)",
    flags=("avx2", "fma", "avx512f", "avx512_fp16"),
    native_bf16=False,
    matmul_gflops={"fp32": 170.0, "bf16": 2.0, "fp16": 600.0},
)
APPLE = DeviceProfile(type="mps", name="Apple GPU", matmul_gflops={"fp32": 3_000.0, "bf16": 3_500.0})


@pytest.mark.parametrize(
    "profile, expected",
    [
        (AVX2_CPU, "fp32"),
        (BF16_CPU, "bf16"),
        (FAST_FP16_CPU, "fp32"),
        (AMPERE, "bf16"),
        (VOLTA, "fp16"),
        (PASCAL, "fp32"),
        (APPLE, "fp32"),
    ],
    ids=["cpu-avx2", "cpu-avx512-bf16", "cpu-fast-fp16", "cuda-bf16", "cuda-fp16", "cuda-slow-fp16", "mps"],
)
def test_auto_precision_follows_the_device(profile, expected):
    choice, warnings = resolve_precision("auto", profile)
    assert choice.value == expected and warnings == []
    if profile.type != "mps":
        assert choice.reason  # says why


def test_auto_is_decided_by_the_measurement_not_by_the_flags():
    """A CPU that claims native bf16 but measures it slower than fp32 gets fp32; one with no flag we know of
    that measures bf16 much faster gets bf16."""
    claims = DeviceProfile(**{**BF16_CPU.to_dict(), "matmul_gflops": {"fp32": 170.0, "bf16": 150.0}})
    assert resolve_precision("auto", claims)[0].value == "fp32"
    unknown = DeviceProfile(**{**AVX2_CPU.to_dict(), "matmul_gflops": {"fp32": 100.0, "bf16": 400.0}})
    assert resolve_precision("auto", unknown)[0].value == "bf16"


def test_explicit_precisions_are_obeyed_and_a_slow_bf16_is_named_with_both_rates():
    choice, warnings = resolve_precision("bf16", AVX2_CPU)
    assert choice.value == "bf16"
    [warning] = warnings
    assert "1.1" in warning and "156.0" in warning and "fp32" in warning
    assert resolve_precision("bf16", BF16_CPU) == (resolve_precision("bf16", BF16_CPU)[0], [])
    assert resolve_precision("fp32", BF16_CPU)[0].value == "fp32"


def test_an_explicit_fp16_is_obeyed_everywhere_with_a_warning_where_it_is_slow():
    choice, [warning] = resolve_precision("fp16", PASCAL, option="--precision")
    assert choice.value == "fp16"
    assert warning.startswith("--precision = fp16") and "62x slower" in warning and "130.0" in warning
    assert resolve_precision("fp16", VOLTA)[1] == []
    assert resolve_precision("fp16", FAST_FP16_CPU)[0].value == "fp16"


def test_an_unknown_precision_is_refused_naming_the_known_ones():
    with pytest.raises(ScratchlmError, match="--precision must be one of auto, fp32, bf16, fp16; got 'fp8'"):
        resolve_precision("fp8", BF16_CPU, option="--precision")


@pytest.mark.parametrize("profile", [AVX2_CPU, BF16_CPU, VOLTA, AMPERE], ids=lambda p: p.name)
@pytest.mark.parametrize("requested", PRECISIONS)
def test_the_plan_answers_dtype_autocast_and_loss_scaling_from_the_one_precision(
    monkeypatch, profile, requested
):
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: profile)
    device = torch.device("cpu")  # the plan's answers depend on the profile; autocast is built for the CPU
    choices = plan(device, requested, threads=1)
    resolved = choices.precision.value
    assert resolved == resolve_precision(requested, profile)[0].value
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[resolved]
    assert choices.dtype == expected
    assert choices.loss_scaling == (resolved == "fp16")
    with choices.autocast():
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == expected  # fp32: no autocast, float32 stays float32


def test_prepare_for_inference_holds_the_weights_in_the_compute_dtype_and_keeps_the_rope_tables_float32(
    monkeypatch,
):
    from scratchlm import TransformerLM

    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: BF16_CPU)
    model = TransformerLM.from_handout(50, 16, 32, 2, 4, 64)
    for requested, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        prepare_for_inference(model, plan(torch.device("cpu"), requested, threads=1))
        assert not model.training
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert {b.dtype for b in model.buffers()} == {torch.float32}


def test_fused_loss_and_the_mfu_peak_are_the_plans(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: AMPERE)
    choices = plan(cpu, "auto", threads=1)
    assert choices.fused_loss.value is False  # auto: on for a CUDA device only
    assert plan(cpu, "auto", threads=1, fused_loss="on").fused_loss.value is True
    assert choices.peak_flops.value == PEAK_FLOPS[("A100", "bf16")] and "A100" in choices.peak_flops.reason
    assert plan(cpu, "fp32", threads=1).peak_flops.value == PEAK_FLOPS[("A100", "fp32")]
    assert plan(cpu, "auto", threads=1, peak_tflops=100).peak_flops.value == 100e12
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: VOLTA)
    assert plan(cpu, "auto", threads=1).peak_flops.value == PEAK_FLOPS[("V100", "fp16")]
    monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: BF16_CPU)
    assert plan(cpu, "auto", threads=1).peak_flops.value is None  # a CPU has no data sheet: no MFU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: None)  # never asked for


def test_the_profile_override_replaces_the_measurement_for_its_device_type(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"profile": BF16_CPU.to_dict()}))  # as `doctor --json` prints it
    monkeypatch.setenv("SCRATCHLM_DEVICE_PROFILE", str(path))
    monkeypatch.setattr(profile_module, "measure", lambda device: pytest.fail("measured"))
    assert device_profile(torch.device("cpu")) == BF16_CPU
    assert plan(torch.device("cpu"), "auto", threads=1).precision.value == "bf16"
    path.write_text(json.dumps(AVX2_CPU.to_dict()))  # as the cache stores it
    assert plan(torch.device("cpu"), "auto", threads=1).precision.value == "fp32"
    path.write_text("{not json")
    with pytest.raises(ScratchlmError, match="SCRATCHLM_DEVICE_PROFILE=.*profile.json: not a readable"):
        device_profile(torch.device("cpu"))


@pytest.mark.parametrize("profile, muon_bf16, expected", [
    (AVX2_CPU, True, torch.float32),
    (BF16_CPU, True, torch.bfloat16),
    (BF16_CPU, False, torch.float32),
])  # fmt: skip
def test_muons_iteration_follows_the_resolved_precision(profile, muon_bf16, expected):
    precision = resolve_precision("auto", profile)[0].value
    config = TrainConfig.from_dict(
        {
            "data": {"train": "t.npy", "valid": "v.npy"},
            "optimizer": {"name": "muon", "muon_bf16": muon_bf16},
            "training": {"max_steps": 1},
        }
    )
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(config.optimizer, model, precision=precision).ns_dtype == expected


@pytest.fixture
def mocked_device(monkeypatch):
    """Make this machine's CPU look like `profile` to every choice."""

    def use(profile: DeviceProfile) -> None:
        monkeypatch.setattr(plan_module, "device_profile", lambda device, refresh=False: profile)

    return use


@pytest.mark.parametrize("profile, expected", [(AVX2_CPU, "fp32"), (BF16_CPU, "bf16")])
def test_training_runs_and_records_what_auto_resolved_to(tmp_path, mocked_device, profile, expected):
    mocked_device(profile)
    config = small_config(tmp_path, training={"max_steps": 2, "precision": "auto"})
    train(config)
    [setup] = [r["setup"] for r in records(tmp_path / "run", "setup")]
    assert setup["precision"] == expected and setup["device"] == "cpu"
    assert setup["device_name"] == profile.name
    toml = (tmp_path / "run" / "config.toml").read_text()
    assert f'precision = "auto"  # resolved to {expected!r}' in toml
    assert TrainConfig.load(tmp_path / "run" / "config.toml").training.precision == "auto"  # still loads
    checkpoint = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    assert torch.load(checkpoint, weights_only=False)["precision"] == expected


def test_the_quickstart_trains_in_fp32_on_a_cpu_without_native_bf16(tmp_path, mocked_device):
    from scratchlm.data.prepare import PreparedData
    from scratchlm.quickstart import FULL, RECIPES, train_config

    data = PreparedData(tmp_path / "t.npy", tmp_path / "v.npy", tmp_path / "tok")
    for recipe in RECIPES:
        config = train_config(FULL, data, tmp_path / "run", 300.0, "cpu", 100, recipe)
        assert config.training.precision == "auto"
        for profile, expected in ((AVX2_CPU, "fp32"), (BF16_CPU, "bf16")):
            mocked_device(profile)
            choices = plan(torch.device("cpu"), config.training.precision, config.training.compile)
            assert choices.precision.value == expected
            optimizer = build_optimizer(config.optimizer, torch.nn.Linear(4, 4), choices.precision.value)
            if recipe == "fast":  # Muon iterates in the same precision
                assert optimizer.ns_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[expected]


def test_an_explicit_slow_bf16_warns_when_training_starts(tmp_path, mocked_device, capsys):
    mocked_device(AVX2_CPU)
    train(small_config(tmp_path, training={"max_steps": 1, "precision": "bf16"}))
    out = " ".join(capsys.readouterr().err.split())
    assert "warning: training.precision = bf16" in out and "142x slower" in out


# -- threads ------------------------------------------------------------------------------------------------

CHILD_ENV = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="requires a platform with sched_setaffinity")
def test_threads_follow_a_restricted_affinity_mask():
    """A process allowed one CPU uses one thread, whatever os.cpu_count() says."""
    code = (
        "import os\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from scratchlm.device.choices import choose_threads\n"
        "from scratchlm.device.host import usable_cores\n"
        "print(os.cpu_count(), usable_cores(), choose_threads().value)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=CHILD_ENV, capture_output=True, text=True, check=True
    )
    cpu_count, usable, threads = map(int, out.stdout.split())
    assert (usable, threads) == (1, 1)
    assert cpu_count >= 1


def test_threads_leave_out_the_cores_other_processes_keep_busy(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(choices_module, "_TORCH_DEFAULT_THREADS", torch.get_num_threads())
    monkeypatch.setattr(choices_module, "usable_cores", lambda: 4)
    for busy, expected in ((0.1, 4), (1.0, 3), (2.6, 1), (3.9, 1), (6.0, 1)):
        monkeypatch.setattr(choices_module, "busy_cores", lambda busy=busy: busy)
        assert choose_threads().value == expected


def test_the_users_thread_choice_wins(monkeypatch):
    monkeypatch.setattr(choices_module, "usable_cores", lambda: 4)
    monkeypatch.setattr(choices_module, "busy_cores", lambda: 0.0)
    assert choose_threads(3).value == 3  # training.threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    choice = choose_threads()
    assert choice.value == torch.get_num_threads() and "OMP_NUM_THREADS" in choice.reason
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(choices_module, "_TORCH_DEFAULT_THREADS", torch.get_num_threads() + 1)
    monkeypatch.setattr(choices_module, "_applied_threads", None)  # not a count scratchlm set itself
    assert "torch.set_num_threads" in choose_threads().reason


def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    monkeypatch.setattr(host_module, "affinity_cpus", lambda: list(range(64)))
    monkeypatch.setattr(host_module, "cgroup_cpu_limit", lambda: 1.5)
    assert host_module.usable_cores() == 2


# -- the profile --------------------------------------------------------------------------------------------


# The measurement cut down for the tests: smaller products, timed for less long. The rates stay comparable
# (they are rates), and a trial takes a fifth of a second rather than one.
SMALL_MEASUREMENT = {
    "CPU_MATMUL_SIZE": 256,
    "MATVEC_MIB": 4,
    "CPU_MEMORY_MIB": 4,
    "MEASURE_SECONDS": 0.03,
    "MATVEC_SECONDS": 0.01,
    "INT8_REPEATS": 2,
}


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """The real measurement, cut down, into an empty cache directory (`tmp_path`), whatever profile the suite
    runs under."""
    monkeypatch.delenv("SCRATCHLM_DEVICE_PROFILE", raising=False)
    monkeypatch.setenv("SCRATCHLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_module, "_in_process", {})
    for name, value in SMALL_MEASUREMENT.items():
        monkeypatch.setattr(rates_module, name, value)
    return tmp_path


def cache_file(device: torch.device, threads: int) -> Path:
    return profile_module.cache_dir() / f"device-{profile_module._cache_key(device, threads)}.json"


def test_the_profile_is_measured_once_per_machine_and_cached(measuring, monkeypatch, capsys):
    # A quiet machine: every trial counts as quiet, and no spot check of the cache beats it (on this shared
    # machine, other tests' work may have slowed the trials down).
    monkeypatch.setattr(rates_module, "quiet_enough", lambda *args: True)
    monkeypatch.setattr(profile_module, "spot_check", lambda device, rates: None)
    calls = []
    real = profile_module.measure
    monkeypatch.setattr(profile_module, "measure", lambda device: calls.append(device) or real(device))
    first = device_profile(torch.device("cpu"))
    assert first.rate("fp32") > 0 and first.rate("bf16") > 0 and first.memory_gbps > 0
    assert len(calls) == 1 and len(list(measuring.glob("device-*.json"))) == 1
    # What the wait is for is said before it (the first `train` or `generate` on a machine waits here).
    assert f"measuring cpu with {torch.get_num_threads()} thread" in capsys.readouterr().err
    # How it was measured is part of the profile: now, with this process's threads, the best of 2 trials.
    assert (first.threads, first.trials, first.provisional) == (torch.get_num_threads(), 2, False)
    assert profile_module.profile_age_days(first) < 1 / 24
    # The int8 product of every precision, each way at each size (PyTorch's kernel may be 0: missing here).
    keys = {f"{way}_{n}" for way in rates_module.INT8_WAYS for n in rates_module.INT8_TOKENS}
    assert {name: set(found) for name, found in first.int8_gbps.items()} == dict.fromkeys(
        rates_module.DTYPES, keys
    )
    assert all(
        found[f"dequantize_{n}"] > 0 for found in first.int8_gbps.values() for n in rates_module.INT8_TOKENS
    )
    monkeypatch.setattr(profile_module, "_in_process", {})  # a new process reads the file
    assert device_profile(torch.device("cpu")) == first and len(calls) == 1
    assert "measuring" not in capsys.readouterr().err
    device_profile(torch.device("cpu"), refresh=True)
    assert len(calls) == 2


def test_a_profile_measured_on_a_busy_machine_is_used_but_not_cached(measuring, monkeypatch, capsys):
    busy = DeviceProfile(**{**BF16_CPU.to_dict(), "trials": 4, "busy": 1.5, "provisional": True})
    monkeypatch.setattr(profile_module, "measure", lambda device: busy)
    assert device_profile(torch.device("cpu")) == busy
    assert not list(measuring.glob("device-*.json"))
    assert "not cached" in capsys.readouterr().err
    monkeypatch.setattr(profile_module, "_in_process", {})  # quiet now: measured again, cached
    monkeypatch.setattr(profile_module, "measure", lambda device: BF16_CPU)
    assert device_profile(torch.device("cpu")) == BF16_CPU
    assert len(list(measuring.glob("device-*.json"))) == 1


# A child process that measures the CPU with all its usable cores, cut down as `SMALL_MEASUREMENT` says, and
# prints its profile as JSON. It prints "ready" and waits for a line on stdin at the point `HOLD` names:
# before measuring at all, or inside the first timed matmul (after any look at the cores before it).
MEASURING_CHILD = """
import json, sys, torch
from scratchlm.device import host, profile, rates
for name, value in SMALL.items():
    setattr(rates, name, value)
torch.set_num_threads(host.usable_cores())
def hold():
    print("ready", flush=True)
    sys.stdin.readline()
if HOLD == "inside":
    host.busy_cores = lambda seconds=0.3: 0.0  # whatever ran before, a check before found the cores idle
    real, held = rates.matmul_gflops, []
    def matmul_gflops(*args, **kwargs):
        if not held:
            held.append(hold())
        return real(*args, **kwargs)
    rates.matmul_gflops = matmul_gflops
else:
    hold()
print(json.dumps(profile.device_profile(torch.device("cpu")).to_dict()), flush=True)
"""


def measuring_child(hold: str, cache: Path) -> subprocess.Popen:
    env = {**CHILD_ENV, "SCRATCHLM_CACHE_DIR": str(cache)}
    env.pop("SCRATCHLM_DEVICE_PROFILE", None)
    child = subprocess.Popen(
        [sys.executable, "-c", f"HOLD = {hold!r}\nSMALL = {SMALL_MEASUREMENT!r}\n" + MEASURING_CHILD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "ready\n", child.communicate()[1]
    return child


def quiet_rates(threads: int) -> dict[str, float]:
    """Each dtype's matmul rate as the children measure it (size 256, `threads` threads), the best of 3."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {
            name: max(rates_module.matmul_gflops(torch.device("cpu"), dtype, 256, 0.03) for _ in range(3))
            for name, dtype in rates_module.DTYPES.items()
        }
    finally:
        torch.set_num_threads(previous)


def test_two_processes_that_measure_at_once_cache_no_spoiled_profile(tmp_path):
    """Two processes start measuring at the same moment, as the ranks of one torchrun job or pytest-xdist
    workers do, each with all the cores. They measure one at a time: exactly one of them waits for the
    other's measurement and says so. A profile either of them trusts, and the cache, are within a factor of 3
    of a measurement taken alone; a profile measured while the cores were taken is provisional, took every
    trial and is not cached; a profile the waiting one got from the cache is the first one's."""
    children = [measuring_child("before", tmp_path) for _ in range(2)]
    for child in children:  # both go at once
        child.stdin.write("\n")
        child.stdin.flush()
    profiles, errors = [], []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        profiles.append(json.loads(out))
        errors.append(err)
    waited = ["waiting for its result" in err for err in errors]
    assert sum(waited) == 1, errors  # the lock made one wait for the other
    first, second = (profiles[1], profiles[0]) if waited[0] else (profiles[0], profiles[1])
    threads = host_module.usable_cores()
    alone = quiet_rates(threads)
    cached = [json.loads(path.read_text()) for path in tmp_path.glob("device-*.json")]
    trusted = [p for p in profiles if not p["provisional"]]
    assert len(cached) == (1 if trusted else 0)
    for profile, err in zip(profiles, errors, strict=True):
        assert profile["threads"] == threads
        if profile["provisional"]:
            assert profile["trials"] == rates_module.MAX_TRIALS and "not cached" in err
    for profile in trusted + cached:
        assert not profile["provisional"]
        for name, rate in alone.items():
            assert profile["matmul_gflops"][name] > rate / 3, (name, profile["matmul_gflops"], alone)
    waiter = errors[waited.index(True)]
    if first["provisional"]:  # nothing was cached for it: it measured itself
        assert "measuring cpu" in waiter
    else:  # measured once: it read the first one's, unless its spot check proved that one too slow
        assert second == first or "the cached device profile is too slow" in waiter


def test_a_measurement_that_other_work_interrupts_is_not_cached(tmp_path):
    """Other work starts after the measurement began (after any check made before it): processes spinning on
    every core. The measurement is marked provisional and not cached."""
    child = measuring_child("inside", tmp_path)
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(host_module.usable_cores())]
    try:
        time.sleep(0.3)  # the spinners run
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert child.returncode == 0, err
    profile = json.loads(out)
    assert profile.get("provisional") is True and profile["trials"] == rates_module.MAX_TRIALS
    assert not list(tmp_path.glob("device-*.json"))
    assert "not cached" in err


@pytest.mark.parametrize(
    "others, share, threads, cores, quiet",
    [
        (0.1, 0.99, 2, 2, True),  # an idle machine
        (1.0, 0.99, 1, 2, True),  # one busy core beside a 1-thread measurement: its core was its own
        (1.0, 0.70, 2, 2, False),  # a busy core under a 2-thread measurement
        (0.9, 0.99, 2, 2, False),  # ... even where the measuring thread itself kept running
        (0.2, 0.50, 1, 2, False),  # the measuring thread waited half the time for its core
        (float("nan"), 0.95, 2, 2, True),  # no /proc/stat: the thread's share alone decides
        (0.3, 0.95, 4, 2, True),  # more threads than cores: the user's choice, not other work
    ],
)
def test_a_trial_is_quiet_when_other_work_left_the_measuring_threads_their_cores(
    others, share, threads, cores, quiet
):
    assert rates_module.quiet_enough(host_module.Load(others, share), threads, cores) is quiet


@pytest.mark.skipif(sys.platform == "win32", reason="the lock is fcntl's")
def test_a_process_that_waits_for_another_ones_measurement_says_so_and_reads_its_result(
    measuring, monkeypatch, capsys
):
    """Another holder of the machine's lock on measuring the CPU (here an open file of this process: flock
    locks belong to open files) caches its profile and lets go; the waiting one said it waits, and takes that
    profile rather than measuring."""
    import fcntl
    import threading

    monkeypatch.setattr(profile_module, "measure", lambda device: pytest.fail("measured"))
    now = datetime.now(UTC).isoformat()
    measured = DeviceProfile(  # rates beyond any spot check
        **{**BF16_CPU.to_dict(), "matmul_gflops": {"fp32": 1e9}, "measured_at": now, "trials": 2}
    )
    measuring.joinpath("device-cpu.lock").touch()
    with open(measuring / "device-cpu.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)

        def finish() -> None:
            time.sleep(0.3)
            write_cached(measured)
            fcntl.flock(lock, fcntl.LOCK_UN)

        other = threading.Thread(target=finish)
        other.start()
        assert device_profile(torch.device("cpu")) == measured
        other.join()
    assert "another process is measuring this device; waiting for its result" in capsys.readouterr().err


def scripted_rates(monkeypatch, bf16: list[float], fp32: float = 140.0) -> list[float]:
    """Trials whose bf16 matmul rates are `bf16`, one a trial, and whose other rates are constants; returns the
    list of the bf16 rates handed out."""
    handed: list[float] = []
    trials = iter(bf16)

    def matmul(device, dtype, size=None, seconds=None):
        if dtype != torch.bfloat16:
            return fp32
        handed.append(next(trials))
        return handed[-1]

    monkeypatch.setattr(rates_module, "matmul_gflops", matmul)
    monkeypatch.setattr(rates_module, "matvec_gbps", lambda *args, **kwargs: 10.0)
    monkeypatch.setattr(rates_module, "int8_gbps", lambda *args, **kwargs: {})
    monkeypatch.setattr(rates_module, "memory_gbps", lambda *args, **kwargs: 40.0)
    monkeypatch.setattr(rates_module, "quiet_enough", lambda *args: True)
    return handed


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-native-bf16"])
def test_native_bf16_measured_slower_than_fp32_is_measured_again_before_it_is_cached(
    measuring, monkeypatch, native
):
    """bf16 measured at 33.6 GFLOP/s against fp32's 140 (other work slowed the bf16 kernels) on a CPU whose
    flags say native bf16: more trials follow, and the cached profile has the rate they found. Without the
    flag, a slow bf16 is what the CPU is expected to measure: the usual trials, nothing more."""
    identity = select_module.identity(torch.device("cpu"))
    flags = ("avx2", "fma", "avx512f", "avx512_bf16") if native else ("avx2", "fma")
    monkeypatch.setattr(
        profile_module, "identity", lambda device: {**identity, "flags": flags, "native_bf16": native}
    )
    handed = scripted_rates(monkeypatch, [33.6, 30.0, 897.0, 880.0])
    profile = device_profile(torch.device("cpu"))
    cached = DeviceProfile.from_dict(json.loads(next(measuring.glob("device-*.json")).read_text()))
    assert cached == profile
    if native:
        assert handed == [33.6, 30.0, 897.0] and profile.trials == 3 and profile.rate("bf16") == 897.0
        assert resolve_precision("auto", profile)[0].value == "bf16"
    else:
        assert handed == [33.6, 30.0] and profile.trials == 2 and profile.rate("bf16") == 33.6
        assert resolve_precision("auto", profile)[0].value == "fp32"


def test_native_bf16_that_stays_slower_than_fp32_in_every_trial_is_believed(measuring, monkeypatch):
    """A CPU whose flags claim native bf16 but whose kernels really are slow: after `MAX_TRIALS` quiet trials
    the measurement stands, is cached, and "auto" trains in fp32."""
    identity = select_module.identity(torch.device("cpu"))
    monkeypatch.setattr(profile_module, "identity", lambda device: {**identity, "native_bf16": True})
    handed = scripted_rates(monkeypatch, [100.0] * rates_module.MAX_TRIALS)
    profile = device_profile(torch.device("cpu"))
    assert len(handed) == profile.trials == rates_module.MAX_TRIALS and not profile.provisional
    assert len(list(measuring.glob("device-*.json"))) == 1
    assert resolve_precision("auto", profile)[0].value == "fp32"


def write_cached(profile: DeviceProfile, **changes) -> Path:
    """`profile` in this machine's cache, as if measured at the current thread count."""
    path = cache_file(torch.device("cpu"), torch.get_num_threads())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**profile.to_dict(), **changes}))
    return path


def test_a_cached_profile_corrects_itself(measuring, monkeypatch, capsys):
    """A cached profile is measured again when it has expired, or when a product runs far faster than it says
    (other work only slows a product down: the cache was spoiled). A fresh, plausible one is used as it is."""
    cpu = torch.device("cpu")
    now = datetime.now(UTC)
    fresh = DeviceProfile(**{**AVX2_CPU.to_dict(), "measured_at": now.isoformat(), "threads": 1, "trials": 2})
    monkeypatch.setattr(profile_module, "measure", lambda device: fresh)
    # Rates no CPU reaches: a spot check cannot beat them.
    fast = {**fresh.to_dict(), "matmul_gflops": {name: 1e9 for name in PRECISIONS if name != "auto"}}
    write_cached(DeviceProfile.from_dict(fast), measured_at=now.isoformat())
    assert device_profile(cpu).rate("fp32") == 1e9  # used as it is

    fp32 = rates_module.matmul_gflops(cpu, torch.float32, 256)  # this CPU's rate, independently
    for stale, why in (
        ({"measured_at": (now - timedelta(days=8)).isoformat()}, "measured 8 days ago"),
        ({"matmul_gflops": {"fp32": fp32 / 20}}, "x the cached"),  # 20x too slow
    ):
        monkeypatch.setattr(profile_module, "_in_process", {})
        path = write_cached(DeviceProfile.from_dict(fast), **{"measured_at": now.isoformat(), **stale})
        capsys.readouterr()
        assert device_profile(cpu) == fresh
        assert why in capsys.readouterr().err
        assert DeviceProfile.from_dict(json.loads(path.read_text())) == fresh  # the cache is corrected


def test_matmul_rates_are_what_a_timed_matmul_gives():
    """Each dtype's measured rate is what products of the measurement's own size, timed here over as long
    (2 n³ FLOPs each), give at the same thread count, within 1.5x either way; and so is the bf16 / fp32 ratio
    "auto" decides by. Each side is the best of five, taken in turns, at one thread (a second thread on a
    shared 2-core machine runs at whatever the other processes leave it): a rate off by 2 (a FLOP count
    without its 2) fails."""
    cpu, size = torch.device("cpu"), rates_module.CPU_MATMUL_SIZE

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        a @ b
        products, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < rates_module.MEASURE_SECONDS or products < 1:
            a @ b
            products += 1
        return 2 * size**3 * products / elapsed / 1e9

    def disagreements() -> list[tuple]:
        measured: dict[str, float] = {}
        independent: dict[str, float] = {}
        with torch_threads(1):
            for name in ("fp32", "bf16"):
                dtype = rates_module.DTYPES[name]
                a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
                for _ in range(5):  # in turns: other work slows both sides alike
                    measured[name] = max(measured.get(name, 0.0), rates_module.matmul_gflops(cpu, dtype))
                    independent[name] = max(independent.get(name, 0.0), timed(a, b))
        ratio = (measured["bf16"] / measured["fp32"]) / (independent["bf16"] / independent["fp32"])
        off = [
            name
            for name in measured
            if not independent[name] / 1.5 < measured[name] < independent[name] * 1.5
        ]
        return [(off, ratio, measured, independent)] if off or not 1 / 1.5 < ratio < 1.5 else []

    assert settled(disagreements) == []


# -- the doctor ---------------------------------------------------------------------------------------------


def test_doctor_reports_the_device_and_the_choices_train_then_uses(tmp_path, capsys):
    config = small_config(tmp_path, training={"max_steps": 1})
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    assert main(["doctor", "--json", "--no-compile-check", "--config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    profile = report["profile"]
    assert profile["type"] == "cpu" and profile["name"] and isinstance(profile["flags"], list)
    assert profile["matmul_gflops"]["fp32"] > 0 and profile["matmul_gflops"]["bf16"] > 0
    assert profile["memory_gbps"] > 0
    assert report["cores"]["usable"] >= 1 and report["cores"]["affinity"] >= report["cores"]["usable"]
    for choice in ("precision", "threads", "compile", "matvec", "decode", "int8_matmul"):
        assert set(report[choice]) == {"value", "reason", "measured"}
    assert report["compile_works"] == {"value": None, "reason": "not checked"}

    train(TrainConfig.load(path))
    [setup] = [r["setup"] for r in records(tmp_path / "run", "setup")]
    assert (setup["precision"], setup["threads"], setup["compile"]) == (
        report["precision"]["value"],
        report["threads"]["value"],
        report["compile"]["value"],
    )


@pytest.mark.parametrize("shipped", ["chat-sft.toml", "chat-rl.toml"])
def test_doctor_reads_the_configs_of_the_other_stages(shipped, capsys):
    """A fine-tuning or reinforcement-learning config's section is known to `doctor` too, and the report
    names the decode step's choice."""
    assert (
        main(["doctor", "--json", "--no-compile-check", "--config", str(PROJECT_ROOT / "configs" / shipped)])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report["decode"]) == {"value", "reason", "measured"} and "decode_timings" in report


def test_doctor_prints_a_table_and_checks_its_options(capsys):
    assert main(["doctor", "--no-compile-check", "--set", "training.precision=bf16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    rows = ("device", "matmul GFLOP/s", "memory bandwidth", "precision bf16", "threads", "compile")
    for row in (*rows, "int8 product"):
        assert row in out
    assert main(["doctor", "--set", "model.d_model=64"]) == 2
    assert "only training.* keys" in capsys.readouterr().err


def test_doctor_says_when_and_how_its_profile_was_measured(measuring, monkeypatch, capsys):
    when = (datetime.now(UTC) - timedelta(days=2)).replace(microsecond=0)
    rates = {"fp32": 1e9, "bf16": 1e7, "fp16": 1e7}  # beyond any spot check
    measured = {"measured_at": when.isoformat(), "threads": 1, "trials": 3, "busy": 0.3}
    cache_file(torch.device("cpu"), 1).write_text(
        json.dumps({**AVX2_CPU.to_dict(), "matmul_gflops": rates, **measured})
    )
    monkeypatch.setattr(profile_module, "measure", lambda device: pytest.fail("measured"))
    args = ["doctor", "--no-compile-check", "--set", "training.threads=1"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"measurement measured {when:%Y-%m-%d %H:%M:%S} UTC (1 thread, best of 3 trials" in out
    assert "0.3 cores kept busy by other processes" in out and "scratchlm doctor --refresh" in out
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {key: report["profile"][key] for key in measured} == measured
    assert report["measurement"].startswith(f"measured {when:%Y-%m-%d}")

    fixture = Path(__file__).parent / "fixtures" / "device" / "cpu-native-bf16.json"
    monkeypatch.setenv("SCRATCHLM_DEVICE_PROFILE", str(fixture))
    assert main(args) == 0
    squeezed = "".join(capsys.readouterr().out.split())  # the table may wrap the path anywhere
    assert f"givenbySCRATCHLM_DEVICE_PROFILE={fixture},notmeasured" in squeezed


def test_doctor_says_what_it_waits_for_before_it_waits(measuring, monkeypatch, capsys):
    """The device measurement (the first command on a machine waits for it) and the trial compilation each
    announce themselves before they start."""
    said: dict[str, str] = {}
    measure = profile_module.measure

    def measuring_now(device):
        said["measure"] = capsys.readouterr().err
        return measure(device)

    def compiling_now(device):
        said["compile"] = capsys.readouterr().err
        return True, "compiled a test function"

    monkeypatch.setattr(profile_module, "measure", measuring_now)
    monkeypatch.setattr(compiler_module, "compile_works", compiling_now)
    assert main(["doctor", "--set", "training.threads=1"]) == 0
    assert "measuring cpu with 1 thread: matmuls, memory, matrix-vector and int8 products" in said["measure"]
    assert "checking that torch.compile works here: compiling a small function" in said["compile"]


def test_compile_is_off_with_a_reason_where_no_compiler_is_found(monkeypatch):
    monkeypatch.setattr(choices_module, "compiler_found", lambda device: (False, "no C++ compiler found"))
    choices = plan(torch.device("cpu"), "fp32", compile=True, threads=1)
    assert choices.compile.value is False and "no C++ compiler" in choices.compile.reason
    assert any("running uncompiled" in w for w in choices.warnings)


def test_compile_works_on_this_machine_is_a_real_compilation():
    found, _ = compiler_module.compiler_found(torch.device("cpu"))
    works, note = compiler_module.compile_works(torch.device("cpu"), timeout=300)
    assert works == found, note


def test_the_thread_count_follows_the_load_while_training(monkeypatch):
    """Other processes take a core (the count drops to 1), then leave it (back to 2); the first interval only
    sets the mark, and a count the user chose is never changed."""
    from scratchlm.device.choices import Choice, ThreadTuner

    monkeypatch.setattr(choices_module, "usable_cores", lambda: 2)
    # (jiffies busy/total of CPUs 0 and 1, this process's CPU seconds, wall seconds) at each log step
    marks = iter([
        ({0: (0, 100), 1: (0, 100)}, 0.0, 0.0),
        ({0: (100, 200), 1: (100, 200)}, 1.0, 1.0),  # both cores busy, 1 of them ours: 1 core for others
        ({0: (200, 300), 1: (200, 300)}, 2.0, 2.0),  # the same
        ({0: (300, 400), 1: (300, 400)}, 4.0, 3.0),  # both busy with our 2 threads: none for others
    ])  # fmt: skip
    monkeypatch.setattr(ThreadTuner, "_mark", lambda self: next(marks))
    torch.set_num_threads(2)
    try:
        tuner = ThreadTuner(Choice(2, "2 usable cores, free", measured=True))
        assert tuner.update() is None  # the mark
        assert "2 → 1" in tuner.update() and torch.get_num_threads() == 1
        assert tuner.update() is None
        assert "1 → 2" in tuner.update() and torch.get_num_threads() == 2
        assert ThreadTuner(Choice(2, "training.threads = 2")).update() is None
        assert not ThreadTuner(Choice(2, "2 usable cores, free", measured=True), compiled=True).enabled
    finally:
        torch.set_num_threads(1)
