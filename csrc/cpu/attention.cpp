// Banded, tiled attention for CPUs: forward and backward (FlashAttention-2 style recomputation).
//
// Semantics (see fastarch/ops/attention.py): q (B,H,Lq,D), k/v (B,Hk,Lk,D), fp32 (the Python side
// converts), read through their strides (so (B,L,H,D) tensors need no transposed copy), outputs in the
// inputs' layouts; a packed variable-length batch (B = 1) gives per-row key bounds instead of the window; query i sees key j when lo(i) <= j <= hi(i) with the window bottom-right aligned
// (offset Lk - Lq), the key is not padded; scores are soft-capped (softcap * tanh(s / softcap)), then the
// additive bias and ALiBi (-slope * |i + Lk - Lq - j|) are added; fully masked rows give 0 and
// lse = -inf; dropout uses the shared counter-based hash of (seed, b, h, i, j).
//
// Layout of the work:
//  - forward: one task per (b, h, block of BQ query rows). The keys that block can see form a band; it is
//    walked in chunks (one chunk when the band is short) with an online softmax. Scores and P.V are small
//    register-blocked GEMMs (6x16 AVX2/FMA micro-kernel) on cache-resident tiles. Scores live in log2
//    units (q is pre-scaled by scale*log2(e)) so the softmax uses a vectorised exp2.
//  - backward pass 1: one task per (b, kv head, block of BK keys) accumulates dK and dV over the query
//    heads of the group and the query rows that see the block (no races: each task owns its rows of dK/dV).
//  - backward pass 2: one task per (b, h, query block) recomputes P and dS and accumulates dQ.
// Memory is O(L * D) plus per-thread tiles of O(BQ * band); never L x L (except dbias, which is an output).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fastarch_parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FA_AVX2 1
#endif

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t BQ = 64;          // query rows per forward / dQ task
constexpr int64_t BK = 64;          // keys per dK/dV task
constexpr int64_t ONE_CHUNK = 1024; // a band up to this long is one chunk (no online rescaling)
constexpr int64_t CHUNK = 512;      // otherwise the band is walked in chunks of this many keys

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// ---- small GEMM: C[m x n] (=|+=) A[m x k] * B[k x n]; row-major, n a multiple of 8 -------------------
#ifdef FA_AVX2
template <int MR, int NV>
__attribute__((always_inline)) inline void micro(int64_t k, const float* A, int64_t lda, const float* B,
                                                 int64_t ldb, float* C, int64_t ldc, bool acc) {
  // The unroll pragmas make GCC keep the MR x NV accumulators in registers (without them it spills).
  __m256 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? _mm256_loadu_ps(C + r * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(B + p * ldb + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + p);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(C + r * ldc + 8 * v, c[r][v]);
}

template <int NV>
inline void micro_rows(int64_t mr, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb,
                       float* C, int64_t ldc, bool acc) {
  switch (mr) {
    case 6: micro<6, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
    case 5: micro<5, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
    case 4: micro<4, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
    case 3: micro<3, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
    case 2: micro<2, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
    default: micro<1, NV>(k, A, lda, B, ldb, C, ldc, acc); break;
  }
}
#endif

void gemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
          int64_t ldc, bool acc) {
#ifdef FA_AVX2
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    for (int64_t i = 0; i < m; i += 6)
      micro_rows<2>(std::min<int64_t>(6, m - i), k, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, acc);
  for (; j + 8 <= n; j += 8)
    for (int64_t i = 0; i < m; i += 6)
      micro_rows<1>(std::min<int64_t>(6, m - i), k, A + i * lda, lda, B + j, ldb, C + i * ldc + j, ldc, acc);
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      float s = acc ? C[i * ldc + j] : 0.f;
      for (int64_t p = 0; p < k; ++p) s += A[i * lda + p] * B[p * ldb + j];
      C[i * ldc + j] = s;
    }
#else
  for (int64_t i = 0; i < m; ++i) {
    float* c = C + i * ldc;
    if (!acc) std::fill(c, c + n, 0.f);
    for (int64_t p = 0; p < k; ++p) {
      const float a = A[i * lda + p];
      const float* b = B + p * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) c[j] += a * b[j];
    }
  }
#endif
}

// Banded variants for a block of query rows whose visible columns are [ra[r], re[r]) (both nondecreasing in
// r): skip the 6x16 tiles of C = A*B that no row of the tile can see, and restrict the k range of
// C += P*V to the union of the tile rows' columns (P is zero elsewhere). With a window this saves the two
// masked corner triangles of every block.
// The scores use B = K^T packed in panels of 16 keys (B[panel][p][16], see key_panels): every micro-tile
// streams one contiguous D x 16 panel instead of D rows one K^T stride (L floats) apart, which alias in L1.
void gemm_skip_cols_panels(int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* Bp,
                           float* C, int64_t ldc, const int64_t* ra, const int64_t* re) {
#ifdef FA_AVX2
  for (int64_t j = 0; j < n; j += 16)
    for (int64_t i = 0; i < m; i += 6) {
      const int64_t mr = std::min<int64_t>(6, m - i);
      if (j >= re[i + mr - 1] || j + 16 <= ra[i]) continue;  // masked later by mask_scores
      micro_rows<2>(mr, k, A + i * lda, lda, Bp + j * k, 16, C + i * ldc + j, ldc, false);
    }
#else
  for (int64_t j = 0; j < n; j += 16)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < 16; ++c) {
        float acc = 0.f;
        for (int64_t p = 0; p < k; ++p) acc += A[i * lda + p] * Bp[j * k + p * 16 + c];
        C[i * ldc + j + c] = acc;
      }
  (void)ra;
  (void)re;
#endif
}

// S[r, j] = Q[r] . K[j] for few query rows (decode): K rows read in place (row stride ldk), no packing.
void scores_rows(int64_t m, int64_t n, int64_t D, const float* Q, const float* K, int64_t ldk, float* S,
                 int64_t ldS) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = K + j * ldk;
    for (int64_t r = 0; r < m; ++r) {
      const float* qr = Q + r * D;
      float acc = 0.f;
      int64_t d = 0;
#ifdef FA_AVX2
      __m256 va = _mm256_setzero_ps();
      for (; d + 8 <= D; d += 8) va = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + d), va);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(va), _mm256_extractf128_ps(va, 1));
      h = _mm_hadd_ps(h, h);
      h = _mm_hadd_ps(h, h);
      acc = _mm_cvtss_f32(h);
#endif
      for (; d < D; ++d) acc += qr[d] * kr[d];
      S[r * ldS + j] = acc;
    }
  }
}

void gemm_band_k(int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, const int64_t* ra, const int64_t* re) {
  for (int64_t i = 0; i < m; i += 6) {
    const int64_t mr = std::min<int64_t>(6, m - i);
    const int64_t k0 = ra[i], k1 = re[i + mr - 1];
    if (k1 <= k0) continue;
    gemm(mr, n, k1 - k0, A + i * lda + k0, lda, B + k0 * ldb, ldb, C + i * ldc, ldc, true);
  }
}

// ---- vectorised row kernels: exp2, soft-capping, max -------------------------------------------------
// Written once over a vector type: 8 lanes (AVX2) or, where the build targets AVX-512, 16. A row's last
// n % W scores are one masked vector (a scalar tail would cost a libm call per score).
#ifdef FA_AVX2
struct Vec8 {
  using F = __m256;
  using M = __m256i;
  static constexpr int64_t W = 8;
  static F set(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static M mask(int64_t n) {  // lanes below n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F load(const float* p, M m, float other) {  // lanes off the mask read `other`
    return _mm256_blendv_ps(set(other), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
  }
  static void store(float* p, M m, F x) { _mm256_maskstore_ps(p, m, x); }
  static F off(M m, F x, float other) { return _mm256_blendv_ps(set(other), x, _mm256_castsi256_ps(m)); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2i(F xi) {  // 2^xi for integral xi in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(xi), _mm256_set1_epi32(127)), 23));
  }
  static F rcp(F x) { return _mm256_rcp_ps(x); }
  static F keep_above(F x, F lim, F v) { return _mm256_and_ps(v, _mm256_cmp_ps(x, lim, _CMP_GT_OQ)); }
  static float sum(F x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
  static float hmax(F x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
};
#if defined(__AVX512F__)
struct Vec16 {
  using F = __m512;
  using M = __mmask16;
  static constexpr int64_t W = 16;
  static F set(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static M mask(int64_t n) { return static_cast<M>((1u << n) - 1u); }
  static F load(const float* p, M m, float other) { return _mm512_mask_loadu_ps(set(other), m, p); }
  static void store(float* p, M m, F x) { _mm512_mask_storeu_ps(p, m, x); }
  static F off(M m, F x, float other) { return _mm512_mask_mov_ps(set(other), m, x); }  // off the mask: other
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2i(F xi) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(xi), _mm512_set1_epi32(127)), 23));
  }
  static F rcp(F x) { return _mm512_rcp14_ps(x); }
  static F keep_above(F x, F lim, F v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lim, _CMP_GT_OQ), v); }
  static float sum(F x) { return _mm512_reduce_add_ps(x); }
  static float hmax(F x) { return _mm512_reduce_max_ps(x); }
};
using VecW = Vec16;  // the row kernels' width
#else
using VecW = Vec8;
#endif

