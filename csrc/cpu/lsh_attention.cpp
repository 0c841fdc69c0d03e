// Reformer LSH attention on the CPU: chunked attention with look-one-back over the sorted hash rounds.
//
// lsh_hash gives the buckets and lsh_sort the permutation `perm` (B, H, S = n_hashes * Lp): the original
// position held by each slot of the concatenated rounds (>= L for padding), and `inv` (B, H, n_hashes, L):
// the slot of each real position in each round. fastarch/ops/lsh_attention.py strings them together.
//
// Keys are the qk rows normalised to unit length (as F.normalize), computed here while they are packed.
//
// Forward, one thread per (batch*head) when there are at least as many of those as threads: it walks the
// chunks of its head in order, scores each chunk's queries (read in place) against the chunk's keys and
// the previous chunk's (packed K^T, reused across consecutive chunks), exponentiates and masks (padding,
// key_padding_mask, causal, self) each block of rows while it is in L1, and adds P V straight into the
// output rows through pointers. Every score of query i is at most |q_i| / sqrt(D), so that bound serves as the
// softmax shift of every round and the rounds combine by plain sums; queries whose bound is too large to
// shift by safely use their row max with an online rescale instead. Otherwise (few heads, more threads)
// one task per (batch*head, chunk) writes o and lse for its own slots, and a second pass over positions
// combines the rounds: out = sum_r o_r softmax_r(lse_r), or the query's own v when every round was empty.
// Memory: O(n_hashes * L * D) for the per-slot outputs at most; never O(L^2).
//
// Backward, same tasks: recompute S, P = exp(S - LSE) with the combined LSE, dP = G V^T,
// dS = P (dP - delta) * scale; dQ, dK, dV per slot; dK/dV of the previous chunk's keys go to a second
// buffer so that every buffer slot has one writer. A last pass sums each position's slots over rounds.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fastarch_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

inline v8f load8(const float* p) { return *reinterpret_cast<const v8fu*>(p); }
inline void store8(float* p, v8f x) { *reinterpret_cast<v8fu*>(p) = x; }
inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
// x where m is all ones, +0 where m is 0
inline v8f and8(v8f x, v8i m) { return (v8f)((v8i)x & m); }

