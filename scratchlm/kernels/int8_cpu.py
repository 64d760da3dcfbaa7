"""A CPU kernel for a few rows of activations times an int8 matrix: `torch.ops.scratchlm.int8_matmul`.

    y[m, j] = scale[j] * Σ_i x[m, i] * w[j, i]        x float32 or bf16 (M, K), w int8 (N, K), scale (N,)

Decoding a token multiplies one row of activations by every weight matrix once: two floating-point operations
for every weight read. A CPU core does dozens of those in the time memory delivers one float32, so the step is
bound by the bytes of the weights, and a weight held in one byte (int8) rather than four (float32) or two
(bf16) is read four or two times faster, if the arithmetic keeps up. That is the kernel's whole job: turn each
int8 weight into a float in registers, never in memory, and never slower than memory hands the bytes over.

What it does, for each output row `j` (rows split over the threads with `at::parallel_for`):

- The scale factors out of the dot product. With one scale a row, `Σ_i x_i (q_ji s_j) = s_j Σ_i x_i q_ji`:
  the loop runs on the integers as read, and one multiplication by `s_j` ends the row. Dequantizing first
  would write a float copy of the matrix and read it back: the bytes int8 saved, spent twice.
- 8 weights at a time (AVX2): 8 bytes are loaded into a vector register (`_mm_loadl_epi64`), widened to 8
  int32 (`_mm256_cvtepi8_epi32`) and converted to 8 floats (`_mm256_cvtepi32_ps`), exact for -127..127; one
  fused multiply-add (`_mm256_fmadd_ps`) adds them, times 8 activations, into an accumulator of 8 partial sums.
- Several accumulators. An FMA's result is ready 4 cycles after it starts, and a core starts two a cycle: a
  single accumulator would make each FMA wait for the previous one, using an eighth of the core. The kernel
  keeps 4 rows (one token) or 2 rows by up to 4 tokens (a batched step) in flight, each pair its own
  accumulator, so 4 to 8 independent chains hide the latency; each 8 activations loaded serve every row of
  the block, and each row's 8 weights every token of the block (read from memory once a step: 16 tokens come
  back for the same row while it sits in the core's first-level cache).
- The last `K mod 8` weights of a row go through a scalar loop, so `K` need not be a multiple of anything.
- bf16 activations are converted to float32 once (M x K values, a few KB), the product computed in float32,
  and the result returned in bf16: an AVX2 CPU has no bf16 arithmetic, and the weights are the bytes that
  count.

Where the CPU lacks AVX2 and FMA (the flags, `scratchlm.device.host`), the same source is compiled without
the intrinsics: a portable scalar loop that the compiler vectorises as it can. The result differs from the
float64 product of the dequantized matrix by float32 rounding only (the sums are reassociated).

The C++ is built at first use with `torch.utils.cpp_extension.load_inline` (about a minute, said once; the
build is cached in torch's extensions directory, `TORCH_EXTENSIONS_DIR`) and registers the operator in C++,
so that a call from Python, or from Inductor's generated code, is a plain dispatcher call. Its fake
implementation (the output's shape and dtype, nothing computed) lets `make_fx` and Inductor trace it: a
compiled decode step (`scratchlm.generation.decode`) calls it as an extern kernel. Where no compiler or no
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

ROWS_AT_MOST = (
    16  # the rows (tokens) a call is written for: a decode step's, a batched step's; more: a matmul
)
# The rows up to which the int8 x int8 form is the faster (docs/device.md: 1.15-1.4x at 1 and 2 rows, one
# core of a Zen 3; at 3 rows and more it loses or ties, its sign, multiply-add and conversion being per pair of
# a row and a token where the float form's conversion is per row).
Q8_ROWS_AT_MOST = 2

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef SCRATCHLM_AVX2
#include <immintrin.h>
#endif

namespace {

at::Tensor as_float(const at::Tensor& t) {  // no copy, no dispatch where it is float32 and contiguous already
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  return t.to(at::kFloat).contiguous();
}

// Rows [j, j + R) of w, tokens [0, T) of x (each K long), into y (token t's row at y + t * N).
template <int R, int T>
void block(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N, int64_t j) {
  float sums[R][T];
  int64_t i = 0;
#ifdef SCRATCHLM_AVX2
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (; i + 8 <= K; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + (j + r) * K + i))));
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + i);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
      const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
      sums[r][t] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    }
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) sums[r][t] = 0.0f;
#endif
  for (int r = 0; r < R; ++r) {
    const int8_t* row = w + (j + r) * K;
    for (int t = 0; t < T; ++t) {
      float s = sums[r][t];
      for (int64_t k = i; k < K; ++k) s += x[t * K + k] * static_cast<float>(row[k]);
      y[t * N + j + r] = s * scale[j + r];
    }
  }
}

// Tokens [0, T) over rows [begin, end): blocks of R rows, then one row at a time.
template <int R, int T>
void rows(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N, int64_t begin,
          int64_t end) {
  int64_t j = begin;
  for (; j + R <= end; j += R) block<R, T>(x, K, w, scale, y, N, j);
  for (; j < end; ++j) block<1, T>(x, K, w, scale, y, N, j);
}

void tokens(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
            int64_t begin, int64_t end) {
  if (M == 1) return rows<4, 1>(x, K, w, scale, y, N, begin, end);
  for (int64_t m = 0; m < M; m += 4) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (M - m) {
      case 1: rows<4, 1>(xm, K, w, scale, ym, N, begin, end); break;
      case 2: rows<2, 2>(xm, K, w, scale, ym, N, begin, end); break;
      case 3: rows<2, 3>(xm, K, w, scale, ym, N, begin, end); break;
      default: rows<2, 4>(xm, K, w, scale, ym, N, begin, end); break;
    }
  }
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight: a 2-D int8 matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension must be the weight's columns");
  TORCH_CHECK(scale.numel() == N, "one scale a weight row");
  const at::Tensor xf = as_float(x);
  const at::Tensor wc = weight.is_contiguous() ? weight : weight.contiguous();
  const at::Tensor sf = as_float(scale);
  const int64_t M = K == 0 ? 0 : xf.numel() / K;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, xf.options());
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each thread's share at least ~64 KB of weights: below that, waking a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  if (at::get_num_threads() == 1 || N <= grain) {
    tokens(xp, M, K, wp, sp, yp, N, 0, N);
  } else {
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { tokens(xp, M, K, wp, sp, yp, N, begin, end); });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// ---- int8 x int8: the activations quantized per block of 32, integer dot products per block ----

constexpr int64_t QB = 32;  // a block: 32 activations, one scale

// Token t's blocks: qa (its int8s, zero past K), ua (their magnitudes), d (one scale a block).
struct Quantized {
  const int8_t* qa;
  const uint8_t* ua;
  const float* d;
  int64_t padded, blocks;
};

// x (M, K) float32 into blocks: d = max|x| / 127, q = round(x / d) (to even), 0 where the block is all 0.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qa, uint8_t* ua, float* d, int64_t blocks) {
  const int64_t padded = blocks * QB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * QB;
      const int64_t n = std::min<int64_t>(QB, K - b * QB);
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float db = amax / 127.0f;
      d[m * blocks + b] = db;
      int8_t* q = qa + m * padded + b * QB;
      uint8_t* u = ua + m * padded + b * QB;
      for (int64_t i = 0; i < QB; ++i) {
        float v = (i < n && db > 0.0f) ? std::nearbyint(xb[i] / db) : 0.0f;
        v = std::min(127.0f, std::max(-127.0f, v));
        q[i] = static_cast<int8_t>(v);
        u[i] = static_cast<uint8_t>(v < 0 ? -v : v);
      }
    }
}

// Rows [j, j + R) of w against tokens [0, T): per block, the exact integer dot product times the block's
// scale, summed; times the row's scale at the end. Full blocks with AVX2, the partial last one (K mod 32)
// by the same integer sum in scalar code.
template <int R, int T>
void qblock(const Quantized& a, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N, int64_t j) {
  const int64_t full = K / QB;
  float sums[R][T];
  int64_t b = 0;
#ifdef SCRATCHLM_AVX2
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (; b < full; ++b) {
    __m256i wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j + r) * K + b * QB));
    for (int t = 0; t < T; ++t) {
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qa + t * a.padded + b * QB));
      const __m256i ua = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.ua + t * a.padded + b * QB));
      const __m256 d = _mm256_set1_ps(a.d[t * a.blocks + b]);
      for (int r = 0; r < R; ++r) {
        // |a| (unsigned) times w with a's sign: pairs summed to int16 (at most 2 * 127 * 127), then to int32.
        const __m256i pairs = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(wv[r], qa));
        const __m256i quads = _mm256_madd_epi16(pairs, ones);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads), d, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
      const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
      sums[r][t] = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    }
#else
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) sums[r][t] = 0.0f;
#endif
  for (int r = 0; r < R; ++r) {
    const int8_t* row = w + (j + r) * K;
    for (int t = 0; t < T; ++t) {
      float s = sums[r][t];
      for (int64_t c = b; c < a.blocks; ++c) {  // the scalar form: every block; the AVX2 form: the tail
        const int8_t* q = a.qa + t * a.padded + c * QB;
        int32_t dot = 0;
        for (int64_t k = c * QB; k < std::min(K, (c + 1) * QB); ++k) dot += int32_t{q[k - c * QB]} * row[k];
        s += static_cast<float>(dot) * a.d[t * a.blocks + c];
      }
      y[t * N + j + r] = s * scale[j + r];
    }
  }
}

template <int R, int T>
void qrows(const Quantized& a, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
           int64_t begin, int64_t end) {
  int64_t j = begin;
  for (; j + R <= end; j += R) qblock<R, T>(a, K, w, scale, y, N, j);
  for (; j < end; ++j) qblock<1, T>(a, K, w, scale, y, N, j);
}

void qtokens(const Quantized& a, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N,
             int64_t begin, int64_t end) {
  for (int64_t m = 0; m < M; m += 4) {
    const Quantized am{a.qa + m * a.padded, a.ua + m * a.padded, a.d + m * a.blocks, a.padded, a.blocks};
    float* ym = y + m * N;
    switch (M - m) {
      case 1: qrows<4, 1>(am, K, w, scale, ym, N, begin, end); break;
      case 2: qrows<2, 2>(am, K, w, scale, ym, N, begin, end); break;
      case 3: qrows<2, 3>(am, K, w, scale, ym, N, begin, end); break;
      default: qrows<2, 4>(am, K, w, scale, ym, N, begin, end); break;
    }
  }
}

at::Tensor int8_matmul_q8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight: a 2-D int8 matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x's last dimension must be the weight's columns");
  TORCH_CHECK(scale.numel() == N, "one scale a weight row");
  const at::Tensor xf = as_float(x);
  const at::Tensor wc = weight.is_contiguous() ? weight : weight.contiguous();
  const at::Tensor sf = as_float(scale);
  const int64_t M = K == 0 ? 0 : xf.numel() / K;
  const int64_t blocks = (K + QB - 1) / QB, padded = blocks * QB;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, xf.options());
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<uint8_t> ua;
  thread_local std::vector<float> d;
  qa.resize(M * padded);
  ua.resize(M * padded);
  d.resize(M * blocks);
  quantize_rows(xf.data_ptr<float>(), M, K, qa.data(), ua.data(), d.data(), blocks);
  const Quantized a{qa.data(), ua.data(), d.data(), padded, blocks};
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  if (at::get_num_threads() == 1 || N <= grain) {
    qtokens(a, M, K, wp, sp, yp, N, 0, N);
  } else {
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { qtokens(a, M, K, wp, sp, yp, N, begin, end); });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(scratchlm, m) {
  m.def("int8_matmul(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("int8_matmul_q8(Tensor x, Tensor weight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(scratchlm, CPU, m) {
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int8_matmul_q8", &int8_matmul_q8);
}
"""

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


def _flags() -> list[str]:
    return ["-O3", "-DSCRATCHLM_AVX2", "-mavx2", "-mfma"] if vector_path() else ["-O3"]


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