// exp2 (|rel err| < 2.5e-7 on the range that matters; very negative inputs give ~0).
template <class V>
inline typename V::F exp2_v(typename V::F x) {
  x = V::min(V::max(x, V::set(-126.f)), V::set(126.f));
  const typename V::F xi = V::round(x);
  const typename V::F f = V::sub(x, xi), f2 = V::mul(f, f);  // |f| <= 1/2
  // 2^f by a degree-5 polynomial fitted for relative error on [-1/2, 1/2] (9e-8 in exact arithmetic),
  // evaluated by Estrin's scheme: three dependent FMAs instead of five keep more iterations in flight.
  const typename V::F p01 = V::fmadd(f, V::set(0.6931470036506653f), V::set(1.f));
  const typename V::F p23 = V::fmadd(f, V::set(0.05550733953714371f), V::set(0.24022242426872253f));
  const typename V::F p45 = V::fmadd(f, V::set(0.0013264708686619997f), V::set(0.009671511128544807f));
  return V::mul(V::fmadd(f2, V::fmadd(f2, p45, p23), p01), V::pow2i(xi));
}

// Soft-capping works on log2-unit scores s2 = s * log2(e): tanh(s / softcap) = 1 - 2 / (exp2(s2 * in) + 1)
// with in = 2 / softcap. This gives 1 / (exp2(s2 * in) + 1) from the vectorised exp2 and a reciprocal refined
// by one Newton step (a division costs several times more); absolute error of tanh < 5e-7.
template <class V>
inline typename V::F cap_recip_v(typename V::F s2, typename V::F vin) {
  const typename V::F y = V::add(exp2_v<V>(V::mul(s2, vin)), V::set(1.f));  // in [1, 2^126]
  const typename V::F r = V::rcp(y);
  return V::mul(r, V::fnmadd(y, r, V::set(2.f)));
}

// Applies body(index, mask) to x[0..n) a vector at a time; the last partial vector gets a lane mask.
template <class V, class Body>
inline void for_vectors(int64_t n, const Body& body) {
  int64_t j = 0;
  for (; j + V::W <= n; j += V::W) body(j, nullptr);
  if (j < n) {
    const typename V::M m = V::mask(n - j);
    body(j, &m);
  }
}
#endif

// x[j] = exp2(x[j] - m) where x[j] > -inf, else 0; returns the sum.
inline float exp2_sub_sum(float* x, int64_t n, float m) {
#ifdef FA_AVX2
  using V = VecW;
  const V::F vm = V::set(m), ninf = V::set(kNegInf);
  V::F vs = V::set(0.f);
  for_vectors<V>(n, [&](int64_t j, const V::M* mk) {
    const V::F s = mk ? V::load(x + j, *mk, kNegInf) : V::load(x + j);
    const V::F p = V::keep_above(s, ninf, exp2_v<V>(V::sub(s, vm)));
    mk ? V::store(x + j, *mk, p) : V::store(x + j, p);
    vs = V::add(vs, p);
  });
  return V::sum(vs);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = x[j] > kNegInf ? std::exp2(x[j] - m) : 0.f;
    x[j] = p;
    sum += p;
  }
  return sum;
#endif
}

inline float row_max(const float* x, int64_t n) {
#ifdef FA_AVX2
  using V = VecW;
  V::F vm = V::set(kNegInf);
  for_vectors<V>(n, [&](int64_t j, const V::M* mk) {
    vm = V::max(vm, mk ? V::load(x + j, *mk, kNegInf) : V::load(x + j));
  });
  return V::hmax(vm);
#else
  float mx = kNegInf;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
#endif
}

// Once per call: (B,H,L,D) -> (B,H,D,L+16) and (B,H,L+16,Dp), zero padded, so that every tile a task
// needs is a plain strided view (no per-task transposes; tiles may run up to 15 columns/rows past L).
at::Tensor transposed_padded(const at::Tensor& x) {
  return at::constant_pad_nd(x.transpose(2, 3), {0, 16}).contiguous();
}
at::Tensor rows_padded(const at::Tensor& x, int64_t Dp) {
  return at::constant_pad_nd(x, {0, Dp - x.size(3), 0, 16}).contiguous();
}

// (B,Hk,Lk,D) -> (B,Hk,Lk/16+2,D,16): keys in zero-padded panels of 16, each panel D x 16 contiguous. With v
// given, the same pass also gives v's rows zero padded, (B,Hk,Lk+16,Dp) (as rows_padded).
std::pair<at::Tensor, at::Tensor> key_panels(const at::Tensor& k, const at::Tensor* v = nullptr, int64_t Dp = 0) {
  // One parallel pass (pad + transpose + contiguous would copy twice: ~7% of a windowed forward). k and v are
  // read through their strides (any layout with unit-stride rows).
  const int64_t L = k.size(2), D = k.size(3), np = L / 16 + 2, nbh = k.size(0) * k.size(1), Hk = k.size(1);
  const int64_t s0 = k.stride(0), s1 = k.stride(1), s2 = k.stride(2);
  at::Tensor out = at::empty({k.size(0), k.size(1), np, D, 16}, k.options());
  at::Tensor vout = v ? at::empty({k.size(0), k.size(1), L + 16, Dp}, k.options()) : at::Tensor();
  const float* src = k.data_ptr<float>();
  const float* vsrc = v ? v->data_ptr<float>() : nullptr;
  const int64_t v0 = v ? v->stride(0) : 0, v1 = v ? v->stride(1) : 0, v2 = v ? v->stride(2) : 0;
  float* dst = out.data_ptr<float>();
  float* vdst = v ? vout.data_ptr<float>() : nullptr;
  fastarch::parallel_for(0, nbh * np, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / np, row0 = (t % np) * 16;
      float* o = dst + t * D * 16;
      const float* s = src + (bh / Hk) * s0 + (bh % Hk) * s1 + row0 * s2;
      for (int64_t c = 0; c < 16; ++c) {
        if (row0 + c < L) {
          const float* r = s + c * s2;
          for (int64_t d = 0; d < D; ++d) o[d * 16 + c] = r[d];
        } else {
          for (int64_t d = 0; d < D; ++d) o[d * 16 + c] = 0.f;
        }
      }
      if (!vsrc) continue;
      const float* vs = vsrc + (bh / Hk) * v0 + (bh % Hk) * v1;
      for (int64_t row = row0; row < std::min(row0 + 16, L + 16); ++row) {
        float* vo = vdst + (bh * (L + 16) + row) * Dp;
        const int64_t n = row < L ? D : 0;
        if (n) std::memcpy(vo, vs + row * v2, sizeof(float) * D);
        std::fill(vo + n, vo + Dp, 0.f);
      }
    }
  });
  return {out, vout};
}

using fastarch::run_tasks;

// ---- dropout hash (see dropout_keep_mask in fastarch/ops/attention.py) ----------------------------------------------------------
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

struct Dropout {
  bool on = false;
  uint32_t seed = 0;
  uint32_t threshold = 0;  // keep iff (r >> 8) >= threshold
  float inv_keep = 1.f;
  uint32_t head_key(int64_t b, int64_t H, int64_t h) const {
    return mix32(seed ^ mix32(static_cast<uint32_t>(b * H + h)));
  }
  bool keep(uint32_t key, int64_t i, int64_t j) const {
    const uint32_t r = mix32(key ^ mix32(static_cast<uint32_t>(i) * 0x9E3779B1u + static_cast<uint32_t>(j)));
    return (r >> 8) >= threshold;
  }
};

struct Problem {
  int64_t B, H, Hk, Lq, Lk, D, Dp, wl, wr, off;
  float scale;
  const float *q, *k, *v;
  int64_t sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2;  // (b, h, row) strides; rows are unit-stride
  // Variable-length batches (B = 1, packed): per query row the visible keys rlo..rhi (inclusive), its
  // bottom-right aligned key position and its sequence (for the ALiBi slopes); both bounds nondecreasing.
  const int64_t *rlo = nullptr, *rhi = nullptr, *rpos = nullptr, *rseg = nullptr;
  const bool* kpm = nullptr;  // (B, Lk)
  const float* bias = nullptr;
  int64_t sb0 = 0, sb1 = 0, sb2 = 0, sb3 = 0;  // bias strides of the (B,H,Lq,Lk) view (0 = broadcast)
  const float* alibi = nullptr;               // (B, H) slopes: score -= slope * |i + off - j|
  float softcap = 0.f;                        // > 0: score = softcap * tanh(score / softcap)
  Dropout drop;

