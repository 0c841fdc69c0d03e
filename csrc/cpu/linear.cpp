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
#include "fastarch_parallel.h"
#define FA_AVX2 1
#endif

namespace {

using fastarch::check_cpu_contig;

constexpr int64_t R = 8;  // weight rows per tile: eight independent streams and accumulators keep enough loads
                          // in flight to read the weights near the memory bandwidth
// Weight elements per thread task at least: a smaller matrix is read faster by one thread than split over
// threads that must first be woken.
constexpr int64_t GRAIN = int64_t(1) << 20;

#if defined(__AVX512F__)
constexpr int64_t VW = 16;  // floats per vector
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(FA_AVX2)
constexpr int64_t VW = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[r] = dot(w + r * K, x) for r < NR.
template <int NR>
inline void dot_rows(const float* w, int64_t K, const float* x, float* out) {
  int64_t k = 0;
#if defined(__AVX512F__) || defined(FA_AVX2)
  vec acc[NR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) acc[r] = vzero();
  for (; k + VW <= K; k += VW) {
    const vec xv = vload(x + k);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[r] = vfma(vload(w + r * K + k), xv, acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) out[r] = vsum(acc[r]);
#else
  for (int r = 0; r < NR; ++r) out[r] = 0.f;
#endif
  for (int r = 0; r < NR; ++r) {
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
  fastarch::parallel_for(0, tiles, std::max<int64_t>(GRAIN / (R * std::max<int64_t>(K, 1)), 1), [&](int64_t t0, int64_t t1) {
    float acc[R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, nr = std::min<int64_t>(R, N - n0);
      for (int64_t m = 0; m < M; ++m) {
        if (nr == R) {
          dot_rows<R>(wp + n0 * K, K, xp + m * K, acc);
        } else {
          for (int64_t r = 0; r < nr; ++r) dot_rows<1>(wp + (n0 + r) * K, K, xp + m * K, acc + r);
        }
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
