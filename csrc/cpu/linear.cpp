// Linear layer y = x W^T + b for a few rows of x (decode steps): a matrix-vector product per row.
// Each weight row is read once per call and kept in L1/L2 while every row of x uses it, so the call streams
// the weights from memory once; rows of W are split over threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "fastarch_tensor.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FA_AVX2 1
#endif

namespace {

using fastarch::check_cpu_contig;

constexpr int64_t R = 4;         // weight rows per tile (four independent streams and accumulators)
// Weight elements per thread task at least: a smaller matrix is read faster by one thread than split over
// threads that must first be woken.
constexpr int64_t GRAIN = int64_t(1) << 20;

#ifdef FA_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[r] = dot(w + r * K, x) for r < nr (nr <= R).
inline void dot_rows(const float* w, int64_t K, int64_t nr, const float* x, float* out) {
  int64_t k = 0;
#ifdef FA_AVX2
  if (nr == R) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
           b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), x0, a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), x1, b0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + K + k), x0, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + K + k + 8), x1, b1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * K + k), x0, a2);
      b2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * K + k + 8), x1, b2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * K + k), x0, a3);
      b3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * K + k + 8), x1, b3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0));
    out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2));
    out[3] = hsum(_mm256_add_ps(a3, b3));
  } else {
    for (int64_t r = 0; r < nr; ++r) out[r] = 0.f;
    k = 0;
    for (int64_t r = 0; r < nr; ++r) {
      __m256 a = _mm256_setzero_ps();
      int64_t kk = 0;
      for (; kk + 8 <= K; kk += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + kk), _mm256_loadu_ps(x + kk), a);
      out[r] = hsum(a);
      k = kk;
    }
  }
#else
  for (int64_t r = 0; r < nr; ++r) out[r] = 0.f;
#endif
  for (int64_t r = 0; r < nr; ++r) {
    float s = 0.f;
    for (int64_t kk = k; kk < K; ++kk) s += w[r * K + kk] * x[kk];
    out[r] += s;
  }
}

// x (M, K), weight (N, K), bias (N,) or none -> (M, N); fp32, contiguous.
torch::Tensor linear_fwd(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  check_cpu_contig(x, "x");
  check_cpu_contig(weight, "weight");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "linear_fwd: fp32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "linear_fwd: x (M, K), weight (N, K)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_cpu_contig(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N, "linear_fwd: bias (N,) fp32");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + R - 1) / R;
  at::parallel_for(0, tiles, std::max<int64_t>(GRAIN / (R * std::max<int64_t>(K, 1)), 1), [&](int64_t t0, int64_t t1) {
    float acc[R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, nr = std::min<int64_t>(R, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        dot_rows(wp + n0 * K, K, nr, xp + m * K, acc);
        for (int64_t r = 0; r < nr; ++r) yp[m * N + n0 + r] = acc[r] + (bp ? bp[n0 + r] : 0.f);
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fwd", &linear_fwd, "y = x weight^T + bias for a few rows of x (fp32)");
}
