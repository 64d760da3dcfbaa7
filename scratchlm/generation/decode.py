"""The one-token decode step, eager or compiled: where the time of generating goes.

A decode step runs one new token a sequence through the model. Its arithmetic is a matrix-vector product per
weight matrix, so the least it can cost is reading every weight once: on a small model (the TinyStories shape,
22 M parameters) that is about 2 ms at 40 GB/s. Run eagerly it costs several times that, because the forward
pass is some 400 small operations, and each is a Python call, a dispatch and a kernel launch that take longer
than its arithmetic. The remedy is the gpt-fast recipe:

1. Give every step the same shape. The rows (sequences) are padded up to a bucket (1, 2, 4, 8, 16, ...), the
   keys and values live in a preallocated `PaddedKVCache` written in place, and every step attends over a
   fixed window of positions under each row's mask (`WholeWindowKVCache`): nothing about a step depends on
   how long the sequences are.
2. Compile that step once per bucket with Inductor: it fuses the elementwise operations (RoPE, RMSNorm,
   SwiGLU's gate, the softmax) into a few loops and writes or calls the matrix products, so a step is a
   handful of kernels with no Python between them. On a GPU the step goes through `torch.compile` and is
   captured as a CUDA graph (`mode="reduce-overhead"`), replayed with one launch. On a CPU each call would
   still pay Dynamo's frame evaluation and guards, 0.5 to 1.2 ms of a 4 to 7 ms step on a 2-core Zen 3; so
   the step is traced once into a graph of ATen operations (`make_fx`, over the cache's tensors as inputs)
   and compiled by Inductor without Dynamo (`torch._inductor.standalone_compile`), and a call runs the
   generated code alone.

The window is the whole context, except where the rows' keys and values weigh as much as a good part of the
weights (`window_buckets`). A step reads every weight once and every row's keys and values over its window
once; with many rows, or a long context, the keys and values are most of those bytes (16 rows of the
TinyStories shape: 67 MB of them over the whole context, against 70 MB of weights; one row of a 30-layer
model with 8,192 positions: 377 MB against 425 MB), and so of the time. There the window follows the
sequences' lengths: windows double from the largest where the keys and values weigh at most a sixteenth of
the weights (below it a smaller window saves under 6 % of a step's bytes) up to the context, and a step runs
at the smallest window that holds its longest row. A conversation of 300 tokens reads 512 positions of an
8K or a 128K context alike. Each window is a compilation of its own, made when a sequence first needs it
(a `generate` call compiles the one window that holds its whole generation, `reach`; a server compiles in
the background, `scratchlm.generation.on_demand`).

Prefill (a prompt of any length) stays eager: it is one pass of many tokens, where the operations are large
and their overhead does not count. Its keys and values are copied into the decoder's rows (`store`).

    decoder = Decoder(model, max_rows=16, compiled=True)
    decoder.cache.store(row, prefill_cache)           # a prompt prefilled eagerly, into row `row`
    logits = decoder.step(tokens)                     # (rows, vocab); every row's length advances by one

Compiled and eager steps compute the same function in a different order of floating-point operations: greedy
tokens agree except where the two largest logits are within rounding of each other.

Whether to compile is the device plan's choice (`Plan.decode`, from a measurement; `--no-compile` turns it
off); when a compiled step is worth its compilation, and which decoders a process keeps, is the timing policy
of `scratchlm.generation.compile_policy`: a compiled step is paid for once per process, model and bucket, so a
short request never waits for it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from scratchlm.model.kv_cache import WholeWindowKVCache, decode_dtype
from scratchlm.model.layers import check_stacks, hold_rows_for_decoding, tracing_step
from scratchlm.model.transformer import TransformerLM


def bucket(rows: int, max_rows: int) -> int:
    """The step shape `rows` sequences run at: the next power of two, at most `max_rows`."""
    size = 1
    while size < rows:
        size *= 2
    return min(size, max_rows)


# Windows are bucketed where the rows' keys and values over the whole context weigh at least this share of
# the weights, and at least `WINDOW_BYTES`: below either, the bytes saved do not pay for more compilations (a
# small model's keys and values stay in the CPU's caches, and its step is not read-bound).
WINDOW_SHARE = 0.25
WINDOW_BYTES = 16 * 2**20
# The smallest window: the largest power of two at which the keys and values weigh at most this share of the
# weights; halving it again would save under 6 % of a step's bytes, for one more compilation.
FLOOR_SHARE = 1 / 16


def window_buckets(model: TransformerLM, rows: int) -> list[int]:
    """The windows (numbers of key positions) a compiled step of `rows` rows runs at: the whole context, or,
    on a CPU where the rows' keys and values over the whole context weigh at least `WINDOW_SHARE` of the
    weights (as they are held: the cache in `decode_dtype`, the weights in theirs) and at least
    `WINDOW_BYTES`, powers of two from the largest whose keys and values weigh at most `FLOOR_SHARE` of the
    weights, doubling up to the context."""
    config, weight, context = model.config, model.lm_head.weight, model.config.context_length
    embeddings = model.token_embeddings  # its rows in the plan's dtype even where the matrices hold int8
    held = decode_dtype(embeddings.output_dtype, embeddings.weight.device).itemsize
    position_bytes = rows * 2 * config.num_layers * config.kv_heads * config.head_dim * held
    weight_bytes = model.num_parameters(non_embedding=True) * weight.element_size()
    # On a GPU the whole context: there the buckets are graphs of one `torch.compile`d function, which
    # recompiles for at most `torch._dynamo.config.recompile_limit` shapes, fewer than the buckets' windows.
    if weight.is_cuda or position_bytes * context < max(WINDOW_SHARE * weight_bytes, WINDOW_BYTES):
        return [context]
    window = 1
    while 2 * window * position_bytes <= FLOOR_SHARE * weight_bytes and 2 * window < context:
        window *= 2
    windows = []
    while window < context:
        windows.append(window)
        window *= 2
    return [*windows, context]


def _step(model: TransformerLM, cache: WholeWindowKVCache, tokens: Tensor) -> Tensor:
    return model.decode(tokens, cache)


class _DecodeStep(nn.Module):
    """`model.decode` as a module's forward, for `torch.func.functional_call`."""

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, cache: WholeWindowKVCache) -> Tensor:
        return self.model.decode(tokens, cache)


