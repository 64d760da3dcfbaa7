"""What a decode step costs on this machine, eager and compiled, per model shape: measured by the decoders that
run (`scratchlm.generation.decode`), kept beside the device profile, read by the next command.

A compiled step is worth its compilation when the time it saves over the tokens still to generate exceeds
the time compiling takes, and it is worth keeping only where it measured faster than the eager step: both
depend on the device, the precision, the threads and the model's shape, so both are measured, here, once:

    key      the device profile's key (device, CPU flags, torch version, threads), the precision, the shape
             (layers, d_model, heads, key/value heads, d_ff, vocabulary, context) and the row bucket
    entry    {"eager_ms": a step eager, "compiled_ms": a step compiled, "compile_s": the compilation}

Until a shape has been measured, `ASSUMED` stands in: a speed-up of 2 and a compilation of 30 s, so that a
first short request is never made to wait for a compilation that may not pay for itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from scratchlm.device import timings

MIN_GAIN = 1.1  # a compiled step must measure at least this much faster than the eager one to be used


@dataclass(frozen=True)
class DecodeTimings:
    eager_ms: float
    compiled_ms: float
    compile_s: float

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.compiled_ms if self.compiled_ms > 0 else 1.0

    def describe(self) -> str:
        return (
            f"a step {self.compiled_ms:.2f} ms compiled against {self.eager_ms:.2f} ms eager "
            f"({self.speedup:.1f}x), compiled in {self.compile_s:.0f} s"
        )


ASSUMED = DecodeTimings(eager_ms=2.0, compiled_ms=1.0, compile_s=30.0)


KIND = "decode"  # decode-timings.json (`scratchlm.device.timings`)


def timings_key(device: torch.device, precision: str, shape: tuple[int, ...], rows: int) -> str:
    return timings.timings_key(device, precision, ",".join(map(str, shape)), f"rows={rows}")


def _timings(entry: dict) -> DecodeTimings | None:
    try:
        return DecodeTimings(**entry)
    except TypeError:  # written by another version
        return None


def measured_timings(key: str) -> DecodeTimings | None:
    """The timings recorded for `key`, or None where this shape has not been measured here."""
    entry = timings.read_timings(KIND).get(key)
    return _timings(entry) if entry is not None else None


def device_timings(device: torch.device) -> dict[str, DecodeTimings]:
    """Every shape measured on `device` at the current thread count: "precision|shape|rows" -> timings."""
    prefix = timings.timings_key(device) + "|"
    found = {}
    for key, entry in timings.read_timings(KIND).items():
        if key.startswith(prefix) and (known := _timings(entry)) is not None:
            found[key[len(prefix) :]] = known
    return found


def record_timings(key: str, measured: DecodeTimings) -> None:
    """Keep `measured` for `key`."""
    timings.record_timing(KIND, key, asdict(measured))


def worth_compiling(timings: DecodeTimings | None, eager_step_s: float, steps_left: int) -> bool:
    """Whether compiling now pays for itself over `steps_left` steps that would take `eager_step_s` each:
    from this shape's measured timings, else the `ASSUMED` ones; never where compiling measured slower."""
    known = timings or ASSUMED
    if timings is not None and known.speedup < MIN_GAIN:
        return False
    saved = steps_left * eager_step_s * (1 - 1 / known.speedup)
    return saved > known.compile_s