// Round to nearest even, for |x| < 2^22: adding and subtracting 1.5 * 2^23 drops the fraction bits.
inline v8f round_nearest8(v8f x) {
  const v8f magic = splat8(12582912.0f);
  return (x + magic) - magic;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kNormEps = 1e-12f;  // as F.normalize
constexpr float kLog2e = 1.44269504088896341f;

// Rows reached through the permutation are scattered in memory: fetch them ahead of use, into L1
// (Locality 3) or into L2 only (Locality 2).
template <int Locality = 3>
inline void prefetch_row(const float* p, int64_t n, bool write = false) {
  for (int64_t k = 0; k < n; k += 16) {
    if (write) __builtin_prefetch(p + k, 1, Locality);
    else __builtin_prefetch(p + k, 0, Locality);
  }
}

// exp for x <= 0 (Cephes-style range reduction and polynomial); values below -87 give exactly 0.
inline v8f vexp_nonpos(v8f x) {
  const v8i keep = x > splat8(-87.0f);
  x = x > splat8(-87.0f) ? x : splat8(-87.0f);
  v8f n = round_nearest8(x * splat8(1.44269504088896341f));
  v8f r = x - n * splat8(0.693359375f) + n * splat8(2.12194440e-4f);
  v8f y = splat8(1.9875691500e-4f);
  y = y * r + splat8(1.3981999507e-3f);
  y = y * r + splat8(8.3334519073e-3f);
  y = y * r + splat8(4.1665795894e-2f);
  y = y * r + splat8(1.6666665459e-1f);
  y = y * r + splat8(5.0000001201e-1f);
  y = y * (r * r) + r + splat8(1.0f);
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  y = y * reinterpret_cast<v8f&>(e);
  v8i bits = reinterpret_cast<v8i&>(y) & keep;
  return reinterpret_cast<v8f&>(bits);
}

// In-register 8 x 8 transpose: x[m][l] <- x[l][m].
inline void transpose8(v8f* x) {
  v8f t[8], u[8];
  for (int k = 0; k < 4; ++k) {
    t[2 * k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * k + 1] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int k = 0; k < 2; ++k)
    for (int h = 0; h < 2; ++h) {
      u[4 * k + 2 * h] = __builtin_shufflevector(t[4 * k + h], t[4 * k + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * k + 2 * h + 1] = __builtin_shufflevector(t[4 * k + h], t[4 * k + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int m = 0; m < 4; ++m) {
    x[m] = __builtin_shufflevector(u[m], u[m + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    x[m + 4] = __builtin_shufflevector(u[m], u[m + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// 2^x for -126 <= x <= 1, without range checks: for the fused score path, whose arguments are bounded by
// construction. Round to nearest, then a degree-5 polynomial for 2^f on [-1/2, 1/2] (relative error 9e-8
// in exact arithmetic, 2e-7 evaluated in fp32; a weighted least-squares fit in float64 with p(0) = 1).
inline v8f vexp2_bounded(v8f x) {
  const v8f n = round_nearest8(x);
  const v8f f = x - n;
  v8f y = splat8(1.326472614891827e-3f);
  y = y * f + splat8(9.671512991189957e-3f);
  y = y * f + splat8(5.550733581185341e-2f);
  y = y * f + splat8(2.4022242426872253e-1f);
  y = y * f + splat8(6.931470036506653e-1f);
  y = y * f + splat8(1.0f);
  v8i e = (__builtin_convertvector(n, v8i) + 127) << 23;
  return y * reinterpret_cast<v8f&>(e);
}

// One k-step of an R x 16 register block: acc[r] += a[r * astride] * (b0 | b1). Every GEMM below is a loop
// of this step over k; they differ only in where A, B and C live.
template <int R>
__attribute__((always_inline)) inline void rank1_16(v8f (&acc)[R][2], const float* a, int64_t astride, v8f b0,
                                                    v8f b1) {
  for (int r = 0; r < R; ++r) {
    const v8f x = splat8(a[r * astride]);
    acc[r][0] += x * b0;
    acc[r][1] += x * b1;
  }
}

// R rows of C[. x n] (+)= A[. x k] B[k x n]: an R x 16 register block (2R accumulators) per column step.
template <int R>
inline void gemm_rows(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                      int64_t n, int64_t k, bool accumulate) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    v8f acc[R][2];
    for (int r = 0; r < R; ++r) {
      if (accumulate) {
        acc[r][0] = load8(C + r * ldc + j0);
        acc[r][1] = load8(C + r * ldc + j0 + 8);
      } else {
        acc[r][0] = splat8(0.0f);
        acc[r][1] = splat8(0.0f);
      }
    }
    for (int64_t p = 0; p < k; ++p) rank1_16<R>(acc, A + p, lda, load8(B + p * ldb + j0), load8(B + p * ldb + j0 + 8));
    for (int r = 0; r < R; ++r) {
      store8(C + r * ldc + j0, acc[r][0]);
      store8(C + r * ldc + j0 + 8, acc[r][1]);
    }
  }
}

// C[m x n] (+)= A[m x k] B[k x n]; row-major with leading dims; n % 16 == 0.
void gemm_nn(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t m,
             int64_t n, int64_t k, bool accumulate) {
  int64_t i = 0;
  for (; i + 6 <= m; i += 6) gemm_rows<6>(A + i * lda, lda, B, ldb, C + i * ldc, ldc, n, k, accumulate);
  for (; i + 4 <= m; i += 4) gemm_rows<4>(A + i * lda, lda, B, ldb, C + i * ldc, ldc, n, k, accumulate);
  for (; i + 2 <= m; i += 2) gemm_rows<2>(A + i * lda, lda, B, ldb, C + i * ldc, ldc, n, k, accumulate);
  for (; i < m; ++i) gemm_rows<1>(A + i * lda, lda, B, ldb, C + i * ldc, ldc, n, k, accumulate);
}

// Integer dot products of a hash tile: acc[u][h] lane l = Rq_{t0 + u} . xq_{row 8h + l}, 16 rows of x. Rows
// of ra (T x Dh) and Xp (Dh x 16) hold int16 pairs (d, d + 1) packed in int32 words. Exact (the scaling
// keeps every sum within int32), so every implementation below gives the same integers.
template <int T>
inline void tile_dots_generic(const int32_t* ra, int64_t Dh, const int32_t* Xp, v8i (&acc)[T][2]) {
  for (int u = 0; u < T; ++u) acc[u][0] = acc[u][1] = v8i{0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < Dh; ++d) {
    v8i x[2], lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      std::memcpy(&x[h], Xp + d * 16 + 8 * h, sizeof(v8i));
      lo[h] = (x[h] << 16) >> 16;  // sign-extended int16 halves
      hi[h] = x[h] >> 16;
    }
    for (int u = 0; u < T; ++u) {
      const int32_t w = ra[u * Dh + d], wl = static_cast<int16_t>(w & 0xffff), wh = w >> 16;
      for (int h = 0; h < 2; ++h) acc[u][h] += wl * lo[h] + wh * hi[h];
    }
  }
}

#if defined(__AVX2__)
// The same for T = 6 with vpmaddwd (16 multiply-adds of int16 pairs into int32 lanes an instruction) in
// asm: 12 accumulators, the two x vectors, the broadcast and one product fill the 16 registers exactly.
// Written with intrinsics, the compiler reloaded x for every product and the tile ran at the fp32 FMA
// rate; this schedule measured 1.55x that (70 against 45 G multiply-adds/s per core).
inline void tile_dots_avx2_6(const int32_t* ra, int64_t Dh, const int32_t* Xp, v8i (&acc)[6][2]) {
  v8i a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{}, a8{}, a9{}, a10{}, a11{};
  const int64_t stride = Dh * 4;  // bytes between rows of ra
  for (int64_t d = 0; d < Dh; ++d) {
    __asm__(
        "vmovdqu (%[x]), %%ymm12\n\t"
        "vmovdqu 32(%[x]), %%ymm13\n\t"
#define FA_LSH_ROW(R, A0, A1)                      \
  "vpbroadcastd " R ", %%ymm14\n\t"                \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"         \
  "vpaddd %%ymm15, %[" #A0 "], %[" #A0 "]\n\t"     \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t"         \
  "vpaddd %%ymm15, %[" #A1 "], %[" #A1 "]\n\t"
        FA_LSH_ROW("(%[p0])", a0, a1) FA_LSH_ROW("(%[p0],%[s],1)", a2, a3) FA_LSH_ROW("(%[p0],%[s],2)", a4, a5)
        FA_LSH_ROW("(%[p3])", a6, a7) FA_LSH_ROW("(%[p3],%[s],1)", a8, a9) FA_LSH_ROW("(%[p3],%[s],2)", a10, a11)
#undef FA_LSH_ROW
        : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4), [a5] "+x"(a5),
          [a6] "+x"(a6), [a7] "+x"(a7), [a8] "+x"(a8), [a9] "+x"(a9), [a10] "+x"(a10), [a11] "+x"(a11)
        : [x] "r"(Xp + d * 16), [p0] "r"(ra + d), [p3] "r"(ra + 3 * Dh + d), [s] "r"(stride)
        : "xmm12", "xmm13", "xmm14", "xmm15", "memory");
  }
  acc[0][0] = a0, acc[0][1] = a1, acc[1][0] = a2, acc[1][1] = a3, acc[2][0] = a4, acc[2][1] = a5;
  acc[3][0] = a6, acc[3][1] = a7, acc[4][0] = a8, acc[4][1] = a9, acc[5][0] = a10, acc[5][1] = a11;
}
#endif

// One tile of the hash projections in integers, transposed: T projections (rows t0.. of Rp) x 16 rows of
// x, then, per row (a lane), the running best of the round over concat[xR, -xR]: m1 = the largest |p| so
// far, m2 = the second largest, i1 = the index of m1 in concat order (first wins). generic: the portable
// dot products even where the AVX2 ones exist (tests compare the two).
template <int T>
__attribute__((noinline)) void hash_tile(const int32_t* Rp, int64_t Dh, const int32_t* Xp, int64_t t0,
                                         int64_t tr0, int64_t R2, v8i* m1, v8i* m2, v8i* i1, bool generic) {
  v8i acc[T][2];
  bool done = false;
#if defined(__AVX2__)
  if constexpr (T == 6) {
    if (!generic) {
      tile_dots_avx2_6(Rp + t0 * Dh, Dh, Xp, acc);
      done = true;
    }
  }
#endif
  if (!done) tile_dots_generic<T>(Rp + t0 * Dh, Dh, Xp, acc);
  // in locals: updated through the pointers, every step went through memory (they may alias)
  v8i b1[2] = {m1[0], m1[1]}, b2[2] = {m2[0], m2[1]}, j1[2] = {i1[0], i1[1]};
  const int32_t r2 = static_cast<int32_t>(R2);
  const v8i r2v = v8i{r2, r2, r2, r2, r2, r2, r2, r2}, zero = v8i{0, 0, 0, 0, 0, 0, 0, 0};
  for (int u = 0; u < T; ++u) {
    const int32_t t = static_cast<int32_t>(tr0 + u);
    const v8i tv = v8i{t, t, t, t, t, t, t, t};
    for (int h = 0; h < 2; ++h) {
      const v8i v = acc[u][h];
      const v8i a = v < zero ? -v : v;  // |v| < 2^31
      const v8i gt = a > b1[h];
      const v8i lo = gt ? b1[h] : a;
      b2[h] = lo > b2[h] ? lo : b2[h];
      b1[h] = gt ? a : b1[h];
      j1[h] = gt ? tv + ((v < zero) & r2v) : j1[h];
    }
  }
  for (int h = 0; h < 2; ++h) {
    m1[h] = b1[h];
    m2[h] = b2[h];
    i1[h] = j1[h];
  }
}

// One round's argmax for one row in fp32: the R2 projections x . R[:, t] (R row-major D x NR from column
// 0 of the round), vectorised over t. Returns the index in concat order, or -1 when the best and the second
// best |p| are within twice the fp32 error bound cr |x| (or the best is within it of 0): fp64 decides.
int64_t round_argmax_fp32(const float* x, const float* R, int64_t NR, int64_t D, int64_t R2, float cr, float* p) {
  int64_t t0 = 0;
  for (; t0 + 64 <= R2; t0 += 64) {  // 8 independent accumulators: the FMA latency is hidden
    v8f acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = splat8(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const v8f xd = splat8(x[d]);
      for (int k = 0; k < 8; ++k) acc[k] += xd * load8(R + d * NR + t0 + 8 * k);
    }
    for (int k = 0; k < 8; ++k) store8(p + t0 + 8 * k, acc[k]);
  }
  for (; t0 + 8 <= R2; t0 += 8) {
    v8f acc = splat8(0.0f);
    for (int64_t d = 0; d < D; ++d) acc += splat8(x[d]) * load8(R + d * NR + t0);
    store8(p + t0, acc);
  }
  for (; t0 < R2; ++t0) {
    float acc = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc += x[d] * R[d * NR + t0];
    p[t0] = acc;
  }
  float n2 = 0.0f, best = -1.0f, second = -1.0f;
  int64_t ib = 0;
  for (int64_t d = 0; d < D; ++d) n2 += x[d] * x[d];
  for (int64_t t = 0; t < R2; ++t) {
    const float a = std::fabs(p[t]);
    if (a > best) {
      second = best;
      best = a;
      ib = p[t] < 0.0f ? t + R2 : t;
    } else {
      second = std::max(second, a);
    }
  }
  if (!(n2 >= 1e-30f)) return -1;  // tiny rows: the relative bound does not hold near underflow
  const float bnd = cr * std::sqrt(n2) * (1.0f + 1e-5f);
  if (!(second < best - 2.0f * bnd) || !(best > 2.0f * bnd)) return -1;  // NaN too
  return ib;
}

// The same in fp64, exact up to fp64 rounding: the first maximum of concat[p, -p] (positive side first).
int64_t round_argmax_fp64(const float* x, const float* R, int64_t NR, int64_t D, int64_t R2, double* p) {
  int64_t c = 0;
  for (; c + 4 <= R2; c += 4) {  // four independent sums, each in the order of d
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      const double xd = x[d];
      const float* rd = R + d * NR + c;
      a0 += xd * double(rd[0]);
      a1 += xd * double(rd[1]);
      a2 += xd * double(rd[2]);
      a3 += xd * double(rd[3]);
    }
    p[c] = a0;
    p[c + 1] = a1;
    p[c + 2] = a2;
    p[c + 3] = a3;
  }
  for (; c < R2; ++c) {
    double acc = 0.0;
    for (int64_t d = 0; d < D; ++d) acc += double(x[d]) * double(R[d * NR + c]);
    p[c] = acc;
  }
  double best = -std::numeric_limits<double>::infinity();
  int64_t ib = 0;
  for (int side = 0; side < 2; ++side)
    for (int64_t t = 0; t < R2; ++t) {
      const double a = side ? -p[t] : p[t];
      if (a > best) {
        best = a;
        ib = side * R2 + t;
      }
    }
  return ib;
}

// Buckets (B, H, NH, L) int64: argmax(concat[x R_r, -x R_r]) per round, first maximum on ties, as if the
// projections were exact. Argmax per round is unchanged by a positive scale of x's row or of the whole
// round of R, so both are scaled to integers of at most qmax = sqrt((2^31 - 1) / D) (so a dot product fits
// an int32) and rounded: x per row, R per round. The integer projection xq . Rq_t is then within
// E = (1/2 + eta) (|xq|_1 + max_t |Rq_t|_1) + D (1/2 + eta)^2 of the exact one in the same units (eta
// covers the fp32 rounding of the scaling). Projections are computed transposed, 16 rows of x to a tile,
// with the argmax kept per row in the tile's registers (no projection matrix is stored). A (row, round)
// whose second best is within 2E of the best, or whose best is within 2E of 0 (about 2% of them on
// Gaussian inputs at D = 64), is recomputed in fp32 with its own error bound, and what that cannot
// separate in fp64, so the result matches an fp64 reference up to ties below fp64 rounding. Rows that
// are zero, tiny or not finite skip the integers.
at::Tensor lsh_hash(const at::Tensor& qk, const at::Tensor& rot, bool generic) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && qk.is_contiguous() && qk.dim() == 4,
              "lsh_attention (cpp): qk must be contiguous fp32 (B, H, L, D)");
  TORCH_CHECK(rot.scalar_type() == at::kFloat && rot.is_contiguous() && rot.dim() == 3 &&
                  rot.size(0) == qk.size(3),
              "lsh_attention (cpp): rotations must be contiguous fp32 (D, NH, R2)");
  const int64_t B = qk.size(0), H = qk.size(1), L = qk.size(2), D = qk.size(3);
  const int64_t NH = rot.size(1), R2 = rot.size(2), NR = NH * R2;
  const int64_t M = B * H * L, Dh = (D + 1) / 2;  // int16 pairs; an odd D gets a zero pad
  const float qmax = std::min(32767.0f, std::floor(std::sqrt(2147483647.0f / float(2 * Dh)) * 0.999f));
  constexpr double eta = 1e-3;
  const float* rp = rot.data_ptr<float>();  // R[d, t] at rp[d * NR + t], rounds side by side
  std::vector<float> cr(NH, 0.0f);  // fp32 bound: 4 D u max_t |R_t| per round, inflated for float rounding
  std::vector<int32_t> Rp(NR * Dh, 0);  // Rq as int16 pairs, a row per projection
  std::vector<double> r1(NH, 0.0);      // max_t |Rq_t|_1 per round
  for (int64_t r = 0; r < NH; ++r) {
    double cm = 0.0;
    float mr = 0.0f;
    for (int64_t t = r * R2; t < (r + 1) * R2; ++t) {
      double n2 = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        n2 += double(rp[d * NR + t]) * rp[d * NR + t];
        mr = std::max(mr, std::fabs(rp[d * NR + t]));
      }
      cm = std::max(cm, std::sqrt(n2));
    }
    cr[r] = static_cast<float>(4.0 * double(D) * std::ldexp(1.0, -24) * cm * (1.0 + 1e-4));
    const float sr = mr > 0.0f && std::isfinite(mr) ? qmax / mr : 0.0f;
    for (int64_t t = r * R2; t < (r + 1) * R2; ++t) {
      double n1 = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const int32_t x = static_cast<int32_t>(std::nearbyint(rp[d * NR + t] * sr));
        n1 += std::abs(x);
        const int32_t w = static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(x)));
        Rp[t * Dh + d / 2] |= d % 2 ? static_cast<int32_t>(static_cast<uint32_t>(w) << 16) : w;
      }
      r1[r] = std::max(r1[r], n1);
    }
  }
  auto out = at::empty({B, H, NH, L}, qk.options().dtype(at::kLong));
  const float* xp = qk.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t nblk = (M + 15) / 16;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 23) / (16 * D * NR));  // >= ~8M MACs per task
  fastarch::run_tasks((nblk + grain - 1) / grain, [&](int64_t task, int64_t) {
    const int64_t begin = task * grain, end = std::min(nblk, begin + grain);
    std::vector<float> Xt(2 * Dh * 16), zero(D + 8, 0.0f);
    std::vector<int32_t> Xp(Dh * 16);
    std::vector<double> proj64(R2);
    std::vector<float> proj32(round_up(R2, 8));
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r0 = blk * 16, rows = std::min<int64_t>(16, M - r0);
      const float* xr[16];
      for (int l = 0; l < 16; ++l) xr[l] = l < rows ? xp + (r0 + l) * D : zero.data();
      if (D % 8 == 0) {
        for (int64_t d0 = 0; d0 < D; d0 += 8)
          for (int h = 0; h < 2; ++h) {
            v8f x8[8];
            for (int l = 0; l < 8; ++l) x8[l] = load8(xr[8 * h + l] + d0);
            transpose8(x8);
            for (int m = 0; m < 8; ++m) store8(&Xt[(d0 + m) * 16 + 8 * h], x8[m]);
          }
      } else {
        for (int64_t d = 0; d < 2 * Dh; ++d)
          for (int l = 0; l < 16; ++l) Xt[d * 16 + l] = d < D ? xr[l][d] : 0.0f;
      }
      // per row (lane): scale to integers, pack pairs, |xq|_1
      alignas(32) float l1[16];
      alignas(32) int32_t bad[16];
      for (int h = 0; h < 2; ++h) {
        const v8f inf = splat8(std::numeric_limits<float>::infinity());
        const v8i absmask = v8i{0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff,
                                0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
        v8f mx = splat8(0.0f);
        v8i finite = v8i{-1, -1, -1, -1, -1, -1, -1, -1};
        for (int64_t d = 0; d < D; ++d) {
          const v8f a = and8(load8(&Xt[d * 16 + 8 * h]), absmask);
          mx = a > mx ? a : mx;
          finite &= a < inf;  // false for inf and NaN
        }
        const v8f sc = splat8(qmax) / mx;
        // rows that are zero, tiny (the scale overflows) or not finite are decided in fp64
        const v8i ok = (sc > splat8(0.0f)) & (sc < inf) & finite;
        const v8f s8 = and8(sc, ok);
        // |x s| <= qmax < 2^22; bad lanes give 0
        auto quantise = [&](int64_t d) {
          return __builtin_convertvector(round_nearest8(and8(load8(&Xt[d * 16 + 8 * h]) * s8, ok)), v8i);
        };
        const v8i zero = v8i{0, 0, 0, 0, 0, 0, 0, 0};
        v8i n1 = zero;
        for (int64_t dh = 0; dh < Dh; ++dh) {
          const v8i lo = quantise(2 * dh), hi = quantise(2 * dh + 1);
          n1 += (lo < zero ? -lo : lo) + (hi < zero ? -hi : hi);
          const v8i w = (lo & 0xffff) | (hi << 16);
          std::memcpy(&Xp[dh * 16 + 8 * h], &w, sizeof(w));
        }
        for (int l = 0; l < 8; ++l) {
          l1[8 * h + l] = static_cast<float>(n1[l]);
          bad[8 * h + l] = ok[l] == 0;
        }
      }
      for (int64_t r = 0; r < NH; ++r) {
        v8i m1[2], m2[2], i1[2];
        for (int h = 0; h < 2; ++h) {
          m1[h] = m2[h] = v8i{-1, -1, -1, -1, -1, -1, -1, -1};
          i1[h] = v8i{0, 0, 0, 0, 0, 0, 0, 0};
        }
        int64_t t = 0;
        for (; t + 6 <= R2; t += 6) hash_tile<6>(Rp.data(), Dh, Xp.data(), r * R2 + t, t, R2, m1, m2, i1, generic);
        for (; t + 2 <= R2; t += 2) hash_tile<2>(Rp.data(), Dh, Xp.data(), r * R2 + t, t, R2, m1, m2, i1, generic);
        for (; t < R2; ++t) hash_tile<1>(Rp.data(), Dh, Xp.data(), r * R2 + t, t, R2, m1, m2, i1, generic);
        for (int l = 0; l < rows; ++l) {
          const int h = l / 8, k = l % 8;
          const double best = m1[h][k], second = m2[h][k];
          const double e2 = 2.0 * ((0.5 + eta) * (double(l1[l]) + r1[r]) + double(D) * (0.5 + eta) * (0.5 + eta));
          int64_t ib = i1[h][k];
          // a close second (or a best near 0, where the other side of the best is close): fp32 with its
          // own bound over the whole round, then fp64 where fp32 cannot separate them
          if (bad[l] || second >= best - e2 || best <= e2) {
            ib = round_argmax_fp32(xr[l], rp + r * R2, NR, D, R2, cr[r], proj32.data());
            if (ib < 0) ib = round_argmax_fp64(xr[l], rp + r * R2, NR, D, R2, proj64.data());
          }
          const int64_t row = r0 + l, bh = row / L, pos = row % L;
          op[(bh * NH + r) * L + pos] = ib;
        }
      }
    }
  });
  return out;
}

