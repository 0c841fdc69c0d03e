// The gated delta rule (Gated DeltaNet, KDA) on CPU: the chunked WY/UT forward, the step recurrence, and the
// backward. For one value head h with q/k head h / (Hv / Hk), state S (K, V) fp32, per step t:
//   S = diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S = S + k_t u_t^T;   o_t = S^T (scale q_t)
// g_t is one log decay per head (Kg = 1, GDN) or one per key channel (Kg = K, KDA).
//
// Layout (the Python glue hands these over contiguous): q, k (B, T, Hk, K) and v (B, T, Hv, V) in fp32, fp16
// or bf16 (one dtype), read as fp32; g (B, T, Hv, Kg) and beta (B, T, Hv) fp32; initial and final states
// (N, Hv, K, V) fp32; o (B, T, Hv, V) fp32. Sequences: the batch rows (N = B), or with cu_seqlens (int64,
// N + 1 offsets, B = 1) the packed sequences of the one row.
//
// Work is parallel over (sequence, value head) on fastarch's task pool; each task owns its state and its
// scratch, so nothing is shared but read-only inputs and disjoint output rows.
//
// Chunked forward, per chunk of C <= 64 steps with G_t = sum_{r <= t} g_r inside the chunk and S the state
// entering it:
//   A[t, s] = beta_t sum_k k_t k_s exp(G_t - G_s)  (s < t),  P[t, s] = sum_k q_t k_s exp(G_t - G_s)  (s <= t)
//   (I + A) U0 = beta V,  (I + A) W = beta K exp(G)    (forward substitution)
//   U = U0 - W S,  O = (Q exp(G)) S + P U,  S = diag(exp(G_C)) S + (K exp(G_C - G))^T U
// Every exponent is a difference G_t - G_s with s <= t, so <= 0. For a per-key gate the products of A and P are
// formed by blocks of 16 rows: within a block pairwise, before it about the step just before the block (both
// factors <= 1). The matrix products are small fp32 loops the compiler vectorises (no BLAS call per chunk).
//
// Backward. A gate shared by the key channels (GDN): the reverse of the chunked algebra, chunk by chunk from the
// last, from the states entering the chunks (kept by a first forward pass). A per-key gate (KDA): the exact
// reverse of the step recurrence, the chunk's states recomputed from its entering state. Memory:
// (N, Hv, T / 64, K, V) per call and one chunk of scratch (KDA: of per-step states) per task; q/k gradients per
// value head (B, T, Hv, K), summed over the heads sharing a q/k head by the glue.
#include <torch/extension.h>

#include "fastarch_math.h"
#include "fastarch_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using fastarch::fast_exp;

constexpr int64_t CH = 64;   // chunk length
constexpr int64_t SUB = 16;  // row block of the per-key products

// -- small fp32 matrix products, row-major with leading dimensions --------------------------------------------
// c (m, n) = alpha a (m, k) b (k, n) + beta c. A register tile of 4 rows x 16 columns accumulates over k (the
// compiler keeps it in vector registers); edges take the same loop with shorter bounds.
constexpr int64_t TM = 4, TN = 16;

void mm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
           float beta, float* c, int64_t ldc) {
  for (int64_t i0 = 0; i0 < m; i0 += TM) {
    const int64_t mi = std::min(TM, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += TN) {
      const int64_t nj = std::min(TN, n - j0);
      float acc[TM][TN] = {};
      if (mi == TM && nj == TN) {
        for (int64_t p = 0; p < k; ++p) {
          const float* bp = b + p * ldb + j0;
          for (int64_t r = 0; r < TM; ++r) {
            const float ar = a[(i0 + r) * lda + p];
#pragma omp simd
            for (int64_t jj = 0; jj < TN; ++jj) acc[r][jj] += ar * bp[jj];
          }
        }
      } else {
        for (int64_t p = 0; p < k; ++p) {
          const float* bp = b + p * ldb + j0;
          for (int64_t r = 0; r < mi; ++r) {
            const float ar = a[(i0 + r) * lda + p];
            for (int64_t jj = 0; jj < nj; ++jj) acc[r][jj] += ar * bp[jj];
          }
        }
      }
      for (int64_t r = 0; r < mi; ++r) {
        float* cr = c + (i0 + r) * ldc + j0;
        if (beta == 0.f) {
          for (int64_t jj = 0; jj < nj; ++jj) cr[jj] = alpha * acc[r][jj];
        } else {
          for (int64_t jj = 0; jj < nj; ++jj) cr[jj] = alpha * acc[r][jj] + beta * cr[jj];
        }
      }
    }
  }
}

// x (rows, cols) with leading dimension ldx -> xt (cols, rows), contiguous
void transpose(int64_t rows, int64_t cols, const float* x, int64_t ldx, float* xt) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * ldx + c];
  }
}

// c (m, n) = a (m, k) b (n, k)^T; bt: scratch of k * n floats
void mm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
           int64_t ldc, float* bt) {
  transpose(n, k, b, ldb, bt);
  mm_nn(m, n, k, 1.f, a, lda, bt, n, 0.f, c, ldc);
}