Traced = tuple[torch.fx.GraphModule, list[Tensor]]  # a step's graph and the inputs it was traced with


def trace_on_cpu(
    model: TransformerLM, view: WholeWindowKVCache, tokens: Int[Tensor, "rows 1"], fake: bool = False
) -> Traced:
    """`view`'s step traced into a graph whose inputs are the tokens, the model's parameters and buffers, and
    the view's tensors: by running the step once, which writes what the step writes (each row's keys and
    values at its position, where its next step writes them again), or, `fake`, on fake tensors of the same
    shapes, which reads and writes nothing (a trace that runs beside the steps, in a thread of its own). The
    weights are inputs, not constants, so that each call reads them where they lie, as a `torch.compile`d step
    does. A fake trace runs on a copy of the model's modules that shares its tensors: `functional_call`
    puts the graph's inputs in the place of the parameters while it traces, and the steps running beside it
    must go on reading the real ones."""
    check_stacks(model)  # on the real tensors: a stack whose weights left it is not traced
    module = _DecodeStep(_sharing_tensors(model) if fake else model)
    named = dict(module.named_parameters()) | dict(module.named_buffers())
    names, weights = list(named), list(named.values())

    def step(tokens: Tensor, *tensors: Tensor) -> Tensor:
        given = dict(zip(names, tensors[: len(names)], strict=True))
        return functional_call(module, given, (tokens, view.over(tensors[len(names) :])))

    inputs = [tokens, *weights, *view.tensors()]
    with torch.no_grad(), tracing_step():
        # Tensors the layers hold beside their parameters (a fused stack, a copy by rows) are the graph's
        # constants either way: `_allow_non_fake_inputs` lets a fake trace take them as they are.
        mode = "fake" if fake else "real"
        graph = make_fx(step, tracing_mode=mode, _allow_non_fake_inputs=fake)(*inputs)
    return graph, inputs