// dst[n x m] = src[m x n]^T (leading dims given).
void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) dst[j * ldd + i] = src[i * lds + j];
}

struct Geometry {
  int64_t B, H, L, D, S, NH, Lp, bs, C;
  int64_t bsp, NK, NKp, Dp;  // padded sizes of the packed buffers
  float scale;
};

Geometry geometry(const at::Tensor& q, const at::Tensor& perm, const at::Tensor& inv, int64_t bs) {
  Geometry g;
  g.B = q.size(0);
  g.H = q.size(1);
  g.L = q.size(2);
  g.D = q.size(3);
  g.S = perm.size(2);
  g.NH = inv.size(2);
  g.Lp = g.S / g.NH;
  g.bs = bs;
  g.C = g.S / bs;
  g.bsp = round_up(bs, 4);
  g.NK = 2 * bs;
  g.NKp = round_up(g.NK, 16);
  g.Dp = round_up(g.D, 16);
  g.scale = 1.0f / std::sqrt(static_cast<float>(g.D));
  return g;
}

void check_inputs(const at::Tensor& q, const at::Tensor& v, const at::Tensor& perm, const at::Tensor& inv,
                  const c10::optional<at::Tensor>& kpm, int64_t bs) {
  for (const at::Tensor* t : {&q, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 4,
                "lsh_attention (cpp): q/v must be contiguous fp32 (B, H, L, D)");
    TORCH_CHECK(t->sizes() == q.sizes(), "lsh_attention (cpp): q/v shapes differ");
  }
  TORCH_CHECK(perm.scalar_type() == at::kLong && perm.is_contiguous() && perm.dim() == 3,
              "lsh_attention (cpp): perm must be contiguous int64 (B, H, S)");
  TORCH_CHECK(inv.scalar_type() == at::kLong && inv.is_contiguous() && inv.dim() == 4,
              "lsh_attention (cpp): inv must be contiguous int64 (B, H, NH, L)");
  TORCH_CHECK(bs >= 1 && perm.size(2) % bs == 0 && perm.size(2) % inv.size(2) == 0,
              "lsh_attention (cpp): slot count must be a multiple of bucket_size and n_hashes");
  if (kpm.has_value()) {
    TORCH_CHECK(kpm->scalar_type() == at::kBool && kpm->is_contiguous() && kpm->dim() == 2 &&
                    kpm->size(0) == q.size(0) && kpm->size(1) == q.size(2),
                "lsh_attention (cpp): key_padding_mask must be contiguous bool (B, L)");
  }
}

