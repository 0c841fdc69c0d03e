// Elementwise math for the CPU kernels: plain arithmetic and bit casts, so `omp simd` loops vectorise it
// (the libm calls would stay scalar).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fastarch {

// e^x by range reduction x = k ln2 + r (|r| <= ln2/2) and a degree-6 minimax polynomial for e^r (relative
// error ~1e-7, fp32 rounding level). Plain arithmetic and a bit cast, so `omp simd` loops vectorise it.
// Inputs are clamped to [-87.3, 88.3]: below, the result is ~1e-38 instead of 0 (harmless for a decay).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = x - kf * 0.693359375f;
  r = r + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// log1p(y) for y in [0, 1]: 2 atanh(s) with s = y / (2 + y) in [0, 1/3], odd series to s^11 (truncation
// <= 1e-7 absolute; relative accuracy holds for tiny y, where the series is ~2s).
inline float log1p_unit(float y) {
  const float s = y / (2.f + y);
  const float s2 = s * s;
  float p = 1.f / 11.f;
  p = p * s2 + 1.f / 9.f;
  p = p * s2 + 1.f / 7.f;
  p = p * s2 + 1.f / 5.f;
  p = p * s2 + 1.f / 3.f;
  p = p * s2 + 1.f;
  return 2.f * s * p;
}
// softplus(x) = max(x, 0) + log1p(exp(-|x|)): branch-free so `omp simd` loops vectorise it. Above 20 this
// is x to fp32 precision, matching mamba's threshold; its derivative sigmoid(x) is 1 there, likewise.
inline float softplus_f(float x) { return std::max(x, 0.f) + log1p_unit(fast_exp(-std::fabs(x))); }
inline float sigmoid_f(float x) { return 1.f / (1.f + fast_exp(-x)); }

}  // namespace fastarch