  float slope2(int64_t b, int64_t h, int64_t i) const {
    return alibi ? alibi[(rseg ? rseg[i] : b) * H + h] * kLog2e : 0.f;
  }
  int64_t pos(int64_t i) const { return rpos ? rpos[i] : i + off; }
  // The rows that see key j are row_first(j) .. row_last(j) (unclamped).
  int64_t row_first(int64_t j) const {
    if (rhi) return std::lower_bound(rhi, rhi + Lq, j) - rhi;
    return wr >= 0 ? j - off - wr : 0;
  }
  int64_t row_last(int64_t j) const {
    if (rlo) return (std::upper_bound(rlo, rlo + Lq, j) - rlo) - 1;
    return wl >= 0 ? j - off + wl : Lq - 1;
  }

  int64_t lo(int64_t i) const {
    if (rlo) return rlo[i];
    return wl < 0 ? 0 : std::max<int64_t>(0, i + off - wl);
  }
  int64_t hi(int64_t i) const {
    if (rhi) return rhi[i];
    return wr < 0 ? Lk - 1 : std::min<int64_t>(Lk - 1, i + off + wr);
  }
  const float* qh(int64_t b, int64_t h) const { return q + b * sq0 + h * sq1; }
  const float* kh(int64_t b, int64_t hk) const { return k + b * sk0 + hk * sk1; }
  const float* vh(int64_t b, int64_t hk) const { return v + b * sv0 + hk * sv1; }
};

using RowBounds = c10::optional<at::Tensor>;  // (4, Lq) int64 rows: lo, hi, pos, seq

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& alibi, const RowBounds& rows, int64_t wl, int64_t wr,
                     double p, int64_t seed, double scale, double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat && v.dtype() == at::kFloat,
              "attention cpp: q, k, v must be float32 (the Python side converts)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "attention cpp: q, k, v need unit-stride rows (any other layout is read through strides)");
  Problem P;
  P.B = q.size(0); P.H = q.size(1); P.Lq = q.size(2); P.D = q.size(3);
  P.Hk = k.size(1); P.Lk = k.size(2);
  P.Dp = round16(P.D);
  P.wl = wl; P.wr = wr; P.off = P.Lk - P.Lq;
  P.scale = static_cast<float>(scale);
  P.q = q.data_ptr<float>(); P.k = k.data_ptr<float>(); P.v = v.data_ptr<float>();
  P.sq0 = q.stride(0); P.sq1 = q.stride(1); P.sq2 = q.stride(2);
  P.sk0 = k.stride(0); P.sk1 = k.stride(1); P.sk2 = k.stride(2);
  P.sv0 = v.stride(0); P.sv1 = v.stride(1); P.sv2 = v.stride(2);
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(P.B == 1, "attention cpp: row bounds need the packed (B = 1) problem");
    TORCH_CHECK(rows->dtype() == at::kLong && rows->is_contiguous() && rows->dim() == 2 && rows->size(0) == 4 &&
                    rows->size(1) == P.Lq,
                "attention cpp: row bounds must be a contiguous int64 (4, Lq) tensor");
    const int64_t* ptr = rows->data_ptr<int64_t>();
    P.rlo = ptr; P.rhi = ptr + P.Lq; P.rpos = ptr + 2 * P.Lq; P.rseg = ptr + 3 * P.Lq;
  }
  if (kpm.has_value() && kpm->defined()) {
    TORCH_CHECK(kpm->dtype() == at::kBool && kpm->is_contiguous(), "attention cpp: key_padding_mask bool");
    P.kpm = kpm->data_ptr<bool>();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dtype() == at::kFloat && bias->dim() == 4, "attention cpp: bias must be 4-d float32");
    at::Tensor e = bias->expand({P.B, P.H, P.Lq, P.Lk});
    P.bias = e.data_ptr<float>();
    P.sb0 = e.stride(0); P.sb1 = e.stride(1); P.sb2 = e.stride(2); P.sb3 = e.stride(3);
  }
  if (alibi.has_value() && alibi->defined()) {
    TORCH_CHECK(alibi->dtype() == at::kFloat && alibi->is_contiguous() && alibi->dim() == 2 &&
                    alibi->size(1) == P.H,
                "attention cpp: alibi slopes must be contiguous float32 (B or sequences, H)");
    P.alibi = alibi->data_ptr<float>();
  }
  P.softcap = static_cast<float>(softcap);
  if (p > 0) {
    P.drop.on = true;
    P.drop.seed = static_cast<uint32_t>(seed & 0xFFFFFFFFll);
    P.drop.threshold = static_cast<uint32_t>(std::ceil(p * 16777216.0));
    P.drop.inv_keep = static_cast<float>(1.0 / (1.0 - p));
  }
  return P;
}

// Soft-capping in log2 units: s2 = s * log2(e) -> softcap * tanh(s / softcap) * log2(e), over n scores;
// dc (optional) receives the derivative factor 1 - tanh^2. Returns the largest capped score (saves the
// forward a pass over the row).
float cap_log2(float* s2, float* dc, int64_t n, float softcap) {
#ifdef FA_AVX2
  using V = VecW;
  const V::F vin = V::set(2.f / softcap), vout = V::set(softcap * kLog2e), one = V::set(1.f), two = V::set(2.f);
  V::F vm = V::set(kNegInf);
  for_vectors<V>(n, [&](int64_t j, const V::M* mk) {
    const V::F t = V::fnmadd(two, cap_recip_v<V>(mk ? V::load(s2 + j, *mk, 0.f) : V::load(s2 + j), vin), one);  // tanh
    const V::F c = V::mul(vout, t), d = V::fnmadd(t, t, one);
    if (mk) {
      V::store(s2 + j, *mk, c);
      vm = V::max(vm, V::off(*mk, c, kNegInf));
      if (dc) V::store(dc + j, *mk, d);
    } else {
      V::store(s2 + j, c);
      vm = V::max(vm, c);
      if (dc) V::store(dc + j, d);
    }
  });
  return V::hmax(vm);
#else
  float mx = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    const float t = std::tanh(s2[j] * (kLn2 / softcap));
    s2[j] = softcap * kLog2e * t;
    mx = std::max(mx, s2[j]);
    if (dc) dc[j] = 1.f - t * t;
  }
  return mx;
#endif
}

// Capped scores lie in [-c, c], c = softcap * log2(e), so c bounds every row's maximum: the softmax can
// subtract c instead of the row's maximum (no max pass, no rescaling between chunks) as long as exp2(-2c)
// stays a normal float; then capping and exponentiating are one pass.
inline bool cap_bounds_max(float softcap) { return softcap > 0.f && softcap * kLog2e <= 60.f; }

// x[j] = exp2(cap(x[j]) - c) over n log2-unit scores (all visible), c = softcap * log2(e); returns the sum.
// cap(s) - c = c * (tanh - 1) = -2c / (exp2(2 s / softcap) + 1).
inline float cap_exp2_sum(float* x, int64_t n, float softcap) {
#ifdef FA_AVX2
  using V = VecW;
  const V::F vin = V::set(2.f / softcap), vneg2out = V::set(-2.f * softcap * kLog2e);
  V::F vs = V::set(0.f);
  for_vectors<V>(n, [&](int64_t j, const V::M* mk) {
    const V::F p = exp2_v<V>(V::mul(vneg2out, cap_recip_v<V>(mk ? V::load(x + j, *mk, 0.f) : V::load(x + j), vin)));
    if (mk) {
      V::store(x + j, *mk, p);
      vs = V::add(vs, V::off(*mk, p, 0.f));
    } else {
      V::store(x + j, p);
      vs = V::add(vs, p);
    }
  });
  return V::sum(vs);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = std::exp2(softcap * kLog2e * (std::tanh(x[j] * (kLn2 / softcap)) - 1.f));
    x[j] = p;
    sum += p;
  }
  return sum;
#endif
}

// ALiBi in log2 units over scores of keys c0 + j (j < n) for a row at key position pos: s -= slope2 * |pos - key|.
inline void alibi_row(float* s, int64_t n, float slope2, int64_t pos_minus_c0) {
  const int32_t base = static_cast<int32_t>(pos_minus_c0);
#pragma omp simd
  for (int32_t j = 0; j < static_cast<int32_t>(n); ++j) s[j] -= slope2 * std::fabs(static_cast<float>(base - j));
}

// Query blocks [starts[t], starts[t+1]) of at most BQ rows; a packed batch starts a block at every sequence
// (a block spanning sequences would walk the union of their key ranges).
std::vector<int64_t> query_blocks(const Problem& P);

