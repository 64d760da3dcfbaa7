"""Launch settings that fit the GPU: the ladders' shape, the choice (the first applicable settings whose
compiled kernel fits the shared memory), and the kernels compiled ahead of time for real architectures on
this CPU: a few tight combinations in the default run, every one with `-m slow`."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import PROJECT_ROOT

pytest.importorskip("triton", reason="triton is not installed")

import scratchlm.kernels.launch as launch
from scratchlm.errors import ScratchlmError
from scratchlm.kernels.flash_kernels import KERNELS
from scratchlm.kernels.launch import LADDERS, SHARED_MEMORY_LIMIT, SMALL, SMALLEST, Settings, choose


@pytest.fixture(autouse=True)
def fresh_choices():
    choose.cache_clear()
    yield
    choose.cache_clear()


def test_every_ladder_ends_with_settings_every_gpu_has_room_for():
    assert set(LADDERS) == set(KERNELS)
    for kind, ladders in LADDERS.items():
        assert set(ladders) == {16, 32, 64, 128, 256}, kind
        for d_pad, ladder in ladders.items():
            if kind != "combine":
                assert ladder[-2:] == (Settings(32, 32, 4, 1), Settings(16, 16, 4, 1)), (kind, d_pad)
            assert any(s.min_arch == 0 for s in ladder), (kind, d_pad)  # something for any GPU and dtype
            for s in ladder:
                sizes = (s.block_m, s.block_n) if kind != "combine" else (s.block_m,)
                assert all(16 <= n <= 128 and n & (n - 1) == 0 for n in sizes), (kind, d_pad, s)
                assert s.num_warps in (4, 8) and 1 <= s.num_stages <= 3 and s.min_arch in (0, 80, 90)


def fake_compiler(monkeypatch, shared: dict[Settings, int]) -> list[Settings]:
    """`compile_for` that reports the given shared memory per settings (others: none); returns the settings
    it compiled."""
    compiled = []

    def compile_for(kind, settings, arch, dtype, head_dim, causal=True):
        compiled.append(settings)
        return SimpleNamespace(metadata=SimpleNamespace(shared=shared.get(settings, 0)))

    monkeypatch.setattr(launch, "compile_for", compile_for)
    return compiled


def test_the_first_settings_that_fit_are_chosen(monkeypatch):
    ladder = LADDERS["forward"][128]  # (128x64, sm_90), (64x64, sm_80), 64x32, 32x32, 16x16
    shared = [131_072, 90_112, 36_864, 24_576, 12_288]
    compiled = fake_compiler(monkeypatch, dict(zip(ladder, shared, strict=True)))
    assert choose("forward", 90, 232_448, torch.bfloat16, 128, True) == ladder[0]
    assert choose("forward", 86, 101_376, torch.bfloat16, 128, True) == ladder[1]
    assert compiled == [ladder[0], ladder[1]]  # sm_86 never tries the sm_90 settings
    assert choose("forward", 80, 80_000, torch.float16, 128, True) == ladder[2]
    # Below sm_80, and for float32 anywhere, only the settings meant for FMA dots are tried.
    assert choose("forward", 75, 65_536, torch.bfloat16, 128, True) == ladder[2]
    assert choose("forward", 90, 232_448, torch.float32, 128, True) == ladder[2]
    assert choose("forward", 75, 30_000, torch.float16, 128, True) == SMALL
    assert choose("forward", 75, 20_000, torch.float16, 128, True) == SMALLEST
    assert choose("forward", 75, 10_000, torch.float16, 128, True) is None


def test_the_choice_on_a_device_reads_its_limits_and_names_a_misfit(monkeypatch):
    fake_compiler(monkeypatch, dict.fromkeys(LADDERS["backward_kv"][256], 200_000))
    monkeypatch.setattr(launch, "device_limits", lambda device: (86, 101_376))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    with pytest.raises(
        ScratchlmError, match=r"^no launch setting of the attention kernel 'backward_kv' fits the "
    ):
        launch.settings_for("backward_kv", torch.device("cuda", 0), torch.bfloat16, 256, True)
    assert not launch.fits(torch.device("cuda", 0), torch.bfloat16, 256)
    # Off a GPU (the interpreter) 32 x 32 blocks, without compiling anything.
    assert launch.settings_for("forward", torch.device("cpu"), torch.float32, 100, True) == SMALL
    assert launch.fits(torch.device("cpu"), torch.float32, 100)


def test_a_device_is_asked_its_properties_once(monkeypatch):
    # Triton's query takes about a millisecond; asked at every launch it cost 4 ms an attention call on an H200.
    asked = []

    def properties(index):
        asked.append(index)
        return {"max_shared_mem": 232_448, "multiprocessor_count": 132}

    driver = SimpleNamespace(active=SimpleNamespace(utils=SimpleNamespace(get_device_properties=properties)))
    monkeypatch.setattr(launch, "triton", SimpleNamespace(runtime=SimpleNamespace(driver=driver)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    launch._properties.cache_clear()
    try:
        for _ in range(3):
            assert launch.device_limits(torch.device("cuda", 1)) == (90, 232_448)
            assert launch.multiprocessors(torch.device("cuda", 1)) == 132
        assert asked == [1]
    finally:
        launch._properties.cache_clear()


def run_aot(out, *args: str) -> list[dict]:
    """`bench_gpu.py --aot` in a process without Triton's interpreter (ahead-of-time compilation needs the
    real kernels); its rows, through the JSON file `out`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(PROJECT_ROOT)}
    command = [sys.executable, "bench_gpu.py", "--aot", "--json", str(out), *args]
    result = subprocess.run(command, cwd=PROJECT_ROOT / "benchmarks", env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "0 over the limit" in result.stdout, result.stdout
    return json.loads(out.read_text())


def test_tight_combinations_compile_ahead_of_time_within_their_shared_memory(tmp_path):
    # The overflows: bf16 d_head 128 dK/dV on a T4 (64 KiB; the old 64 x 64, 3-stage kernel asked for
    # 131,072 B) and on sm_86 (99 KiB), float32 d_head 128 forward on an A100.
    rows = run_aot(
        tmp_path / "a.json",
        "--arch",
        "75",
        "86",
        "--dtype",
        "bf16",
        "--head-dim",
        "128",
        "--kernel",
        "backward_kv",
    )
    rows += run_aot(
        tmp_path / "b.json", "--arch", "80", "--dtype", "fp32", "--head-dim", "128", "--kernel", "forward"
    )
    assert [(r["kernel"], r["arch"], r["dtype"]) for r in rows] == [
        ("backward_kv", 75, "bf16"),
        ("backward_kv", 86, "bf16"),
        ("forward", 80, "fp32"),
    ]
    for r in rows:
        assert (
            r["settings"] is not None and 0 < r["shared"] <= r["limit"] == SHARED_MEMORY_LIMIT[r["arch"]]
        ), r
        assert 0 < r["registers"] <= 255 and r["transposes"] == 0, r
    tensor_cores = rows[1]  # sm_86 bf16: tensor-core dots, no spills
    assert tensor_cores["mix"]["HMMA"] > 0 and tensor_cores["spill_stores"] == 0, tensor_cores
    assert "HMMA" not in rows[2]["mix"] and rows[2]["mix"]["FFMA"] > 0  # float32: full-precision FMA


@pytest.mark.aot
def test_every_combination_fits_and_tensor_core_kernels_do_not_spill(tmp_path):
    rows = run_aot(tmp_path / "all.json")
    assert len(rows) == len(KERNELS) * 6 * 3 * 5  # kernels × sm_70 … sm_90 × dtypes × padded head sizes
    assert all(r["shared"] <= r["limit"] for r in rows if r["settings"] is not None)
    # Nothing fits only float32 d_head 256 backward on a T4 ("auto" never sends float32 to the kernel).
    nothing_fits = {
        (r["kernel"], r["arch"], r["dtype"], r["head_dim"]) for r in rows if r["settings"] is None
    }
    assert nothing_fits == {("backward_kv", 75, "fp32", 256), ("backward_q", 75, "fp32", 256)}
    for r in rows:  # what "auto" runs: tensor-core dots, no spills, no transposes in registers
        if r["arch"] >= 80 and r["dtype"] != "fp32":
            assert r["spill_stores"] == 0 and r["transposes"] == 0, r
