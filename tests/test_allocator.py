"""`keep_freed_memory`: after it, a large block comes from the heap instead of a fresh mmap (glibc only); a
model prepared for inference on a CPU applies it."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from scratchlm.allocator import keep_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mmapped_bytes_for(size: int) -> int:
    """How much glibc's mmapped total grows while a block of `size` bytes is held."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2().hblkhd
    block = bytearray(size)
    grown = libc.mallinfo2().hblkhd - before
    del block
    return grown


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_blocks_come_from_the_heap_afterwards() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 (glibc >= 2.33)
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33")
    size = 64 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): always mmapped by default
    assert keep_freed_memory()
    assert mmapped_bytes_for(size) == 0


MMAPPED_AFTER = """
import ctypes, sys, torch
sys.path.insert(0, {tests!r})
from test_allocator import mmapped_bytes_for
from scratchlm.device import plan
from scratchlm.generation.layout import prepare_for_inference
from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM
model = TransformerLM.from_config(ModelConfig(vocab_size=64, context_length=8, d_model=16, num_layers=1,
                                              num_heads=2, d_ff=32))
if sys.argv[1] == "prepared":
    prepare_for_inference(model, plan(torch.device("cpu"), "fp32", threads=1))
print(mmapped_bytes_for(64 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
def test_a_model_prepared_for_inference_on_a_cpu_keeps_freed_memory(prepared: bool) -> None:
    """In a fresh process (glibc's default thresholds), a 64 MiB block is mmapped until a model is prepared
    for inference on the CPU, and comes from the heap afterwards."""
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018 (glibc >= 2.33)
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33")
    code = MMAPPED_AFTER.format(tests=str(Path(__file__).parent))
    which = "prepared" if prepared else "plain"
    out = subprocess.run([sys.executable, "-c", code, which], capture_output=True, text=True, check=True)
    mmapped = int(out.stdout.split()[-1])
    assert (mmapped == 0) if prepared else (mmapped >= 64 << 20)