// Scores of rows [i0, i0+m) against keys [c0, c0+n) (S, m x ldS) -> soft-capped, bias and ALiBi added,
// masked (-inf) (log2 units). dcap (m x ldS, optional) receives the soft-capping derivative (0 if masked).
// Returns whether rmax (m, optional) received each row's largest visible score (when soft-capping is all
// that changes the scores).
bool mask_scores(const Problem& P, int64_t b, int64_t h, int64_t i0, int64_t m, int64_t c0, int64_t n, float* S,
                 int64_t ldS, float* dcap = nullptr, float* rmax = nullptr) {
  const bool cap_only = rmax && P.softcap > 0.f && !P.alibi && !P.bias && !P.kpm;
  const bool* kp = P.kpm ? P.kpm + b * P.Lk : nullptr;
  for (int64_t r = 0; r < m; ++r) {
    const int64_t i = i0 + r;
    float* s = S + r * ldS;
    const int64_t a = std::max<int64_t>(P.lo(i) - c0, 0), e = std::min<int64_t>(P.hi(i) - c0 + 1, n);
    for (int64_t j = 0; j < std::min(a, n); ++j) s[j] = kNegInf;
    for (int64_t j = std::max<int64_t>(e, 0); j < ldS; ++j) s[j] = kNegInf;
    if (P.softcap > 0.f) {
      float* dc = dcap ? dcap + r * ldS : nullptr;
      if (dc) std::fill(dc, dc + ldS, 0.f);
      const float mx = e > a ? cap_log2(s + a, dc ? dc + a : nullptr, e - a, P.softcap) : kNegInf;
      if (cap_only) rmax[r] = mx;
    }
    if (P.alibi && e > a) alibi_row(s + a, e - a, P.slope2(b, h, i), P.pos(i) - c0 - a);
    if (P.bias) {
      const float* bb = P.bias + b * P.sb0 + h * P.sb1 + i * P.sb2 + c0 * P.sb3;
      for (int64_t j = a; j < e; ++j) s[j] += bb[j * P.sb3] * kLog2e;
    }
    if (kp) {
      for (int64_t j = a; j < e; ++j)
        if (!kp[c0 + j]) s[j] = kNegInf;
    }
  }
  return cap_only;
}

std::vector<int64_t> query_blocks(const Problem& P) {
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < P.Lq;) {
    starts.push_back(i);
    int64_t e = std::min(i + BQ, P.Lq);
    if (P.rseg)
      for (int64_t r = i + 1; r < e; ++r)
        if (P.rseg[r] != P.rseg[i]) {
          e = r;
          break;
        }
    i = e;
  }
  starts.push_back(P.Lq);
  return starts;
}

// ---- forward ------------------------------------------------------------------------------------------
std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& kpm, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& alibi, const RowBounds& rows, int64_t wl,
                            int64_t wr, double dropout_p, int64_t seed, double scale, double softcap) {
  const Problem P = make_problem(q, k, v, kpm, bias, alibi, rows, wl, wr, dropout_p, seed, scale, softcap);
  at::Tensor o = at::empty_like(q);  // q's layout (strides)
  const int64_t so0 = o.stride(0), so1 = o.stride(1), so2 = o.stride(2);
  at::Tensor lse = at::empty({P.B, P.H, P.Lq}, q.options());
  float* O = o.data_ptr<float>();
  float* LSE = lse.data_ptr<float>();
  const std::vector<int64_t> qblocks = query_blocks(P);
  const int64_t nqb = static_cast<int64_t>(qblocks.size()) - 1;
  const int64_t D = P.D, Dp = P.Dp;
  const float qscale = P.scale * kLog2e;
  // Soft-capping alone: the cap's bound replaces the row maxima and is fused with the exp2.
  const bool cap_fused = cap_bounds_max(P.softcap) && !P.alibi && !P.bias && !P.kpm;
  const float cap_max = P.softcap * kLog2e;
  // Few rows per block (decode): keys and values are read in place, since packing the whole cache
  // would cost more than the attention itself. Otherwise keys are packed in panels
  // (B, Hk, Lk/16+2, D, 16), and values read in place when D is a multiple of 16 and a head's rows are
  // adjacent, else from a zero-padded (B, Hk, Lk+16, Dp) copy: rows H * D apart ((B, L, H, D) tensors, packed
  // variable-length batches) map to few L1 sets, and P.V streams them column slice by column slice.
  int64_t max_rows = 0;
  for (size_t t = 0; t + 1 < qblocks.size(); ++t) max_rows = std::max(max_rows, qblocks[t + 1] - qblocks[t]);
  const bool rows_mode = max_rows <= 8;
  const bool copy_v = !rows_mode && !(D == Dp && v.stride(2) == D);
  at::Tensor KP = k, VP = v;
  if (!rows_mode) std::tie(KP, VP) = key_panels(k, copy_v ? &v : nullptr, Dp);
  if (!copy_v) VP = v;
  const int64_t nV = rows_mode ? D : Dp;
  const float* KPp = KP.data_ptr<float>();
  const float* VPp = VP.data_ptr<float>();
  const int64_t kpanels = rows_mode ? 0 : KP.size(2) * D * 16, G = P.H / P.Hk;
  const int64_t sv0 = VP.stride(0), sv1 = VP.stride(1), ldv = VP.stride(2);

  run_tasks(P.B * P.H * nqb, [&](int64_t begin, int64_t end) {
    std::vector<float> Qs(BQ * D), S, acc(BQ * Dp), mrow(BQ), lrow(BQ), rmax(BQ);
    std::vector<int64_t> ra(BQ), re(BQ);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % nqb, bh = task / nqb, h = bh % P.H, b = bh / P.H;
      const int64_t i0 = qblocks[qb], m = qblocks[qb + 1] - i0;
      const float* qp = P.qh(b, h) + i0 * P.sq2;
      const float* kp = KPp + (b * P.Hk + h / G) * kpanels;
      const float* vp = VPp + b * sv0 + (h / G) * sv1;
      float* op = O + b * so0 + h * so1 + i0 * so2;
      float* lp = LSE + (b * P.H + h) * P.Lq + i0;
      // Chunks start on a panel boundary; the extra leading columns are masked like any other.
      const int64_t span_lo = P.lo(i0) / 16 * 16, span_hi = P.hi(i0 + m - 1);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mrow.begin(), mrow.end(), kNegInf);
      std::fill(lrow.begin(), lrow.end(), 0.f);
      if (span_lo <= span_hi) {
        for (int64_t r = 0; r < m; ++r)
          for (int64_t d = 0; d < D; ++d) Qs[r * D + d] = qp[r * P.sq2 + d] * qscale;
        const int64_t span = span_hi - span_lo + 1;
        const int64_t csz = span <= ONE_CHUNK ? span : CHUNK;
        const uint32_t hkey = P.drop.on ? P.drop.head_key(b, P.H, h) : 0;
        for (int64_t c0 = span_lo; c0 <= span_hi; c0 += csz) {
          const int64_t n = std::min(csz, span_hi + 1 - c0), np = round16(n);
          S.resize(m * np);
          for (int64_t r = 0; r < m; ++r) {  // visible columns of each row within this tile
            ra[r] = std::min<int64_t>(std::max<int64_t>(P.lo(i0 + r) - c0, 0), n);
            re[r] = std::max<int64_t>(std::min<int64_t>(P.hi(i0 + r) - c0 + 1, n), ra[r]);
          }
          if (rows_mode)
            scores_rows(m, n, D, Qs.data(), P.kh(b, h / G) + c0 * P.sk2, P.sk2, S.data(), np);
          else
            gemm_skip_cols_panels(m, np, D, Qs.data(), D, kp + c0 * D, S.data(), np, ra.data(), re.data());
          const bool have_max = !cap_fused && mask_scores(P, b, h, i0, m, c0, n, S.data(), np, nullptr, rmax.data());
          for (int64_t r = 0; r < m; ++r) {
            float* s = S.data() + r * np;
            const bool any = re[r] > ra[r];
            const float mx = cap_fused ? (any ? cap_max : kNegInf)
                                       : have_max ? rmax[r] : row_max(s + ra[r], re[r] - ra[r]);
            const float mnew = std::max(mrow[r], mx);
            if (mnew == kNegInf) {  // nothing visible yet in this row
              std::fill(s, s + np, 0.f);
              continue;
            }
            const float alpha = mrow[r] == kNegInf ? 0.f : std::exp2(mrow[r] - mnew);
            const float rs = cap_fused ? (any ? cap_exp2_sum(s + ra[r], re[r] - ra[r], P.softcap) : 0.f)
                                       : exp2_sub_sum(s + ra[r], re[r] - ra[r], mnew);
            std::fill(s, s + ra[r], 0.f);
            std::fill(s + re[r], s + np, 0.f);
            lrow[r] = lrow[r] * alpha + rs;
            mrow[r] = mnew;
            if (alpha != 1.f) {
              float* a = acc.data() + r * Dp;
              for (int64_t d = 0; d < Dp; ++d) a[d] *= alpha;
            }
            if (P.drop.on) {
              const int64_t i = i0 + r;
              for (int64_t j = 0; j < n; ++j)
                s[j] = (s[j] != 0.f && P.drop.keep(hkey, i, c0 + j)) ? s[j] * P.drop.inv_keep : 0.f;
            }
          }
          gemm_band_k(m, nV, S.data(), np, vp + c0 * ldv, ldv, acc.data(), Dp, ra.data(), re.data());
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const float l = lrow[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t d = 0; d < D; ++d) op[r * so2 + d] = acc[r * Dp + d] * inv;
        lp[r] = l > 0.f ? (mrow[r] + std::log2(l)) * kLn2 : kNegInf;
      }
    }
  });
  return {o, lse};
}

