// Mamba-2's SSD scan on CPU, forward and backward: the core recurrence
//   h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t
// by chunks of `cs` steps. Within a chunk the output is a masked (T, T) matrix product; between chunks only
// the (P, N) states pass.
//
// Layout the Python glue hands us (all fp32 contiguous unless said; the forward reads x, B and C through any
// strides, e.g. views of a (batch, channels, L) convolution output, so no copy is made of them):
//   x, y, dy, dx: (batch, L, H, P)   dt, ddt: (batch, L, H)   A: (H,)   B, C, dB, dC: (batch, L, G, N)
//   D: (H,) or (H, P), optional: the forward's y then includes the skip D x
//   The forward also takes dt raw (any strides) with dt_bias (H,), softplus and clamp applied as it reads it.
//   initial_states, final_states, dfinal: (batch, H, P, N)   seq_idx: (batch, L) int32
//   chunk_states: (batch, nc, H, P, N), the state entering each chunk (before any restart at its first step)
// Head h reads group h / (H / G).
//
// For one head and one chunk of T steps (t, s in [0, T)), with cum_t = sum_{r <= t} dt_r A and S the state
// entering the chunk:
//   y_t   = sum_{s <= t, same seq} exp(cum_t - cum_s) dt_s (C_t . B_s) x_s  +  carry_t S C_t
//   S_out = decay S + sum_s wend_s x_s B_s^T
// where carry_t = exp(cum_t) while step t continues the entering sequence (else 0), wend_s =
// exp(cum_{T-1} - cum_s) dt_s for steps of the sequence that ends the chunk (else 0), decay = carry_{T-1}.
//
// Work is split in three passes so the per-chunk matrix products run in parallel over (batch, chunk, group,
// block of heads) and only the cheap state pass is sequential over chunks:
//   forward:  1. per chunk: each chunk's own end-state contribution;
//             2. per (batch, head): the states pass from chunk to chunk (in place in chunk_states);
//             3. per chunk: y = carry * C S^T (one product for a block of heads) + M x + D x.
//   backward: A. per chunk: dY^T diag(carry) C, the output's pull on the entering state;
//             B. per (batch, head): the state gradients pass backwards from chunk to chunk;
//             C. per chunk: every input gradient, recomputing the chunk from its entering state.
// The forward works on sub-chunks of at most 128 steps (see fwd_split) and keeps the states entering whole chunks.
// Temporaries are chunk-sized per thread; nothing of size L x P x N is formed. Matrix products go to ATen's
// BLAS (single-threaded inside the parallel region).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "fastarch_math.h"
#include "fastarch_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using fastarch::fast_exp;

// A matrix operand: element (i, j) at p[i * rs + j * cs].
struct Mat {
  const float* p;
  int64_t rs, cs;
  Mat rows_from(int64_t i) const { return {p + i * rs, rs, cs}; }
  Mat t() const { return {p, cs, rs}; }
};

// The row-major (rows, cols) matrix at p with leading dimension ld, or its transpose (trans).
Mat mat(const float* p, int64_t ld, bool trans = false) { return trans ? Mat{p, 1, ld} : Mat{p, ld, 1}; }

// c (m, n) = a (m, k) b (k, n) + beta c, c row-major with leading dimension ldc.
void gemm(int64_t m, int64_t n, int64_t k, Mat a, Mat b, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto cm = torch::from_blob(c, {m, n}, {ldc, 1}, opts);
  if (k == 0) {
    if (beta == 0.f) cm.zero_();
    return;
  }
  auto am = torch::from_blob(const_cast<float*>(a.p), {m, k}, {a.rs, a.cs}, opts);
  auto bm = torch::from_blob(const_cast<float*>(b.p), {k, n}, {b.rs, b.cs}, opts);
  if (beta == 0.f) {
    at::mm_out(cm, am, bm);
  } else {
    cm.addmm_(am, bm, beta, 1.f);
  }
}

// c (m, n) = op(a) (m, k) op(b) (k, n) + beta c, row-major with leading dimensions.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm(m, n, k, mat(a, lda, ta), mat(b, ldb, tb), beta, c, ldc);
}

// Below this many steps the triangular products below are one plain product.
constexpr int64_t kSplitSteps = 64;

// c (T, n) = a b (lower-triangular a (T, T)) or a^T b (trans), skipping the quarter of a above the diagonal:
// the top half of the rows (lower) or the bottom half (trans) needs only half of the sum.
void gemm_tri(bool trans, int64_t T, int64_t n, const float* a, int64_t lda, Mat b, float beta, float* c,
              int64_t ldc) {
  if (T < kSplitSteps) return gemm(T, n, T, mat(a, lda, trans), b, beta, c, ldc);
  const int64_t h = T / 2;
  if (!trans) {
    gemm(h, n, h, mat(a, lda), b, beta, c, ldc);
    gemm(T - h, n, T, mat(a + h * lda, lda), b, beta, c + h * ldc, ldc);
  } else {
    gemm(h, n, T, mat(a, lda, true), b, beta, c, ldc);
    gemm(T - h, n, T - h, mat(a + h * lda + h, lda, true), b.rows_from(h), beta, c + h * ldc, ldc);
  }
}

