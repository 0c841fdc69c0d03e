// Mamba's selective scan on CPU (forward and backward) and its decode step (selective_state_update) at the
// end of the file. The causal conv1d that precedes it is csrc/cpu/causal_conv1d.cpp.
//
// Layout the Python glue hands us (all fp32, contiguous):
//   u, delta, z, out: (batch, D, L)     A: (D, N)     D, delta_bias: (D,)
//   B, C: constant (D, N) when groups == 0, else (batch, G, L, N) -- time-major so one step's N values are
//         contiguous; channel d reads group d / (D / G).
//   ckpt: (batch, D, n_chunks, N), the state entering each chunk of `chunk` steps.
//
// Vectorisation: a task owns a block of W=16 channels that share the same B/C group. The state of the
// block lives as h[n][c] (N x 16 floats, L1-resident); every time step loops over n, and each n is one
// 16-lane vector (Lanes: one AVX-512 register, two AVX2 registers, or a plain loop elsewhere): exp, the
// recurrence and the C-contraction are all lane-parallel, a variable B_t[n] / C_t[n] is one broadcast, and y
// needs no horizontal sum. The decay exp(delta A) is fastarch::fast_exp's polynomial on whole registers.
// Per chunk, delta, u and z enter lane-major through 8x8 transposes, softplus and the output gate run on
// whole lane vectors, and the output leaves through the inverse transpose.
//
// Backward: the forward stores the state only at chunk boundaries. Walking the chunks from last to first,
// each is re-run forward from its checkpoint (states and decay factors kept for that chunk only, chunk x N
// x 16 floats), then walked backward. Variable dB/dC get contributions from every channel of their group;
// each (batch, segment, slice) task writes its own partial row, summed afterwards (memory batch*L*N*slices,
// no D factor).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fastarch_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include "fastarch_parallel.h"
#endif