// ---- backward -----------------------------------------------------------------------------------------
std::vector<at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& kpm,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& alibi,
                            const RowBounds& rows, int64_t wl, int64_t wr, double dropout_p, int64_t seed,
                            double scale, double softcap, bool need_dbias) {
  const Problem P = make_problem(q, k, v, kpm, bias, alibi, rows, wl, wr, dropout_p, seed, scale, softcap);
  TORCH_CHECK(dout.is_contiguous() && lse.is_contiguous(), "attention cpp: dout and lse must be contiguous");
  TORCH_CHECK(dout.dtype() == at::kFloat && out.dtype() == at::kFloat, "attention cpp: do/o float32");
  const int64_t D = P.D, Dp = P.Dp, G = P.H / P.Hk;
  // lse2 = lse * log2(e) (natural -> log2 units), with -inf rows mapped to +inf so that exp2(s - lse2) = 0;
  // Di = rowsum(dO * O).
  at::Tensor lse2t = at::where(at::isinf(lse), at::full({}, std::numeric_limits<float>::infinity(), lse.options()),
                               lse * kLog2e);
  at::Tensor Dit = (dout * out).sum(-1).contiguous();
  const float* lse2 = lse2t.data_ptr<float>();
  const float* Di = Dit.data_ptr<float>();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);  // inputs' layouts
  at::Tensor dbias;
  float* DB = nullptr;
  if (need_dbias) {
    dbias = at::zeros({P.B, P.H, P.Lq, P.Lk}, q.options());
    DB = dbias.data_ptr<float>();
  }
  const float* dO = dout.data_ptr<float>();
  const float qscale = P.scale * kLog2e;

  // pass 1: dK, dV per (b, kv head, key block), over the group's query heads and the rows that see the block
  {
    const at::Tensor QT = transposed_padded(q), dOT = transposed_padded(dout);  // (B, H, D, Lq+16)
    const at::Tensor QP = rows_padded(q, Dp), dOP = rows_padded(dout, Dp);      // (B, H, Lq+16, Dp)
    const float *QTp = QT.data_ptr<float>(), *dOTp = dOT.data_ptr<float>();
    const float *QPp = QP.data_ptr<float>(), *dOPp = dOP.data_ptr<float>();
    const int64_t LqT = P.Lq + 16;
    const int64_t nkb = (P.Lk + BK - 1) / BK;
    float* DK = dk.data_ptr<float>();
    float* DV = dv.data_ptr<float>();
    run_tasks(P.B * P.Hk * nkb, [&](int64_t begin, int64_t end) {
      // Each query head's dK/dV contribution is summed in fp32 (as one GEMM over its rows), and the heads of
      // a group are added in fp64: a running fp32 sum over G * Lq rows would grow G times the rounding error.
      std::vector<float> Ks(BK * D), dKa(BK * Dp), dVa(BK * Dp), St, dPt, Dc;
      std::vector<double> dKd(BK * Dp), dVd(BK * Dp);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t kb = task % nkb, bhk = task / nkb, hk = bhk % P.Hk, b = bhk / P.Hk;
        const int64_t j0 = kb * BK, nk = std::min(BK, P.Lk - j0);
        const float* kp = P.kh(b, hk) + j0 * P.sk2;
        const float* vp = P.vh(b, hk) + j0 * P.sv2;
        for (int64_t r = 0; r < nk; ++r)
          for (int64_t d = 0; d < D; ++d) Ks[r * D + d] = kp[r * P.sk2 + d] * qscale;
        std::fill(dKd.begin(), dKd.end(), 0.0);
        std::fill(dVd.begin(), dVd.end(), 0.0);
        // query i sees key j iff j - off - wr <= i <= j - off + wl (each side only when limited)
        const int64_t a_lo = std::max<int64_t>(0, P.row_first(j0));
        const int64_t a_hi = std::min<int64_t>(P.Lq - 1, P.row_last(j0 + nk - 1));
        const bool* kpb = P.kpm ? P.kpm + b * P.Lk : nullptr;
        for (int64_t g = 0; g < G && a_lo <= a_hi; ++g) {
          const int64_t h = hk * G + g;
          const int64_t bh = b * P.H + h;
          const float* l2 = lse2 + bh * P.Lq;
          const float* dih = Di + bh * P.Lq;
          const uint32_t hkey = P.drop.on ? P.drop.head_key(b, P.H, h) : 0;
          std::fill(dKa.begin(), dKa.end(), 0.f);
          std::fill(dVa.begin(), dVa.end(), 0.f);
          const int64_t total = a_hi - a_lo + 1;
          const int64_t csz = total <= ONE_CHUNK ? total : CHUNK;
          for (int64_t a0 = a_lo; a0 <= a_hi; a0 += csz) {
            const int64_t nq = std::min(csz, a_hi + 1 - a0), nqp = round16(nq);
            St.resize(nk * nqp);
            dPt.resize(nk * nqp);
            if (P.softcap > 0.f) Dc.resize(nk * nqp);
            gemm(nk, nqp, D, Ks.data(), D, QTp + bh * D * LqT + a0, LqT, St.data(), nqp, false);   // S^T
            gemm(nk, nqp, D, vp, P.sv2, dOTp + bh * D * LqT + a0, LqT, dPt.data(), nqp, false);   // dPd^T
            for (int64_t jr = 0; jr < nk; ++jr) {
              const int64_t j = j0 + jr;
              float* s = St.data() + jr * nqp;
              float* dp = dPt.data() + jr * nqp;
              // the columns (query rows) that see key j
              int64_t cA = std::max<int64_t>(0, P.row_first(j) - a0);
              int64_t cB = std::min<int64_t>(nq, P.row_last(j) + 1 - a0);
              if (kpb && !kpb[j]) cB = cA;
              cB = std::max(cB, cA);
              for (int64_t c = 0; c < cA; ++c) s[c] = kNegInf;
              float* dc = P.softcap > 0.f ? Dc.data() + jr * nqp : nullptr;
              if (dc && cB > cA) cap_log2(s + cA, dc + cA, cB - cA, P.softcap);
              if (P.alibi)
                for (int64_t c = cA; c < cB; ++c)
                  s[c] -= P.slope2(b, h, a0 + c) * static_cast<float>(std::llabs(P.pos(a0 + c) - j));
              if (P.bias) {
                const float* bb = P.bias + b * P.sb0 + h * P.sb1 + a0 * P.sb2 + j * P.sb3;
                for (int64_t c = cA; c < cB; ++c) s[c] += bb[c * P.sb2] * kLog2e;
              }
#pragma omp simd
              for (int64_t c = cA; c < cB; ++c) s[c] -= l2[a0 + c];
              for (int64_t c = cB; c < nqp; ++c) s[c] = kNegInf;
              exp2_sub_sum(s + cA, cB - cA, 0.f);  // P^T (pre-dropout); the rest is set to 0 below
              std::fill(s, s + cA, 0.f);
              std::fill(s + cB, s + nqp, 0.f);
              if (P.drop.on) {
                for (int64_t c = cA; c < cB; ++c)
                  dp[c] = (s[c] != 0.f && P.drop.keep(hkey, a0 + c, j)) ? dp[c] * P.drop.inv_keep : 0.f;
              }
              // dS^T = P * (dP - Di), kept in dp; P stays in s for dV below.
#pragma omp simd
              for (int64_t c = cA; c < cB; ++c) dp[c] = s[c] * (dp[c] - dih[a0 + c]);
              std::fill(dp, dp + cA, 0.f);
              std::fill(dp + cB, dp + nqp, 0.f);
              if (DB) {
                float* db = DB + (bh * P.Lq + a0) * P.Lk + j;
                for (int64_t c = cA; c < cB; ++c) db[c * P.Lk] = dp[c];
              }
              if (dc)
                for (int64_t c = cA; c < cB; ++c) dp[c] *= dc[c];
              if (P.drop.on) {  // dV uses the dropped probabilities
                for (int64_t c = cA; c < cB; ++c)
                  if (s[c] != 0.f) s[c] = P.drop.keep(hkey, a0 + c, j) ? s[c] * P.drop.inv_keep : 0.f;
              }
            }
            gemm(nk, Dp, nqp, St.data(), nqp, dOPp + (bh * LqT + a0) * Dp, Dp, dVa.data(), Dp, true);
            gemm(nk, Dp, nqp, dPt.data(), nqp, QPp + (bh * LqT + a0) * Dp, Dp, dKa.data(), Dp, true);
          }
          for (int64_t r = 0; r < nk * Dp; ++r) {
            dKd[r] += dKa[r];
            dVd[r] += dVa[r];
          }
        }
        float* dkp = DK + b * dk.stride(0) + hk * dk.stride(1) + j0 * dk.stride(2);
        float* dvp = DV + b * dv.stride(0) + hk * dv.stride(1) + j0 * dv.stride(2);
        for (int64_t r = 0; r < nk; ++r)
          for (int64_t d = 0; d < D; ++d) {
            dkp[r * dk.stride(2) + d] = static_cast<float>(dKd[r * Dp + d] * P.scale);
            dvp[r * dv.stride(2) + d] = static_cast<float>(dVd[r * Dp + d]);
          }
      }
    });
  }

  // pass 2: dQ per (b, h, query block)
  {
    const at::Tensor KT = transposed_padded(k), VT = transposed_padded(v);  // (B, Hk, D, Lk+16)
    const at::Tensor KP = rows_padded(k, Dp);                               // (B, Hk, Lk+16, Dp)
    const float *KTp = KT.data_ptr<float>(), *VTp = VT.data_ptr<float>(), *KPp = KP.data_ptr<float>();
    const int64_t LkT = P.Lk + 16;
    const std::vector<int64_t> qblocks = query_blocks(P);
    const int64_t nqb = static_cast<int64_t>(qblocks.size()) - 1;
    float* DQ = dq.data_ptr<float>();
    run_tasks(P.B * P.H * nqb, [&](int64_t begin, int64_t end) {
      std::vector<float> Qs(BQ * D), S, dP, dQa(BQ * Dp), Dc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t qb = task % nqb, bh = task / nqb, h = bh % P.H, b = bh / P.H;
        const int64_t hk = b * P.Hk + h / G;
        const int64_t i0 = qblocks[qb], m = qblocks[qb + 1] - i0;
        const float* qp = P.qh(b, h) + i0 * P.sq2;
        const float* dop = dO + (bh * P.Lq + i0) * D;
        const float* l2 = lse2 + bh * P.Lq + i0;
        const float* dih = Di + bh * P.Lq + i0;
        const uint32_t hkey = P.drop.on ? P.drop.head_key(b, P.H, h) : 0;
        std::fill(dQa.begin(), dQa.end(), 0.f);
        const int64_t span_lo = P.lo(i0), span_hi = P.hi(i0 + m - 1);
        if (span_lo <= span_hi) {
          for (int64_t r = 0; r < m; ++r)
            for (int64_t d = 0; d < D; ++d) Qs[r * D + d] = qp[r * P.sq2 + d] * qscale;
          const int64_t span = span_hi - span_lo + 1;
          const int64_t csz = span <= ONE_CHUNK ? span : CHUNK;
          for (int64_t c0 = span_lo; c0 <= span_hi; c0 += csz) {
            const int64_t n = std::min(csz, span_hi + 1 - c0), np = round16(n);
            S.resize(m * np);
            dP.resize(m * np);
            if (P.softcap > 0.f) Dc.resize(m * np);
            gemm(m, np, D, Qs.data(), D, KTp + hk * D * LkT + c0, LkT, S.data(), np, false);
            gemm(m, np, D, dop, D, VTp + hk * D * LkT + c0, LkT, dP.data(), np, false);
            mask_scores(P, b, h, i0, m, c0, n, S.data(), np, P.softcap > 0.f ? Dc.data() : nullptr);
            for (int64_t r = 0; r < m; ++r) {
              float* s = S.data() + r * np;
              float* dp = dP.data() + r * np;
              exp2_sub_sum(s, np, l2[r]);  // lse2 = +inf for empty rows gives P = 0
              if (P.drop.on) {
                for (int64_t j = 0; j < n; ++j)
                  dp[j] = (s[j] != 0.f && P.drop.keep(hkey, i0 + r, c0 + j)) ? dp[j] * P.drop.inv_keep : 0.f;
              }
              const float di = dih[r];
#pragma omp simd
              for (int64_t j = 0; j < np; ++j) dp[j] = s[j] * (dp[j] - di);
              if (P.softcap > 0.f) {
                const float* dc = Dc.data() + r * np;
#pragma omp simd
                for (int64_t j = 0; j < np; ++j) dp[j] *= dc[j];
              }
            }
            gemm(m, Dp, n, dP.data(), np, KPp + (hk * LkT + c0) * Dp, Dp, dQa.data(), Dp, true);
          }
        }
        float* dqp = DQ + b * dq.stride(0) + h * dq.stride(1) + i0 * dq.stride(2);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t d = 0; d < D; ++d) dqp[r * dq.stride(2) + d] = dQa[r * Dp + d] * P.scale;
      }
    });
  }
  if (need_dbias) return {dq, dk, dv, dbias};
  return {dq, dk, dv};
}