// c (m, n) += a (k, m)^T b (k, n); at: scratch of m * k floats
void mm_tn_acc(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
               int64_t ldc, float* at) {
  transpose(k, m, a, lda, at);
  mm_nn(m, n, k, 1.f, at, k, b, ldb, 1.f, c, ldc);
}

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// -- the problem -------------------------------------------------------------------------------------------------
struct Problem {
  int64_t B, T, Hk, Hv, K, V, Kg, N;
  const int64_t* cu;  // N + 1 packed offsets, or null (sequence n is batch row n)
  float scale;

  int64_t start(int64_t n) const { return cu ? cu[n] : n * T; }
  int64_t length(int64_t n) const { return cu ? cu[n + 1] - cu[n] : T; }
  int64_t qk_head(int64_t h) const { return h / (Hv / Hk); }
  // (sequence, head) items per task: enough state work that a task outweighs handing it to another thread (a
  // decode step's heads run on the calling thread)
  int64_t grain() const {
    const int64_t steps = cu ? std::max<int64_t>(1, cu[N] / std::max<int64_t>(N, 1)) : std::max<int64_t>(T, 1);
    return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, steps * K * V));
  }
};

template <typename T>
void load(const T* src, float* dst, int64_t n, float mul = 1.f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * mul;
}

// The inputs of one (sequence, value head): row pointers by step.
template <typename T>
struct Rows {
  const Problem& p;
  const T *q, *k, *v;
  const float *g, *beta;
  int64_t n, h, s0, hk;

  const T* q_at(int64_t t) const { return q + ((s0 + t) * p.Hk + hk) * p.K; }
  const T* k_at(int64_t t) const { return k + ((s0 + t) * p.Hk + hk) * p.K; }
  const T* v_at(int64_t t) const { return v + ((s0 + t) * p.Hv + h) * p.V; }
  const float* g_at(int64_t t) const { return g + ((s0 + t) * p.Hv + h) * p.Kg; }
  float beta_at(int64_t t) const { return beta[(s0 + t) * p.Hv + h]; }
};

// -- one step of the recurrence: S (K, V) in place; o (V) when given -----------------------------------------
struct StepScratch {
  std::vector<float> kv, qv, vv, pv;
  StepScratch(int64_t K, int64_t V) : kv(K), qv(K), vv(V), pv(V) {}
};

template <typename T>
void step(const Problem& p, const Rows<T>& r, int64_t t, float* S, float* o, StepScratch& w) {
  const int64_t K = p.K, V = p.V;
  load(r.k_at(t), w.kv.data(), K);
  load(r.v_at(t), w.vv.data(), V);
  const float* g = r.g_at(t);
  const float b = r.beta_at(t);
  float* pv = w.pv.data();
  std::fill(pv, pv + V, 0.f);
  const float d0 = fast_exp(g[0]);
  for (int64_t i = 0; i < K; ++i) {  // decay, and read S^T k
    const float d = p.Kg == 1 ? d0 : fast_exp(g[i]);
    const float ki = w.kv[i];
    float* Si = S + i * V;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      Si[j] *= d;
      pv[j] += ki * Si[j];
    }
  }
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) pv[j] = b * (w.vv[j] - pv[j]);  // u
  if (o != nullptr) {
    load(r.q_at(t), w.qv.data(), K, p.scale);
    std::fill(o, o + V, 0.f);
  }
  for (int64_t i = 0; i < K; ++i) {  // write k u^T, read S^T q
    const float ki = w.kv[i];
    float* Si = S + i * V;
    if (o != nullptr) {
      const float qi = w.qv[i];
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) {
        Si[j] += ki * pv[j];
        o[j] += qi * Si[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) Si[j] += ki * pv[j];
    }
  }
}

// -- the chunked forward of one (sequence, head) ------------------------------------------------------------------
struct ChunkScratch {
  std::vector<float> Q, Kc, Vc, G, A, P, AK, U, W, X, Y, O, beta, Tr;
  ChunkScratch(int64_t K, int64_t V, int64_t Kg)
      : Q(CH * K), Kc(CH * K), Vc(CH * V), G(CH * Kg), A(CH * CH), P(CH * CH), AK(CH * CH), U(CH * V), W(CH * K),
        X(CH * K), Y(CH * K), O(CH * V), beta(CH), Tr(CH * K) {}
};

// out[t, s] = sum_k a[t, k] b[s, k] exp(G[t, k] - G[s, k]) for s < t (strict) or s <= t, else 0; a, b, G (L, K).
void gated_gram_per_key(int64_t L, int64_t K, const float* a, const float* b, const float* G, bool strict,
                        float* out, float* xa, float* xb, float* tr) {
  std::fill(out, out + L * CH, 0.f);
  for (int64_t i0 = 0; i0 < L; i0 += SUB) {
    const int64_t i1 = std::min(L, i0 + SUB);
    for (int64_t t = i0; t < i1; ++t) {  // the block's own columns, pairwise
      const int64_t last = strict ? t - 1 : t;
      for (int64_t s = i0; s <= last; ++s) {
        const float *at = a + t * K, *bs = b + s * K, *Gt = G + t * K, *Gs = G + s * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < K; ++c) acc += at[c] * bs[c] * fast_exp(Gt[c] - Gs[c]);
        out[t * CH + s] = acc;
      }
    }
    if (i0 == 0) continue;
    const float* Gr = G + (i0 - 1) * K;  // the step before the block: s <= i0 - 1 < t
    for (int64_t t = i0; t < i1; ++t) {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) xa[(t - i0) * K + c] = a[t * K + c] * fast_exp(G[t * K + c] - Gr[c]);
    }
    for (int64_t s = 0; s < i0; ++s) {
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) xb[s * K + c] = b[s * K + c] * fast_exp(Gr[c] - G[s * K + c]);
    }
    mm_nt(i1 - i0, i0, K, xa, K, xb, K, out + i0 * CH, CH, tr);
  }
}

