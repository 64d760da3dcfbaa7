"""Whether torch.compile can generate code on a device: the probes behind `training.compile`'s and the decode
step's choices (`scratchlm.device.choices`), and `scratchlm doctor`'s check.

    compiler_found   cheap, on every plan: is there a code generator to call (a C++ compiler on a CPU, Triton
                     on CUDA)?
    compile_works    slow (seconds to minutes), on request: does a small function really compile and run, in a
                     child process, so that a compiler crash cannot take the caller down?
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import torch


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