void gemm_tri(bool trans, int64_t T, int64_t n, const float* a, int64_t lda, const float* b, int64_t ldb,
              float beta, float* c, int64_t ldc) {
  gemm_tri(trans, T, n, a, lda, mat(b, ldb), beta, c, ldc);
}

// The lower triangle (diagonal included) of c (T, T) = a b^T for a, b (T, k); some entries above it are left
// unwritten.
void gemm_lower_abt(int64_t T, int64_t k, Mat a, Mat b, float* c, int64_t ldc) {
  if (T < kSplitSteps) return gemm(T, T, k, a, b.t(), 0.f, c, ldc);
  const int64_t h = T / 2;
  gemm(h, h, k, a, b.t(), 0.f, c, ldc);
  gemm(T - h, T, k, a.rows_from(h), b.t(), 0.f, c + h * ldc, ldc);
}

void gemm_lower_abt(int64_t T, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                    int64_t ldc) {
  gemm_lower_abt(T, k, mat(a, lda), mat(b, ldb), c, ldc);
}

struct Scan {
  const float* x;
  const float* dt;
  const float* A;
  const float* B;
  const float* C;
  const float* init;
  const int32_t* seq;
  int64_t sdt[3];    // element strides of dt (batch, L, H)
  // The step the scan uses from dt: clamp(softplus(dt + dt_bias), lo, hi), each part only where asked (the
  // forward takes the raw dt; the backward the step itself).
  const float* dt_bias;  // (H,) or null
  bool dt_softplus, dt_clamp;
  float dt_lo, dt_hi;
  // v[0:n] (head h's raw values) -> the steps, in place.
  void steps(float* v, int64_t n, int64_t h) const {
    const float bias = dt_bias ? dt_bias[h] : 0.f;
    const float lo = dt_clamp ? dt_lo : -INFINITY, hi = dt_clamp ? dt_hi : INFINITY;
    if (dt_softplus) {
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) v[t] = std::min(std::max(fastarch::softplus_f(v[t] + bias), lo), hi);
    } else {
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) v[t] = std::min(std::max(v[t] + bias, lo), hi);
    }
  }
  const float* D;    // (H,) or (H, P) skip weights, or null
  int64_t D_ps;      // D's stride over P: 0 for (H,), 1 for (H, P)
  int64_t sx[4], sB[4], sC[4];  // element strides of x (batch, L, H, P), B and C (batch, L, G, N)
  int64_t batch, L, H, P, G, N, cs, nc, rep;
  int64_t cmax;      // the longest chunk: min(cs, L), what scratch is sized for
  int64_t nhb, hbs;  // head blocks per group and heads per block
  int64_t ldx() const { return H * P; }
  int64_t ldb() const { return G * N; }
  // Step t0's (T, P) block of x for head h of batch row b, and the (T, N) block of B or C for group g.
  Mat x_at(int64_t b, int64_t t0, int64_t h) const { return {x + b * sx[0] + t0 * sx[1] + h * sx[2], sx[1], sx[3]}; }
  Mat B_at(int64_t b, int64_t t0, int64_t g) const { return {B + b * sB[0] + t0 * sB[1] + g * sB[2], sB[1], sB[3]}; }
  Mat C_at(int64_t b, int64_t t0, int64_t g) const { return {C + b * sC[0] + t0 * sC[1] + g * sC[2], sC[1], sC[3]}; }
  int64_t tasks() const { return batch * nc * G * nhb; }
};

// strided: any strides (the forward reads x, B and C through them), else contiguous.
void check(const torch::Tensor& t, const char* name, at::IntArrayRef shape, bool strided = false) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && (strided || t.is_contiguous()),
              "ssd_scan (cpp): ", name, " must be a", strided ? "n" : " contiguous", " fp32 CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.sizes() == shape, "ssd_scan (cpp): ", name, " has shape ", t.sizes(), ", expected ", shape);
}

void strides_of(const torch::Tensor& t, int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = t.stride(i);
}

