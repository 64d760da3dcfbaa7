"""The GPU benchmark at toy shapes on whatever device there is (on a CPU: the Triton rows under the
interpreter, which conftest turns on), so that the one command keeps running: every row measured (decoding
too), the fused and unfused head + loss agree."""

import json
import os
import subprocess
import sys

import pytest
from helpers import PROJECT_ROOT

pytest.importorskip("triton", reason="triton is not installed")


def test_tiny_run_fills_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    command = [sys.executable, "bench_gpu.py", "--tiny", "--no-compile", "--repeats", "1", "--out", str(out)]
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT)}
    result = subprocess.run(command, cwd=PROJECT_ROOT / "benchmarks", env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())
    impls = {r["impl"] for r in results["attention"]}
    assert impls == {"scratchlm triton", "sdpa flash", "scratchlm blocked"}
    assert all(r["ms"] > 0 for r in results["attention"]), results["attention"]
    assert {r["impl"] for r in results["training"]} == {"scratchlm", "reference"}
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in results["training"])
    assert {r["impl"] for r in results["decode"]} == {"scratchlm triton", "sdpa", "scratchlm blocked"}
    assert all(r["us"] > 0 for r in results["decode"]), results["decode"]
    head = results["head_and_loss"]
    assert head["fused"]["loss"] == pytest.approx(head["unfused"]["loss"], rel=1e-5)
    assert "LM head + cross-entropy" in result.stdout