// ---- KV-cache forward (decode): pages read in place, split-K with a log-sum-exp merge -------------------
// q (B,H,Lq,D) fp32 read through strides; k/v caches (num_pages, page, Hk, D) read through strides and the
// block table (B, n) int32: key j of batch b is row j % page of page table[b][j / page]. Batch b's query
// row i sits at key position pos = seqlens[b] - Lq + i and sees keys max(leftpad[b], pos - wl) ..
// min(seqlens[b] - 1, pos + wr). One task per (b, key split); the rows of a task are its H query heads times
// Lq, each with its own online softmax. Excluded keys are never read into a row (their
// scores are -inf and their V rows are not accumulated), so a NaN/Inf there cannot reach the output; a row
// that does see a non-finite K or V row gives NaN (o and lse), which is found from the non-finite results
// it causes, so there is no pass over the cache.

inline float dot(const float* a, const float* b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#ifdef FA_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
  }
  for (; d + 8 <= D; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
  s0 = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  s = _mm_cvtss_f32(h);
#endif
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// y[0..D) += a * x[0..D)
inline void axpy(float* y, float a, const float* x, int64_t D) {
  int64_t d = 0;
#ifdef FA_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
#endif
  for (; d < D; ++d) y[d] += a * x[d];
}

// Whether x[0..n) holds no NaN or Inf.
inline bool all_finite(const float* x, int64_t n) {
  int64_t d = 0;
#ifdef FA_AVX2
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (; d + 8 <= n; d += 8)  // |x| < inf is false for NaN and +-Inf
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + d), absmask), inf, _CMP_LT_OQ));
  if (_mm256_movemask_ps(ok) != 0xFF) return false;
#endif
  for (; d < n; ++d)
    if (!std::isfinite(x[d])) return false;
  return true;
}

// S[j] = q . K[j] for j < n, the K rows ldk apart (read in place). Eight keys at a time with one accumulator
// each (independent FMA chains), summed across lanes by one transposing reduction.
inline void dots(const float* q, const float* K, int64_t ldk, int64_t n, int64_t D, float* S) {
  int64_t j = 0;
#ifdef FA_AVX2
  const int64_t D8 = D / 8 * 8;
  for (; j + 8 <= n; j += 8) {
    const float* k0 = K + j * ldk;
    __m256 a[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + u * ldk + d), a[u]);
    }
    const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(S + j, _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
    for (int64_t d = D8; d < D; ++d)
      for (int u = 0; u < 8; ++u) S[j + u] += q[d] * k0[u * ldk + d];
  }
#endif
  for (; j < n; ++j) S[j] = dot(q, K + j * ldk, D);
}

#ifdef FA_AVX2
// acc[d..d+8NB) += sum_j p[j] * V[j][d..d+8NB) for j < n: two sets of NB accumulators (even and odd keys)
// keep enough independent FMA chains in flight.
template <int NB>
inline void pv_block(float* acc, const float* p, const float* V, int64_t ldv, int64_t n) {
  __m256 a[NB], c[NB];
#pragma GCC unroll 8
  for (int u = 0; u < NB; ++u) {
    a[u] = _mm256_loadu_ps(acc + 8 * u);
    c[u] = _mm256_setzero_ps();
  }
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const float* v0 = V + j * ldv;
    const __m256 p0 = _mm256_broadcast_ss(p + j), p1 = _mm256_broadcast_ss(p + j + 1);
#pragma GCC unroll 8
    for (int u = 0; u < NB; ++u) {
      a[u] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * u), a[u]);
      c[u] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v0 + ldv + 8 * u), c[u]);
    }
  }
  if (j < n) {
    const __m256 p0 = _mm256_broadcast_ss(p + j);
#pragma GCC unroll 8
    for (int u = 0; u < NB; ++u) a[u] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(V + j * ldv + 8 * u), a[u]);
  }