// One chunk's within-chunk quantities (steps c0 .. c0 + n): Q (scaled), K, V, beta, G (the gate's cumulative
// sum inside the chunk), A (strict, scaled by beta_t), P (inclusive), for a scalar gate AK = A / beta_t (the
// gated k.k products), and the UT transform's U0 = (I + A)^-1 beta V (in U) and W = (I + A)^-1 beta K exp(G).
template <typename T>
void chunk_prepare(const Problem& p, const Rows<T>& r, int64_t c0, int64_t n, ChunkScratch& w) {
  const int64_t K = p.K, V = p.V, Kg = p.Kg;
  float *Q = w.Q.data(), *Kc = w.Kc.data(), *Vc = w.Vc.data(), *G = w.G.data(), *A = w.A.data(), *P = w.P.data();
  float *U = w.U.data(), *W = w.W.data(), *X = w.X.data(), *Y = w.Y.data(), *bt = w.beta.data();
  for (int64_t t = 0; t < n; ++t) {
    load(r.q_at(c0 + t), Q + t * K, K, p.scale);
    load(r.k_at(c0 + t), Kc + t * K, K);
    load(r.v_at(c0 + t), Vc + t * V, V);
    bt[t] = r.beta_at(c0 + t);
    const float* g = r.g_at(c0 + t);
    for (int64_t c = 0; c < Kg; ++c) G[t * Kg + c] = g[c] + (t > 0 ? G[(t - 1) * Kg + c] : 0.f);
  }
  // the within-chunk products A (strict, scaled by beta_t) and P (inclusive)
  if (Kg == 1) {
    float* AK = w.AK.data();
    transpose(n, K, Kc, K, w.Tr.data());  // Kc^T, shared by both products
    mm_nn(n, n, K, 1.f, Kc, K, w.Tr.data(), n, 0.f, A, CH);
    mm_nn(n, n, K, 1.f, Q, K, w.Tr.data(), n, 0.f, P, CH);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s = 0; s < n; ++s) {
        const float e = s <= t ? fast_exp(G[t] - G[s]) : 0.f;
        AK[t * CH + s] = s < t ? A[t * CH + s] * e : 0.f;
        A[t * CH + s] = bt[t] * AK[t * CH + s];
        P[t * CH + s] = P[t * CH + s] * e;
      }
    }
  } else {
    gated_gram_per_key(n, K, Kc, Kc, G, true, A, X, Y, w.Tr.data());
    gated_gram_per_key(n, K, Q, Kc, G, false, P, X, Y, w.Tr.data());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s = 0; s < t; ++s) A[t * CH + s] *= bt[t];
    }
  }
  // (I + A) U0 = beta V and (I + A) W = beta K exp(G), row by row
  for (int64_t t = 0; t < n; ++t) {
    float* Ut = U + t * V;
    float* Wt = W + t * K;
    const float* Gt = G + t * Kg;
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) Ut[j] = bt[t] * Vc[t * V + j];
    for (int64_t c = 0; c < K; ++c) Wt[c] = bt[t] * Kc[t * K + c] * fast_exp(Gt[Kg == 1 ? 0 : c]);
    for (int64_t s = 0; s < t; ++s) {
      const float a = A[t * CH + s];
      if (a == 0.f) continue;
      const float *Us = U + s * V, *Ws = W + s * K;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) Ut[j] -= a * Us[j];
#pragma omp simd
      for (int64_t c = 0; c < K; ++c) Wt[c] -= a * Ws[c];
    }
  }
}

