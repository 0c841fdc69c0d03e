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
// Its constants are shared with vector versions written with intrinsics (they repeat its operations).
namespace exp_poly {
constexpr float LO = -87.3f, HI = 88.3f;  // input clamp
constexpr float LOG2E = 1.44269504088896341f, ROUND_MAGIC = 12582912.0f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = 2.12194440e-4f;  // ln 2 = LN2_HI - LN2_LO
constexpr float P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                        1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

inline float fast_exp(float x) {
  using namespace exp_poly;
  x = std::min(std::max(x, LO), HI);
  const float kf = (x * LOG2E + ROUND_MAGIC) - ROUND_MAGIC;  // round to nearest
  float r = x - kf * LN2_HI;
  r = r + kf * LN2_LO;
  float p = P[0];
  p = p * r + P[1];
  p = p * r + P[2];
  p = p * r + P[3];
  p = p * r + P[4];
  p = p * r + P[5];
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