#pragma GCC unroll 8
  for (int u = 0; u < NB; ++u) _mm256_storeu_ps(acc + 8 * u, _mm256_add_ps(a[u], c[u]));
}
#endif

// acc[0..D) += sum_j p[j] * V[j] for j < n, the V rows ldv apart (read in place). Whole rows of up to 64
// floats per pass over the keys where 32 vector registers hold both accumulator sets (AVX-512), else 32:
// a second pass over the same rows would fetch the rest of their cache lines apart from the first half.
inline void pv(float* acc, const float* p, const float* V, int64_t ldv, int64_t n, int64_t D) {
  int64_t d = 0;
#ifdef FA_AVX2
#if defined(__AVX512F__)
  for (; d + 64 <= D; d += 64) pv_block<8>(acc + d, p, V + d, ldv, n);
#endif
  for (; d + 32 <= D; d += 32) pv_block<4>(acc + d, p, V + d, ldv, n);
  for (; d + 8 <= D; d += 8) pv_block<1>(acc + d, p, V + d, ldv, n);
#endif
  for (; d < D; ++d) {
    float s = acc[d];
    for (int64_t j = 0; j < n; ++j) s += p[j] * V[j * ldv + d];
    acc[d] = s;
  }
}

// Asks for the cache line at p. An asm statement rather than __builtin_prefetch: GCC deems a function that
// only prefetches free of side effects and deletes the calls to it (and so every prefetch of this kernel).
inline void prefetch_line(const float* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Asks for the n rows (ldx apart, D floats each) that the next run reads.
inline void prefetch_rows(const float* x, int64_t ldx, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 16) prefetch_line(x + j * ldx + d);
}

constexpr int64_t CACHE_CHUNK = 128;  // keys per online-softmax step (a multiple of RUN)
constexpr int64_t MIN_SPLIT = 512;    // keys per split at least
constexpr int64_t RUN = 16;           // keys per run when the heads of a key are adjacent in memory