// The chunked forward of one (sequence, head): outputs into o_base rows (when given), S updated in place to the
// final state; with `entering`, the state entering each chunk is kept there ((L / 64) x K x V).
template <typename T>
void chunked_forward(const Problem& p, const Rows<T>& r, int64_t L, float* S, float* o_base, ChunkScratch& w,
                     float* entering = nullptr) {
  const int64_t K = p.K, V = p.V, Kg = p.Kg;
  for (int64_t c0 = 0; c0 < L; c0 += CH) {
    const int64_t n = std::min(CH, L - c0);
    if (entering != nullptr) std::memcpy(entering + (c0 / CH) * K * V, S, K * V * sizeof(float));
    chunk_prepare(p, r, c0, n, w);
    float *Q = w.Q.data(), *Kc = w.Kc.data(), *G = w.G.data(), *P = w.P.data(), *U = w.U.data(), *W = w.W.data();
    float* O = w.O.data();
    // U = U0 - W S;  O = (Q exp(G)) S + P U
    mm_nn(n, V, K, -1.f, W, K, S, V, 1.f, U, V);
    if (o_base != nullptr) {
      for (int64_t t = 0; t < n; ++t) {
        const float* Gt = G + t * Kg;
        for (int64_t c = 0; c < K; ++c) Q[t * K + c] *= fast_exp(Gt[Kg == 1 ? 0 : c]);
      }
      mm_nn(n, V, K, 1.f, Q, K, S, V, 0.f, O, V);
      mm_nn(n, V, n, 1.f, P, CH, U, V, 1.f, O, V);
      for (int64_t t = 0; t < n; ++t) {
        float* dst = o_base + ((r.s0 + c0 + t) * p.Hv + r.h) * V;
        std::memcpy(dst, O + t * V, V * sizeof(float));
      }
    }
    // S = diag(exp(G_last)) S + (K exp(G_last - G))^T U
    const float* Gl = G + (n - 1) * Kg;
    for (int64_t i = 0; i < K; ++i) {
      const float d = fast_exp(Gl[Kg == 1 ? 0 : i]);
      float* Si = S + i * V;
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) Si[j] *= d;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* Gt = G + t * Kg;
      for (int64_t c = 0; c < K; ++c) {
        const int64_t gc = Kg == 1 ? 0 : c;
        Kc[t * K + c] *= fast_exp(Gl[gc] - Gt[gc]);
      }
    }
    mm_tn_acc(K, V, n, Kc, K, U, V, S, V, w.Tr.data());
  }
}

Problem problem(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& g,
                const c10::optional<torch::Tensor>& cu, double scale) {
  Problem p{};
  p.B = q.size(0);
  p.T = q.size(1);
  p.Hk = q.size(2);
  p.K = q.size(3);
  p.Hv = v.size(2);
  p.V = v.size(3);
  p.Kg = g.dim() == 4 ? p.K : 1;
  p.cu = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  p.N = cu.has_value() ? cu->size(0) - 1 : p.B;
  p.scale = static_cast<float>(scale);
  return p;
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
                  const torch::Tensor& beta, const c10::optional<torch::Tensor>& h0,
                  const c10::optional<torch::Tensor>& cu) {
  for (const auto* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "delta_rule: inputs must be contiguous CPU tensors");
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "delta_rule: q, k, v must share a dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, "delta_rule: g, beta must be fp32");
  TORCH_CHECK(v.size(2) % q.size(2) == 0, "delta_rule: value heads must be a multiple of q/k heads");
  if (h0.has_value()) {
    TORCH_CHECK(h0->scalar_type() == at::kFloat && h0->is_contiguous(), "delta_rule: initial_state fp32 contiguous");
  }
  if (cu.has_value()) {
    TORCH_CHECK(cu->scalar_type() == at::kLong && cu->is_contiguous() && q.size(0) == 1,
                "delta_rule: cu_seqlens int64 contiguous, batch 1");
  }
}

// Forward: (o (B, T, Hv, V) fp32, final state (N, Hv, K, V) fp32).
std::vector<torch::Tensor> delta_rule_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& g, const torch::Tensor& beta,
                                          const c10::optional<torch::Tensor>& h0,
                                          const c10::optional<torch::Tensor>& cu, double scale, bool recurrent) {
  check_inputs(q, k, v, g, beta, h0, cu);
  const Problem p = problem(q, v, g, cu, scale);
  auto f32 = q.options().dtype(at::kFloat);
  auto o = torch::zeros({p.B, p.T, p.Hv, p.V}, f32);
  auto final_state = h0.has_value() ? h0->clone() : torch::zeros({p.N, p.Hv, p.K, p.V}, f32);
  float* op = o.data_ptr<float>();
  float* fp = final_state.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "delta_rule_fwd", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
    fastarch::parallel_for(0, p.N * p.Hv, p.grain(), [&](int64_t begin, int64_t end) {
      StepScratch sw(p.K, p.V);
      ChunkScratch cw(recurrent ? 0 : p.K, recurrent ? 0 : p.V, recurrent ? 0 : p.Kg);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / p.Hv, h = item % p.Hv;
        Rows<scalar_t> r{p, qp, kp, vp, gp, bp, n, h, p.start(n), p.qk_head(h)};
        float* S = fp + item * p.K * p.V;
        const int64_t L = p.length(n);
        if (recurrent) {
          for (int64_t t = 0; t < L; ++t) step(p, r, t, S, op + ((r.s0 + t) * p.Hv + h) * p.V, sw);
        } else {
          chunked_forward(p, r, L, S, op, cw);
        }
      }
    });
  });
  return {o, final_state};
}

// -- backward --------------------------------------------------------------------------------------------------
struct BackScratch {
  std::vector<float> states, Sp, qv, kv, vv, dov, pv, uv, du, dp, dS;
  BackScratch(int64_t K, int64_t V)
      : states(CH * K * V), Sp(K * V), qv(K), kv(K), vv(V), dov(V), pv(V), uv(V), du(V), dp(V), dS(K * V) {}
};