// The inputs of one task (bh, chunk c): positions, key validity, unit keys K^T (normalised here, as
// F.normalize: q / max(|q|, eps)), and packed Q / V copies (rows or panels) as a path needs them.
// Key columns [own*bs, own*bs + bs) hold chunk c, the other half chunk c-1. A thread walks consecutive
// chunks, so the previous task's own keys become this task's previous keys without a gather or a copy.
struct Tile {
  std::vector<int32_t> qpos, kpos;
  std::vector<int32_t> kval;  // -1: a valid key (padding, key_padding_mask), 0: masked
  std::vector<float> knorm;   // max(|q|, eps) of each key column (0 for padding)
  std::vector<float> Qb, Kt, Vb, Vp, Sb, zero;
  bool pack_q, pack_v, panel_v = false;
  int64_t last_bh = -1, last_c = -1;
  int64_t own = 1;  // which half of the key columns holds chunk c (the other holds chunk c-1)
  Tile(const Geometry& g, bool pack_q_ = true, bool pack_v_ = true)
      : qpos(g.bsp, static_cast<int32_t>(g.L)), kpos(g.NKp, static_cast<int32_t>(g.L)), kval(g.NKp, 0),
        knorm(g.NKp, 0.0f), Qb(pack_q_ ? g.bsp * g.Dp : 0, 0.0f), Kt(g.Dp * g.NKp, 0.0f),
        Vb(pack_v_ ? g.NKp * g.Dp : 0, 0.0f), Sb(g.bsp * g.NKp), zero(g.Dp, 0.0f), pack_q(pack_q_),
        pack_v(pack_v_) {}
  // V as Dp/16 panels of NKp x 16 (the PV GEMM then streams one contiguous panel per column block)
  void use_panels(const Geometry& g) {
    panel_v = true;
    Vp.assign(g.Dp * g.NKp, 0.0f);
  }

  // Keys at positions perm_c[0, bs) into columns [j0, j0 + bs). K^T is written 8 columns at a time so
  // that each store of the transpose fills part of one line rather than touching a new line per key.
  void keys(const Geometry& g, const float* q, const float* v, const bool* kpm_b, int64_t j0,
            const int64_t* perm_c) {
    const float* rows[8];
    float rn[8];
    for (int64_t jb = 0; jb < g.bs; jb += 8) {
      const int64_t nb = std::min<int64_t>(8, g.bs - jb);
      // the next group's rows into L1 while this group is packed
      for (int64_t jj = jb + 8; jj < std::min<int64_t>(jb + 16, g.bs); ++jj) {
        const int64_t p = perm_c[jj];
        if (p < g.L) {
          prefetch_row(q + p * g.D, g.D);
          if (panel_v || pack_v) prefetch_row(v + p * g.D, g.D);
        }
      }
      for (int64_t jj = 0; jj < nb; ++jj) {
        const int64_t j = j0 + jb + jj, p = perm_c[jb + jj];
        const bool real = p < g.L;
        kpos[j] = static_cast<int32_t>(p);
        kval[j] = (real && (kpm_b == nullptr || kpm_b[p])) ? -1 : 0;
        rows[jj] = real ? q + p * g.D : zero.data();
        float n2 = 0.f;
        if (real) {
          const float* x = q + p * g.D;
#pragma omp simd reduction(+ : n2)
          for (int64_t d = 0; d < g.D; ++d) n2 += x[d] * x[d];
        }
        const float nrm = std::max(std::sqrt(n2), kNormEps);
        knorm[j] = real ? nrm : 0.0f;
        rn[jj] = real ? 1.0f / nrm : 0.0f;
        if (panel_v) {
          const float* src = real ? v + p * g.D : zero.data();
          int64_t d0 = 0;
          for (; d0 + 16 <= g.D; d0 += 16) {  // inline: a libc memcpy call per 64 bytes costs more than the copy
            float* dst = &Vp[d0 * g.NKp + j * 16];
            store8(dst, load8(src + d0));
            store8(dst + 8, load8(src + d0 + 8));
          }
          for (; d0 < g.D; ++d0) Vp[(d0 / 16 * 16) * g.NKp + j * 16 + d0 % 16] = src[d0];
        }
        if (pack_v) {
          if (real) std::memcpy(&Vb[j * g.Dp], v + p * g.D, sizeof(float) * g.D);
          else std::fill(&Vb[j * g.Dp], &Vb[j * g.Dp] + g.D, 0.0f);
        }
      }
      float* dst = &Kt[j0 + jb];
      if (nb == 8 && g.D % 8 == 0) {
        const v8f r8 = load8(rn);
        for (int64_t d = 0; d < g.D; d += 8) {
          v8f x[8];
          for (int jj = 0; jj < 8; ++jj) x[jj] = load8(rows[jj] + d);
          transpose8(x);
          for (int m = 0; m < 8; ++m) store8(dst + (d + m) * g.NKp, x[m] * r8);
        }
      } else {
        for (int64_t d = 0; d < g.D; ++d)
          for (int64_t jj = 0; jj < nb; ++jj) dst[d * g.NKp + jj] = rows[jj][d] * rn[jj];
      }
    }
  }

