"""The C++ of scratchlm's int8 CPU kernel (`scratchlm.kernels.int8_cpu`, whose docstring teaches what it
does): the float form `int8_matmul` and the int8 x int8 form `int8_matmul_q8`, with their operators'
registration. Compiled with `-DSCRATCHLM_AVX2 -mavx2 -mfma` where the CPU has both, else as scalar loops."""

SOURCE = r"""
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

// How far ahead of the rows being read their bytes are asked for (`_mm_prefetch`): rows [j, j + R) lie in
// one run of R * K bytes, read front to back as the loop goes, so the bytes PREFETCH on are the next rows'.
// Without it, the hardware's prefetcher leaves a core waiting on the weights' cache misses.
constexpr int64_t PREFETCH = 8192;

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
  // An address as an integer: near a matrix's end it lies past the weights (a prefetch never faults).
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + j * K) + PREFETCH;
  for (; i + 8 <= K; i += 8) {
    // R * 8 bytes a step: the line PREFETCH bytes on
    _mm_prefetch(reinterpret_cast<const char*>(ahead + i * R), _MM_HINT_T0);
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
  // An address as an integer: near a matrix's end it lies past the weights (a prefetch never faults).
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + j * K) + PREFETCH;
  for (; b < full; ++b) {
    for (int l = 0; l < R * QB; l += 64)  // R * 32 bytes a block
      _mm_prefetch(reinterpret_cast<const char*>(ahead + b * R * QB + l), _MM_HINT_T0);
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