// The backward of one (sequence, value head): gradients written to its rows; returns with dS = dinitial_state.
template <typename scalar_t>
void backward_item(const Problem& p, const Rows<scalar_t>& r, int64_t item, const float* h0p, const float* dfp,
                   const float* dop, float* dqp, float* dkp, float* dvp, float* dgp, float* dbp, StepScratch& sw,
                   BackScratch& w) {
  const int64_t K = p.K, V = p.V, KV = p.K * p.V;
  const int64_t h = r.h;
  const int64_t L = p.length(r.n);
  const int64_t nc = (L + CH - 1) / CH;
  // the state entering each chunk
  std::vector<float> entering(std::max<int64_t>(nc, 1) * KV, 0.f);
  std::vector<float> S(KV, 0.f);
  if (h0p != nullptr) std::memcpy(S.data(), h0p + item * KV, KV * sizeof(float));
  for (int64_t c = 0; c < nc; ++c) {
    std::memcpy(entering.data() + c * KV, S.data(), KV * sizeof(float));
    for (int64_t t = c * CH; t < std::min(L, (c + 1) * CH); ++t) step(p, r, t, S.data(), nullptr, sw);
  }
  float* dS = w.dS.data();
  if (dfp != nullptr) {
    std::memcpy(dS, dfp + item * KV, KV * sizeof(float));
  } else {
    std::fill(dS, dS + KV, 0.f);
  }
  for (int64_t c = nc - 1; c >= 0; --c) {
    const int64_t t0 = c * CH, n_steps = std::min(L, t0 + CH) - t0;
    // the state before each step of the chunk
    std::memcpy(w.states.data(), entering.data() + c * KV, KV * sizeof(float));
    for (int64_t j = 0; j + 1 < n_steps; ++j) {
      std::memcpy(w.states.data() + (j + 1) * KV, w.states.data() + j * KV, KV * sizeof(float));
      step(p, r, t0 + j, w.states.data() + (j + 1) * KV, nullptr, sw);
    }
    for (int64_t j = n_steps - 1; j >= 0; --j) {
      const int64_t t = t0 + j, tok = r.s0 + t;
      const float* Sprev = w.states.data() + j * KV;
      float *Sp = w.Sp.data(), *qv = w.qv.data(), *kv = w.kv.data(), *vv = w.vv.data(), *dov = w.dov.data();
      float *pv = w.pv.data(), *uv = w.uv.data(), *du = w.du.data(), *dp = w.dp.data();
      load(r.q_at(t), qv, K, p.scale);
      load(r.k_at(t), kv, K);
      load(r.v_at(t), vv, V);
      std::memcpy(dov, dop + (tok * p.Hv + h) * V, V * sizeof(float));
      const float* gt = r.g_at(t);
      const float b = r.beta_at(t);
      const float d0 = fast_exp(gt[0]);
      // S' = diag(exp(g)) S_prev, p = S'^T k
      std::fill(pv, pv + V, 0.f);
      for (int64_t i = 0; i < K; ++i) {
        const float d = p.Kg == 1 ? d0 : fast_exp(gt[i]);
        const float ki = kv[i];
        const float* Si = Sprev + i * V;
        float* Spi = Sp + i * V;
#pragma omp simd
        for (int64_t jv = 0; jv < V; ++jv) {
          Spi[jv] = d * Si[jv];
          pv[jv] += ki * Spi[jv];
        }
      }
#pragma omp simd
      for (int64_t jv = 0; jv < V; ++jv) uv[jv] = b * (vv[jv] - pv[jv]);
      const float ud = dot(uv, dov, V);
      float* dqt = dqp + (tok * p.Hv + h) * K;
      float* dkt = dkp + (tok * p.Hv + h) * K;
      std::fill(du, du + V, 0.f);
      // o = S^T q with S = S' + k u^T: dq, dS += q do^T; then dk = dS u, du = dS^T k
      for (int64_t i = 0; i < K; ++i) {
        const float* Spi = Sp + i * V;
        float* dSi = dS + i * V;
        dqt[i] = p.scale * (dot(Spi, dov, V) + kv[i] * ud);
        const float qi = qv[i], ki = kv[i];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t jv = 0; jv < V; ++jv) {
          dSi[jv] += qi * dov[jv];
          acc += dSi[jv] * uv[jv];
          du[jv] += ki * dSi[jv];
        }
        dkt[i] = acc;
      }
      // u = beta (v - p)
      float dbeta_t = 0.f;
      float* dvt = dvp + (tok * p.Hv + h) * V;
      for (int64_t jv = 0; jv < V; ++jv) {
        dvt[jv] = b * du[jv];
        dbeta_t += du[jv] * (vv[jv] - pv[jv]);
        dp[jv] = -b * du[jv];
      }
      dbp[tok * p.Hv + h] = dbeta_t;
      // p = S'^T k: dS' = dS + k dp^T, dk += S' dp; S' = diag(exp(g)) S_prev: dg, dS_prev
      float* dgt = dgp + (tok * p.Hv + h) * p.Kg;
      float dg_sum = 0.f;
      for (int64_t i = 0; i < K; ++i) {
        const float* Spi = Sp + i * V;
        float* dSi = dS + i * V;
        const float ki = kv[i];
        const float d = p.Kg == 1 ? d0 : fast_exp(gt[i]);
        float acc_k = 0.f, acc_g = 0.f;
#pragma omp simd reduction(+ : acc_k, acc_g)
        for (int64_t jv = 0; jv < V; ++jv) {
          dSi[jv] += ki * dp[jv];
          acc_k += Spi[jv] * dp[jv];
          acc_g += dSi[jv] * Spi[jv];
          dSi[jv] *= d;
        }
        dkt[i] += acc_k;
        if (p.Kg == 1) {
          dg_sum += acc_g;
        } else {
          dgt[i] = acc_g;
        }
      }
      if (p.Kg == 1) dgt[0] = dg_sum;
    }
  }
}