Scan make_scan(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& A, const torch::Tensor& B,
               const torch::Tensor& C, const c10::optional<torch::Tensor>& init,
               const c10::optional<torch::Tensor>& seq_idx, int64_t chunk_size, bool strided = false) {
  TORCH_CHECK(x.dim() == 4, "ssd_scan (cpp): x must be (batch, L, H, P), got ", x.sizes());
  TORCH_CHECK(B.dim() == 4, "ssd_scan (cpp): B must be (batch, L, G, N), got ", B.sizes());
  TORCH_CHECK(chunk_size >= 1, "ssd_scan (cpp): chunk_size must be positive, got ", chunk_size);
  Scan s;
  s.batch = x.size(0), s.L = x.size(1), s.H = x.size(2), s.P = x.size(3), s.G = B.size(2), s.N = B.size(3);
  TORCH_CHECK(s.G >= 1 && s.H % s.G == 0, "ssd_scan (cpp): H=", s.H, " is not a multiple of G=", s.G);
  check(x, "x", {s.batch, s.L, s.H, s.P}, strided);
  check(dt, "dt", {s.batch, s.L, s.H}, strided);
  check(A, "A", {s.H});
  check(B, "B", {s.batch, s.L, s.G, s.N}, strided);
  check(C, "C", {s.batch, s.L, s.G, s.N}, strided);
  strides_of(x, s.sx), strides_of(B, s.sB), strides_of(C, s.sC);
  for (int i = 0; i < 3; ++i) s.sdt[i] = dt.stride(i);
  s.dt_bias = nullptr, s.dt_softplus = false, s.dt_clamp = false, s.dt_lo = 0.f, s.dt_hi = 0.f;
  s.D = nullptr, s.D_ps = 0;
  s.x = x.data_ptr<float>(), s.dt = dt.data_ptr<float>(), s.A = A.data_ptr<float>();
  s.B = B.data_ptr<float>(), s.C = C.data_ptr<float>();
  s.init = nullptr, s.seq = nullptr;
  if (init) {
    check(*init, "initial_states", {s.batch, s.H, s.P, s.N});
    s.init = init->data_ptr<float>();
  }
  if (seq_idx) {
    TORCH_CHECK(seq_idx->scalar_type() == torch::kInt && seq_idx->is_contiguous() &&
                    seq_idx->sizes() == at::IntArrayRef({s.batch, s.L}),
                "ssd_scan (cpp): seq_idx must be int32 contiguous (batch, L), got ", seq_idx->scalar_type(), " ",
                seq_idx->sizes());
    s.seq = seq_idx->data_ptr<int32_t>();
  }
  s.cs = chunk_size;
  s.nc = (s.L + s.cs - 1) / s.cs;
  s.cmax = std::min(s.cs, s.L);
  s.rep = s.H / s.G;
  // Split a group's heads into blocks only when (batch, chunk, group) tasks are too few for the threads:
  // each block recomputes the group's C B^T.
  const int64_t base = std::max<int64_t>(s.batch * s.nc * s.G, 1);
  const int64_t want = 8 * static_cast<int64_t>(at::get_num_threads());
  s.nhb = std::min<int64_t>(s.rep, std::max<int64_t>(1, (want + base - 1) / base));
  s.hbs = (s.rep + s.nhb - 1) / s.nhb;
  s.nhb = (s.rep + s.hbs - 1) / s.hbs;
  return s;
}

// One task: a chunk of one batch row, one group, a block of its heads.
struct Task {
  int64_t b, c, g, h0, h1;  // heads [h0, h1)
  int64_t s0, T;            // first step, steps
  int64_t hb;               // head block index within the group
};

Task task_of(const Scan& s, int64_t i) {
  Task k;
  k.hb = i % s.nhb;
  i /= s.nhb;
  k.g = i % s.G;
  i /= s.G;
  k.c = i % s.nc;
  k.b = i / s.nc;
  k.h0 = k.g * s.rep + k.hb * s.hbs;
  k.h1 = std::min(k.h0 + s.hbs, (k.g + 1) * s.rep);
  k.s0 = k.c * s.cs;
  k.T = std::min(s.cs, s.L - k.s0);
  return k;
}

// The chunk's sequence structure, shared by its heads: sid (T), in (step continues the entering sequence),
// end (step belongs to the sequence that ends the chunk).
struct ChunkSeq {
  std::vector<int32_t> sid;
  std::vector<float> in, end;
  void fill(const Scan& s, const Task& k) {
    sid.assign(k.T, 0);
    in.assign(k.T, 1.f);
    end.assign(k.T, 1.f);
    if (!s.seq) return;
    const int32_t* q = s.seq + k.b * s.L + k.s0;
    const int32_t before = k.c == 0 ? 0 : q[-1];
    for (int64_t t = 0; t < k.T; ++t) {
      sid[t] = q[t];
      in[t] = q[t] == before ? 1.f : 0.f;
      end[t] = q[t] == q[k.T - 1] ? 1.f : 0.f;
    }
  }
};

// Per-head decay factors of one chunk.
struct Decays {
  std::vector<float> cum, dt, carry, eend, wend;  // T each
  float decay = 0.f;
  void fill(const Scan& s, const Task& k, const ChunkSeq& q, int64_t h) {
    const int64_t T = k.T;
    cum.resize(T), dt.resize(T), carry.resize(T), eend.resize(T), wend.resize(T);
    const float a = s.A[h];
    const float* d = s.dt + k.b * s.sdt[0] + k.s0 * s.sdt[1] + h * s.sdt[2];
    for (int64_t t = 0; t < T; ++t) dt[t] = d[t * s.sdt[1]];
    s.steps(dt.data(), T, h);
    float acc = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      acc += dt[t] * a;
      cum[t] = acc;
    }
    const float last = cum[T - 1];
#pragma omp simd
    for (int64_t t = 0; t < T; ++t) {
      carry[t] = q.in[t] * fast_exp(cum[t]);
      eend[t] = q.end[t] * fast_exp(last - cum[t]);
      wend[t] = eend[t] * dt[t];
    }
    decay = carry[T - 1];
  }
  // The steps, their running sum and carry as the forward's first pass kept them (rows of `keep`, one per
  // quantity, `ld` apart): the output pass needs no step recomputed.
  void load(const float* keep, int64_t ld, int64_t T) {
    dt.assign(keep, keep + T);
    cum.assign(keep + ld, keep + ld + T);
    carry.assign(keep + 2 * ld, keep + 2 * ld + T);
  }
  void store(float* keep, int64_t ld) const {
    std::copy(dt.begin(), dt.end(), keep);
    std::copy(cum.begin(), cum.end(), keep + ld);
    std::copy(carry.begin(), carry.end(), keep + 2 * ld);
  }
};