  void load(const Geometry& g, const float* q, const float* v, const int64_t* perm, const bool* kpm_b,
            int64_t bh, int64_t c) {
    const int64_t cprev = (c + g.C - 1) % g.C;
    for (int64_t i = 0; i < g.bs; ++i) {
      const int64_t p = perm[c * g.bs + i];
      qpos[i] = static_cast<int32_t>(p);
      if (!pack_q) continue;
      if (p < g.L) std::memcpy(&Qb[i * g.Dp], q + p * g.D, sizeof(float) * g.D);
      else std::fill(&Qb[i * g.Dp], &Qb[i * g.Dp] + g.D, 0.0f);
    }
    if (bh == last_bh && c == last_c + 1) {
      own = 1 - own;  // the previous task's own keys are this task's previous keys: no copy, swap halves
    } else {
      own = 1;
      keys(g, q, v, kpm_b, 0, perm + cprev * g.bs);
    }
    keys(g, q, v, kpm_b, own * g.bs, perm + c * g.bs);
    last_bh = bh;
    last_c = c;
  }

  // Scaled scores of packed row i after masking; returns the row max (-inf when no valid key but itself).
  float mask_row(const Geometry& g, int64_t i, bool causal) {
    float* s = &Sb[i * g.NKp];
    const int32_t qp = qpos[i];
    const v8f ninf = splat8(-std::numeric_limits<float>::infinity()), sc = splat8(g.scale);
    const v8i q8 = v8i{qp, qp, qp, qp, qp, qp, qp, qp};
    v8f m8 = ninf;
    for (int64_t j = 0; j < g.NKp; j += 8) {  // NKp % 16 == 0
      v8i kp, kv;
      std::memcpy(&kp, &kpos[j], sizeof(kp));
      std::memcpy(&kv, &kval[j], sizeof(kv));
      v8i ok = kv & (kp != q8);
      if (causal) ok = ok & (kp <= q8);
      const v8f x = ok ? load8(s + j) * sc : ninf;
      store8(s + j, x);
      m8 = m8 > x ? m8 : x;
    }
    float mx = m8[0];
    for (int l = 1; l < 8; ++l) mx = std::max(mx, m8[l]);
    if (qp >= g.L) mx = -std::numeric_limits<float>::infinity();  // padded queries are dropped
    return mx;
  }
};

// Prefetches the rows of q, v and out that the next chunk reads, a few at a time between the row blocks of
// this chunk's GEMMs (a burst of hundreds of prefetches fills the miss buffers and stalls), into L2: L1
// holds this chunk's P, V panels and K^T, and rows fetched into it were evicted before the next chunk.
struct RowPrefetcher {
  const float* q = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  const int64_t* perm = nullptr;  // the next chunk's positions, or nullptr
  int64_t n = 0, i = 0, L = 0, D = 0;
  void step(int64_t rows) {
    if (perm == nullptr) return;
    for (const int64_t e = std::min(n, i + rows); i < e; ++i) {
      const int64_t p = perm[i];
      if (p < L) {
        prefetch_row<2>(q + p * D, D);
        prefetch_row<2>(v + p * D, D);
        if (out != nullptr) prefetch_row<2>(out + p * D, D, true);
      }
    }
  }
};