def _sharing_tensors(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules (and of the objects they hold) whose tensors are `model`'s own."""
    shared: dict[int, object] = {}
    seen: set[int] = set()
    pending: list[object] = [model]
    while pending:
        item = pending.pop()
        if isinstance(item, Tensor):
            shared[id(item)] = item
        elif id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, dict):
                pending.extend(item.values())
            elif isinstance(item, list | tuple | set):
                pending.extend(item)
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                pending.extend(vars(item).values())
    return copy.deepcopy(model, shared)


def compile_traced(traced: Traced, threads: int) -> Callable[[Tensor], Tensor]:
    """A traced step compiled by Inductor without Dynamo, its loops written for `threads` threads (set here:
    a thread's count is its own, and this may run in a thread of its own), taking the tokens alone."""
    graph, inputs = traced
    torch.set_num_threads(threads)
    with torch.no_grad():  # an inference graph, whichever thread compiles it: nothing is kept for backward
        compiled = torch._inductor.standalone_compile(graph, inputs, dynamic_shapes="from_example_inputs")
    held = inputs[1:]  # every input but the tokens: the same tensors at every call
    return lambda tokens: compiled(tokens, *held)


class Decoder:
    """Decode steps for up to `max_rows` sequences held in `cache` (a `PaddedKVCache`), eager or `compiled`.

    Eager, a step runs on the rows in use and the keys of the longest row, as the serving engine always has.
    Compiled, it runs at the bucket of the rows in use, over the smallest of its `window_buckets` that holds
    the longest row and `reach` (the length the caller will take its rows to: one compilation for a whole
    generation); the first step of each bucket, window and thread count compiles it (`compile_seconds` adds
    up the time), said through `announce` before and after, so a command can show what it waits for."""

    def __init__(
        self,
        model: TransformerLM,
        max_rows: int,
        compiled: bool,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.model, self.max_rows, self.compiled = model, max_rows, compiled
        self.cache = model.new_padded_kv_cache(max_rows)
        self.announce = announce or (lambda line: None)
        self.reach = 0  # the length the caller will take its rows to: a window holds it from the start
        self.compile_seconds = 0.0
        self.step_seconds: list[float] = []  # the compiled steps' times, compilations left out
        # Sizes where the compiled step measured no faster (`scratchlm.generation.on_demand`): run eagerly.
        self.eager_buckets: set[int] = set()
        self._windows = {size: window_buckets(model, size) for size in range(1, max_rows + 1)}
        self._views: dict[tuple[int, int], WholeWindowKVCache] = {}  # by bucket and window
        self._tokens: dict[int, Tensor] = {}  # by bucket
        # The compiled step of each bucket, window and thread count: Inductor's loops are written for the
        # threads they will run on (a step compiled for 1 thread runs on 1 whatever `torch.get_num_threads`
        # says).
        self._steps: dict[tuple[int, int, int], Callable[[Tensor], Tensor]] = {}
        self._on_gpu = self.cache.layers[0].keys.is_cuda
        if compiled and not self._on_gpu:
            # The compiled step reads each weight by rows (`Linear.forward`), while the eager products
            # (prefill, an eager step) stay fastest on the wide matrices held by columns where `Plan.matvec`
            # measured that: those get a copy by rows.
            hold_rows_for_decoding(model)
        if compiled and self._on_gpu:
            # dynamic=False: a graph per bucket, each at fixed shapes. "reduce-overhead" records the step as a
            # CUDA graph; the cache's tensors keep their addresses, so the graph writes to them.
            self._graphed = torch.compile(_step, dynamic=False, mode="reduce-overhead", fullgraph=True)

    def _view(self, rows: int, window: int) -> WholeWindowKVCache:
        view = self._views.get((rows, window))
        if view is None:
            view = self._views[rows, window] = WholeWindowKVCache(self.cache, rows, window)
            if rows not in self._tokens:
                self._tokens[rows] = torch.zeros(rows, 1, dtype=torch.long, device=view.positions.device)
            for tensor in (*view.tensors(), self._tokens[rows]):
                torch._dynamo.mark_static_address(tensor)
        return view

    def _trace(self, rows: int, window: int, fake: bool = False) -> Traced:
        """The CPU step of `rows` rows over `window` positions, traced at the rows' current positions (or,
        `fake`, on fake tensors: see `trace_on_cpu`)."""
        return trace_on_cpu(self.model, self._views[rows, window], self._tokens[rows], fake)

    def _compile(self, rows: int, window: int) -> Callable[[Tensor], Tensor]:
        """The step of `rows` rows over `window` positions, compiled: on a GPU at its first call, as a CUDA
        graph (the output is copied: it lives in the graph's memory, which the next step overwrites); on a
        CPU now."""
        view = self._views[rows, window]
        if self._on_gpu:
            return lambda tokens: self._graphed(self.model, view, tokens).clone()
        return compile_traced(self._trace(rows, window), torch.get_num_threads())

    def window_for(self, rows: int, reach: int) -> int:
        """The smallest window of the bucket of `rows` rows that holds `reach` positions (or the context)."""
        size = bucket(rows, self.max_rows)
        return next((w for w in self._windows[size] if w >= reach), self._windows[size][-1])

    def window(self, rows: int) -> int:
        """The window a compiled step of the first `rows` rows runs at: the smallest of the bucket's windows
        past the longest row's length (where its new token goes) that holds `reach` too."""
        return self.window_for(rows, max(max(self.cache.lengths[:rows]) + 1, self.reach))

    def is_compiled_for(self, rows: int, reach: int = 1) -> bool:
        """Whether a step of `rows` sequences whose lengths stay within `reach` runs without compiling first."""
        size = bucket(rows, self.max_rows)
        if not self.compiled or size in self.eager_buckets:
            return True
        return (size, self.window_for(rows, reach), torch.get_num_threads()) in self._steps

    def eager_step(self, tokens: Int[Tensor, " rows"]) -> Float[Tensor, "rows vocab"]:
        """The step run eagerly on the rows in use, whatever the decoder compiles."""
        self.cache.batch_size = tokens.shape[0]
        return self.model(tokens[:, None], kv_cache=self.cache)[:, -1]

    def step(self, tokens: Int[Tensor, " rows"]) -> Float[Tensor, "rows vocab"]:
        """Run each row's newest token (row r of the cache is sequence r); every row's length grows by one."""
        if not self.compiled or bucket(tokens.shape[0], self.max_rows) in self.eager_buckets:
            return self.eager_step(tokens)
        return self.compiled_step(tokens, self.window(tokens.shape[0]))

    def _shape(self, size: int, window: int) -> str:
        shape = f"{size} sequence{'' if size == 1 else 's'}"
        return shape + ("" if window == self.cache.window else f", {window} positions")

    def _prepare(self, tokens: Int[Tensor, " rows"], window: int) -> tuple[int, int, int]:
        """Put the rows' tokens and positions where the step of their bucket over `window` reads them; its
        key (bucket, window, threads)."""
        rows = tokens.shape[0]
        size = bucket(rows, self.max_rows)
        self.cache.batch_size = rows
        view = self._view(size, window)
        view.set_positions(self.cache.lengths[:rows])
        self._tokens[size][:rows, 0] = tokens
        return size, window, torch.get_num_threads()

    def compiled_step(self, tokens: Int[Tensor, " rows"], window: int) -> Float[Tensor, "rows vocab"]:
        """`step` through the compiled step over `window` positions (which must hold every row's new token),
        compiled first where this is its first call."""
        key = size, _, _ = self._prepare(tokens, window)
        first = key not in self._steps
        if first:
            self.announce(f"compiling the decode step for {self._shape(size, window)}…")
        start = time.perf_counter()
        if first:
            self._steps[key] = self._compile(size, window)
        logits = self._steps[key](self._tokens[size])[: tokens.shape[0]]
        seconds = time.perf_counter() - start
        if first:
            self.compile_seconds += seconds
            self.announce(f"compiled the decode step for {self._shape(size, window)} in {seconds:.1f} s")
        else:
            self.step_seconds.append(seconds)
        self.cache.advance(1)
        return logits