// cb (T, T) = C B^T of the task's chunk and group, its lower triangle.
void chunk_cb(const Scan& s, const Task& k, float* cb) {
  gemm_lower_abt(k.T, s.N, s.C_at(k.b, k.s0, k.g), s.B_at(k.b, k.s0, k.g), cb, k.T);
}

// rows (T, n) scaled row-wise by w into out (T, n), rows read with leading dimension ld.
void scale_rows(const float* rows, int64_t ld, const float* w, int64_t T, int64_t n, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float wt = w[t];
    const float* r = rows + t * ld;
    float* o = out + t * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = wt * r[j];
  }
}

// Steps per block of the transposing walks below: a block's rows and columns stay in L1 even when the
// strides alias to a few cache sets.
constexpr int64_t kBlockSteps = 16;

// out (T, n), row-major, = a strided (T, n) a. When the steps are a's unit stride (a transposed view) the
// walk goes by blocks of steps, each column's cache line read once per block.
void pack(Mat a, int64_t T, int64_t n, float* out) {
  if (a.cs == 1) {
    for (int64_t t = 0; t < T; ++t) std::copy(a.p + t * a.rs, a.p + t * a.rs + n, out + t * n);
  } else if (a.rs == 1) {
    for (int64_t t0 = 0; t0 < T; t0 += kBlockSteps) {
      const int64_t nt = std::min(kBlockSteps, T - t0);
      for (int64_t j = 0; j < n; ++j) {
        const float* col = a.p + j * a.cs + t0;
        float* o = out + t0 * n + j;
        for (int64_t t = 0; t < nt; ++t) o[t * n] = col[t];
      }
    }
  } else {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < n; ++j) out[t * n + j] = a.p[t * a.rs + j * a.cs];
  }
}

// y (T, P) (leading dimension ldy) += x diag(d) for a strided (T, P) x (the skip with one weight per channel;
// one weight per head is folded into the mixing matrix's diagonal instead).
void add_skip(Mat x, const float* d, int64_t T, int64_t P, float* y, int64_t ldy) {
  float buf[kBlockSteps * 256];
  const int64_t pb = std::min<int64_t>(P, 256);
  for (int64_t p0 = 0; p0 < P; p0 += pb) {
    const int64_t np = std::min(pb, P - p0);
    for (int64_t t0 = 0; t0 < T; t0 += kBlockSteps) {
      const int64_t nt = std::min(kBlockSteps, T - t0);
      pack({x.p + t0 * x.rs + p0 * x.cs, x.rs, x.cs}, nt, np, buf);
      for (int64_t t = 0; t < nt; ++t) {
        float* o = y + (t0 + t) * ldy + p0;
        const float* r = buf + t * np;
#pragma omp simd
        for (int64_t j = 0; j < np; ++j) o[j] += d[p0 + j] * r[j];
      }
    }
  }
}

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

int64_t nthreads() { return std::max<int64_t>(1, at::get_num_threads()); }

// Below this many multiply-adds a pass runs on the calling thread: forking costs more than it saves.
constexpr int64_t kSerialWork = 1 << 20;

// Multiply-adds of one pass over the chunks (roughly: C B^T, the (T, T) mixes and the (P, N) products).
int64_t pass_work(const Scan& s) {
  return s.batch * s.L * (s.cmax * (s.N + s.H * s.P) + 2 * s.H * s.P * s.N);
}

// body(i) for every task of the chunk passes: in parallel, or on this thread for small problems.
template <class Body>
void for_tasks(const Scan& s, const Body& body) {
  const int64_t n = s.tasks();
  if (pass_work(s) < kSerialWork || nthreads() == 1) {
    for (int64_t i = 0; i < n; ++i) body(i, i + 1);
  } else {
    fastarch::run_tasks(n, body);
  }
}

// Below this many multiply-adds the state passes (streaming, one multiply-add per float) run on the calling
// thread: waking a worker costs more, most of all on a loaded machine.
constexpr int64_t kSerialStreamWork = 1 << 21;

// body(r0, r1) over the (batch, head) rows of the state passes, each touching nc * P * N floats.
template <class Body>
void for_rows(const Scan& s, const Body& body) {
  const int64_t per_row = std::max<int64_t>(1, s.nc * s.P * s.N);
  fastarch::parallel_for(0, s.batch * s.H, std::max<int64_t>(1, kSerialStreamWork / per_row), body);
}