// Scores of R query rows (rows i0.. of the chunk) against every key column of the tile, masked.
// EXP: P = exp(s - shift_r) with masked entries 0, and red_r = the row sum; otherwise the masked
// scores themselves (-inf where masked) and red_r = the row max. EXP stores the exponents of a 16-column
// register block and then runs the exp and the mask along the R rows (in L1): done in the GEMM's
// registers, the exp's constants and the mask operands spilled (the forward was ~3% slower).
// plain (EXP only): every key valid and no query repeated among the keys but in its own column O + i0 + r,
// so that column is the only one masked.
// SYM (bs % 16 == 0): the chunk's queries are its own keys, q_i = |q_i| k_i, so its own-key scores are
// |q_i| (k_i . k_j) * scale with a symmetric Gram matrix: the row blocks compute its 16-column blocks
// from their own diagonal on (saving ~35% of those products), keep them in G (bs x bs), and read the
// blocks left of the diagonal back from G transposed.
// Kept out of line: inlined into the per-head loop, the register allocation of the whole loop suffers (13%).
template <int R, bool EXP, bool SYM>
__attribute__((noinline)) void score_rows(const Geometry& g, const Tile& t, const float* const* qrow, int64_t i0,
                       const float* shift, const float* qscale, bool causal, bool plain, float* S, float* G,
                       float* red) {
  const v8f ninf = splat8(-std::numeric_limits<float>::infinity()), sc = splat8(g.scale);
  const v8f l2e = splat8(kLog2e);
  const int64_t O = t.own * g.bs, mirror_end = i0 / 16 * 16;
  const int32_t* qpos = t.qpos.data() + i0;
  v8f red8[R];
  for (int r = 0; r < R; ++r) red8[r] = EXP ? splat8(0.0f) : ninf;
  for (int64_t j0 = 0; j0 < g.NKp; j0 += 16) {
    v8f acc[R][2];
    v8f mult[R];
    const int64_t jr = j0 - O;
    const bool own = SYM && jr >= 0 && jr < g.bs;
    if (own && jr + 16 <= mirror_end) {
      for (int r = 0; r < R; ++r) {
        alignas(32) float col[16];
        for (int l = 0; l < 16; ++l) col[l] = G[(jr + l) * g.bs + i0 + r];
        acc[r][0] = load8(col);
        acc[r][1] = load8(col + 8);
        mult[r] = splat8(qscale[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = splat8(0.0f);
      const float* kt = t.Kt.data() + j0;
      if (own) {
        const float* ka = t.Kt.data() + O + i0;
        for (int64_t p = 0; p < g.D; ++p)
          rank1_16<R>(acc, ka + p * g.NKp, 1, load8(kt + p * g.NKp), load8(kt + p * g.NKp + 8));
        for (int r = 0; r < R; ++r) {
          store8(G + (i0 + r) * g.bs + jr, acc[r][0]);
          store8(G + (i0 + r) * g.bs + jr + 8, acc[r][1]);
          mult[r] = splat8(qscale[r]);
        }
      } else {
        for (int64_t p = 0; p < g.D; ++p) {
          const v8f b0 = load8(kt + p * g.NKp), b1 = load8(kt + p * g.NKp + 8);
          for (int r = 0; r < R; ++r) {
            const v8f a = splat8(qrow[r][p]);
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
          }
        }
        for (int r = 0; r < R; ++r) mult[r] = sc;
      }
    }
    if (EXP) {  // the exponent (s - shift) log2 e now; the exp and the mask in a row pass below
      for (int r = 0; r < R; ++r) {
        const v8f m = mult[r] * l2e, b = splat8(shift[r] * kLog2e);
        store8(S + r * g.NKp + j0, acc[r][0] * m - b);
        store8(S + r * g.NKp + j0 + 8, acc[r][1] * m - b);
      }
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      v8i kp, kv;
      std::memcpy(&kp, &t.kpos[j0 + 8 * h], sizeof(kp));
      std::memcpy(&kv, &t.kval[j0 + 8 * h], sizeof(kv));
      for (int r = 0; r < R; ++r) {
        const int32_t qp = qpos[r];
        const v8i q8 = v8i{qp, qp, qp, qp, qp, qp, qp, qp};
        v8i ok = kv & (kp != q8);
        if (causal) ok = ok & (kp <= q8);
        const v8f x = ok ? acc[r][h] * mult[r] : ninf;
        store8(S + r * g.NKp + j0 + 8 * h, x);
        red8[r] = red8[r] > x ? red8[r] : x;
      }
    }
  }
  if (EXP) {  // P = 2^x (s - shift >= -2 * kShiftLimit keeps 2^x in range), masked entries 0
    const v8i lane = v8i{0, 1, 2, 3, 4, 5, 6, 7};
    for (int r = 0; r < R; ++r) {
      float* s = S + r * g.NKp;
      v8f a0 = splat8(0.0f), a1 = splat8(0.0f);
      if (plain) {
        const int64_t self = O + i0 + r, sv = self / 8 * 8;
        const int32_t sl = static_cast<int32_t>(self - sv);
        const v8i keep = lane != v8i{sl, sl, sl, sl, sl, sl, sl, sl};
        for (int64_t j = 0; j < g.NKp; j += 16) {
          v8f e0 = vexp2_bounded(load8(s + j)), e1 = vexp2_bounded(load8(s + j + 8));
          if (j == sv) e0 = and8(e0, keep);
          if (j + 8 == sv) e1 = and8(e1, keep);
          store8(s + j, e0);
          store8(s + j + 8, e1);
          a0 += e0;
          a1 += e1;
        }
      } else {
        const int32_t qp = qpos[r];
        const v8i q8 = v8i{qp, qp, qp, qp, qp, qp, qp, qp};
        for (int64_t j = 0; j < g.NKp; j += 8) {
          v8i kp, kv;
          std::memcpy(&kp, &t.kpos[j], sizeof(kp));
          std::memcpy(&kv, &t.kval[j], sizeof(kv));
          v8i ok = kv & (kp != q8);
          if (causal) ok = ok & (kp <= q8);
          const v8f e = and8(vexp2_bounded(load8(s + j)), ok);
          store8(s + j, e);
          a0 += e;
        }
      }
      red8[r] = a0 + a1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float x = red8[r][0];
    for (int l = 1; l < 8; ++l) x = EXP ? x + red8[r][l] : std::max(x, red8[r][l]);
    red[r] = x;
  }
}

template <bool EXP, bool SYM>
void score_block(const Geometry& g, const Tile& t, const float* const* qrow, const float* shift,
                 const float* qscale, bool causal, bool plain, float* S, float* G, float* red, RowPrefetcher& pf) {
  int64_t i = 0;
  for (; i + 6 <= g.bs; i += 6) {
    score_rows<6, EXP, SYM>(g, t, qrow + i, i, shift + i, qscale + i, causal, plain, S + i * g.NKp, G, red + i);
    pf.step(3);
  }
  for (; i + 4 <= g.bs; i += 4)
    score_rows<4, EXP, SYM>(g, t, qrow + i, i, shift + i, qscale + i, causal, plain, S + i * g.NKp, G, red + i);
  for (; i + 2 <= g.bs; i += 2)
    score_rows<2, EXP, SYM>(g, t, qrow + i, i, shift + i, qscale + i, causal, plain, S + i * g.NKp, G, red + i);
  for (; i < g.bs; ++i)
    score_rows<1, EXP, SYM>(g, t, qrow + i, i, shift + i, qscale + i, causal, plain, S + i * g.NKp, G, red + i);
}

// R rows of C (+)= A[R x k] Vp[k x n], Vp in panels of k x 16; C rows through pointers; any n. With rs,
// row r of the result is then multiplied by rs[r].
template <int R>
inline void gemm_rows_panel(const float* A, int64_t lda, const float* Vp, int64_t ldp, float* const* Crow,
                            int64_t n, int64_t k, bool accumulate, const float* rs) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const bool full = j0 + 16 <= n;
    v8f acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = splat8(0.0f);
      if (accumulate && full) {
        acc[r][0] = load8(Crow[r] + j0);
        acc[r][1] = load8(Crow[r] + j0 + 8);
      }
    }
    const float* b = Vp + j0 * ldp;
    for (int64_t p = 0; p < k; ++p) rank1_16<R>(acc, A + p, lda, load8(b + p * 16), load8(b + p * 16 + 8));
    for (int r = 0; r < R; ++r) {
      if (rs != nullptr && full) {
        const v8f f = splat8(rs[r]);
        acc[r][0] *= f;
        acc[r][1] *= f;
      }
      if (full) {
        store8(Crow[r] + j0, acc[r][0]);
        store8(Crow[r] + j0 + 8, acc[r][1]);
      } else {
        for (int64_t l = 0; j0 + l < n; ++l) {
          const float x = l < 8 ? acc[r][0][l] : acc[r][1][l - 8];
          const float y = accumulate ? Crow[r][j0 + l] + x : x;
          Crow[r][j0 + l] = rs != nullptr ? y * rs[r] : y;
        }
      }
    }
  }
}

void gemm_panel(const float* A, int64_t lda, const float* Vp, int64_t ldp, float* const* Crow, int64_t m,
                int64_t n, int64_t k, bool accumulate, const float* rs, RowPrefetcher& pf) {
  int64_t i = 0;
  for (; i + 6 <= m; i += 6) {
    gemm_rows_panel<6>(A + i * lda, lda, Vp, ldp, Crow + i, n, k, accumulate, rs ? rs + i : nullptr);
    pf.step(3);
  }
  for (; i + 4 <= m; i += 4) gemm_rows_panel<4>(A + i * lda, lda, Vp, ldp, Crow + i, n, k, accumulate, rs ? rs + i : nullptr);
  for (; i + 2 <= m; i += 2) gemm_rows_panel<2>(A + i * lda, lda, Vp, ldp, Crow + i, n, k, accumulate, rs ? rs + i : nullptr);
  for (; i < m; ++i) gemm_rows_panel<1>(A + i * lda, lda, Vp, ldp, Crow + i, n, k, accumulate, rs ? rs + i : nullptr);
}



// One thread walks every chunk of a head and adds each round into the output at once. Every score of
// query i is at most |q_i| * scale (the keys are unit vectors), so exp(s - |q_i| * scale) cannot overflow
// and, while |q_i| * scale <= kShiftLimit, cannot underflow either: one shift serves every round, and
// combining the rounds is a plain sum of P V and of the row sums, divided once at the end. A chunk with
// a query above the limit takes that query's row max per round and rescales what it has accumulated
// (an online softmax over rounds), so no input loses precision. No per-slot buffers.
constexpr float kShiftLimit = 40.0f;  // exp(-2 * 40) is far above fp32's smallest normal

void fwd_per_head(const Geometry& g, const float* qp, const float* vp, const int64_t* pp, const bool* mp,
                  bool causal, float* outp, float* lsep) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t per_round = g.Lp / g.bs;
  fastarch::run_tasks(g.B * g.H, [&](int64_t begin, int64_t end) {
    Tile t(g, false, false);
    t.use_panels(g);
    std::vector<float> P(g.bs * g.NKp), red(g.bs), shift(g.bs), qscale(g.bs), rz(g.bs), G(g.bs * g.bs), scratch(g.Dp);
    std::vector<float> zsum(g.L), crun(g.L);
    std::vector<const float*> qrow(g.bs);
    std::vector<float*> orow(g.bs);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / g.H, off = bh * g.L * g.D;
      const float* q = qp + off;
      const float* v = vp + off;
      float* out = outp + off;
      const int64_t* perm = pp + bh * g.S;
      std::fill(crun.begin(), crun.end(), ninf);
      for (int64_t c = 0; c < g.C; ++c) {
        t.load(g, q, v, perm, mp ? mp + b * g.L : nullptr, bh, c);
        RowPrefetcher pf;  // the next chunk's rows, spread over this one's GEMMs
        if (c + 1 < g.C) {
          pf.q = q;
          pf.v = v;
          pf.out = out;
          pf.perm = perm + (c + 1) * g.bs;
          pf.n = g.bs;
          pf.L = g.L;
          pf.D = g.D;
        }
        const bool first = c < per_round;  // round 0 writes each position's output row, later rounds add
        // no padding, key mask or causal mask, and chunk c-1 from the same round (distinct positions): the
        // only masked score of a query is its own column
        bool plain = !causal && mp == nullptr && g.NK == g.NKp && c % per_round != 0;
        bool large = false;
        for (int64_t i = 0; i < g.bs; ++i) {
          const int64_t p = t.qpos[i];
          const bool real = p < g.L;
          qrow[i] = real ? q + p * g.D : t.zero.data();
          orow[i] = real ? out + p * g.D : scratch.data();
          if (real && c == 0) prefetch_row(orow[i], g.D, true);  // later chunks: by the previous chunk's pf
          plain &= real;
          shift[i] = real ? g.scale * t.knorm[t.own * g.bs + i] : 0.0f;
          qscale[i] = shift[i];  // |q_i| * scale: the own-key scores from the unit Gram matrix
          large |= !(shift[i] <= kShiftLimit);  // NaN too
        }
        if (!large) {
          if (g.bs % 16 == 0)
            score_block<true, true>(g, t, qrow.data(), shift.data(), qscale.data(), causal, plain, P.data(), G.data(),
                                    red.data(), pf);
          else
            score_block<true, false>(g, t, qrow.data(), shift.data(), qscale.data(), causal, plain, P.data(), G.data(),
                                     red.data(), pf);
          for (int64_t i = 0; i < g.bs; ++i) {
            const int64_t p = t.qpos[i];
            if (p >= g.L) continue;
            crun[p] = shift[i];
            zsum[p] = first ? red[i] : zsum[p] + red[i];
          }
        } else {
          score_block<false, false>(g, t, qrow.data(), shift.data(), qscale.data(), causal, plain, P.data(), G.data(),
                                    red.data(), pf);
          for (int64_t i = 0; i < g.bs; ++i) {
            const int64_t p = t.qpos[i];
            float* s = &P[i * g.NKp];
            if (p >= g.L || red[i] == ninf) {  // dropped, or no valid key but itself this round
              std::fill(s, s + g.NKp, 0.0f);
              if (p < g.L && first) zsum[p] = 0.0f;
              if (p < g.L && shift[i] <= kShiftLimit) crun[p] = shift[i];
              continue;
            }
            float cs = shift[i];
            if (!(cs <= kShiftLimit)) {
              cs = std::max(crun[p], red[i]);
              if (!first && crun[p] != ninf && cs > crun[p]) {
                const float f = std::exp(crun[p] - cs);
                for (int64_t d = 0; d < g.D; ++d) orow[i][d] *= f;
                zsum[p] *= f;
              }
            }
            crun[p] = cs;
            v8f a8 = splat8(0.0f);
            const v8f c8 = splat8(cs);
            for (int64_t j = 0; j < g.NKp; j += 8) {
              const v8f e = vexp_nonpos(load8(s + j) - c8);  // masked: -inf -> 0
              store8(s + j, e);
              a8 += e;
            }
            float sum = 0.0f;
            for (int l = 0; l < 8; ++l) sum += a8[l];
            zsum[p] = first ? sum : zsum[p] + sum;
          }
        }
        // the last round holds every position once: normalise its output rows as P V is added
        const bool last = c >= (g.NH - 1) * per_round;
        if (last)
          for (int64_t i = 0; i < g.bs; ++i) {
            const int64_t p = t.qpos[i];
            if (p >= g.L) {
              rz[i] = 0.0f;
              continue;
            }
            rz[i] = zsum[p] == 0.0f ? 0.0f : 1.0f / zsum[p];
            lsep[bh * g.L + p] = zsum[p] == 0.0f ? ninf : crun[p] + std::log(zsum[p]);
          }
        gemm_panel(P.data(), g.NKp, t.Vp.data(), g.NKp, orow.data(), g.bs, g.D, g.NK, !first,
                   last ? rz.data() : nullptr, pf);
        pf.step(g.bs);  // whatever the row blocks left
        if (last)
          for (int64_t i = 0; i < g.bs; ++i) {
            const int64_t p = t.qpos[i];
            if (p < g.L && zsum[p] == 0.0f)  // every round fell back to the query itself
              std::memcpy(orow[i], v + p * g.D, sizeof(float) * g.D);
          }
      }
    }
  });
}

}  // namespace