// -- the chunked backward for a gate shared by the key channels (GDN) -------------------------------------------
// Per chunk, from its entering state S and the gradient dS of its end state, the reverse of chunked_forward's
// algebra (U = U0 - W S, O = Qg S + P U, S_end = exp(G_last) S + Kd^T U with Qg = Q exp(G), Kd = K exp(G_last - G)):
//   dU = P^T dO + Kd dS_end,  dP = dO U^T,  dQ = exp(G) dO S^T,  dW = -dU S^T,
//   (I + A)^T dXu = dU, (I + A)^T dXw = dW (back substitution), dA = -(dXu U0^T + dXw W^T),
//   dS <- exp(G_last) dS_end + Qg^T dO - W^T dU,
// then A = beta (K K^T * E), P = Q K^T * E, Xu = beta V, Xw = beta exp(G) K give the input gradients; a gate
// gradient dG_t (of the cumulative sum) becomes dg_t = sum_{t' >= t} dG_t' within the chunk.
struct BackChunk {
  std::vector<float> Uf, dO, dU, dQ, dK, dW, Yk, dXu, dXw, dA, dA2, dP, dG, Qg, Kd, Tr;
  BackChunk(int64_t K, int64_t V)
      : Uf(CH * V), dO(CH * V), dU(CH * V), dQ(CH * K), dK(CH * K), dW(CH * K), Yk(CH * K), dXu(CH * V),
        dXw(CH * K), dA(CH * CH), dA2(CH * CH), dP(CH * CH), dG(CH), Qg(CH * K), Kd(CH * K),
        Tr(std::max(K * V, CH * std::max<int64_t>(std::max(K, V), CH))) {}  // transposes of a state, too
};

