"""Timings that commands measure on this machine, kept beside the device profile for the next command: one
JSON file a kind (`decode-timings.json`: a decode step eager and compiled, `scratchlm.device.decode_timings`;
`train-timings.json`: a training step of a shape, `scratchlm.training.sizing`), each a map from a key (the
device profile's key, then what else the timing depends on, joined by "|") to a record.

The records are a cache: a cache directory that cannot be written loses them, and a record that another
version wrote and this one cannot read is as if never measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scratchlm.device.profile import cache_dir, profile_path
from scratchlm.errors import ScratchlmError
from scratchlm.io import atomic_write


def timings_path(kind: str) -> Path:
    return cache_dir() / f"{kind}-timings.json"


def timings_key(device: torch.device, *parts: object, threads: int | None = None) -> str:
    """`device`'s profile key (device, CPU flags, torch version, and `threads`, by default the current thread
    count), then `parts`."""
    return "|".join([profile_path(device, threads).stem, *map(str, parts)])


def read_timings(kind: str) -> dict[str, dict[str, Any]]:
    """Every record of `kind` on this machine (none where the file is missing or unreadable)."""
    try:
        values = json.loads(timings_path(kind).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in values.items() if isinstance(v, dict)} if isinstance(values, dict) else {}


def record_timing(kind: str, key: str, record: dict[str, Any]) -> None:
    """Keep `record` for `key` (written atomically; a read-only cache directory only loses the record)."""
    entries = read_timings(kind)
    entries[key] = record
    try:
        timings_path(kind).parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(timings_path(kind), "w") as f:
            json.dump(entries, f, indent=1)
    except (OSError, ScratchlmError):
        pass