// (out, lse): out (B, H, L, D), lse (B, H, L) of the combined rounds (-inf where every round was empty).
std::vector<at::Tensor> lsh_fwd(const at::Tensor& q, const at::Tensor& v, const at::Tensor& perm,
                                const at::Tensor& inv, const c10::optional<at::Tensor>& kpm, bool causal,
                                int64_t bucket_size) {
  check_inputs(q, v, perm, inv, kpm, bucket_size);
  const Geometry g = geometry(q, perm, inv, bucket_size);
  const int64_t BH = g.B * g.H;
  if (BH >= at::get_num_threads()) {
    auto out = at::empty_like(q);
    auto lse = at::empty({g.B, g.H, g.L}, q.options());
    fwd_per_head(g, q.data_ptr<float>(), v.data_ptr<float>(), perm.data_ptr<int64_t>(),
                 kpm.has_value() ? kpm->data_ptr<bool>() : nullptr, causal, out.data_ptr<float>(),
                 lse.data_ptr<float>());
    return {out, lse};
  }
  auto o_s = at::empty({BH, g.S, g.D}, q.options());
  auto lse_s = at::empty({BH, g.S}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  const bool* mp = kpm.has_value() ? kpm->data_ptr<bool>() : nullptr;
  float* op = o_s.data_ptr<float>();
  float* lp = lse_s.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();

  fastarch::parallel_for(0, BH * g.C, 1, [&](int64_t begin, int64_t end) {
    Tile t(g);
    std::vector<float> Ob(g.bsp * g.Dp), rinv(g.bsp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / g.C, c = task % g.C, b = bh / g.H;
      const int64_t off = bh * g.L * g.D;
      t.load(g, qp + off, vp + off, pp + bh * g.S, mp ? mp + b * g.L : nullptr, bh, c);
      gemm_nn(t.Qb.data(), g.Dp, t.Kt.data(), g.NKp, t.Sb.data(), g.NKp, g.bsp, g.NKp, g.D, false);
      for (int64_t i = 0; i < g.bsp; ++i) {
        const float mx = t.mask_row(g, i, causal);
        float* s = &t.Sb[i * g.NKp];
        float sum = 0.0f;
        if (mx == ninf) {
          std::fill(s, s + g.NKp, 0.0f);
        } else {
          v8f acc = splat8(0.0f);
          const v8f m8 = splat8(mx);
          for (int64_t j = 0; j < g.NKp; j += 8) {
            const v8f e = vexp_nonpos(load8(s + j) - m8);
            store8(s + j, e);
            acc += e;
          }
          for (int l = 0; l < 8; ++l) sum += acc[l];
        }
        if (i < g.bs) lp[bh * g.S + c * g.bs + i] = mx == ninf ? ninf : mx + std::log(sum);
        rinv[i] = mx == ninf ? 0.0f : 1.0f / sum;  // applied to O rather than to every P entry
      }
      gemm_nn(t.Sb.data(), g.NKp, t.Vb.data(), g.Dp, Ob.data(), g.Dp, g.bsp, g.Dp, g.NKp, false);
      for (int64_t i = 0; i < g.bs; ++i) {
        float* dst = op + (bh * g.S + c * g.bs + i) * g.D;
        const float* src = &Ob[i * g.Dp];
        for (int64_t d = 0; d < g.D; ++d) dst[d] = src[d] * rinv[i];
      }
    }
  });

  // Combine the rounds per real position.
  auto out = at::empty_like(q);
  auto lse = at::empty({g.B, g.H, g.L}, q.options());
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t* ip = inv.data_ptr<int64_t>();
  fastarch::parallel_for(0, BH * g.L, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> w(g.NH);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t bh = idx / g.L, i = idx % g.L;
      const int64_t* slots = ip + (bh * g.NH) * g.L + i;
      float mx = ninf;
      for (int64_t r = 0; r < g.NH; ++r) mx = std::max(mx, lp[bh * g.S + slots[r * g.L]]);
      float* o = outp + idx * g.D;
      if (mx == ninf) {
        std::memcpy(o, vp + idx * g.D, sizeof(float) * g.D);
        lsep[idx] = ninf;
        continue;
      }
      float z = 0.0f;
      for (int64_t r = 0; r < g.NH; ++r) {
        w[r] = std::exp(lp[bh * g.S + slots[r * g.L]] - mx);
        z += w[r];
      }
      std::fill(o, o + g.D, 0.0f);
      for (int64_t r = 0; r < g.NH; ++r) {
        const float wr = w[r] / z;
        if (wr == 0.0f) continue;
        const float* orow = op + (bh * g.S + slots[r * g.L]) * g.D;
        for (int64_t d = 0; d < g.D; ++d) o[d] += wr * orow[d];
      }
      lsep[idx] = mx + std::log(z);
    }
  });
  return {out, lse};
}