// The pass between chunks for every (batch, head) row of the (batch, nc, H, P, N) slots, each already holding
// its chunk's own part: forward, slot c+1 += decay_c slot c (slot 0 first set to `start`, or 0; `past`
// (batch, H, P, N) stands for slot nc); reverse, slot c-1 += decay_c slot c (slot nc-1 first set to `start`,
// or 0; `past` stands for slot -1). `every` (forward only): slot c, once complete, is also copied to slot c / every
// of `kept` (batch, ceil(nc / every), H, P, N) when every divides c.
void pass_states(const Scan& s, float* slots, const float* start, float* past, const float* decays, bool reverse,
                 float* kept = nullptr, int64_t every = 1) {
  const int64_t nkept = (s.nc + every - 1) / every;
  const int64_t PN = s.P * s.N, step = reverse ? -1 : 1;
  for_rows(s, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / s.H, h = r % s.H;
      auto slot = [&](int64_t c) { return slots + ((b * s.nc + c) * s.H + h) * PN; };
      const int64_t c0 = reverse ? s.nc - 1 : 0;
      float* first = slot(c0);
      if (start) {
        std::copy(start + r * PN, start + (r + 1) * PN, first);
      } else {
        std::fill(first, first + PN, 0.f);
      }
      for (int64_t i = 0, c = c0; i < s.nc; ++i, c += step) {
        const float* cur = slot(c);
        if (kept && c % every == 0) std::copy(cur, cur + PN, kept + ((b * nkept + c / every) * s.H + h) * PN);
        float* nxt = c + step >= 0 && c + step < s.nc ? slot(c + step) : past + r * PN;
        const float dc = decays[(b * s.nc + c) * s.H + h];
#pragma omp simd
        for (int64_t j = 0; j < PN; ++j) nxt[j] += dc * cur[j];
      }
    }
  });
}

// -- forward ---------------------------------------------------------------------------------------------------
// The forward's longest and shortest sub-chunks: within a chunk the (T, T) mixes cost T per step and head, while
// the state terms cost N per step and head whatever T is, so chunks of 256 steps (mamba-ssm's default) run
// faster as two of 128. A chunk is split into the fewest equal sub-chunks of at most kFwdSteps steps, unless
// they would be shorter than kFwdMinSteps.
constexpr int64_t kFwdSteps = 128, kFwdMinSteps = 32;

// How many equal sub-chunks the forward cuts each chunk of chunk_size steps into.
int64_t fwd_split(int64_t chunk_size) {
  for (int64_t k = (chunk_size + kFwdSteps - 1) / kFwdSteps; k > 1 && chunk_size / k >= kFwdMinSteps; ++k) {
    if (chunk_size % k == 0) return k;
  }
  return 1;
}

