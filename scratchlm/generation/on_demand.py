"""A server's decode steps: compiled as its traffic asks for them, in the background, and kept where they pay.

A server cannot know which batch sizes and windows its clients will need, and on a CPU each step (a bucket of
rows over a window of positions, `scratchlm.generation.decode`) takes seconds to compile, 30 to 40 for a
30-layer model. Compiling every one before the first request (5 buckets and the windows of an 8K context)
would keep a server silent for minutes. So `OnDemandDecoder`

    serves at once       a step whose compiled form is not ready runs at a larger window of its bucket that is
                         compiled (the same function over more masked positions), else eagerly;
    compiles what the    the first step that needs a bucket and window starts its compilation, when none is
    traffic needs        running, in a thread of its own: the graph traced on fake tensors (which reads and
                         writes nothing of the cache the steps go on using; tracing a 30-layer step takes tens
                         of seconds), then compiled by Inductor; the step is used from the first step after it
                         is done. One compilation at a time: a step that still needs its own asks again
                         later. Meanwhile the eager steps run on one thread fewer and the interpreter switches
                         threads more often, so that the compilation slows them less. On a GPU, where a step
                         compiles through `torch.compile` at its first call, and where `background` is off
                         (tests, benchmarks), a step compiles at once, in the serving thread;
    keeps what pays      the first use of each compiled step times it against the eager step at the same rows
                         and lengths (a few of each; the rows' lengths are put back after, and the slots they
                         wrote are written again by the next step); where it is not `MIN_GAIN` times faster,
                         that bucket runs eagerly from then on. The timings are recorded for this machine
                         (`scratchlm.device.decode_timings`), and a bucket recorded as not paying is not
                         compiled again.

`compiling` names the step being compiled, for the server's `/info`; `settle` waits for it (a benchmark
measuring the steady state).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
from jaxtyping import Float, Int
from torch import Tensor

from scratchlm.device.decode_timings import MIN_GAIN, DecodeTimings, measured_timings, record_timings
from scratchlm.generation.compile_policy import model_timings_key
from scratchlm.generation.decode import Decoder, bucket, compile_traced
from scratchlm.model.transformer import TransformerLM

Key = tuple[int, int, int]  # the bucket of rows, the window, the threads
SWITCH_INTERVAL = 2e-4  # seconds: the switch interval while a step compiles beside the steps (`_start`)
# Compiled and eager steps timed at a compiled step's first use: the fastest of each counts.
MEASURED_STEPS = 3


class OnDemandDecoder(Decoder):
    """A compiled `Decoder` for a server: each step compiled when the traffic first needs it, in the
    background where `background` and the device allow, and kept only where it measures faster."""

    def __init__(
        self,
        model: TransformerLM,
        max_rows: int,
        background: bool = True,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(model, max_rows, compiled=True, announce=announce)
        self.background = background and not self._on_gpu
        self._in_flight: tuple[Key, Future] | None = None  # its result: the step and its compile seconds
        self._unmeasured: dict[Key, float] = {}  # compiled, not yet timed against eager: its compile seconds
        for size in {bucket(rows, max_rows) for rows in range(1, max_rows + 1)}:
            known = measured_timings(model_timings_key(model, size))
            if known is not None and known.speedup < MIN_GAIN:
                self.eager_buckets.add(size)

    def compiling(self) -> list[str]:
        """The step being compiled, as `announce` names it (none, or one)."""
        if self._in_flight is None or self._in_flight[1].done():
            return []
        return [self._shape(*self._in_flight[0][:2])]

    def settle(self, timeout: float | None = None) -> None:
        """Wait until the step being compiled is done (its result is taken at the next step)."""
        if self._in_flight is not None:
            self._in_flight[1].exception(timeout)

    def step(self, tokens: Int[Tensor, " rows"]) -> Float[Tensor, "rows vocab"]:
        self._collect()
        rows = tokens.shape[0]
        size, threads = bucket(rows, self.max_rows), torch.get_num_threads()
        if size in self.eager_buckets:
            return self.eager_step(tokens)
        window = self.window(rows)
        if (size, window, threads) not in self._steps:
            if not self.background:
                compile_before = self.compile_seconds
                logits = self.compiled_step(tokens, window)
                self._unmeasured[size, window, threads] = self.compile_seconds - compile_before
                return logits
            if self._in_flight is None:
                self._start(tokens, window)
            ready = [w for w in self._windows[size] if w >= window and (size, w, threads) in self._steps]
            if not ready:
                return self._eager_beside_compilation(tokens, threads)
            window = ready[0]
        if (size, window, threads) in self._unmeasured:
            self._measure(tokens, window)
            if size in self.eager_buckets:
                return self.eager_step(tokens)
        return self.compiled_step(tokens, window)

    def _eager_beside_compilation(self, tokens: Int[Tensor, " rows"], threads: int) -> Tensor:
        """The eager step, on one thread fewer while a compilation takes a core: threads that wait for each
        other at every operation's end lose most where one of them shares its core (a 30-layer model's
        first answer of 16 tokens, beside its compilation on a 2-core Zen 3: 12.6 s so, 14.8 s on both)."""
        if self._in_flight is None or self._in_flight[1].done() or threads < 2:
            return self.eager_step(tokens)
        torch.set_num_threads(threads - 1)
        try:
            return self.eager_step(tokens)
        finally:
            torch.set_num_threads(threads)

    def _start(self, tokens: Int[Tensor, " rows"], window: int) -> None:
        """Trace and compile the step the rows need now, in a thread of its own."""
        key = size, _, threads = self._prepare(tokens, window)
        self.announce(
            f"compiling the decode step for {self._shape(size, window)} in the background; "
            "serving without it meanwhile…"
        )
        start = time.perf_counter()
        done: Future = Future()
        shape = self._shape(size, window)

        def compile_it() -> None:
            # Tracing and Inductor's code generation are Python that holds the interpreter's lock; each
            # operation of an eager step waits for it, up to the switch interval, so a shorter interval
            # keeps the steps beside a compilation moving (with the default 5 ms a 30-layer model's first answer
            # took 17 s instead of about 1; 0.2 ms and one thread fewer, 12.6 s).
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL)
            try:
                step = compile_traced(self._trace(size, window, fake=True), threads)
            except BaseException as e:  # reported by the serving thread, which goes on eagerly
                done.set_exception(e)
                return
            finally:
                sys.setswitchinterval(interval)
            seconds = time.perf_counter() - start
            self.announce(f"compiled the decode step for {shape} in {seconds:.1f} s")
            done.set_result((step, seconds))

        # A daemon thread: a server stopped mid-compilation exits without waiting for Inductor.
        threading.Thread(target=compile_it, name="scratchlm-compile", daemon=True).start()
        self._in_flight = (key, done)

    def _collect(self) -> None:
        """Take a finished compilation's step (or its failure: that bucket runs eagerly)."""
        if self._in_flight is None or not self._in_flight[1].done():
            return
        (size, window, threads), done = self._in_flight
        self._in_flight = None
        if (error := done.exception()) is not None:
            self.eager_buckets.add(size)
            shape = self._shape(size, window)
            self.announce(f"compiling the decode step for {shape} failed ({error}); it runs eagerly")
            return
        step, seconds = done.result()
        self.compile_seconds += seconds
        self._steps[size, window, threads] = step
        self._unmeasured[size, window, threads] = seconds

    def _measure(self, tokens: Int[Tensor, " rows"], window: int) -> None:
        """Time the compiled step over `window` against the eager step at the rows' lengths; keep the
        faster way for the bucket, and record the timings for this machine."""
        size = bucket(tokens.shape[0], self.max_rows)
        compile_s = self._unmeasured.pop((size, window, torch.get_num_threads()))
        lengths = list(self.cache.lengths)

        def timed(run: Callable[[], object]) -> float:
            self.cache.lengths[:] = lengths
            start = time.perf_counter()
            run()
            if tokens.is_cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - start

        compiled = min(timed(lambda: self.compiled_step(tokens, window)) for _ in range(MEASURED_STEPS))
        eager = min(timed(lambda: self.eager_step(tokens)) for _ in range(MEASURED_STEPS))
        self.cache.lengths[:] = lengths
        timings = DecodeTimings(eager_ms=eager * 1e3, compiled_ms=compiled * 1e3, compile_s=compile_s)
        record_timings(model_timings_key(self.model, size), timings)
        if timings.speedup < MIN_GAIN:
            self.eager_buckets.add(size)
        way = "eager" if size in self.eager_buckets else "compiled"
        self.announce(f"  {self._shape(size, window)}: {way}; {timings.describe()}")
