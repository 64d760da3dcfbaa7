"""A CPU kernel for a few rows of activations times an int8 matrix, in two forms.

    torch.ops.scratchlm.int8_matmul(x, w, scale)     y[m, j] = scale[j] * Σ_i x[m, i] * w[j, i]
    torch.ops.scratchlm.int8_matmul_q8(x, w, scale)  the same, x quantized to int8 per block of 32 first

x float32 or bf16 (M, K), w int8 (N, K) with one scale a row, scale (N,). `matmul` takes the faster form
for x's rows (`Q8_ROWS_AT_MOST`): what the layers call, eagerly and in a compiled decode step.

Decoding a token multiplies one row of activations by every weight matrix once: two floating-point operations
for every weight read. A CPU core does dozens of those in the time memory delivers one float32, so the step is
bound by the bytes of the weights, and a weight held in one byte (int8) rather than four (float32) or two
(bf16) is read four or two times faster, if the arithmetic keeps up. That is the kernel's whole job: never be
slower than memory hands the bytes over. Both forms factor the scale out of each row's dot product:
`Σ_i x_i (q_ji s_j) = s_j Σ_i x_i q_ji`, so the loop runs on the integers as read and one multiplication by
`s_j` ends the row (dequantizing first would write a float copy of the matrix and read it back).

The float form (`int8_matmul`), 8 weights at a time (AVX2): 8 bytes loaded (`_mm_loadl_epi64`), widened to
8 int32 (`_mm256_cvtepi8_epi32`), converted to 8 floats (`_mm256_cvtepi32_ps`, exact for -127..127), and one
fused multiply-add (`_mm256_fmadd_ps`) adds them, times 8 activations, into 8 partial sums: three
instructions for every 8 bytes, 12 for 32, and the conversions, not memory, set the pace (on a Zen 3 core,
15-20 GB/s from the caches).

The int8 x int8 form (`int8_matmul_q8`), llama.cpp's Q8_0 dot product:

- Each row of x is quantized in blocks of 32 (a few KB, once a call): `d = max|x| / 127` and
  `q = round(x / d)` (to even) in float32, `x ≈ q d`; the last block of a `K` not a multiple of 32 is
  padded with zeros, an all-zero block gets `d = 0`.
- Per block of 32 and weight row, the integer dot product, exact: `_mm256_maddubs_epi16` multiplies 32
  unsigned bytes by 32 signed bytes and adds adjacent pairs into 16 int16; the activations' magnitudes
  `|q|` are the unsigned operand, and `_mm256_sign_epi8(w, q)` gives the weights the activations' signs.
  Each pair sum is `|a·b + c·d| ≤ 2 · 127 · 127 = 32,258 < 32,767`: it never saturates (int8 stops at -127
  for that, never -128). `_mm256_madd_epi16` with ones adds the pairs into 8 int32, `_mm256_cvtepi32_ps`
  converts them (exact: at most 4 · 32,258 < 2^24), and one FMA with the block's `d` adds them into the row's
  8 partial sums. Five instructions for 32 bytes where the float form takes 12: at one row 1.2-1.45x the float
  form's speed (docs/device.md), and the same bytes read.
- The rows' scales `s_j` end each row, as in the float form. A partial last block goes through the same
  integer sum in scalar code.
- The price: the activations' rounding, at most `d / 2` an activation (1/254 of its block's largest), so
  `|y_j - exact| ≤ s_j Σ_b (d_b / 2) Σ_{i in b} |q_ji|`: the same relative size as the weights' own rounding,
  as llama.cpp's Q8_0 pays. Past 2 rows it no longer pays: its sign, multiply-adds and conversion are per
  pair of a row and a token, where the float form converts each weight once for every token.

Both forms keep several rows in flight: an FMA's result is ready 4 cycles after it starts, and a core starts
two a cycle, so a single accumulator would make each wait for the previous one. 4 rows (one token) or 2 rows
by up to 4 tokens (a batched step), each pair its own accumulator; each activation block loaded serves every
row of the block, and each row's weights every token (read from memory once a step). Rows are split over
the threads with `at::parallel_for` (not entered at one thread). bf16 activations are converted to float32
once and the result returned in bf16: an AVX2 CPU has no bf16 arithmetic, and the weights are the bytes that
count; float32 contiguous inputs are used as they are, with no copy.

Both forms ask for the weights ahead of the loop (`_mm_prefetch`, 8 KB on: `PREFETCH` in the C++): a block of rows is
one run of bytes read front to back, so the bytes 8 KB on are the next blocks'. Left to the hardware's
prefetcher, a core waited on the weights' cache misses: in a compiled TinyStories step the 17 calls took
about 2.3 ms; asked for ahead, 0.8-1.0 (docs/device.md).

Where the CPU lacks AVX2 and FMA (the flags, `scratchlm.device.host`), the same source is compiled without
the intrinsics: portable scalar loops computing the same maths (for the int8 x int8 form, the same quantized
integers and per-block sums), so that results differ between the two builds by float32 rounding only.

The C++ is built at first use with `torch.utils.cpp_extension.load_inline` (about a minute, said once; the
build is cached in torch's extensions directory, `TORCH_EXTENSIONS_DIR`) and registers the operators in C++,
so that a call from Python, or from Inductor's generated code, is a plain dispatcher call. Their fake
implementation (the output's shape and dtype, nothing computed) lets `make_fx` and Inductor trace them: a
compiled decode step (`scratchlm.generation.decode`) calls them as extern kernels. Where no compiler or no
build works, `load()` returns None and says why (`failure()`), and callers keep PyTorch's forms.

Measured on a 2-core AMD EPYC (Zen 3, AVX2, no AVX-512): docs/device.md's int8 section.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

from scratchlm.kernels.int8_source import SOURCE as _SOURCE

ROWS_AT_MOST = (
    16  # the rows (tokens) a call is written for: a decode step's, a batched step's; more: a matmul
)
# The rows up to which the int8 x int8 form is the faster (docs/device.md: 1.15-1.4x at 1 and 2 rows, one
# core of a Zen 3; at 3 rows and more it loses or ties, its sign, multiply-add and conversion being per pair of
# a row and a token where the float form's conversion is per row).
Q8_ROWS_AT_MOST = 2

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "loaded": True once registered; "failure": why it could not be


def vector_path() -> bool:
    """Whether this CPU runs the AVX2 and FMA form rather than the scalar loop: where PyTorch's own CPU
    kernels run AVX2 or wider (`torch.backends.cpu.get_cpu_capability()`, which needs both flags; the
    device profile shows it as `cpu_capability`)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return platform.machine().lower() in ("x86_64", "amd64") and capability.startswith(("AVX2", "AVX512"))


