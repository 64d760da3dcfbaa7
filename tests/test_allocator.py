"""`keep_freed_memory`: after it, a large block comes from the heap instead of a fresh mmap (glibc only)."""

from __future__ import annotations

import ctypes
import sys

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
