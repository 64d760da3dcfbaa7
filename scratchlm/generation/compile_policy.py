"""When decoding compiles: the timing policy over `scratchlm.generation.decode`'s steps.

A compiled decode step (`Decoder`) is paid for once per process, model and bucket, and it is worth paying for
only where it runs faster than the eager step and the tokens still to generate save more time than compiling
costs. Both depend on the machine and the model's shape, so both are measured, and the measurements are kept
per machine (`scratchlm.device.decode_timings`) for the next decision:

    CompiledSwitch    one `generate` call's move from eager steps to a compiled decoder: after a few timed
                      eager steps, and only where the steps left pay for the compilation; it records what it
                      measured when the call ends
    _DECODERS         the compiled decoders of this process, one per model and row count, so that a second
                      call never compiles what the first one did

The decode step itself (buckets, windows, how a step compiles on each device) is `scratchlm.generation.decode`;
a server's steps, compiled in the background as its traffic needs them and kept where they measure faster, are
`scratchlm.generation.on_demand`.
"""

from __future__ import annotations

import statistics
import time
import weakref

from scratchlm.console import console
from scratchlm.device.decode_timings import (
    DecodeTimings,
    measured_timings,
    record_timings,
    timings_key,
    worth_compiling,
)
from scratchlm.generation.decode import Decoder
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.transformer import TransformerLM
from scratchlm.precisions import DTYPE_NAMES

WARMUP_STEPS = 4  # eager steps `generate` times before it decides whether compiling pays


def model_timings_key(model: TransformerLM, rows: int) -> str:
    """The key of `model`'s decode timings at `rows` rows on its device and in its weights' precision."""
    weight = model.lm_head.weight
    precision = {dtype: name for name, dtype in DTYPE_NAMES.items()}.get(str(weight.dtype).split(".")[-1])
    c = model.config
    shape = (c.num_layers, c.d_model, c.num_heads, c.kv_heads, c.d_ff, c.vocab_size, c.context_length)
    return timings_key(weight.device, precision or str(weight.dtype), shape, rows)


# One compiled decoder per model and row count, for `generate`: a compilation is paid for once per process.
_DECODERS: weakref.WeakKeyDictionary[TransformerLM, dict[int, Decoder]] = weakref.WeakKeyDictionary()


def _announce(line: str) -> None:
    console.print(line, style="dim")


class CompiledSwitch:
    """When `generate` moves from eager steps to a compiled decoder, for one call of `rows` sequences.

    `compile=None` follows the plan (`prepare_for_inference` sets `model.compiled_decode`): the first
    `WARMUP_STEPS` steps run eagerly and are timed, then the call compiles only if the steps it has left save
    more time than compiling costs (`worth_compiling`, from this machine's measured timings of the shape). A
    decoder this process already compiled is used at once. `compile=True` compiles at the first step (a
    benchmark, a caller about to generate a lot); `False` never compiles. `finish` records the timings the
    call measured, eager and compiled, for the next decision."""

    def __init__(self, model: TransformerLM, rows: int, compile: bool | None) -> None:
        self.model, self.rows = model, rows
        self.wanted = getattr(model, "compiled_decode", False) if compile is None else compile
        self.forced = compile is True
        self.eager_seconds: list[float] = []
        self._last: float | None = None
        self.used: Decoder | None = None

    def decoder(self, cache: KVCache, steps_left: int) -> Decoder | None:
        """After each eager step (the prefill first): the compiled decoder to go on with, `cache`'s sequences
        copied into its rows, or None to stay eager."""
        if not self.wanted or steps_left <= 0:
            return None
        now = time.perf_counter()
        if self._last is not None:
            self.eager_seconds.append(now - self._last)
        self._last = now
        decoders = _DECODERS.get(self.model, {})
        reach = cache.length + steps_left  # the rows' length at the call's last step: one window holds it
        ready = self.rows in decoders and decoders[self.rows].is_compiled_for(self.rows, reach)
        if not (ready or self.forced):
            if len(self.eager_seconds) < WARMUP_STEPS:
                return None
            timings = measured_timings(model_timings_key(self.model, self.rows))
            if not worth_compiling(timings, statistics.median(self.eager_seconds), steps_left):
                self.wanted = False
                return None
        if self.rows not in decoders:
            decoders = _DECODERS.setdefault(self.model, {})
            decoders[self.rows] = Decoder(self.model, self.rows, compiled=True, announce=_announce)
        decoder = self.used = decoders[self.rows]
        decoder.reach = reach
        for row in range(self.rows):
            decoder.cache.store(row, cache, row)
        return decoder

    def finish(self) -> None:
        """Record the timings of this call's eager and compiled steps, where it measured both."""
        decoder = self.used
        if decoder is None or len(self.eager_seconds) < WARMUP_STEPS or len(decoder.step_seconds) < 2:
            return
        key = model_timings_key(self.model, self.rows)
        compile_s = decoder.compile_seconds or getattr(measured_timings(key), "compile_s", 0.0)
        timings = DecodeTimings(
            eager_ms=statistics.median(self.eager_seconds) * 1e3,
            compiled_ms=statistics.median(decoder.step_seconds[-64:]) * 1e3,
            compile_s=compile_s,
        )
        record_timings(key, timings)