// table, seqlens and leftpad may be None: one page per batch row (k, v (B, L, Hk, D)), full rows, no padding.
std::vector<at::Tensor> cache_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const c10::optional<at::Tensor>& table_opt,
                                  const c10::optional<at::Tensor>& seqlens_opt,
                                  const c10::optional<at::Tensor>& leftpad_opt,
                                  const c10::optional<at::Tensor>& alibi, int64_t wl, int64_t wr, double scale,
                                  double softcap) {
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat && v.dtype() == at::kFloat,
              "attention cpp cache: q, k, v must be float32 (the Python side converts)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.stride(3) == 1 && k.stride(3) == 1 &&
                  v.stride(3) == 1,
              "attention cpp cache: q (B,H,Lq,D) and k/v (num_pages,page,Hk,D) need unit-stride rows");
  TORCH_CHECK(k.sizes() == v.sizes(), "attention cpp cache: k and v must have the same shape");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t page = k.size(1), Hk = k.size(2), G = H / Hk, R = H * Lq;
  TORCH_CHECK(k.size(3) == D && Hk > 0 && H % Hk == 0, "attention cpp cache: head counts or head dims differ");
  const auto given = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(given(table_opt) || k.size(0) == B, "attention cpp cache: without a block table k/v are (B, L, Hk, D)");
  // Absent arguments are filled on the stack side (plain vectors, not tensors): a decode step's fixed cost.
  const auto int32_vec = [](const c10::optional<at::Tensor>& t, int64_t n, const char* what) -> const int32_t* {
    TORCH_CHECK(t->dtype() == at::kInt && t->is_contiguous() && t->numel() == n, "attention cpp cache: ", what,
                " must be contiguous int32 with ", n, " entries");
    return t->data_ptr<int32_t>();
  };
  std::vector<int32_t> own_table, own_seqlens, own_leftpad;
  int64_t npb = 1;
  const int32_t* tb;
  if (given(table_opt)) {
    TORCH_CHECK(table_opt->dim() == 2 && table_opt->size(0) == B, "attention cpp cache: block table must be (B, n)");
    npb = table_opt->size(1);
    tb = int32_vec(table_opt, B * npb, "the block table");
  } else {
    own_table.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) own_table[static_cast<size_t>(b)] = static_cast<int32_t>(b);
    tb = own_table.data();
  }
  const int64_t Lc = npb * page;
  const int32_t* sl;
  if (given(seqlens_opt)) {
    sl = int32_vec(seqlens_opt, B, "seqlens");
  } else {
    own_seqlens.assign(static_cast<size_t>(B), static_cast<int32_t>(Lc));
    sl = own_seqlens.data();
  }
  const int32_t* lpd;
  if (given(leftpad_opt)) {
    lpd = int32_vec(leftpad_opt, B, "leftpad");
  } else {
    own_leftpad.assign(static_cast<size_t>(B), 0);
    lpd = own_leftpad.data();
  }
  const float* al = nullptr;
  if (alibi.has_value() && alibi->defined()) {
    TORCH_CHECK(alibi->dtype() == at::kFloat && alibi->is_contiguous() && alibi->dim() == 2 &&
                    alibi->size(0) == B && alibi->size(1) == H,
                "attention cpp cache: alibi slopes must be contiguous float32 (B, H)");
    al = alibi->data_ptr<float>();
  }
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= lpd[b] && lpd[b] <= sl[b] && sl[b] <= Lc, "attention cpp cache: bad seqlens/leftpad");
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t sk0 = k.stride(0), sk1 = k.stride(1), sk2 = k.stride(2);
  const int64_t sv0 = v.stride(0), sv1 = v.stride(1), sv2 = v.stride(2);
  const float sc2 = static_cast<float>(scale) * kLog2e, cap = static_cast<float>(softcap);
  const bool cap_fused = cap_bounds_max(cap) && !al;  // the cap's bound stands in for the row maxima
  const float cap_max = cap * kLog2e;
  // A key's rows of all heads next to each other ((page, Hk, D) caches): a run of RUN keys of every head is
  // one contiguous block. Otherwise each head's keys are contiguous: runs go to the end of a page.
  const bool heads_adjacent = std::abs(sk2) <= std::abs(sk1) && std::abs(sv2) <= std::abs(sv1);
  const int64_t GL = G * Lq;

  // Row r = h * Lq + i of batch b is query head h (kv head h / G), row i; its visible keys [lo, hi].
  auto row_lo = [&](int64_t b, int64_t i) {
    const int64_t pos = sl[b] - Lq + i;
    return wl < 0 ? static_cast<int64_t>(lpd[b]) : std::max<int64_t>(lpd[b], pos - wl);
  };
  auto row_hi = [&](int64_t b, int64_t i) {
    const int64_t pos = sl[b] - Lq + i;
    return wr < 0 ? static_cast<int64_t>(sl[b]) - 1 : std::min<int64_t>(sl[b] - 1, pos + wr);
  };
  // Splits: enough tasks to keep every thread busy, each split at least MIN_SPLIT keys.
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, sl[b] - lpd[b]);
  const int64_t want = (4 * static_cast<int64_t>(at::get_num_threads()) + B - 1) / B;
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(want, (longest + MIN_SPLIT - 1) / MIN_SPLIT));

  auto o = at::empty({B, Lq, H, D}, q.options());
  auto lse = at::empty({B, H, Lq}, q.options());
  // Per split partial results, in one uninitialised buffer (every entry is written before it is read).
  const int64_t nparts = B * S * R;
  std::unique_ptr<float[]> parts(new float[static_cast<size_t>(nparts * (D + 2))]);
  std::vector<uint8_t> part_bad(static_cast<size_t>(nparts), 0);
  float* pm = parts.get();
  float* pl = pm + nparts;
  float* pa = pl + nparts;

  // Merges the splits of batch row b: run by the task that finishes the row's last split, so that the call
  // is one parallel region (each region costs a scheduling quantum on a busy host).
  float* op = o.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto merge = [&](int64_t b) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t h = r / Lq, i = r % Lq;
      float* out = op + ((b * Lq + i) * H + h) * D;
      float m = kNegInf;
      bool is_bad = false;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t idx = (b * S + s) * R + r;
        m = std::max(m, pm[idx]);
        is_bad = is_bad || part_bad[idx];
      }
      float* lrow = lp + (b * H + h) * Lq + i;
      if (is_bad) {
        std::fill(out, out + D, nan);
        *lrow = nan;
        continue;
      }
      std::fill(out, out + D, 0.f);
      if (m == kNegInf) {
        *lrow = kNegInf;
        continue;
      }
      float l = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t idx = (b * S + s) * R + r;
        if (pm[idx] == kNegInf) continue;
        const float w = std::exp2(pm[idx] - m);
        l += pl[idx] * w;
        axpy(out, w, pa + idx * D, D);
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv;
      *lrow = l > 0.f ? (m + std::log2(l)) * kLn2 : kNegInf;
    }
  };
  std::vector<std::atomic<int64_t>> splits_done(static_cast<size_t>(B));

  fastarch::run_tasks(B * S, [&](int64_t t0, int64_t t1) {
    std::vector<float> qs(R * D), sbuf(R * CACHE_CHUNK);
    std::vector<int64_t> lo(R), hi(R), ra(R), re(R);
    std::vector<int64_t> run_at, run_key;  // runs of the chunk: first index in the chunk, first key
    auto split = [&](int64_t t) {
      const int64_t s = t % S, b = t / S;
      float* mrow = pm + t * R;
      float* lrow = pl + t * R;
      float* acc = pa + t * R * D;
      uint8_t* bad = part_bad.data() + t * R;
      int64_t band_lo = INT64_MAX, band_hi = -1;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = r / Lq, i = r % Lq;
        lo[r] = row_lo(b, i);
        hi[r] = row_hi(b, i);
        if (hi[r] >= lo[r]) {
          band_lo = std::min(band_lo, lo[r]);
          band_hi = std::max(band_hi, hi[r]);
        }
        const float* qr = qp + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qr[d] * sc2;
        mrow[r] = kNegInf;
        lrow[r] = 0.f;
      }
      std::fill(acc, acc + R * D, 0.f);
      if (band_hi < band_lo) return;
      // Splits and chunks start on multiples of CACHE_CHUNK keys (so on page boundaries for pages dividing it).
      const int64_t base = band_lo / CACHE_CHUNK * CACHE_CHUNK;
      const int64_t per = ((band_hi + 1 - base + S - 1) / S + CACHE_CHUNK - 1) / CACHE_CHUNK * CACHE_CHUNK;
      const int64_t ka = std::max(band_lo, base + s * per), kb = std::min(band_hi + 1, base + (s + 1) * per);
      const int32_t* trow = tb + b * npb;
      auto key_row = [&](const float* x, int64_t sx0, int64_t sx1, int64_t key) {
        return x + trow[key / page] * sx0 + (key % page) * sx1;
      };
      for (int64_t c0 = ka; c0 < kb;) {
        const int64_t n = std::min(kb, (c0 / CACHE_CHUNK + 1) * CACHE_CHUNK) - c0;
        // Runs: keys of one page (at most RUN of them when the heads are adjacent), read as a strided block.
        run_at.clear();
        run_key.clear();
        for (int64_t j = 0; j < n;) {
          const int64_t key = c0 + j, in_page = page - key % page;
          const int64_t len = std::min(n - j, heads_adjacent ? std::min(RUN, in_page) : in_page);
          run_at.push_back(j);
          run_key.push_back(key);
          j += len;
        }
        run_at.push_back(n);
        const int64_t nruns = static_cast<int64_t>(run_key.size());
        // Pages break the hardware prefetcher's streams: while a run is read, the first rows of the next stream
        // (of this head) are fetched ahead: the next run when it starts another page, after the last run of
        // the K pass the first V run, after the last of the V pass the next chunk's first K run.
        auto fetch = [&](const float* x, int64_t sx0, int64_t sx1, int64_t sx2, int64_t key, int64_t len,
                         int64_t hk) {
          prefetch_rows(key_row(x, sx0, sx1, key) + hk * sx2, sx1, std::min(len, RUN), D);
        };
        auto fetch_after = [&](bool v_pass, int64_t u, int64_t hk) {
          if (u + 1 < nruns) {
            if (run_key[u + 1] % page == 0)
              v_pass ? fetch(vp, sv0, sv1, sv2, run_key[u + 1], run_at[u + 2] - run_at[u + 1], hk)
                     : fetch(kp, sk0, sk1, sk2, run_key[u + 1], run_at[u + 2] - run_at[u + 1], hk);
          } else if (!v_pass) {
            fetch(vp, sv0, sv1, sv2, run_key[0], run_at[1], hk);
          } else if (c0 + n < kb) {
            fetch(kp, sk0, sk1, sk2, c0 + n, std::min(kb - c0 - n, page - (c0 + n) % page), hk);
          }
        };
        for (int64_t r = 0; r < R; ++r) {
          ra[r] = std::max<int64_t>(lo[r] - c0, 0);
          re[r] = std::min<int64_t>(hi[r] - c0 + 1, n);
        }
        // Visits the chunk run by run and kv head by kv head: body(r, a, x, len) for each row r that sees keys
        // a .. a + len - 1 of the run, x the first of their K (V pass: V) rows.
        auto for_runs = [&](bool v_pass, auto&& body) {
          const float* x = v_pass ? vp : kp;
          const int64_t x0 = v_pass ? sv0 : sk0, x1 = v_pass ? sv1 : sk1, x2 = v_pass ? sv2 : sk2;
          for (int64_t u = 0; u < nruns; ++u) {
            const int64_t j0 = run_at[u], j1 = run_at[u + 1];
            const float* xr = key_row(x, x0, x1, run_key[u]);
            for (int64_t hk = 0; hk < Hk; ++hk) {
              fetch_after(v_pass, u, hk);
              for (int64_t r = hk * GL; r < (hk + 1) * GL; ++r) {
                const int64_t a = std::max(ra[r], j0), e = std::min(re[r], j1);
                if (e > a) body(r, a, xr + hk * x2 + (a - j0) * x1, e - a);
              }
            }
          }
        };
        for_runs(false, [&](int64_t r, int64_t a, const float* kr, int64_t len) {
          dots(qs.data() + r * D, kr, sk1, len, D, sbuf.data() + r * CACHE_CHUNK + a);
        });
        for (int64_t r = 0; r < R; ++r) {
          float* sr = sbuf.data() + r * CACHE_CHUNK;
          const int64_t a = ra[r], e = re[r];
          if (e <= a) continue;
          // A non-finite score comes from a non-finite K row or from overflow; only the first counts.
          if (!bad[r] && !all_finite(sr + a, e - a))
            for (int64_t j = a; j < e && !bad[r]; ++j)
              if (!std::isfinite(sr[j]) && !all_finite(key_row(kp, sk0, sk1, c0 + j) + (r / GL) * sk2, D)) bad[r] = 1;
          float mx = cap_fused ? cap_max : kNegInf;
          if (!cap_fused) {
            if (cap > 0.f) mx = cap_log2(sr + a, nullptr, e - a, cap);
            if (al) alibi_row(sr + a, e - a, al[b * H + r / Lq] * kLog2e, sl[b] - Lq + r % Lq - c0 - a);
            if (al || cap == 0.f) mx = row_max(sr + a, e - a);
          }
          const float mnew = std::max(mrow[r], mx);
          if (mnew == kNegInf) {  // nothing visible yet in this row
            re[r] = ra[r];
            continue;
          }
          const float alpha = mrow[r] == kNegInf ? 0.f : std::exp2(mrow[r] - mnew);
          lrow[r] = lrow[r] * alpha +
                    (cap_fused ? cap_exp2_sum(sr + a, e - a, cap) : exp2_sub_sum(sr + a, e - a, mnew));
          mrow[r] = mnew;
          float* ar = acc + r * D;
          if (alpha != 1.f)
            for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
        }
        for_runs(true, [&](int64_t r, int64_t a, const float* vr, int64_t len) {
          pv(acc + r * D, sbuf.data() + r * CACHE_CHUNK + a, vr, sv1, len, D);
        });
        c0 += n;
      }
      // A non-finite accumulator comes from a non-finite V row the row sees or from overflow.
      for (int64_t r = 0; r < R; ++r) {
        if (bad[r] || all_finite(acc + r * D, D)) continue;
        for (int64_t key = std::max(ka, lo[r]); key <= std::min(kb - 1, hi[r]) && !bad[r]; ++key)
          if (!all_finite(key_row(vp, sv0, sv1, key) + (r / GL) * sv2, D)) bad[r] = 1;
      }
    };
    for (int64_t t = t0; t < t1; ++t) {
      split(t);
      if (splits_done[t / S].fetch_add(1, std::memory_order_acq_rel) == S - 1) merge(t / S);
    }
  });

  return {o, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_fwd", &fwd, "banded tiled attention forward -> (o, lse)");
  m.def("attention_bwd", &bwd, "banded tiled attention backward -> (dq, dk, dv[, dbias])");
  m.def("attention_cache_fwd", &cache_fwd, "KV-cache (paged) attention forward -> (o (B,Lq,H,D), lse)");
  m.def("has_avx2", []() {
#ifdef FA_AVX2
    return true;
#else
    return false;
#endif
  });
}