std::vector<at::Tensor> lsh_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                const at::Tensor& perm, const at::Tensor& inv,
                                const c10::optional<at::Tensor>& kpm, bool causal, int64_t bucket_size) {
  check_inputs(q, v, perm, inv, kpm, bucket_size);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == at::kFloat && dout.is_contiguous(),
              "lsh_attention (cpp): dout must be contiguous fp32 like q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "lsh_attention (cpp): out must be contiguous fp32 like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == q.numel() / q.size(3),
              "lsh_attention (cpp): lse must be contiguous fp32 (B, H, L)");
  const Geometry g = geometry(q, perm, inv, bucket_size);
  const int64_t BH = g.B * g.H;
  // delta_i = g_i . out_i
  auto delta = (dout * out).sum(-1).contiguous();
  auto dq_s = at::empty({BH, g.S, g.D}, q.options());
  auto dk_own = at::empty({BH, g.S, g.D}, q.options());
  auto dk_prev = at::empty({BH, g.S, g.D}, q.options());
  auto dv_own = at::empty({BH, g.S, g.D}, q.options());
  auto dv_prev = at::empty({BH, g.S, g.D}, q.options());
  const float* gp = dout.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* lsep = lse.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const int64_t* pp = perm.data_ptr<int64_t>();
  const bool* mp = kpm.has_value() ? kpm->data_ptr<bool>() : nullptr;
  float* dqs = dq_s.data_ptr<float>();
  float* dko = dk_own.data_ptr<float>();
  float* dkp = dk_prev.data_ptr<float>();
  float* dvo = dv_own.data_ptr<float>();
  float* dvp = dv_prev.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();

  fastarch::parallel_for(0, BH * g.C, 1, [&](int64_t begin, int64_t end) {
    Tile t(g);
    std::vector<float> Gb(g.bsp * g.Dp), Vt(g.Dp * g.NKp), Kb(g.NKp * g.Dp), dP(g.bsp * g.NKp);
    std::vector<float> T(g.NKp * g.bsp), Ob(g.NKp * g.Dp);
    std::vector<float> lq(g.bsp), dq(g.bsp);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / g.C, c = task % g.C, b = bh / g.H;
      const int64_t cprev = (c + g.C - 1) % g.C;
      const int64_t off = bh * g.L * g.D;
      t.load(g, qp + off, vp + off, pp + bh * g.S, mp ? mp + b * g.L : nullptr, bh, c);
      std::fill(Gb.begin(), Gb.end(), 0.0f);
      for (int64_t i = 0; i < g.bsp; ++i) {
        const int64_t p = t.qpos[i];
        const bool real = i < g.bs && p < g.L;
        lq[i] = real ? lsep[bh * g.L + p] : ninf;
        dq[i] = real ? dp[bh * g.L + p] : 0.0f;
        if (real) std::memcpy(&Gb[i * g.Dp], gp + off + p * g.D, sizeof(float) * g.D);
      }
      transpose(t.Vb.data(), g.Dp, Vt.data(), g.NKp, g.NKp, g.Dp);
      transpose(t.Kt.data(), g.NKp, Kb.data(), g.Dp, g.Dp, g.NKp);
      gemm_nn(t.Qb.data(), g.Dp, t.Kt.data(), g.NKp, t.Sb.data(), g.NKp, g.bsp, g.NKp, g.D, false);
      gemm_nn(Gb.data(), g.Dp, Vt.data(), g.NKp, dP.data(), g.NKp, g.bsp, g.NKp, g.D, false);
      for (int64_t i = 0; i < g.bsp; ++i) {
        const float mx = t.mask_row(g, i, causal);
        float* s = &t.Sb[i * g.NKp];
        float* dpr = &dP[i * g.NKp];
        if (mx == ninf || lq[i] == ninf) {
          std::fill(s, s + g.NKp, 0.0f);
          std::fill(dpr, dpr + g.NKp, 0.0f);
          continue;
        }
        const v8f l8 = splat8(lq[i]), d8 = splat8(dq[i]), sc = splat8(g.scale);
        for (int64_t j = 0; j < g.NKp; j += 8) {
          // s - LSE <= 0 up to rounding; clamp so the exp stays in its domain
          v8f x = load8(s + j) - l8;
          x = x < splat8(0.0f) ? x : splat8(0.0f);
          const v8f p = vexp_nonpos(x);
          store8(s + j, p);                                   // P
          store8(dpr + j, p * (load8(dpr + j) - d8) * sc);   // dS (scaled)
        }
      }
      // dQ = dS K  (slots of this chunk)
      gemm_nn(dP.data(), g.NKp, Kb.data(), g.Dp, Ob.data(), g.Dp, g.bsp, g.Dp, g.NKp, false);
      for (int64_t i = 0; i < g.bs; ++i)
        std::memcpy(dqs + (bh * g.S + c * g.bs + i) * g.D, &Ob[i * g.Dp], sizeof(float) * g.D);
      // dK = dS^T Q ; dV = P^T G   (key half t.own -> chunk c, the other half -> chunk c-1)
      transpose(dP.data(), g.NKp, T.data(), g.bsp, g.bsp, g.NKp);
      gemm_nn(T.data(), g.bsp, t.Qb.data(), g.Dp, Ob.data(), g.Dp, g.NKp, g.Dp, g.bsp, false);
      for (int64_t j = 0; j < g.NK; ++j) {
        const int64_t jj = j % g.bs;
        float* dst = j / g.bs != t.own ? dkp + (bh * g.S + cprev * g.bs + jj) * g.D
                                       : dko + (bh * g.S + c * g.bs + jj) * g.D;
        std::memcpy(dst, &Ob[j * g.Dp], sizeof(float) * g.D);
      }
      transpose(t.Sb.data(), g.NKp, T.data(), g.bsp, g.bsp, g.NKp);
      gemm_nn(T.data(), g.bsp, Gb.data(), g.Dp, Ob.data(), g.Dp, g.NKp, g.Dp, g.bsp, false);
      for (int64_t j = 0; j < g.NK; ++j) {
        const int64_t jj = j % g.bs;
        float* dst = j / g.bs != t.own ? dvp + (bh * g.S + cprev * g.bs + jj) * g.D
                                       : dvo + (bh * g.S + c * g.bs + jj) * g.D;
        std::memcpy(dst, &Ob[j * g.Dp], sizeof(float) * g.D);
      }
    }
  });

  // Sum every real position's slots over the rounds.
  auto dqo = at::empty_like(q);
  auto dkno = at::empty_like(q);
  auto dvout = at::empty_like(q);
  float* dqop = dqo.data_ptr<float>();
  float* dknp = dkno.data_ptr<float>();
  float* dvop = dvout.data_ptr<float>();
  const int64_t* ip = inv.data_ptr<int64_t>();
  fastarch::parallel_for(0, BH * g.L, 256, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t bh = idx / g.L, i = idx % g.L;
      const int64_t* slots = ip + (bh * g.NH) * g.L + i;
      float* a = dqop + idx * g.D;
      float* k = dknp + idx * g.D;
      float* w = dvop + idx * g.D;
      std::fill(a, a + g.D, 0.0f);
      std::fill(k, k + g.D, 0.0f);
      // every round fell back to the query's own value: out_i = v_i
      if (lsep[idx] == ninf) std::memcpy(w, gp + idx * g.D, sizeof(float) * g.D);
      else std::fill(w, w + g.D, 0.0f);
      for (int64_t r = 0; r < g.NH; ++r) {
        const int64_t base = (bh * g.S + slots[r * g.L]) * g.D;
        for (int64_t d = 0; d < g.D; ++d) {
          a[d] += dqs[base + d];
          k[d] += dko[base + d] + dkp[base + d];
          w[d] += dvo[base + d] + dvp[base + d];
        }
      }
    }
  });
  return {dqo, dkno, dvout};
}

// Stable counting sort of every round by bucket, after padding to Lp with bucket n_buckets.
// buckets (B, H, NH, L) int64 in [0, n_buckets) -> perm (B, H, NH * Lp), inv (B, H, NH, L).
std::vector<at::Tensor> lsh_sort(const at::Tensor& buckets, int64_t bucket_size, int64_t n_buckets) {
  TORCH_CHECK(buckets.scalar_type() == at::kLong && buckets.is_contiguous() && buckets.dim() == 4,
              "lsh_attention (cpp): buckets must be contiguous int64 (B, H, NH, L)");
  const int64_t B = buckets.size(0), H = buckets.size(1), NH = buckets.size(2), L = buckets.size(3);
  const int64_t Lp = round_up(L, bucket_size);
  auto perm = at::empty({B, H, NH * Lp}, buckets.options());
  auto inv = at::empty({B, H, NH, L}, buckets.options());
  const int64_t* bp = buckets.data_ptr<int64_t>();
  int64_t* pp = perm.data_ptr<int64_t>();
  int64_t* ip = inv.data_ptr<int64_t>();
  // rows of a few thousand elements are not worth waking threads for
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(L, 1));
  fastarch::parallel_for(0, B * H * NH, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> start(n_buckets + 2);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t* bk = bp + row * L;
      const int64_t r = row % NH;
      int64_t* pr = pp + row * Lp;  // (B, H, NH*Lp) rows of Lp per round line up with (B, H, NH)
      int64_t* ir = ip + row * L;
      std::fill(start.begin(), start.end(), 0);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t b = bk[i];
        TORCH_CHECK(b >= 0 && b < n_buckets, "lsh_attention (cpp): bucket id out of range");
        ++start[b + 1];
      }
      for (int64_t b = 0; b < n_buckets; ++b) start[b + 1] += start[b];
      for (int64_t i = 0; i < L; ++i) {
        const int64_t s = start[bk[i]]++;
        pr[s] = i;
        ir[i] = r * Lp + s;
      }
      for (int64_t i = L; i < Lp; ++i) pr[i] = i;  // padding: bucket n_buckets, after every real one
    }
  });
  return {perm, inv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lsh_hash", &lsh_hash, "buckets (B, H, NH, L): argmax(concat[xR, -xR]) per round", py::arg("qk"),
        py::arg("rot"), py::arg("generic") = false);
  m.def("lsh_sort", &lsh_sort, "stable counting sort of the hash rounds: (perm, inv)");
  m.def("lsh_attention_fwd", &lsh_fwd, "LSH attention forward: (out, lse)");
  m.def("lsh_attention_bwd", &lsh_bwd, "LSH attention backward: (dq, dkn, dv)");
}