// x, dt, B, C may have any strides; dt is raw: the step is clamp(softplus(dt + dt_bias), lo, hi) (bias when
// given, softplus when dt_softplus, clamp when dt_clamp); D (optional, (H,) or (H, P)) adds the skip D * x to y.
std::vector<torch::Tensor> ssd_fwd(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                   torch::Tensor C, c10::optional<torch::Tensor> D,
                                   c10::optional<torch::Tensor> dt_bias, bool dt_softplus, bool dt_clamp,
                                   double dt_lo, double dt_hi, c10::optional<torch::Tensor> initial_states,
                                   c10::optional<torch::Tensor> seq_idx, int64_t chunk_size) {
  at::NoGradGuard ng;
  // The work runs on sub-chunks of `chunk_size / every` steps; chunk_states keeps every `every`-th entering
  // state, which is the state entering each chunk of chunk_size steps.
  const int64_t every = fwd_split(chunk_size);
  Scan s = make_scan(x, dt, A, B, C, initial_states, seq_idx, chunk_size / every, true);
  if (dt_bias) {
    check(*dt_bias, "dt_bias", {s.H});
    s.dt_bias = dt_bias->data_ptr<float>();
  }
  s.dt_softplus = dt_softplus, s.dt_clamp = dt_clamp;
  s.dt_lo = static_cast<float>(dt_lo), s.dt_hi = static_cast<float>(dt_hi);
  if (D) {
    TORCH_CHECK(D->dim() == 1 || D->dim() == 2, "ssd_scan (cpp): D must be (H,) or (H, P), got ", D->sizes());
    check(*D, "D", D->dim() == 1 ? at::IntArrayRef({s.H}) : at::IntArrayRef({s.H, s.P}));
    s.D = D->data_ptr<float>();
    s.D_ps = D->dim() == 2 ? 1 : 0;
  }
  const int64_t PN = s.P * s.N, T2 = s.cmax * s.cmax, ldy = s.H * s.P;
  auto opts = x.options().memory_format(at::MemoryFormat::Contiguous);
  auto y = torch::empty({s.batch, s.L, s.H, s.P}, opts);
  // The states entering every sub-chunk are returned only when sub-chunks are whole chunks; otherwise they are
  // scratch, kept per calling thread between calls up to kKeptStateFloats: fresh pages of that size cost page
  // faults every call.
  constexpr size_t kKeptStateFloats = size_t(1) << 24;
  thread_local std::vector<float> state_scratch;
  torch::Tensor states;
  if (every == 1 || static_cast<size_t>(s.batch * s.nc * s.H * PN) > kKeptStateFloats) {
    states = torch::empty({s.batch, s.nc, s.H, s.P, s.N}, opts);
  } else {
    const size_t n = static_cast<size_t>(s.batch * s.nc * s.H * PN);
    if (state_scratch.size() < n) state_scratch.resize(n);
    states = torch::from_blob(state_scratch.data(), {s.batch, s.nc, s.H, s.P, s.N}, opts);
  }
  auto chunk_states = every == 1 ? states : torch::empty({s.batch, (s.nc + every - 1) / every, s.H, s.P, s.N}, opts);
  auto final_states = torch::empty({s.batch, s.H, s.P, s.N}, opts);
  auto decays = torch::empty({s.batch, s.nc, s.H}, opts);
  // per (batch, head): the steps, their running sums within sub-chunks and the carries, rows of L
  auto steps = torch::empty({s.batch, s.H, 3, s.L}, opts);
  float* py = y.data_ptr<float>();
  float* pst = states.data_ptr<float>();
  float* pfin = final_states.data_ptr<float>();
  float* pdec = decays.data_ptr<float>();
  float* psteps = steps.data_ptr<float>();
  auto steps_at = [&](const Task& k, int64_t h) { return psteps + (k.b * s.H + h) * 3 * s.L + k.s0; };
  std::vector<Scratch> scratch(nthreads());

  // 1. each chunk's own end-state contribution x^T diag(wend) B (into the next chunk's slot)
  for_tasks(s, [&](int64_t i, int64_t) {
    at::NoGradGuard ng2;
    const Task k = task_of(s, i);
    float* Bp = scratch[fastarch::thread_index()].get(2 * s.cmax * s.N);
    float* bw = Bp + s.cmax * s.N;
    ChunkSeq q;
    q.fill(s, k);
    Decays d;
    pack(s.B_at(k.b, k.s0, k.g), k.T, s.N, Bp);
    for (int64_t h = k.h0; h < k.h1; ++h) {
      d.fill(s, k, q, h);
      scale_rows(Bp, s.N, d.wend.data(), k.T, s.N, bw);
      float* own = k.c + 1 < s.nc ? pst + ((k.b * s.nc + k.c + 1) * s.H + h) * PN : pfin + (k.b * s.H + h) * PN;
      gemm(s.P, s.N, k.T, s.x_at(k.b, k.s0, h).t(), mat(bw, s.N), 0.f, own, s.N);
      pdec[(k.b * s.nc + k.c) * s.H + h] = d.decay;
      d.store(steps_at(k, h), s.L);
    }
  });

  // 2. the states pass from chunk to chunk
  pass_states(s, pst, s.init, pfin, pdec, false, every == 1 ? nullptr : chunk_states.data_ptr<float>(), every);

  // 3. the outputs: the entering states' part for the block's heads in one product (C S^T, then each head's
  // rows scaled by carry), the intra-chunk part M x, the skip D x
  for_tasks(s, [&](int64_t i, int64_t) {
    at::NoGradGuard ng2;
    const Task k = task_of(s, i);
    const int64_t T = k.T;
    float* cb = scratch[fastarch::thread_index()].get(2 * T2 + 2 * s.cmax * s.N);
    float* m = cb + T2;
    float* Cp = m + T2;
    float* Bp = Cp + s.cmax * s.N;
    pack(s.C_at(k.b, k.s0, k.g), T, s.N, Cp);
    pack(s.B_at(k.b, k.s0, k.g), T, s.N, Bp);
    ChunkSeq q;
    q.fill(s, k);
    // the chunk starts a new sequence (or chunk 0 has no initial state): the entering state is never read
    const bool reads_state = (k.c > 0 || s.init) && q.in[0] != 0.f;
    float* yb = py + (k.b * s.L + k.s0) * ldy;
    if (reads_state) {
      const float* S = pst + ((k.b * s.nc + k.c) * s.H + k.h0) * PN;  // (heads, P, N): the heads' rows
      gemm(T, (k.h1 - k.h0) * s.P, s.N, mat(Cp, s.N), mat(S, s.N, true), 0.f, yb + k.h0 * s.P, ldy);
    }
    Decays d;
    gemm_lower_abt(T, s.N, Cp, s.N, Bp, s.N, cb, T);
    for (int64_t h = k.h0; h < k.h1; ++h) {
      d.load(steps_at(k, h), s.L, T);
      float* yh = yb + h * s.P;
      if (reads_state) {
        for (int64_t t = 0; t < T; ++t) {
          float* r = yh + t * ldy;
          const float w = d.carry[t];
#pragma omp simd
          for (int64_t j = 0; j < s.P; ++j) r[j] *= w;
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        const float ct = d.cum[t];
        const float* cbr = cb + t * T;
        float* mr = m + t * T;
        if (s.seq) {
          const int32_t st = q.sid[t];
#pragma omp simd
          for (int64_t j = 0; j <= t; ++j)
            mr[j] = q.sid[j] == st ? cbr[j] * fast_exp(ct - d.cum[j]) * d.dt[j] : 0.f;
        } else {
#pragma omp simd
          for (int64_t j = 0; j <= t; ++j) mr[j] = cbr[j] * fast_exp(ct - d.cum[j]) * d.dt[j];
        }
        std::fill(mr + t + 1, mr + T, 0.f);
        if (s.D && !s.D_ps) mr[t] += s.D[h];  // the skip D_h x_t as the diagonal of M
      }
      const Mat xh = s.x_at(k.b, k.s0, h);
      gemm_tri(false, T, s.P, m, T, xh, reads_state ? 1.f : 0.f, yh, ldy);
      if (s.D && s.D_ps) add_skip(xh, s.D + h * s.P, T, s.P, yh, ldy);
    }
  });
  return {y, final_states, chunk_states};
}

// -- backward --------------------------------------------------------------------------------------------------
std::vector<torch::Tensor> ssd_bwd(torch::Tensor dy, c10::optional<torch::Tensor> dfinal, torch::Tensor x,
                                   torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
                                   c10::optional<torch::Tensor> initial_states, c10::optional<torch::Tensor> seq_idx,
                                   torch::Tensor chunk_states, int64_t chunk_size) {
  at::NoGradGuard ng;
  const Scan s = make_scan(x, dt, A, B, C, initial_states, seq_idx, chunk_size);
  check(dy, "dy", {s.batch, s.L, s.H, s.P});
  check(chunk_states, "chunk_states", {s.batch, s.nc, s.H, s.P, s.N});
  if (dfinal) check(*dfinal, "dfinal", {s.batch, s.H, s.P, s.N});
  const int64_t PN = s.P * s.N, T2 = s.cmax * s.cmax;
  auto opts = x.options();
  auto dx = torch::empty_like(x);
  auto ddt = torch::empty_like(dt);
  // dB, dC: one partial sum per head block, added up at the end
  auto dB = torch::zeros({s.nhb, s.batch, s.L, s.G, s.N}, opts);
  auto dC = torch::zeros({s.nhb, s.batch, s.L, s.G, s.N}, opts);
  auto dA = torch::empty({s.batch, s.nc, s.H}, opts);
  auto dstates = torch::empty({s.batch, s.nc, s.H, s.P, s.N}, opts);  // gradient of the state leaving chunk c
  auto dinit = torch::empty({s.batch, s.H, s.P, s.N}, opts);
  auto decays = torch::empty({s.batch, s.nc, s.H}, opts);
  const float* pdy = dy.data_ptr<float>();
  const float* pst = chunk_states.data_ptr<float>();
  float* pdx = dx.data_ptr<float>();
  float* pddt = ddt.data_ptr<float>();
  float* pdB = dB.data_ptr<float>();
  float* pdC = dC.data_ptr<float>();
  float* pdA = dA.data_ptr<float>();
  float* pds = dstates.data_ptr<float>();
  float* pdi = dinit.data_ptr<float>();
  float* pdec = decays.data_ptr<float>();
  const int64_t part = s.batch * s.L * s.G * s.N;
  std::vector<Scratch> scratch(nthreads());

  // A. each chunk's outputs pull on its entering state: dY^T diag(carry) C, into the previous chunk's slot
  for_tasks(s, [&](int64_t i, int64_t) {
    at::NoGradGuard ng2;
    const Task k = task_of(s, i);
    float* cw = scratch[fastarch::thread_index()].get(s.cmax * s.N);
    ChunkSeq q;
    q.fill(s, k);
    Decays d;
    const float* Cc = s.C + (k.b * s.L + k.s0) * s.ldb() + k.g * s.N;
    for (int64_t h = k.h0; h < k.h1; ++h) {
      d.fill(s, k, q, h);
      pdec[(k.b * s.nc + k.c) * s.H + h] = d.decay;
      float* out = k.c > 0 ? pds + ((k.b * s.nc + k.c - 1) * s.H + h) * PN : pdi + (k.b * s.H + h) * PN;
      if (q.in[0] == 0.f) {
        std::fill(out, out + PN, 0.f);
        continue;
      }
      scale_rows(Cc, s.ldb(), d.carry.data(), k.T, s.N, cw);
      const int64_t xo = (k.b * s.L + k.s0) * s.ldx() + h * s.P;
      gemm(true, false, s.P, s.N, k.T, pdy + xo, s.ldx(), cw, s.N, 0.f, out, s.N);
    }
  });

  // B. the state gradients pass backwards
  pass_states(s, pds, dfinal ? dfinal->data_ptr<float>() : nullptr, pdi, pdec, true);

  // C. every input gradient, chunk by chunk
  for_tasks(s, [&](int64_t i, int64_t) {
    at::NoGradGuard ng2;
    const Task k = task_of(s, i);
    const int64_t T = k.T, N = s.N, P = s.P;
    float* cb = scratch[fastarch::thread_index()].get(4 * T2 + 2 * s.cmax * N + 4 * s.cmax);
    float* m = cb + T2;
    float* z = m + T2;
    float* zs = z + T2;          // sum over the block's heads of K*dt_s*(dY X^T): B and C are shared by them
    float* tn = zs + T2;         // (T, N)
    float* tn2 = tn + s.cmax * N;  // (T, N)
    float* colf = tn2 + s.cmax * N;
    float* dcum = colf + s.cmax;
    float* u = dcum + s.cmax;
    float* ex = u + s.cmax;
    ChunkSeq q;
    q.fill(s, k);
    Decays d;
    chunk_cb(s, k, cb);
    const int64_t bo = (k.b * s.L + k.s0) * s.ldb() + k.g * N;
    const float* Bc = s.B + bo;
    const float* Cc = s.C + bo;
    float* dBc = pdB + k.hb * part + bo;
    float* dCc = pdC + k.hb * part + bo;
    std::fill(zs, zs + T * T, 0.f);
    for (int64_t h = k.h0; h < k.h1; ++h) {
      d.fill(s, k, q, h);
      const int64_t xo = (k.b * s.L + k.s0) * s.ldx() + h * P;
      const float* X = s.x + xo;
      const float* dY = pdy + xo;
      const float* S = pst + ((k.b * s.nc + k.c) * s.H + h) * PN;
      const float* Gs = pds + ((k.b * s.nc + k.c) * s.H + h) * PN;
      // z = dY X^T (its lower triangle); then m = K*CB*dt_s (the forward's mixing matrix) and
      // zs += K*dt_s*z, with the pair terms' pulls on the steps (colf) and on the decays (dcum)
      gemm_lower_abt(T, P, dY, s.ldx(), X, s.ldx(), z, T);
      std::fill(colf, colf + T, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float ct = d.cum[t];
        const int32_t st = q.sid[t];
        const float* cbr = cb + t * T;
        float* mr = m + t * T;
        const float* zr = z + t * T;
        float* zsr = zs + t * T;
        float row = 0.f;
#pragma omp simd reduction(+ : row)
        for (int64_t j = 0; j <= t; ++j) {
          const float kk = q.sid[j] == st ? fast_exp(ct - d.cum[j]) : 0.f;
          const float f = kk * cbr[j] * zr[j];
          colf[j] += f;
          row += f * d.dt[j];
          mr[j] = kk * cbr[j] * d.dt[j];
          zsr[j] += kk * d.dt[j] * zr[j];
        }
        std::fill(mr + t + 1, mr + T, 0.f);
        dcum[t] = row;
      }
      // dX = M^T dY + diag(wend) B G^T
      float* dX = pdx + xo;
      gemm_tri(true, T, P, m, T, dY, s.ldx(), 0.f, dX, s.ldx());
      scale_rows(Bc, s.ldb(), d.wend.data(), T, N, tn);
      gemm(false, true, T, P, N, tn, N, Gs, N, 1.f, dX, s.ldx());
      // dB += diag(wend) X G;  u_s = x_s^T G B_s
      gemm(false, false, T, N, P, X, s.ldx(), Gs, N, 0.f, tn, N);
      for (int64_t t = 0; t < T; ++t) {
        const float* r = tn + t * N;
        const float* br = Bc + t * s.ldb();
        float* o = dBc + t * s.ldb();
        const float w = d.wend[t];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < N; ++j) {
          acc += r[j] * br[j];
          o[j] += w * r[j];
        }
        u[t] = acc;
      }
      // dC += diag(carry) dY S;  v_t = carry_t dy_t^T S C_t
      const bool reads_state = q.in[0] != 0.f;
      if (reads_state) gemm(false, false, T, N, P, dY, s.ldx(), S, N, 0.f, tn2, N);
      float end_pull = 0.f;
      for (int64_t t = 0; t < T; ++t) {
        float v = 0.f;
        if (reads_state && d.carry[t] != 0.f) {
          const float* r = tn2 + t * N;
          const float* cr = Cc + t * s.ldb();
          float* o = dCc + t * s.ldb();
          const float w = d.carry[t];
#pragma omp simd reduction(+ : v)
          for (int64_t j = 0; j < N; ++j) {
            v += r[j] * cr[j];
            o[j] += w * r[j];
          }
          v *= w;
        }
        const float own = d.wend[t] * u[t];
        end_pull += own;
        dcum[t] += v - d.dt[t] * colf[t] - own;
        ex[t] = colf[t] + d.eend[t] * u[t];  // the explicit pull on dt_t
      }
      if (d.decay != 0.f) {
        float gs = 0.f;
#pragma omp simd reduction(+ : gs)
        for (int64_t j = 0; j < PN; ++j) gs += Gs[j] * S[j];
        end_pull += d.decay * gs;
      }
      dcum[T - 1] += end_pull;
      // cum is the running sum of dt A: its gradient flows back as a reverse running sum
      const float a = s.A[h];
      float run = 0.f, da = 0.f;
      float* ddt_c = pddt + (k.b * s.L + k.s0) * s.H + h;
      for (int64_t t = T - 1; t >= 0; --t) {
        run += dcum[t];
        ddt_c[t * s.H] = ex[t] + a * run;
        da += d.dt[t] * run;
      }
      pdA[(k.b * s.nc + k.c) * s.H + h] = da;
    }
    // the pair terms of the whole block: dB += Zs^T C, dC += Zs B
    gemm_tri(true, T, N, zs, T, Cc, s.ldb(), 1.f, dBc, s.ldb());
    gemm_tri(false, T, N, zs, T, Bc, s.ldb(), 1.f, dCc, s.ldb());
  });

  auto dBs = s.nhb == 1 ? dB[0] : dB.sum(0);
  auto dCs = s.nhb == 1 ? dC[0] : dC.sum(0);
  auto dAs = dA.sum({0, 1});
  return {dx, ddt, dAs, dBs, dCs, dinit};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: Mamba-2's SSD chunked scan on CPU";
  m.def("ssd_scan_fwd", &ssd_fwd, "SSD scan forward -> (y (+ D x), final_states, chunk_states)", py::arg("x"),
        py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("D"), py::arg("dt_bias"),
        py::arg("dt_softplus"), py::arg("dt_clamp"), py::arg("dt_lo"), py::arg("dt_hi"), py::arg("initial_states"),
        py::arg("seq_idx"), py::arg("chunk_size"));
  m.def("ssd_scan_bwd", &ssd_bwd, "SSD scan backward -> (dx, ddt, dA, dB, dC, dinitial_states)", py::arg("dy"),
        py::arg("dfinal"), py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"),
        py::arg("initial_states"), py::arg("seq_idx"), py::arg("chunk_states"), py::arg("chunk_size"));
}