template <typename T>
void chunked_backward_shared_gate(const Problem& p, const Rows<T>& r, int64_t item, const float* h0p,
                                  const float* dfp, const float* dop, float* dqp, float* dkp, float* dvp, float* dgp,
                                  float* dbp, float* dhp, ChunkScratch& w, BackChunk& b) {
  const int64_t K = p.K, V = p.V, KV = K * V, h = r.h;
  const int64_t L = p.length(r.n);
  const int64_t nc = (L + CH - 1) / CH;
  std::vector<float> entering(std::max<int64_t>(nc, 1) * KV);
  std::vector<float> S(KV, 0.f);
  if (h0p != nullptr) std::memcpy(S.data(), h0p + item * KV, KV * sizeof(float));
  chunked_forward(p, r, L, S.data(), nullptr, w, entering.data());
  float* dS = dhp + item * KV;  // the running state gradient, ending as dinitial_state
  if (dfp != nullptr) {
    std::memcpy(dS, dfp + item * KV, KV * sizeof(float));
  } else {
    std::fill(dS, dS + KV, 0.f);
  }
  for (int64_t c = nc - 1; c >= 0; --c) {
    const int64_t c0 = c * CH, n = std::min(CH, L - c0);
    const float* Sin = entering.data() + c * KV;
    chunk_prepare(p, r, c0, n, w);
    float *Q = w.Q.data(), *Kc = w.Kc.data(), *Vc = w.Vc.data(), *G = w.G.data(), *A = w.A.data();
    float *P = w.P.data(), *AK = w.AK.data(), *U0 = w.U.data(), *W = w.W.data(), *bt = w.beta.data();
    float *Uf = b.Uf.data(), *dO = b.dO.data(), *dU = b.dU.data(), *dQ = b.dQ.data(), *dK = b.dK.data();
    float *dW = b.dW.data(), *Yk = b.Yk.data(), *dXu = b.dXu.data(), *dXw = b.dXw.data(), *dA = b.dA.data();
    float *dP = b.dP.data(), *dG = b.dG.data(), *Qg = b.Qg.data(), *Kd = b.Kd.data(), *Tr = b.Tr.data();
    const float GL = G[n - 1], dL = fast_exp(GL);
    std::vector<float> eg(n), ed(n);
    for (int64_t t = 0; t < n; ++t) {
      eg[t] = fast_exp(G[t]);
      ed[t] = fast_exp(GL - G[t]);
    }
    // U = U0 - W S
    std::memcpy(Uf, U0, n * V * sizeof(float));
    mm_nn(n, V, K, -1.f, W, K, Sin, V, 1.f, Uf, V);
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(dO + t * V, dop + ((r.s0 + c0 + t) * p.Hv + h) * V, V * sizeof(float));
      for (int64_t i = 0; i < K; ++i) {
        Qg[t * K + i] = Q[t * K + i] * eg[t];
        Kd[t * K + i] = Kc[t * K + i] * ed[t];
      }
    }
    std::fill(dG, dG + n, 0.f);
    std::fill(dK, dK + n * K, 0.f);
    // dU = P^T dO + Kd dS_end
    mm_nn(n, V, K, 1.f, Kd, K, dS, V, 0.f, dU, V);
    mm_tn_acc(n, V, n, P, CH, dO, V, dU, V, Tr);
    // dP = dO U^T (inclusive lower part)
    mm_nt(n, n, V, dO, V, Uf, V, dP, CH, Tr);
    // dQ = exp(G) dO S^T; its pull on the gate: dG_t += q_t . dQ_t (the entering state's part of o_t)
    mm_nt(n, K, V, dO, V, Sin, V, dQ, K, Tr);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < K; ++i) dQ[t * K + i] *= eg[t];
      dG[t] += dot(Q + t * K, dQ + t * K, K);
    }
    // S_end = exp(G_last) S + Kd^T U: Y = U dS_end^T gives dKd = Y and the gate's pull through Kd
    mm_nt(n, K, V, Uf, V, dS, V, Yk, K, Tr);
    float dGL = dL * dot(Sin, dS, KV);
    for (int64_t t = 0; t < n; ++t) {
      const float ct = dot(Kd + t * K, Yk + t * K, K);
      dGL += ct;
      dG[t] -= ct;
      for (int64_t i = 0; i < K; ++i) dK[t * K + i] += ed[t] * Yk[t * K + i];
    }
    // dW = -dU S^T
    mm_nt(n, K, V, dU, V, Sin, V, dW, K, Tr);
    for (int64_t x = 0; x < n * K; ++x) dW[x] = -dW[x];
    // the state gradient entering the chunk: exp(G_last) dS_end + Qg^T dO - W^T dU
    for (int64_t x = 0; x < KV; ++x) dS[x] *= dL;
    mm_tn_acc(K, V, n, Qg, K, dO, V, dS, V, Tr);
    for (int64_t x = 0; x < n * K; ++x) Yk[x] = -W[x];
    mm_tn_acc(K, V, n, Yk, K, dU, V, dS, V, Tr);
    // (I + A)^T dXu = dU and (I + A)^T dXw = dW, last row first
    for (int64_t t = n - 1; t >= 0; --t) {
      float* xu = dXu + t * V;
      float* xw = dXw + t * K;
      std::memcpy(xu, dU + t * V, V * sizeof(float));
      std::memcpy(xw, dW + t * K, K * sizeof(float));
      for (int64_t s2 = t + 1; s2 < n; ++s2) {
        const float a = A[s2 * CH + t];
        if (a == 0.f) continue;
        const float *us = dXu + s2 * V, *ws = dXw + s2 * K;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) xu[j] -= a * us[j];
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) xw[i] -= a * ws[i];
      }
    }
    // dA = -(dXu U0^T + dXw W^T) on the strict lower part
    mm_nt(n, n, V, dXu, V, U0, V, dA, CH, Tr);
    float* dA2 = b.dA2.data();
    mm_nt(n, n, K, dXw, K, W, K, dA2, CH, Tr);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s2 = 0; s2 < n; ++s2) dA[t * CH + s2] = s2 < t ? -(dA[t * CH + s2] + dA2[t * CH + s2]) : 0.f;
    }
    // Xu = beta V, Xw = beta exp(G) K
    float* dvt_base = dvp;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t tok = r.s0 + c0 + t;
      float* dvt = dvt_base + (tok * p.Hv + h) * V;
      for (int64_t j = 0; j < V; ++j) dvt[j] = bt[t] * dXu[t * V + j];
      const float kx = dot(Kc + t * K, dXw + t * K, K);
      float dbeta = dot(Vc + t * V, dXu + t * V, V) + eg[t] * kx;
      dG[t] += bt[t] * eg[t] * kx;
      for (int64_t i = 0; i < K; ++i) dK[t * K + i] += bt[t] * eg[t] * dXw[t * K + i];
      // A = beta (K K^T * E): dbeta, and M = beta dA * E for K K^T
      for (int64_t s2 = 0; s2 < t; ++s2) dbeta += dA[t * CH + s2] * AK[t * CH + s2];
      dbp[tok * p.Hv + h] = dbeta;
    }
    // the gate through E in A and P: dG_t += rowsum(R) - colsum(R) with R = dA * A + dP * P
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s2 = 0; s2 <= t; ++s2) {
        const float rr = (s2 < t ? dA[t * CH + s2] * A[t * CH + s2] : 0.f) + dP[t * CH + s2] * P[t * CH + s2];
        dG[t] += rr;
        dG[s2] -= rr;
      }
    }
    // K K^T and Q K^T gradients: dKK = beta_t dA * E (strict), dQK = dP * E (inclusive)
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t s2 = 0; s2 < n; ++s2) {
        const float e = s2 <= t ? fast_exp(G[t] - G[s2]) : 0.f;
        dA[t * CH + s2] = s2 < t ? bt[t] * dA[t * CH + s2] * e : 0.f;
        dP[t * CH + s2] = dP[t * CH + s2] * e;
      }
    }
    mm_nn(n, K, n, 1.f, dA, CH, Kc, K, 1.f, dK, K);    // dKK K
    mm_tn_acc(n, K, n, dA, CH, Kc, K, dK, K, Tr);       // dKK^T K
    mm_nn(n, K, n, 1.f, dP, CH, Kc, K, 1.f, dQ, K);    // dQK K
    mm_tn_acc(n, K, n, dP, CH, Q, K, dK, K, Tr);        // dQK^T Q
    dG[n - 1] += dGL;
    // write: q was scaled, the gate gradient is the reverse cumulative sum of dG
    float acc = 0.f;
    for (int64_t t = n - 1; t >= 0; --t) {
      const int64_t tok = r.s0 + c0 + t;
      acc += dG[t];
      dgp[tok * p.Hv + h] = acc;
      float* dqt = dqp + (tok * p.Hv + h) * K;
      float* dkt = dkp + (tok * p.Hv + h) * K;
      for (int64_t i = 0; i < K; ++i) {
        dqt[i] = p.scale * dQ[t * K + i];
        dkt[i] = dK[t * K + i];
      }
    }
  }
}