def _build_directory(name: str, cpp_extension) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


def load() -> bool:
    """Build (once per machine, cached) and register the kernel; whether it is there. Never raises: a build
    that fails is remembered for the process, with its reason (`failure()`)."""
    with _LOCK:
        if "loaded" in _STATE or "failure" in _STATE:
            return "loaded" in _STATE
        try:
            _build_and_register()
            _STATE["loaded"] = True
        except Exception as error:  # noqa: BLE001  (a compiler's failure takes many forms; all mean "not here")
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            _STATE["failure"] = f"the int8 CPU kernel did not build: {first[:200]}"
    return "loaded" in _STATE


def failure() -> str | None:
    """Why `load()` found no kernel in this process, or None (loaded, or not tried)."""
    reason = _STATE.get("failure")
    return reason if isinstance(reason, str) else None


def _openmp() -> list[str]:
    """`-fopenmp` where PyTorch's own parallel backend is OpenMP and the compiler takes the flag (Linux's):
    `at::parallel_for` is a header template whose OpenMP form is a `#pragma omp parallel`, which a build
    without the flag ignores, running every call on one thread whatever `torch.set_num_threads` says (a
    compiled TinyStories step's 17 calls took 0.62 ms at 2 threads as at 1, on a 2-core Zen 3)."""
    backend = "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()
    return ["-fopenmp"] if backend and sys.platform.startswith("linux") else []


def _flags() -> list[str]:
    return (["-O3", "-DSCRATCHLM_AVX2", "-mavx2", "-mfma"] if vector_path() else ["-O3"]) + _openmp()


def _name_and_directory(cpp_extension) -> tuple[str, Path]:
    """The extension's name (its source, flags and torch version hashed in) and where its build lies."""
    flags = _flags()
    digest = hashlib.sha256((_SOURCE + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    name = f"scratchlm_int8_{'avx2' if vector_path() else 'scalar'}_{digest}"
    return name, _build_directory(name, cpp_extension)


def ready() -> bool:
    """Whether `load()` would not have to compile: loaded in this process, or built on this machine before.
    The device profile measures the kernel only then, so that no command's first measurement of the
    machine waits a minute for a compiler on behalf of `--quantize int8`, which may never be asked for."""
    if "loaded" in _STATE:
        return True
    from torch.utils import cpp_extension  # noqa: PLC0415

    name, directory = _name_and_directory(cpp_extension)
    return any(directory.glob(f"{name}*.so")) or any(directory.glob(f"{name}*.pyd"))


def _build_and_register() -> None:
    from torch.utils import cpp_extension  # noqa: PLC0415  (imports setuptools: only where it is built)

    vector, flags = vector_path(), _flags()
    name, directory = _name_and_directory(cpp_extension)
    directory.mkdir(parents=True, exist_ok=True)
    built = any(directory.glob(f"{name}*.so")) or any(directory.glob(f"{name}*.pyd"))
    start = time.perf_counter()
    cpp_extension.load_inline(
        name,
        cpp_sources=[_SOURCE],
        extra_cflags=flags,
        extra_ldflags=_openmp(),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    if not built:
        form = "AVX2" if vector else "scalar"
        print(
            f"built the int8 CPU kernel ({form}) in {time.perf_counter() - start:.0f} s; cached in {directory}",
            file=sys.stderr,
        )
    torch.library.register_fake("scratchlm::int8_matmul")(_fake)
    torch.library.register_fake("scratchlm::int8_matmul_q8")(_fake)


def _fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The output a call would give, without computing it: what tracing (`make_fx`, Inductor) needs."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ (weight * scale[:, None]).T` by the kernel (`load()` first), in `x`'s dtype: x (..., K) float32
    or bf16 on the CPU, weight (N, K) int8, scale (N,). Any number of rows runs; it is written for up to
    `ROWS_AT_MOST`, beyond which a BLAS matmul of the dequantized matrix is the faster."""
    return torch.ops.scratchlm.int8_matmul(x, weight, scale)


def int8_matmul_q8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int8_matmul` with the activations quantized too (`load()` first): each row of `x` in blocks of 32, one
    float32 scale a block, `d = max|x| / 127`, `q = round(x / d)`; the product of the integers per block, exact
    in int32, times `d` and the weight row's scale. Fewer instructions a weight than `int8_matmul`, at the
    error of the activations' rounding, at most `d / 2` an activation."""
    return torch.ops.scratchlm.int8_matmul_q8(x, weight, scale)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's faster form for `x`'s rows: `int8_matmul_q8` up to `Q8_ROWS_AT_MOST`, else `int8_matmul`
    (what a layer calls, eagerly and in a compiled step)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (int8_matmul_q8 if rows <= Q8_ROWS_AT_MOST else int8_matmul)(x, weight, scale)