namespace {

using fastarch::fast_exp;
using fastarch::sigmoid_f;
using fastarch::softplus_f;

constexpr int W = 16;

// One register of AVX-512 (V16) or AVX2 (V8), with the few operations the recurrence needs.
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }  // b where either is NaN
  friend V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend V16 fnma(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
  friend V16 times_pow2(V16 p, V16 k) { return {_mm512_scalef_ps(p.v, k.v)}; }  // p 2^k, k integral
};
#define FASTARCH_SCAN_VEC V16
#elif defined(__AVX2__) && defined(__FMA__)
struct V8 {
  __m256 v;
  static V8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static V8 bcast(float x) { return {_mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend V8 operator*(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend V8 operator+(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend V8 operator-(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend V8 min(V8 a, V8 b) { return {_mm256_min_ps(a.v, b.v)}; }  // b where either is NaN
  friend V8 max(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend V8 fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend V8 fnma(V8 a, V8 b, V8 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
  friend V8 times_pow2(V8 p, V8 k) {  // p 2^k, k integral in [-126, 127]
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(e))};
  }
};
#define FASTARCH_SCAN_VEC V8
#endif

#ifdef FASTARCH_SCAN_VEC
// fastarch::fast_exp on a register, operation for operation, so the results are the same bits.
template <class V>
V vec_exp(V a) {
  using namespace fastarch::exp_poly;
  const V x = min(V::bcast(HI), max(V::bcast(LO), a));  // a NaN stays NaN
  const V k = fma(x, V::bcast(LOG2E), V::bcast(ROUND_MAGIC)) - V::bcast(ROUND_MAGIC);
  V r = fnma(k, V::bcast(LN2_HI), x);
  r = fma(k, V::bcast(LN2_LO), r);
  V p = fma(V::bcast(P[0]), r, V::bcast(P[1]));
  for (int i = 2; i < 6; ++i) p = fma(p, r, V::bcast(P[i]));
  p = fma(p * r, r, r) + V::bcast(1.f);
  return times_pow2(p, k);
}

// Lanes: W floats, one per channel of a block, as W / (floats per register) registers.
struct Lanes {
  static constexpr int R = W / static_cast<int>(sizeof(FASTARCH_SCAN_VEC) / sizeof(float));
  FASTARCH_SCAN_VEC v[R];
  template <class F>
  static Lanes map(F f) {
    Lanes out;
    for (int i = 0; i < R; ++i) out.v[i] = f(i);
    return out;
  }
  static Lanes load(const float* p) { return map([&](int i) { return FASTARCH_SCAN_VEC::load(p + i * W / R); }); }
  static Lanes bcast(float x) { return map([&](int) { return FASTARCH_SCAN_VEC::bcast(x); }); }
  static Lanes zero() { return bcast(0.f); }
  void store(float* p) const {
    for (int i = 0; i < R; ++i) v[i].store(p + i * W / R);
  }
  friend Lanes operator*(Lanes a, Lanes b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
  friend Lanes fma(Lanes a, Lanes b, Lanes c) { return map([&](int i) { return fma(a.v[i], b.v[i], c.v[i]); }); }
  friend Lanes exp(Lanes a) { return map([&](int i) { return vec_exp(a.v[i]); }); }
};
#else
// A plain loop over the lanes elsewhere (the compiler vectorises it for the target).
struct Lanes {
  float v[W];
  template <class F>
  static Lanes map(F f) {
    Lanes r;
#pragma omp simd
    for (int i = 0; i < W; ++i) r.v[i] = f(i);
    return r;
  }
  static Lanes load(const float* p) { return map([&](int i) { return p[i]; }); }
  static Lanes bcast(float x) { return map([&](int) { return x; }); }
  static Lanes zero() { return bcast(0.f); }
  void store(float* p) const {
#pragma omp simd
    for (int i = 0; i < W; ++i) p[i] = v[i];
  }
  friend Lanes operator*(Lanes a, Lanes b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
  friend Lanes fma(Lanes a, Lanes b, Lanes c) { return map([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
  friend Lanes exp(Lanes a) { return map([&](int i) { return fast_exp(a.v[i]); }); }
};
#endif

struct Scan {
  const float* u;
  const float* delta;
  const float* A;
  const float* B;
  const float* C;
  const float* Dp;
  const float* z;
  const float* bias;
  int64_t gB, gC;  // 0 = constant (D, N)
  bool softplus;
  int64_t batch, dim, L, N, chunk, nck;
  int64_t seg, nseg, nblk;  // channels per segment (one B group and one C group), segments, blocks/segment
};

Scan make_scan(const torch::Tensor& u, const torch::Tensor& delta, const torch::Tensor& A, const torch::Tensor& B,
               int64_t gB, const torch::Tensor& C, int64_t gC, const c10::optional<torch::Tensor>& Dp,
               const c10::optional<torch::Tensor>& z, const c10::optional<torch::Tensor>& bias, bool softplus,
               int64_t chunk) {
  Scan s;
  s.u = u.data_ptr<float>();
  s.delta = delta.data_ptr<float>();
  s.A = A.data_ptr<float>();
  s.B = B.data_ptr<float>();
  s.C = C.data_ptr<float>();
  s.Dp = Dp ? Dp->data_ptr<float>() : nullptr;
  s.z = z ? z->data_ptr<float>() : nullptr;
  s.bias = bias ? bias->data_ptr<float>() : nullptr;
  s.gB = gB;
  s.gC = gC;
  s.softplus = softplus;
  s.batch = u.size(0);
  s.dim = u.size(1);
  s.L = u.size(2);
  s.N = A.size(1);
  s.chunk = chunk;
  s.nck = (s.L + chunk - 1) / chunk;
  int64_t seg = s.dim;
  if (gB) seg = std::gcd(seg, s.dim / gB);
  if (gC) seg = std::gcd(seg, s.dim / gC);
  s.seg = seg;
  s.nseg = s.dim / seg;
  s.nblk = (seg + W - 1) / W;
  return s;
}

// Per-block constants: A (and constant B/C) transposed to [n][lane], zero in unused lanes.
void load_lanes(const float* src, int64_t d0, int nc, int64_t N, float* dst) {
  for (int64_t n = 0; n < N; ++n)
    for (int c = 0; c < W; ++c) dst[n * W + c] = c < nc ? src[(d0 + c) * N + n] : 0.f;
}

#if defined(__AVX2__)
// In-register transpose of an 8x8 block: rows r[0..7] become columns.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: in 8x8 register blocks where AVX2 is there,
// eight source rows at a time over all columns (rows far apart share cache sets).
void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows, int64_t cols) {
  int64_t i0 = 0;
#if defined(__AVX2__)
  const int64_t cv = cols / 8 * 8;
  for (; i0 + 8 <= rows; i0 += 8) {
    for (int64_t j0 = 0; j0 < cv; j0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (i0 + i) * lds + j0);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (j0 + j) * ldd + i0, r[j]);
    }
    for (int64_t i = i0; i < i0 + 8; ++i)
      for (int64_t j = cv; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
#endif
  for (int64_t i = i0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// Rows of a channel-major tensor into lane-major form: dst[t][lane] = src[lane * ld + t] for lane < nc (other
// lanes 0), t < tl.
void rows_to_lanes(const float* src, int64_t ld, int nc, int64_t tl, float* dst) {
  if (nc < W) std::fill(dst, dst + tl * W, 0.f);
  transpose(src, ld, dst, W, nc, tl);
}

// The inverse: dst[lane * ld + t] = src[t][lane] for lane < nc, t < tl.
void lanes_to_rows(const float* src, int nc, int64_t tl, float* dst, int64_t ld) {
  transpose(src, W, dst, ld, tl, nc);
}

// dt (after bias and softplus), u and, for the backward, the softplus derivative, for one chunk, [t][lane].
// biasl: delta_bias per lane (zeros without one).
void load_chunk(const Scan& s, int64_t b, int64_t d0, int nc, int64_t t0, int64_t tl, const float* biasl,
                float* dtb, float* ub, float* dsp) {
  const int64_t row = (b * s.dim + d0) * s.L + t0;
  rows_to_lanes(s.delta + row, s.L, nc, tl, dtb);
  rows_to_lanes(s.u + row, s.L, nc, tl, ub);
  for (int64_t t = 0; t < tl; ++t) {
    float* dt = dtb + t * W;
    float* ds = dsp ? dsp + t * W : nullptr;
    // Separate loops per case so each vectorises (softplus/sigmoid are branch-free polynomials).
    if (s.softplus) {
      if (ds) {
#pragma omp simd
        for (int c = 0; c < W; ++c) ds[c] = sigmoid_f(dt[c] + biasl[c]);
      }
#pragma omp simd
      for (int c = 0; c < W; ++c) dt[c] = softplus_f(dt[c] + biasl[c]);
    } else {
#pragma omp simd
      for (int c = 0; c < W; ++c) dt[c] += biasl[c];
      if (ds)
        for (int c = 0; c < W; ++c) ds[c] = 1.f;
    }
  }
}

// One chunk of the recurrence for a block (Al: A as [n][lane]). Writes y[t][lane]; when hs/es are
// given also every state (hs[(t+1)][n][lane], hs[0] = entry state) and decay factor (es[t][n][lane]) for the
// backward. pf: cache lines of the next chunk's inputs, prefetched a few per step (a burst of them would stall
// on the miss buffers).
template <bool VB, bool VC>
void run_chunk(const Scan& s, const float* Bbase, const float* Cbase, int64_t t0, int64_t tl, const float* Al,
               const float* Bl, const float* Cl, const float* dtb, const float* ub, float* h, float* yb, float* hs,
               float* es, const std::vector<const float*>& pf) {
  const int64_t N = s.N;
  const int64_t npf = static_cast<int64_t>(pf.size());
  for (int64_t t = 0; t < tl; ++t) {
    for (int64_t i = t * npf / tl; i < (t + 1) * npf / tl; ++i) __builtin_prefetch(pf[i]);
    const Lanes dt = Lanes::load(dtb + t * W);
    const Lanes dtu = dt * Lanes::load(ub + t * W);
    Lanes y = Lanes::zero();
    const float* Bt = VB ? Bbase + (t0 + t) * N : nullptr;
    const float* Ct = VC ? Cbase + (t0 + t) * N : nullptr;
    float* hout = hs ? hs + (t + 1) * N * W : h;
    for (int64_t n = 0; n < N; ++n) {
      const Lanes dA = exp(dt * Lanes::load(Al + n * W));
      const Lanes bx = dtu * (VB ? Lanes::bcast(Bt[n]) : Lanes::load(Bl + n * W));
      const Lanes hv = fma(dA, Lanes::load(h + n * W), bx);
      hv.store(hout + n * W);
      y = fma(hv, VC ? Lanes::bcast(Ct[n]) : Lanes::load(Cl + n * W), y);
      if (es) dA.store(es + (t * N + n) * W);
    }
    if (hs) h = hout;  // the next step reads the state just written
    y.store(yb + t * W);
  }
}

// Cache lines of rows [t0, t0 + tl) of a block's channels in the (batch, D, L) tensors read per chunk.
void chunk_lines(const Scan& s, int64_t b, int64_t d0, int nc, int64_t t0, int64_t tl,
                 std::initializer_list<const float*> tensors, std::vector<const float*>& lines) {
  lines.clear();
  for (const float* p : tensors)
    if (p)
      for (int c = 0; c < nc; ++c)
        for (int64_t t = 0; t < tl; t += 16) lines.push_back(p + (b * s.dim + d0 + c) * s.L + t0 + t);
}

template <bool VB, bool VC>
void fwd_task(const Scan& s, int64_t task, float* out, float* last, float* ckpt) {
  const int64_t N = s.N;
  const int64_t blk = task % s.nblk;
  const int64_t sg = (task / s.nblk) % s.nseg;
  const int64_t b = task / (s.nblk * s.nseg);
  const int64_t d0 = sg * s.seg + blk * W;
  const int nc = static_cast<int>(std::min<int64_t>(W, s.seg - blk * W));
  std::vector<float> Al(N * W), Bl(VB ? 0 : N * W), Cl(VC ? 0 : N * W), h(N * W, 0.f);
  std::vector<float> dtb(s.chunk * W), ub(s.chunk * W), yb(s.chunk * W), zb(s.z ? s.chunk * W : 0);
  std::vector<const float*> pf;
  float biasl[W], Dl[W];
  for (int c = 0; c < W; ++c) {
    biasl[c] = s.bias && c < nc ? s.bias[d0 + c] : 0.f;
    Dl[c] = s.Dp && c < nc ? s.Dp[d0 + c] : 0.f;
  }
  load_lanes(s.A, d0, nc, N, Al.data());
  if (!VB) load_lanes(s.B, d0, nc, N, Bl.data());
  if (!VC) load_lanes(s.C, d0, nc, N, Cl.data());
  const float* Bbase = VB ? s.B + (b * s.gB + d0 / (s.dim / s.gB)) * s.L * N : nullptr;
  const float* Cbase = VC ? s.C + (b * s.gC + d0 / (s.dim / s.gC)) * s.L * N : nullptr;
  for (int64_t k = 0; k < s.nck; ++k) {
    const int64_t t0 = k * s.chunk, tl = std::min(s.chunk, s.L - t0);
    if (ckpt)
      for (int c = 0; c < nc; ++c)
        for (int64_t n = 0; n < N; ++n) ckpt[((b * s.dim + d0 + c) * s.nck + k) * N + n] = h[n * W + c];
    load_chunk(s, b, d0, nc, t0, tl, biasl, dtb.data(), ub.data(), nullptr);
    pf.clear();
    if (k + 1 < s.nck) chunk_lines(s, b, d0, nc, t0 + tl, std::min(s.chunk, s.L - t0 - tl), {s.delta, s.u, s.z}, pf);
    run_chunk<VB, VC>(s, Bbase, Cbase, t0, tl, Al.data(), Bl.data(), Cl.data(), dtb.data(), ub.data(), h.data(),
                      yb.data(), nullptr, nullptr, pf);
    // out = (y + D u) * silu(z), lane-major, then back to rows.
    const int64_t row = (b * s.dim + d0) * s.L + t0;
    if (s.z) rows_to_lanes(s.z + row, s.L, nc, tl, zb.data());
    for (int64_t t = 0; t < tl; ++t) {
      float* y = yb.data() + t * W;
      const float* uu = ub.data() + t * W;
      if (s.z) {
        const float* zz = zb.data() + t * W;
#pragma omp simd
        for (int c = 0; c < W; ++c) y[c] = (y[c] + Dl[c] * uu[c]) * zz[c] * sigmoid_f(zz[c]);
      } else {
#pragma omp simd
        for (int c = 0; c < W; ++c) y[c] += Dl[c] * uu[c];
      }
    }
    lanes_to_rows(yb.data(), nc, tl, out + row, s.L);
  }
  for (int c = 0; c < nc; ++c)
    for (int64_t n = 0; n < N; ++n) last[(b * s.dim + d0 + c) * N + n] = h[n * W + c];
}

template <bool VB, bool VC>
void bwd_task(const Scan& s, int64_t b, int64_t sg, int64_t slice, int64_t nslice, const float* dout,
              const float* dlast, const float* ckpt, float* du, float* ddelta, float* dz, float* dA, float* dBc,
              float* dCc, float* dBpart, float* dCpart, float* dD, float* dbias) {
  const int64_t N = s.N, NW = N * W, T = s.chunk;
  std::vector<float> Al(NW), Bl(VB ? 0 : NW), Cl(VC ? 0 : NW), dh(NW);
  std::vector<float> hs((T + 1) * NW), es(T * NW);
  std::vector<const float*> pf;
  std::vector<float> dtb(T * W), ub(T * W), dsp(T * W), yb(T * W), gb(T * W), dub(T * W), ddb(T * W);
  std::vector<float> dAacc(NW), dBl(NW), dCl(NW);
  // Partial rows of variable dB/dC owned by this task: layout (nseg, nslice, batch, L, N).
  float* dBrow = VB ? dBpart + ((sg * nslice + slice) * s.batch + b) * s.L * N : nullptr;
  float* dCrow = VC ? dCpart + ((sg * nslice + slice) * s.batch + b) * s.L * N : nullptr;
  for (int64_t blk = slice; blk < s.nblk; blk += nslice) {
    const int64_t d0 = sg * s.seg + blk * W;
    const int nc = static_cast<int>(std::min<int64_t>(W, s.seg - blk * W));
    load_lanes(s.A, d0, nc, N, Al.data());
    load_lanes(s.A, d0, nc, N, Al.data());
    if (!VB) load_lanes(s.B, d0, nc, N, Bl.data());
    if (!VC) load_lanes(s.C, d0, nc, N, Cl.data());
    const float* Bbase = VB ? s.B + (b * s.gB + d0 / (s.dim / s.gB)) * s.L * N : nullptr;
    const float* Cbase = VC ? s.C + (b * s.gC + d0 / (s.dim / s.gC)) * s.L * N : nullptr;
    float biasl[W];
    for (int c = 0; c < W; ++c) biasl[c] = s.bias && c < nc ? s.bias[d0 + c] : 0.f;
    std::fill(dAacc.begin(), dAacc.end(), 0.f);
    std::fill(dBl.begin(), dBl.end(), 0.f);
    std::fill(dCl.begin(), dCl.end(), 0.f);
    float dDacc[W] = {0}, dbacc[W] = {0}, Dv[W];
    for (int c = 0; c < W; ++c) Dv[c] = (s.Dp && c < nc) ? s.Dp[d0 + c] : 0.f;
    for (int64_t n = 0; n < N; ++n)
      for (int c = 0; c < W; ++c)
        dh[n * W + c] = (dlast && c < nc) ? dlast[(b * s.dim + d0 + c) * N + n] : 0.f;
    for (int64_t k = s.nck - 1; k >= 0; --k) {
      const int64_t t0 = k * T, tl = std::min(T, s.L - t0);
      for (int64_t n = 0; n < N; ++n)
        for (int c = 0; c < W; ++c)
          hs[n * W + c] = c < nc ? ckpt[((b * s.dim + d0 + c) * s.nck + k) * N + n] : 0.f;
      load_chunk(s, b, d0, nc, t0, tl, biasl, dtb.data(), ub.data(), dsp.data());
      pf.clear();
      if (k > 0) chunk_lines(s, b, d0, nc, t0 - T, T, {s.delta, s.u, s.z, dout}, pf);
      run_chunk<VB, VC>(s, Bbase, Cbase, t0, tl, Al.data(), Bl.data(), Cl.data(), dtb.data(), ub.data(),
                        hs.data(), yb.data(), hs.data(), es.data(), pf);
      // Output side: g = dL/dy, and the direct gradients of D, u (through D) and z.
      for (int c = 0; c < W; ++c) {
        const int64_t row = (b * s.dim + d0 + c) * s.L + t0;
        for (int64_t t = 0; t < tl; ++t) {
          const int i = t * W + c;
          if (c >= nc) {
            gb[i] = 0.f;
            continue;
          }
          const float go = dout[row + t];
          float g = go;
          if (s.z) {
            const float zv = s.z[row + t];
            const float sz = sigmoid_f(zv);
            const float pre = yb[i] + Dv[c] * ub[i];
            dz[row + t] = go * pre * sz * (1.f + zv * (1.f - sz));
            g = go * zv * sz;
          }
          gb[i] = g;
          dDacc[c] += g * ub[i];
          dub[i] = g * Dv[c];
        }
      }
      for (int64_t t = tl - 1; t >= 0; --t) {
        const float* dt = dtb.data() + t * W;
        const float* uu = ub.data() + t * W;
        const float* g = gb.data() + t * W;
        const float* Bt = VB ? Bbase + (t0 + t) * N : nullptr;
        const float* Ct = VC ? Cbase + (t0 + t) * N : nullptr;
        const float* hcur = hs.data() + (t + 1) * NW;
        const float* hprev = hs.data() + t * NW;
        const float* e = es.data() + t * NW;
        float ddt[W], dsb[W], dtu[W];
#pragma omp simd
        for (int c = 0; c < W; ++c) {
          ddt[c] = 0.f;
          dsb[c] = 0.f;
          dtu[c] = dt[c] * uu[c];
        }
        for (int64_t n = 0; n < N; ++n) {
          const int64_t o = n * W;
          const float bs = VB ? Bt[n] : 0.f;
          const float cs = VC ? Ct[n] : 0.f;
          float sumC = 0.f, sumB = 0.f;
#pragma omp simd reduction(+ : sumC, sumB)
          for (int c = 0; c < W; ++c) {
            const float cv = VC ? cs : Cl[o + c];
            const float bv = VB ? bs : Bl[o + c];
            const float gh = g[c] * hcur[o + c];
            if (VC) sumC += gh; else dCl[o + c] += gh;
            const float d = dh[o + c] + g[c] * cv;
            const float hp_e = hprev[o + c] * e[o + c];
            dAacc[o + c] += d * hp_e * dt[c];
            ddt[c] += d * (hp_e * Al[o + c] + uu[c] * bv);
            dsb[c] += d * bv;
            const float db = d * dtu[c];
            if (VB) sumB += db; else dBl[o + c] += db;
            dh[o + c] = d * e[o + c];
          }
          if (VC) dCrow[(t0 + t) * N + n] += sumC;
          if (VB) dBrow[(t0 + t) * N + n] += sumB;
        }
        for (int c = 0; c < W; ++c) {
          const int i = t * W + c;
          dub[i] += dt[c] * dsb[c];
          const float dd = ddt[c] * dsp[i];
          ddb[i] = dd;
          dbacc[c] += dd;
        }
      }
      for (int c = 0; c < nc; ++c) {
        const int64_t row = (b * s.dim + d0 + c) * s.L + t0;
        for (int64_t t = 0; t < tl; ++t) {
          du[row + t] = dub[t * W + c];
          ddelta[row + t] = ddb[t * W + c];
        }
      }
    }
    // Per-channel parameter gradients: this (batch) row, summed over batch by the caller.
    for (int c = 0; c < nc; ++c) {
      const int64_t d = d0 + c;
      for (int64_t n = 0; n < N; ++n) {
        dA[(b * s.dim + d) * N + n] = dAacc[n * W + c];
        if (!VB) dBc[(b * s.dim + d) * N + n] = dBl[n * W + c];
        if (!VC) dCc[(b * s.dim + d) * N + n] = dCl[n * W + c];
      }
      dD[b * s.dim + d] = dDacc[c];
      dbias[b * s.dim + d] = dbacc[c];
    }
  }
}

void check_inputs(const torch::Tensor& u, const torch::Tensor& A) {
  TORCH_CHECK(u.is_contiguous() && u.scalar_type() == torch::kFloat, "selective_scan cpp: u must be fp32 contiguous");
  TORCH_CHECK(A.size(1) <= 256, "selective_scan cpp: d_state must be <= 256, got ", A.size(1));
}

std::vector<torch::Tensor> scan_fwd(torch::Tensor u, torch::Tensor delta, torch::Tensor A, torch::Tensor B,
                                    int64_t gB, torch::Tensor C, int64_t gC, c10::optional<torch::Tensor> Dp,
                                    c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> bias,
                                    bool softplus, bool need_ckpt, int64_t chunk) {
  check_inputs(u, A);
  Scan s = make_scan(u, delta, A, B, gB, C, gC, Dp, z, bias, softplus, chunk);
  auto out = torch::empty_like(u);
  auto last = torch::empty({s.batch, s.dim, s.N}, u.options());
  auto ckpt = need_ckpt ? torch::empty({s.batch, s.dim, s.nck, s.N}, u.options()) : torch::empty({0}, u.options());
  float* po = out.data_ptr<float>();
  float* pl = last.data_ptr<float>();
  float* pc = need_ckpt ? ckpt.data_ptr<float>() : nullptr;
  const int64_t ntask = s.batch * s.nseg * s.nblk;
  // A task is 16 channels x L x N state updates; short sequences run several tasks per thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(W * s.L * s.N, 1));
  fastarch::parallel_for(0, ntask, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      if (gB && gC) fwd_task<true, true>(s, task, po, pl, pc);
      else if (gB) fwd_task<true, false>(s, task, po, pl, pc);
      else if (gC) fwd_task<false, true>(s, task, po, pl, pc);
      else fwd_task<false, false>(s, task, po, pl, pc);
    }
  });
  return {out, last, ckpt};
}

// Sum the per-task partials of a variable dB/dC, (nseg, nslice, batch, L, N) -> (batch, G, L, N).
torch::Tensor reduce_partial(const torch::Tensor& part, int64_t nseg, int64_t nslice, int64_t G, int64_t batch,
                             int64_t L, int64_t N) {
  auto r = part.view({nseg, nslice, batch, L, N}).sum(1);  // (nseg, batch, L, N)
  r = r.view({G, nseg / G, batch, L, N}).sum(1);            // (G, batch, L, N)
  return r.permute({1, 0, 2, 3}).contiguous();
}

std::vector<torch::Tensor> scan_bwd(torch::Tensor dout, c10::optional<torch::Tensor> dlast, torch::Tensor u,
                                    torch::Tensor delta, torch::Tensor A, torch::Tensor B, int64_t gB, torch::Tensor C,
                                    int64_t gC, c10::optional<torch::Tensor> Dp, c10::optional<torch::Tensor> z,
                                    c10::optional<torch::Tensor> bias, torch::Tensor ckpt, bool softplus,
                                    int64_t chunk) {
  check_inputs(u, A);
  Scan s = make_scan(u, delta, A, B, gB, C, gC, Dp, z, bias, softplus, chunk);
  TORCH_CHECK(ckpt.numel() == s.batch * s.dim * s.nck * s.N, "selective_scan cpp: checkpoints have the wrong size");
  const auto opt = u.options();
  auto du = torch::empty_like(u);
  auto ddelta = torch::empty_like(u);
  auto dz = z ? torch::empty_like(u) : torch::empty({0}, opt);
  // Per-batch rows of the per-channel gradients, summed over batch at the end (no write conflicts).
  auto dA = torch::empty({s.batch, s.dim, s.N}, opt);
  auto dBc = gB ? torch::empty({0}, opt) : torch::empty({s.batch, s.dim, s.N}, opt);
  auto dCc = gC ? torch::empty({0}, opt) : torch::empty({s.batch, s.dim, s.N}, opt);
  auto dD = torch::empty({s.batch, s.dim}, opt);
  auto dbias = torch::empty({s.batch, s.dim}, opt);
  // Enough slices per segment to feed every thread; each slice owns a partial dB/dC row.
  const int64_t want = 2 * at::get_num_threads();
  const int64_t base = s.batch * s.nseg;
  const int64_t nslice = (gB || gC) ? std::max<int64_t>(1, std::min(s.nblk, (want + base - 1) / base)) : s.nblk;
  auto dBp = gB ? torch::zeros({s.nseg, nslice, s.batch, s.L, s.N}, opt) : torch::empty({0}, opt);
  auto dCp = gC ? torch::zeros({s.nseg, nslice, s.batch, s.L, s.N}, opt) : torch::empty({0}, opt);
  const float* pdl = dlast ? dlast->data_ptr<float>() : nullptr;
  float* pdz = z ? dz.data_ptr<float>() : nullptr;
  float* pdBc = gB ? nullptr : dBc.data_ptr<float>();
  float* pdCc = gC ? nullptr : dCc.data_ptr<float>();
  float* pdBp = gB ? dBp.data_ptr<float>() : nullptr;
  float* pdCp = gC ? dCp.data_ptr<float>() : nullptr;
  const int64_t ntask = base * nslice;
  const int64_t task_work = W * s.L * s.N * ((s.nblk + nslice - 1) / nslice);
  fastarch::parallel_for(0, ntask, std::max<int64_t>(1, 65536 / std::max<int64_t>(task_work, 1)), [&](int64_t begin,
                                                                                                int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t slice = task % nslice;
      const int64_t sg = (task / nslice) % s.nseg;
      const int64_t b = task / (nslice * s.nseg);
      auto call = [&](auto fn) {
        fn(s, b, sg, slice, nslice, dout.data_ptr<float>(), pdl, ckpt.data_ptr<float>(), du.data_ptr<float>(),
           ddelta.data_ptr<float>(), pdz, dA.data_ptr<float>(), pdBc, pdCc, pdBp, pdCp, dD.data_ptr<float>(),
           dbias.data_ptr<float>());
      };
      if (gB && gC) call(bwd_task<true, true>);
      else if (gB) call(bwd_task<true, false>);
      else if (gC) call(bwd_task<false, true>);
      else call(bwd_task<false, false>);
    }
  });
  auto dB = gB ? reduce_partial(dBp, s.nseg, nslice, gB, s.batch, s.L, s.N) : dBc.sum(0);
  auto dC = gC ? reduce_partial(dCp, s.nseg, nslice, gC, s.batch, s.L, s.N) : dCc.sum(0);
  return {du, ddelta, dA.sum(0), dB, dC, dD.sum(0), dz, dbias.sum(0)};
}

// ---- selective_state_update: one decode step, in place on the state --------------------------------------
// Heads form (the no-heads form arrives with nheads = 1):
//   state (batch_state, H, P, N) fp32 contiguous, updated in place; with state_batch_indices (int64, one per
//   row of x, validated in Python) row b updates state[state_batch_indices[b]] and a negative index skips the
//   row (output 0, state untouched), else row b updates state[b];  x, dt, z, out: (batch, H, P);
//   A (H, P, N);  B, C (batch, G, N), head h reads group h / (H / G);  D, dt_bias (H, P).
// Parallel over batch x H x P rows; each row's N-long update is one `omp simd` loop with the polynomial exp.
torch::Tensor state_update(torch::Tensor state, torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                           torch::Tensor C, c10::optional<torch::Tensor> Dp, c10::optional<torch::Tensor> z,
                           c10::optional<torch::Tensor> dt_bias, bool softplus,
                           c10::optional<torch::Tensor> state_batch_indices) {
  TORCH_CHECK(state.is_contiguous() && state.scalar_type() == torch::kFloat && state.dim() == 4,
              "selective_state_update cpp: state must be fp32 contiguous (batch, nheads, dim, N)");
  const int64_t H = state.size(1), P = state.size(2), N = state.size(3);
  const int64_t batch = state_batch_indices ? state_batch_indices->numel() : state.size(0);
  const int64_t* pidx = state_batch_indices ? state_batch_indices->data_ptr<int64_t>() : nullptr;
  const int64_t G = B.size(1), GC = C.size(1);
  TORCH_CHECK(x.numel() == batch * H * P && A.numel() == H * P * N && B.numel() == batch * G * N &&
                  C.numel() == batch * GC * N,
              "selective_state_update cpp: inconsistent sizes");
  auto out = torch::empty({batch, H, P}, x.options());
  float* ps = state.data_ptr<float>();
  const float* px = x.data_ptr<float>();
  const float* pdt = dt.data_ptr<float>();
  const float* pA = A.data_ptr<float>();
  const float* pB = B.data_ptr<float>();
  const float* pC = C.data_ptr<float>();
  const float* pD = Dp ? Dp->data_ptr<float>() : nullptr;
  const float* pz = z ? z->data_ptr<float>() : nullptr;
  const float* pbias = dt_bias ? dt_bias->data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t rows = batch * H * P;
  // A row is ~10 N flops: a decode step of a whole model layer (1536 x 16) is ~30 us of work, less than
  // waking a thread team costs on a busy machine, so fork only above ~64K state elements per task.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1));
  fastarch::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (H * P);
      const int64_t hp = r % (H * P);  // (head, channel) index into A / D / dt_bias
      const int64_t h = hp / P;
      const float* Br = pB + (b * G + h / (H / G)) * N;
      const float* Cr = pC + (b * GC + h / (H / GC)) * N;
      const float* Ar = pA + hp * N;
      const int64_t sb = pidx ? pidx[b] : b;
      if (sb < 0) {  // a padding slot: no state to update
        po[r] = 0.f;
        continue;
      }
      float* sr = ps + (sb * H * P + hp) * N;
      float d = pdt[r] + (pbias ? pbias[hp] : 0.f);
      if (softplus) d = softplus_f(d);
      const float dx = d * px[r];
      float y = 0.f;
#pragma omp simd reduction(+ : y)
      for (int64_t n = 0; n < N; ++n) {
        const float v = sr[n] * fast_exp(d * Ar[n]) + dx * Br[n];
        sr[n] = v;
        y += v * Cr[n];
      }
      if (pD) y += px[r] * pD[hp];
      if (pz) y *= pz[r] * sigmoid_f(pz[r]);
      po[r] = y;
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: selective scan (Mamba) and its decode step on CPU";
  m.def("selective_scan_fwd", &scan_fwd, "selective scan forward -> (out, last_state, ckpt)");
  m.def("selective_scan_bwd", &scan_bwd,
        "selective scan backward -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)");
  m.def("selective_state_update_fwd", &state_update, "selective_state_update (in place on state) -> out");
}