// Gradients: (dq, dk per value head (B, T, Hv, K), dv, dg (g's shape), dbeta, dinitial_state (N, Hv, K, V)).
std::vector<torch::Tensor> delta_rule_bwd(const torch::Tensor& dout, const c10::optional<torch::Tensor>& dfinal,
                                          const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& g, const torch::Tensor& beta,
                                          const c10::optional<torch::Tensor>& h0,
                                          const c10::optional<torch::Tensor>& cu, double scale) {
  check_inputs(q, k, v, g, beta, h0, cu);
  TORCH_CHECK(dout.scalar_type() == at::kFloat && dout.is_contiguous(), "delta_rule: dout fp32 contiguous");
  const Problem p = problem(q, v, g, cu, scale);
  auto f32 = q.options().dtype(at::kFloat);
  auto dq = torch::zeros({p.B, p.T, p.Hv, p.K}, f32);
  auto dk = torch::zeros({p.B, p.T, p.Hv, p.K}, f32);
  auto dv = torch::zeros({p.B, p.T, p.Hv, p.V}, f32);
  auto dg = torch::zeros(g.sizes(), f32);
  auto dbeta = torch::zeros(beta.sizes(), f32);
  auto dh0 = torch::zeros({p.N, p.Hv, p.K, p.V}, f32);
  const float* dfp = dfinal.has_value() ? dfinal->data_ptr<float>() : nullptr;
  const float* h0p = h0.has_value() ? h0->data_ptr<float>() : nullptr;
  const float* dop = dout.data_ptr<float>();
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  float *dgp = dg.data_ptr<float>(), *dbp = dbeta.data_ptr<float>(), *dhp = dh0.data_ptr<float>();
  const int64_t K = p.K, V = p.V, KV = p.K * p.V;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "delta_rule_bwd", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
    fastarch::parallel_for(0, p.N * p.Hv, p.grain(), [&](int64_t begin, int64_t end) {
      const bool shared_gate = p.Kg == 1;  // GDN: the chunked backward; KDA: the reverse recurrence
      StepScratch sw(K, V);
      BackScratch w(shared_gate ? 0 : K, shared_gate ? 0 : V);
      ChunkScratch cw(shared_gate ? K : 0, shared_gate ? V : 0, 1);
      BackChunk bc(shared_gate ? K : 0, shared_gate ? V : 0);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / p.Hv, h = item % p.Hv;
        Rows<scalar_t> r{p, qp, kp, vp, gp, bp, n, h, p.start(n), p.qk_head(h)};
        if (shared_gate) {
          chunked_backward_shared_gate(p, r, item, h0p, dfp, dop, dqp, dkp, dvp, dgp, dbp, dhp, cw, bc);
          continue;
        }
        backward_item(p, r, item, h0p, dfp, dop, dqp, dkp, dvp, dgp, dbp, sw, w);
        std::memcpy(dhp + item * KV, w.dS.data(), KV * sizeof(float));
      }
    });
  });
  return {dq, dk, dv, dg, dbeta, dh0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: the gated delta rule (Gated DeltaNet, KDA) on CPU";
  m.def("delta_rule_fwd", &delta_rule_fwd, "gated delta rule forward -> (o fp32, final_state fp32)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("initial_state"), py::arg("cu_seqlens"),
        py::arg("scale"), py::arg("recurrent"));
  m.def("delta_rule_bwd", &delta_rule_bwd,
        "gated delta rule backward -> (dq, dk per value head, dv, dg, dbeta, dinitial_state)", py::arg("dout"),
        py::arg("dfinal"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
        py::arg("initial_state"), py::arg("cu_seqlens"), py::arg("scale"));
}
