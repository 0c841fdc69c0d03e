// Fused decode steps on CPU, one call each:
// - a Mamba-1 mixer: (optional RMS norm) -> in_proj -> causal conv update + SiLU -> x_proj -> dt_proj (+ bias,
//   softplus) -> selective state update (D skip, silu(z) gate) -> out_proj (-> optional residual);
// - a Mamba-2 mixer (below);
// - a pre-norm decoder layer (the Llama family, GPT-2), in two halves around the caller's KV-cache write: norm
//   -> q, k, v projections -> rotary; then attention over the cache -> o_proj + residual -> norm -> MLP +
//   residual.
// A decode step reads every weight once and does little arithmetic, so its time is the time to stream the
// weights from memory plus whatever each separate call adds; one call per layer leaves only the weights.
// The conv and SSM states advance in place.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "fastarch_math.h"
#include "fastarch_tensor.h"
#include "fastarch_parallel.h"

namespace {

using fastarch::check_cpu_contig;
using fastarch::fast_exp;
using fastarch::sigmoid_f;
using fastarch::softplus_f;

// Weight elements per thread task at least: waking the second thread costs more than reading a small
// matrix alone.
constexpr int64_t GRAIN = int64_t(1) << 18;

// Y[m, r] = dot(W[r], X[m]) + bias[r] for weight rows r in [r0, r1) and every batch row m < M.
// Four weight rows go together (four independent streams and accumulators); each tile of rows is kept in
// cache while the batch rows use it.
void matvec_rows(const float* W, const float* bias, int64_t K, const float* X, int64_t M, float* Y, int64_t ldy,
                 int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const float* w0 = W + r * K;
    const float* w1 = w0 + K;
    const float* w2 = w1 + K;
    const float* w3 = w2 + K;
    for (int64_t m = 0; m < M; ++m) {
      const float* x = X + m * K;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t k = 0; k < K; ++k) {
        a0 += w0[k] * x[k];
        a1 += w1[k] * x[k];
        a2 += w2[k] * x[k];
        a3 += w3[k] * x[k];
      }
      float* y = Y + m * ldy + r;
      y[0] = a0 + (bias ? bias[r] : 0.f);
      y[1] = a1 + (bias ? bias[r + 1] : 0.f);
      y[2] = a2 + (bias ? bias[r + 2] : 0.f);
      y[3] = a3 + (bias ? bias[r + 3] : 0.f);
    }
  }
  for (; r < r1; ++r) {
    const float* w = W + r * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* x = X + m * K;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t k = 0; k < K; ++k) a += w[k] * x[k];
      Y[m * ldy + r] = a + (bias ? bias[r] : 0.f);
    }
  }
}

// Y (M, N) = X (M, K) W^T (N, K) + bias, rows of W split over threads in tasks of at least GRAIN elements
// (one task when not parallel).
void matvec(const float* W, const float* bias, int64_t N, int64_t K, const float* X, int64_t M, float* Y,
            bool parallel) {
  const int64_t tiles = (N + 3) / 4;
  const int64_t grain = parallel ? std::max<int64_t>(1, GRAIN / (4 * std::max<int64_t>(K, 1))) : std::max<int64_t>(tiles, 1);
  fastarch::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    matvec_rows(W, bias, K, X, M, Y, N, t0 * 4, std::min(N, t1 * 4));
  });
}

const float* opt_ptr(const c10::optional<torch::Tensor>& t, int64_t numel, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check_cpu_contig(*t, name);
  TORCH_CHECK(t->scalar_type() == torch::kFloat && t->numel() == numel, "decode_step: ", name, " must be fp32 with ",
              numel, " elements");
  return t->data_ptr<float>();
}

void check_f32(const torch::Tensor& t, const char* name, std::initializer_list<int64_t> shape) {
  check_cpu_contig(t, name);
  TORCH_CHECK(t.scalar_type() == torch::kFloat, "decode_step: ", name, " must be fp32");
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(shape), "decode_step: ", name, " must have shape ", c10::IntArrayRef(shape),
              ", got ", t.sizes());
}

// x (B, d_model) -> out (B, d_model). in_w (2E, d_model); conv_state (B, E, S >= W - 1); conv_w (E, W);
// xproj_w (R + 2N, E); dtproj_w (E, R); A_log (E, N) (A = -exp(A_log)); ssm_state (B, E, N);
// out_w (d_out, E). Optional: in_b (2E), conv_b (E), xproj_b (R + 2N), dt_bias (E), D (E), out_b (d_out);
// norm_w (d_model): the mixer reads rms_norm(x) * norm_w (epsilon norm_eps); residual: x is added to out;
// parallel: split the larger loops over threads (else the whole step runs on the calling thread).
torch::Tensor mamba_step(const torch::Tensor& x, const torch::Tensor& in_w, const c10::optional<torch::Tensor>& in_b,
                         torch::Tensor conv_state, const torch::Tensor& conv_w,
                         const c10::optional<torch::Tensor>& conv_b, const torch::Tensor& xproj_w,
                         const c10::optional<torch::Tensor>& xproj_b, const torch::Tensor& dtproj_w, const c10::optional<torch::Tensor>& dt_bias,
                         const torch::Tensor& A_log, const c10::optional<torch::Tensor>& D, torch::Tensor ssm_state,
                         const torch::Tensor& out_w, const c10::optional<torch::Tensor>& out_b,
                         const c10::optional<torch::Tensor>& norm_w, double norm_eps, bool residual,
                         bool parallel) {
  TORCH_CHECK(x.dim() == 2 && in_w.dim() == 2 && conv_w.dim() == 2 && dtproj_w.dim() == 2 && A_log.dim() == 2,
              "mamba_step: x (B, d_model), in_w (2E, d_model), conv_w (E, W), dtproj_w (E, R), A_log (E, N)");
  const int64_t Bsz = x.size(0), Dm = x.size(1), E = conv_w.size(0), W = conv_w.size(1);
  const int64_t R = dtproj_w.size(1), N = A_log.size(1);
  TORCH_CHECK(conv_state.dim() == 3, "mamba_step: conv_state must be (B, E, S)");
  const int64_t S = conv_state.size(2);
  TORCH_CHECK(S >= W - 1 && W >= 1, "mamba_step: conv_state must hold at least W - 1 steps");
  check_f32(x, "x", {Bsz, Dm});
  check_f32(in_w, "in_w", {2 * E, Dm});
  check_f32(conv_state, "conv_state", {Bsz, E, S});
  check_f32(conv_w, "conv_w", {E, W});
  check_f32(xproj_w, "xproj_w", {R + 2 * N, E});
  check_f32(dtproj_w, "dtproj_w", {E, R});
  check_f32(A_log, "A_log", {E, N});
  check_f32(ssm_state, "ssm_state", {Bsz, E, N});
  TORCH_CHECK(out_w.dim() == 2, "mamba_step: out_w must be (d_out, E)");
  const int64_t Dout = out_w.size(0);
  check_f32(out_w, "out_w", {Dout, E});
  const float* pin_b = opt_ptr(in_b, 2 * E, "in_b");
  const float* pconv_b = opt_ptr(conv_b, E, "conv_b");
  const float* pxproj_b = opt_ptr(xproj_b, R + 2 * N, "xproj_b");
  const float* pdt_b = opt_ptr(dt_bias, E, "dt_bias");
  const float* pD = opt_ptr(D, E, "D");
  const float* pout_b = opt_ptr(out_b, Dout, "out_b");
  const float* pnorm_w = opt_ptr(norm_w, Dm, "norm_w");
  TORCH_CHECK(!residual || Dout == Dm, "mamba_step: residual needs d_out == d_model, got ", Dout, " and ", Dm);

  auto opts = x.options();
  auto xz = torch::empty({Bsz, 2 * E}, opts);        // in_proj: [x | z]
  auto xc = torch::empty({Bsz, E}, opts);            // conv + SiLU
  auto xdbl = torch::empty({Bsz, R + 2 * N}, opts);  // x_proj: [dt | B | C]
  auto y = torch::empty({Bsz, E}, opts);             // gated scan output
  auto out = torch::empty({Bsz, Dout}, opts);
  float* pxz = xz.data_ptr<float>();
  float* pxc = xc.data_ptr<float>();
  float* pxd = xdbl.data_ptr<float>();
  float* py = y.data_ptr<float>();

  // Optional RMS norm of the input: x * rsqrt(mean(x^2) + eps) * norm_w.
  const float* px = x.data_ptr<float>();
  torch::Tensor xn;
  if (pnorm_w) {
    xn = torch::empty({Bsz, Dm}, opts);
    float* pxn = xn.data_ptr<float>();
    for (int64_t b = 0; b < Bsz; ++b) {
      const float* xr = px + b * Dm;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t k = 0; k < Dm; ++k) ss += xr[k] * xr[k];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(Dm) + static_cast<float>(norm_eps));
      for (int64_t k = 0; k < Dm; ++k) pxn[b * Dm + k] = xr[k] * rstd * pnorm_w[k];
    }
  }
  matvec(in_w.data_ptr<float>(), pin_b, 2 * E, Dm, pnorm_w ? xn.data_ptr<float>() : px, Bsz, pxz, parallel);

  // Conv: the window is the last W - 1 states and the new input; the state shifts by one.
  const float* pcw = conv_w.data_ptr<float>();
  float* pcs = conv_state.data_ptr<float>();
  for (int64_t b = 0; b < Bsz; ++b) {
    for (int64_t e = 0; e < E; ++e) {
      float* st = pcs + (b * E + e) * S;
      const float* w = pcw + e * W;
      const float xin = pxz[b * 2 * E + e];
      float acc = pconv_b ? pconv_b[e] : 0.f;
      for (int64_t k = 0; k < W - 1; ++k) acc += w[k] * st[S - (W - 1) + k];
      acc += w[W - 1] * xin;
      for (int64_t k = 0; k + 1 < S; ++k) st[k] = st[k + 1];
      if (S > 0) st[S - 1] = xin;
      pxc[b * E + e] = acc * sigmoid_f(acc);
    }
  }

  matvec(xproj_w.data_ptr<float>(), pxproj_b, R + 2 * N, E, pxc, Bsz, pxd, parallel);

  // dt_proj, softplus and the state update, one channel at a time.
  const float* pdw = dtproj_w.data_ptr<float>();
  const float* pAl = A_log.data_ptr<float>();
  float* pss = ssm_state.data_ptr<float>();
  const int64_t chan_grain = parallel ? std::max<int64_t>(1, GRAIN / std::max<int64_t>(4 * (R + N), 1))
                                        : std::max<int64_t>(E, 1);
  fastarch::parallel_for(0, E, chan_grain, [&](int64_t e0, int64_t e1) {
    for (int64_t b = 0; b < Bsz; ++b) {
      const float* dtr = pxd + b * (R + 2 * N);
      const float* Bv = dtr + R;
      const float* Cv = Bv + N;
      for (int64_t e = e0; e < e1; ++e) {
        const float* w = pdw + e * R;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t k = 0; k < R; ++k) d += w[k] * dtr[k];
        d = softplus_f(d + (pdt_b ? pdt_b[e] : 0.f));
        const float u = pxc[b * E + e];
        const float du = d * u;
        float* st = pss + (b * E + e) * N;
        const float* al = pAl + e * N;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
          const float v = st[n] * fast_exp(-d * fast_exp(al[n])) + du * Bv[n];
          st[n] = v;
          acc += v * Cv[n];
        }
        if (pD) acc += u * pD[e];
        const float z = pxz[b * 2 * E + E + e];
        py[b * E + e] = acc * z * sigmoid_f(z);
      }
    }
  });

  float* pout = out.data_ptr<float>();
  matvec(out_w.data_ptr<float>(), pout_b, Dout, E, py, Bsz, pout, parallel);
  if (residual) {
    for (int64_t i = 0; i < Bsz * Dm; ++i) pout[i] += px[i];
  }
  return out;
}

// One decode step of a Mamba-2 mixer. x (Bsz, Dm); in_w (2 H P + 2 G N + H, Dm): rows [z | x B C | dt];
// conv_state (Bsz, Cd, S >= W - 1) with Cd = H P + 2 G N; conv_w (Cd, W); A_log (H) (A = -exp(A_log));
// ssm_state (Bsz, H, P, N); out_w (Dout, H P). Optional: in_b, conv_b (Cd), dt_bias (H), D (H or H P),
// out_b (Dout); norm_w (H P): the gated RMS norm over groups of norm_group channels (norm_before_gate: norm(y) *
// silu(z), else norm(y * silu(z))), without it y * silu(z). dt = clamp(softplus(dt + dt_bias), dt_lo, dt_hi).
torch::Tensor mamba2_step(const torch::Tensor& x, const torch::Tensor& in_w, const c10::optional<torch::Tensor>& in_b,
                          torch::Tensor conv_state, const torch::Tensor& conv_w,
                          const c10::optional<torch::Tensor>& conv_b, const c10::optional<torch::Tensor>& dt_bias,
                          const torch::Tensor& A_log, const c10::optional<torch::Tensor>& D, torch::Tensor ssm_state,
                          const c10::optional<torch::Tensor>& norm_w, double norm_eps, int64_t norm_group,
                          bool norm_before_gate, const torch::Tensor& out_w, const c10::optional<torch::Tensor>& out_b,
                          int64_t G, double dt_lo, double dt_hi, bool parallel) {
  TORCH_CHECK(x.dim() == 2 && in_w.dim() == 2 && conv_w.dim() == 2 && A_log.dim() == 1 && ssm_state.dim() == 4 &&
                  conv_state.dim() == 3 && out_w.dim() == 2,
              "mamba2_step: x (B, d_model), in_w (d_in_proj, d_model), conv_w (Cd, W), A_log (H), "
              "ssm_state (B, H, P, N), conv_state (B, Cd, S), out_w (d_out, H P)");
  const int64_t Bsz = x.size(0), Dm = x.size(1), H = ssm_state.size(1), P = ssm_state.size(2),
                N = ssm_state.size(3), E = H * P, W = conv_w.size(1), S = conv_state.size(2);
  TORCH_CHECK(G >= 1 && H % G == 0, "mamba2_step: the heads must split evenly into ", G, " groups");
  const int64_t Cd = E + 2 * G * N, Din = 2 * E + 2 * G * N + H, Dout = out_w.size(0);
  TORCH_CHECK(S >= W - 1 && W >= 1, "mamba2_step: conv_state must hold at least W - 1 steps");
  check_f32(x, "x", {Bsz, Dm});
  check_f32(in_w, "in_w", {Din, Dm});
  check_f32(conv_state, "conv_state", {Bsz, Cd, S});
  check_f32(conv_w, "conv_w", {Cd, W});
  check_f32(A_log, "A_log", {H});
  check_f32(ssm_state, "ssm_state", {Bsz, H, P, N});
  check_f32(out_w, "out_w", {Dout, E});
  const float* pin_b = opt_ptr(in_b, Din, "in_b");
  const float* pconv_b = opt_ptr(conv_b, Cd, "conv_b");
  const float* pdt_b = opt_ptr(dt_bias, H, "dt_bias");
  const bool d_per_channel = D.has_value() && D->defined() && D->numel() == E && E != H;
  const float* pD = opt_ptr(D, d_per_channel ? E : H, "D");
  const float* pout_b = opt_ptr(out_b, Dout, "out_b");
  const float* pnorm_w = opt_ptr(norm_w, E, "norm_w");
  TORCH_CHECK(!pnorm_w || (norm_group >= 1 && E % norm_group == 0), "mamba2_step: norm_group must divide ", E);

  auto opts = x.options();
  auto proj = torch::empty({Bsz, Din}, opts);  // in_proj: [z | x B C | dt]
  auto xbc = torch::empty({Bsz, Cd}, opts);    // conv + SiLU
  auto y = torch::empty({Bsz, E}, opts);       // gated, normalised scan output
  auto out = torch::empty({Bsz, Dout}, opts);
  float* pp = proj.data_ptr<float>();
  float* pc = xbc.data_ptr<float>();
  float* py = y.data_ptr<float>();
  matvec(in_w.data_ptr<float>(), pin_b, Din, Dm, x.data_ptr<float>(), Bsz, pp, parallel);

  // Conv: the window is the last W - 1 states and the new input; the state shifts by one.
  const float* pcw = conv_w.data_ptr<float>();
  float* pcs = conv_state.data_ptr<float>();
  for (int64_t b = 0; b < Bsz; ++b) {
    for (int64_t c = 0; c < Cd; ++c) {
      float* st = pcs + (b * Cd + c) * S;
      const float* w = pcw + c * W;
      const float xin = pp[b * Din + E + c];
      float acc = pconv_b ? pconv_b[c] : 0.f;
      for (int64_t k = 0; k < W - 1; ++k) acc += w[k] * st[S - (W - 1) + k];
      acc += w[W - 1] * xin;
      for (int64_t k = 0; k + 1 < S; ++k) st[k] = st[k + 1];
      if (S > 0) st[S - 1] = xin;
      pc[b * Cd + c] = acc * sigmoid_f(acc);
    }
  }

  // The state update, one head at a time: dt and exp(dt A) per head, B and C of the head's group.
  const float* pAl = A_log.data_ptr<float>();
  float* pss = ssm_state.data_ptr<float>();
  const float lo = static_cast<float>(dt_lo), hi = static_cast<float>(dt_hi);
  const int64_t heads_per_group = H / G;
  const int64_t head_grain = parallel ? std::max<int64_t>(1, GRAIN / std::max<int64_t>(4 * P * N, 1))
                                        : std::max<int64_t>(H, 1);
  fastarch::parallel_for(0, H, head_grain, [&](int64_t h0, int64_t h1) {
    for (int64_t b = 0; b < Bsz; ++b) {
      const float* xr = pc + b * Cd;
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t g = h / heads_per_group;
        const float* Bv = xr + E + g * N;
        const float* Cv = xr + E + G * N + g * N;
        float d = softplus_f(pp[b * Din + 2 * E + 2 * G * N + h] + (pdt_b ? pdt_b[h] : 0.f));
        d = std::min(std::max(d, lo), hi);
        const float dA = std::exp(-d * std::exp(pAl[h]));
        for (int64_t p = 0; p < P; ++p) {
          const float u = xr[h * P + p];
          const float du = d * u;
          float* st = pss + ((b * H + h) * P + p) * N;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t n = 0; n < N; ++n) {
            const float v = st[n] * dA + du * Bv[n];
            st[n] = v;
            acc += v * Cv[n];
          }
          if (pD) acc += u * pD[d_per_channel ? h * P + p : h];
          py[b * E + h * P + p] = acc;
        }
      }
    }
  });

  // The gate and the grouped RMS norm.
  for (int64_t b = 0; b < Bsz; ++b) {
    float* yr = py + b * E;
    const float* z = pp + b * Din;
    if (!pnorm_w) {
      for (int64_t e = 0; e < E; ++e) yr[e] *= z[e] * sigmoid_f(z[e]);
      continue;
    }
    if (!norm_before_gate)
      for (int64_t e = 0; e < E; ++e) yr[e] *= z[e] * sigmoid_f(z[e]);
    for (int64_t g0 = 0; g0 < E; g0 += norm_group) {
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = g0; e < g0 + norm_group; ++e) ss += yr[e] * yr[e];
      const float rstd = 1.f / std::sqrt(ss / static_cast<float>(norm_group) + static_cast<float>(norm_eps));
      for (int64_t e = g0; e < g0 + norm_group; ++e) yr[e] *= rstd * pnorm_w[e];
    }
    if (norm_before_gate)
      for (int64_t e = 0; e < E; ++e) yr[e] *= z[e] * sigmoid_f(z[e]);
  }

  matvec(out_w.data_ptr<float>(), pout_b, Dout, E, py, Bsz, out.data_ptr<float>(), parallel);
  return out;
}

// Storage types of the decoder step: fp32, or bf16 read into fp32 (the step computes in fp32).
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A vector argument (norm weights, biases, angles) as fp32: the values of t, of dtype st and numel elements.
// Empty when t is absent.
std::vector<float> floats(const c10::optional<torch::Tensor>& t, torch::ScalarType st, int64_t numel,
                          const char* name) {
  if (!t.has_value() || !t->defined()) return {};
  check_cpu_contig(*t, name);
  TORCH_CHECK(t->scalar_type() == st && t->numel() == numel, "decode_step: ", name, " must be ", st, " with ", numel,
              " elements, got ", t->scalar_type(), " with ", t->numel());
  std::vector<float> out(static_cast<size_t>(numel));
  if (st == torch::kFloat) {
    std::copy(t->data_ptr<float>(), t->data_ptr<float>() + numel, out.begin());
  } else {
    const c10::BFloat16* p = t->data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < numel; ++i) out[i] = to_float(p[i]);
  }
  return out;
}

inline const float* ptr_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// Norm of each row of x (rows, n) into y: RMS (x * rsqrt(mean(x^2) + eps) * w) or, with bias b (layer),
// (x - mean) * rsqrt(var + eps) * w + b.
void norm_rows(const float* x, const float* w, const float* b, bool rms, int64_t rows, int64_t n, float eps,
               float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float mean = 0.f;
    if (!rms) {
#pragma omp simd reduction(+ : mean)
      for (int64_t k = 0; k < n; ++k) mean += xr[k];
      mean /= static_cast<float>(n);
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < n; ++k) ss += (xr[k] - mean) * (xr[k] - mean);
    const float rstd = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* yr = y + r * n;
    for (int64_t k = 0; k < n; ++k) yr[k] = (xr[k] - mean) * rstd * w[k] + (b ? b[k] : 0.f);
  }
}

// A projection's weight, logically (N, K) as nn.Linear keeps it: row-major (unit stride over K), or a
// column-major view of a (K, >= N) matrix (unit stride over N: a Conv1D weight, or a column block of one).
template <typename T>
struct Weight {
  const T* data;
  int64_t N, K, ld;  // ld: the stride of the non-unit dimension
  bool columns;      // column-major: element (n, k) at data[k * ld + n]
};

template <typename T>
Weight<T> weight_of(const torch::Tensor& w, const char* name, int64_t N, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == c10::CppTypeToScalarType<T>::value && w.dim() == 2 &&
                  w.size(0) == N && w.size(1) == K,
              "decode_step: ", name, " must be a ", c10::CppTypeToScalarType<T>::value, " CPU (", N, ", ", K,
              ") tensor, got ", w.scalar_type(), " ", w.sizes());
  if (w.stride(1) == 1 && (w.stride(0) >= K || N == 1)) return {w.data_ptr<T>(), N, K, w.stride(0), false};
  TORCH_CHECK(w.stride(0) == 1 && (w.stride(1) >= N || K == 1), "decode_step: ", name,
              " must have unit stride over one dimension (row- or column-major)");
  return {w.data_ptr<T>(), N, K, w.stride(1), true};
}

// Y (M, N) = X (M, K) W^T + bias (fp32 X, Y and bias) for either layout and storage type of W.
template <typename T>
void project(const Weight<T>& w, const float* bias, const float* X, int64_t M, float* Y, bool parallel) {
  if constexpr (std::is_same_v<T, float>) {
    if (!w.columns && w.ld == w.K) {
      matvec(w.data, bias, w.N, w.K, X, M, Y, parallel);
      return;
    }
  }
  if (!w.columns) {
    const int64_t grain = parallel ? std::max<int64_t>(1, GRAIN / std::max<int64_t>(w.K, 1)) : std::max<int64_t>(w.N, 1);
    fastarch::parallel_for(0, w.N, grain, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const T* row = w.data + n * w.ld;
        for (int64_t m = 0; m < M; ++m) {
          const float* x = X + m * w.K;
          float a = 0.f;
#pragma omp simd reduction(+ : a)
          for (int64_t k = 0; k < w.K; ++k) a += to_float(row[k]) * x[k];
          Y[m * w.N + n] = a + (bias ? bias[n] : 0.f);
        }
      }
    });
    return;
  }
  // Column-major: y += x[k] * W[k, :], streaming each row of the (K, N) matrix once per batch row; columns
  // split over threads in blocks of at least GRAIN elements.
  const int64_t block = 64;
  const int64_t blocks = (w.N + block - 1) / block;
  const int64_t grain = parallel ? std::max<int64_t>(1, GRAIN / (block * std::max<int64_t>(w.K, 1))) : blocks;
  fastarch::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t m = 0; m < M; ++m) {
      const float* x = X + m * w.K;
      float* y = Y + m * w.N;
      const int64_t n0 = b0 * block, n1 = std::min(w.N, b1 * block);
      for (int64_t n = n0; n < n1; ++n) y[n] = bias ? bias[n] : 0.f;
      for (int64_t k = 0; k < w.K; ++k) {
        const float xk = x[k];
        const T* row = w.data + k * w.ld;
#pragma omp simd
        for (int64_t n = n0; n < n1; ++n) y[n] += xk * to_float(row[n]);
      }
    }
  });
}

// Rows of a (rows, n) tensor of storage type T into fp32 (a contiguous copy).
template <typename T>
std::vector<float> rows_f32(const torch::Tensor& t, const char* name, int64_t rows, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == rows * n, "decode_step: ", name,
              " must be a contiguous CPU tensor of ", rows * n, " elements");
  std::vector<float> out(static_cast<size_t>(rows * n));
  const T* p = t.data_ptr<T>();
  for (int64_t i = 0; i < rows * n; ++i) out[i] = to_float(p[i]);
  return out;
}

template <typename T>
torch::Tensor stored(const float* v, c10::IntArrayRef shape, const torch::TensorOptions& opts) {
  auto out = torch::empty(shape, opts);
  T* p = out.data_ptr<T>();
  for (int64_t i = 0; i < out.numel(); ++i) p[i] = static_cast<T>(v[i]);
  return out;
}

// Rotates each of the rows (rows, D) of v by the angles (cos, sin) (R / 2 each): channel pairs (i, i + R / 2) for
// i < R / 2 (rotate-half pairs over the first R channels; the rest pass through).
void rotate_rows(float* v, int64_t rows, int64_t D, const float* c, const float* s, int64_t half) {
  for (int64_t r = 0; r < rows; ++r) {
    float* x = v + r * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * c[i] - b * s[i];
      x[i + half] = b * c[i] + a * s[i];
    }
  }
}

// First half of a pre-norm decoder layer's decode step, every tensor fp32 or every tensor bf16 (computed in fp32,
// the results rounded once). x (B, d); norm_w (d), norm_b (d) for a layer norm (else RMS); q_w (H D, d), k_w and
// v_w (Hk D, d), each row- or column-major (see Weight), biases optional; q_norm_w and k_norm_w (D), optional: a
// per-head RMS norm of q and k before the rotation (epsilon head_eps); cos and sin (Bc, R / 2), Bc 1 or B,
// R <= D even, optional: the rotation's angles. Returns q (B, H, D), k (B, Hk, D) rotated and v (B, Hk, D).
template <typename T>
std::vector<torch::Tensor> qkv_step(const torch::Tensor& x, const torch::Tensor& norm_w,
                                    const c10::optional<torch::Tensor>& norm_b, double norm_eps,
                                    const torch::Tensor& q_w, const c10::optional<torch::Tensor>& q_b,
                                    const torch::Tensor& k_w, const c10::optional<torch::Tensor>& k_b,
                                    const torch::Tensor& v_w, const c10::optional<torch::Tensor>& v_b,
                                    const c10::optional<torch::Tensor>& q_norm_w,
                                    const c10::optional<torch::Tensor>& k_norm_w, double head_eps,
                                    const c10::optional<torch::Tensor>& cos, const c10::optional<torch::Tensor>& sin,
                                    int64_t H, int64_t Hk, bool parallel) {
  const auto st = x.scalar_type();
  const int64_t Bsz = x.size(0), Dm = x.size(1), D = q_w.size(0) / H;
  const Weight<T> wq = weight_of<T>(q_w, "q_w", H * D, Dm), wk = weight_of<T>(k_w, "k_w", Hk * D, Dm),
                  wv = weight_of<T>(v_w, "v_w", Hk * D, Dm);
  const std::vector<float> nw = floats(norm_w, st, Dm, "norm_w"), nb = floats(norm_b, st, Dm, "norm_b"),
                           qb = floats(q_b, st, H * D, "q_b"), kb = floats(k_b, st, Hk * D, "k_b"),
                           vb = floats(v_b, st, Hk * D, "v_b"), qn = floats(q_norm_w, st, D, "q_norm_w"),
                           kn = floats(k_norm_w, st, D, "k_norm_w");
  const bool rotary = cos.has_value() && cos->defined();
  int64_t half = 0, Bc = 1;
  std::vector<float> cs, sn;
  if (rotary) {
    TORCH_CHECK(cos->dim() == 2 && sin.has_value() && sin->defined(), "decoder_qkv_step: cos and sin must be (Bc, R/2)");
    half = cos->size(1);
    Bc = cos->size(0);
    TORCH_CHECK(2 * half <= D && (Bc == 1 || Bc == Bsz), "decoder_qkv_step: cos must be (1 or B, <= D / 2)");
    TORCH_CHECK(sin->sizes() == cos->sizes(), "decoder_qkv_step: sin must have cos's shape");
    cs = floats(cos, st, Bc * half, "cos");
    sn = floats(sin, st, Bc * half, "sin");
  }
  const std::vector<float> xf = rows_f32<T>(x, "x", Bsz, Dm);
  std::vector<float> xn(static_cast<size_t>(Bsz * Dm)), q(static_cast<size_t>(Bsz * H * D)),
      k(static_cast<size_t>(Bsz * Hk * D)), v(static_cast<size_t>(Bsz * Hk * D));
  norm_rows(xf.data(), nw.data(), ptr_or_null(nb), nb.empty(), Bsz, Dm, static_cast<float>(norm_eps), xn.data());
  project(wq, ptr_or_null(qb), xn.data(), Bsz, q.data(), parallel);
  project(wk, ptr_or_null(kb), xn.data(), Bsz, k.data(), parallel);
  project(wv, ptr_or_null(vb), xn.data(), Bsz, v.data(), parallel);
  if (!qn.empty()) norm_rows(q.data(), qn.data(), nullptr, true, Bsz * H, D, static_cast<float>(head_eps), q.data());
  if (!kn.empty()) norm_rows(k.data(), kn.data(), nullptr, true, Bsz * Hk, D, static_cast<float>(head_eps), k.data());
  if (rotary) {
    for (int64_t b = 0; b < Bsz; ++b) {
      const int64_t t = Bc == 1 ? 0 : b;
      rotate_rows(q.data() + b * H * D, H, D, cs.data() + t * half, sn.data() + t * half, half);
      rotate_rows(k.data() + b * Hk * D, Hk, D, cs.data() + t * half, sn.data() + t * half, half);
    }
  }
  const auto opts = x.options();
  return {stored<T>(q.data(), {Bsz, H, D}, opts), stored<T>(k.data(), {Bsz, Hk, D}, opts),
          stored<T>(v.data(), {Bsz, Hk, D}, opts)};
}

std::vector<torch::Tensor> decoder_qkv_step(const torch::Tensor& x, const torch::Tensor& norm_w,
                                            const c10::optional<torch::Tensor>& norm_b, double norm_eps,
                                            const torch::Tensor& q_w, const c10::optional<torch::Tensor>& q_b,
                                            const torch::Tensor& k_w, const c10::optional<torch::Tensor>& k_b,
                                            const torch::Tensor& v_w, const c10::optional<torch::Tensor>& v_b,
                                            const c10::optional<torch::Tensor>& q_norm_w,
                                            const c10::optional<torch::Tensor>& k_norm_w, double head_eps,
                                            const c10::optional<torch::Tensor>& cos,
                                            const c10::optional<torch::Tensor>& sin, int64_t H, int64_t Hk,
                                            bool parallel) {
  TORCH_CHECK(x.dim() == 2 && q_w.dim() == 2 && H >= 1 && Hk >= 1 && q_w.size(0) % H == 0,
              "decoder_qkv_step: x (B, d), q_w (H D, d)");
  if (x.scalar_type() == torch::kBFloat16)
    return qkv_step<c10::BFloat16>(x, norm_w, norm_b, norm_eps, q_w, q_b, k_w, k_b, v_w, v_b, q_norm_w, k_norm_w,
                                   head_eps, cos, sin, H, Hk, parallel);
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "decoder_qkv_step: x must be fp32 or bf16, got ", x.scalar_type());
  return qkv_step<float>(x, norm_w, norm_b, norm_eps, q_w, q_b, k_w, k_b, v_w, v_b, q_norm_w, k_norm_w, head_eps, cos,
                         sin, H, Hk, parallel);
}

inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + std::tanh(u));
}

// Second half of the step, every tensor fp32 or every tensor bf16 (computed in fp32, the result rounded once).
// q (B, H, D); key and value (B, Hk, S, D), unit stride in D, S >= n: the query (at position n - 1) attends keys
// [j0, n) with j0 = max(0, n - 1 - left) (left < 0: all), scaled by scale, its head reading key head h / (H / Hk).
// Then h = residual + attn @ o_w^T (+ o_b). With the MLP (up_w and down_w): m = norm(h) (norm_w, norm_b as in
// decoder_qkv_step) and the result is h + down(a) + down_b with a = silu(gate(m)) * up(m) (gate_w given:
// SwiGLU) or a = gelu_tanh(up(m) + up_b) (no gate: GPT-2's MLP); without it, h. residual (B, d); o_w (d, H D);
// gate_w, up_w (I, d); down_w (d, I): any layout of Weight.
template <typename T>
torch::Tensor out_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value, int64_t n,
                       int64_t left, double scale, const torch::Tensor& residual, const torch::Tensor& o_w,
                       const c10::optional<torch::Tensor>& o_b, const c10::optional<torch::Tensor>& norm_w,
                       const c10::optional<torch::Tensor>& norm_b, double norm_eps,
                       const c10::optional<torch::Tensor>& gate_w, const c10::optional<torch::Tensor>& up_w,
                       const c10::optional<torch::Tensor>& up_b, const c10::optional<torch::Tensor>& down_w,
                       const c10::optional<torch::Tensor>& down_b, bool parallel) {
  const auto st = q.scalar_type();
  const int64_t Bsz = q.size(0), H = q.size(1), D = q.size(2), Hk = key.size(1), Dm = residual.size(1);
  TORCH_CHECK(key.scalar_type() == st && value.scalar_type() == st && residual.scalar_type() == st,
              "decoder_out_step: q, key, value and residual must share one dtype");
  const Weight<T> wo = weight_of<T>(o_w, "o_w", Dm, H * D);
  const std::vector<float> ob = floats(o_b, st, Dm, "o_b");
  const bool mlp = up_w.has_value() && up_w->defined();
  const bool gated = gate_w.has_value() && gate_w->defined();
  int64_t I = 0;
  Weight<T> wg{}, wu{}, wd{};
  std::vector<float> ub, db, nw, nb;
  if (mlp) {
    I = up_w->size(0);
    wu = weight_of<T>(*up_w, "up_w", I, Dm);
    if (gated) wg = weight_of<T>(*gate_w, "gate_w", I, Dm);
    TORCH_CHECK(down_w.has_value() && down_w->defined(), "decoder_out_step: the MLP needs down_w");
    wd = weight_of<T>(*down_w, "down_w", Dm, I);
    ub = floats(up_b, st, I, "up_b");
    db = floats(down_b, st, Dm, "down_b");
    nw = floats(norm_w, st, Dm, "norm_w");
    nb = floats(norm_b, st, Dm, "norm_b");
    TORCH_CHECK(!nw.empty(), "decoder_out_step: the MLP needs norm_w");
  }
  const std::vector<float> qf = rows_f32<T>(q, "q", Bsz, H * D), rf = rows_f32<T>(residual, "residual", Bsz, Dm);

  std::vector<float> attn(static_cast<size_t>(Bsz * H * D));
  float* pa = attn.data();
  const T* pk = key.data_ptr<T>();
  const T* pv = value.data_ptr<T>();
  const int64_t ksb = key.stride(0), ksh = key.stride(1), kss = key.stride(2);
  const int64_t vsb = value.stride(0), vsh = value.stride(1), vss = value.stride(2);
  const int64_t j0 = left < 0 ? 0 : std::max<int64_t>(0, n - 1 - left);
  const int64_t L = n - j0, group = H / Hk;
  const float sc = static_cast<float>(scale);
  const int64_t head_grain = parallel ? std::max<int64_t>(1, GRAIN / std::max<int64_t>(2 * L * D, 1))
                                      : std::max<int64_t>(Bsz * H, 1);
  fastarch::parallel_for(0, Bsz * H, head_grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(static_cast<size_t>(L));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H, g = h / group;
      const float* qh = qf.data() + t * D;
      const T* kh = pk + b * ksb + g * ksh + j0 * kss;
      const T* vh = pv + b * vsb + g * vsh + j0 * vss;
      float mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        const T* kr = kh + j * kss;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qh[d] * to_float(kr[d]);
        p[j] = s * sc;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      float* out = pa + t * D;
      std::fill(out, out + D, 0.f);
      for (int64_t j = 0; j < L; ++j) {
        const float w = p[j] / sum;
        const T* vr = vh + j * vss;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out[d] += w * to_float(vr[d]);
      }
    }
  });

  std::vector<float> hid(static_cast<size_t>(Bsz * Dm));
  project(wo, ptr_or_null(ob), pa, Bsz, hid.data(), parallel);
  for (int64_t i = 0; i < Bsz * Dm; ++i) hid[i] += rf[i];
  if (!mlp) return stored<T>(hid.data(), {Bsz, Dm}, q.options());

  std::vector<float> m(static_cast<size_t>(Bsz * Dm)), u(static_cast<size_t>(Bsz * I)), out(static_cast<size_t>(Bsz * Dm));
  norm_rows(hid.data(), nw.data(), ptr_or_null(nb), nb.empty(), Bsz, Dm, static_cast<float>(norm_eps), m.data());
  project(wu, ptr_or_null(ub), m.data(), Bsz, u.data(), parallel);
  if (gated) {
    std::vector<float> g(static_cast<size_t>(Bsz * I));
    project(wg, nullptr, m.data(), Bsz, g.data(), parallel);
    for (int64_t i = 0; i < Bsz * I; ++i) u[i] *= g[i] * sigmoid_f(g[i]);
  } else {
    for (int64_t i = 0; i < Bsz * I; ++i) u[i] = gelu_tanh(u[i]);
  }
  project(wd, ptr_or_null(db), u.data(), Bsz, out.data(), parallel);
  for (int64_t i = 0; i < Bsz * Dm; ++i) out[i] += hid[i];
  return stored<T>(out.data(), {Bsz, Dm}, q.options());
}

torch::Tensor decoder_out_step(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                               int64_t n, int64_t left, double scale, const torch::Tensor& residual,
                               const torch::Tensor& o_w, const c10::optional<torch::Tensor>& o_b,
                               const c10::optional<torch::Tensor>& norm_w, const c10::optional<torch::Tensor>& norm_b,
                               double norm_eps, const c10::optional<torch::Tensor>& gate_w,
                               const c10::optional<torch::Tensor>& up_w, const c10::optional<torch::Tensor>& up_b,
                               const c10::optional<torch::Tensor>& down_w, const c10::optional<torch::Tensor>& down_b,
                               bool parallel) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && value.dim() == 4 && residual.dim() == 2 && o_w.dim() == 2,
              "decoder_out_step: q (B, H, D), key and value (B, Hk, S, D), residual (B, d), o_w (d, H D)");
  const int64_t Bsz = q.size(0), H = q.size(1), D = q.size(2), Hk = key.size(1);
  TORCH_CHECK(Hk >= 1 && H % Hk == 0, "decoder_out_step: key heads must divide the query heads");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == Bsz && key.size(3) == D && n >= 1 && n <= key.size(2),
              "decoder_out_step: key and value must be (B, Hk, S >= n, D)");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1 && key.device().is_cpu() && value.device().is_cpu() &&
                  residual.size(0) == Bsz,
              "decoder_out_step: key and value must be CPU tensors with unit stride over D");
  if (q.scalar_type() == torch::kBFloat16)
    return out_step<c10::BFloat16>(q, key, value, n, left, scale, residual, o_w, o_b, norm_w, norm_b, norm_eps, gate_w,
                                   up_w, up_b, down_w, down_b, parallel);
  TORCH_CHECK(q.scalar_type() == torch::kFloat, "decoder_out_step: q must be fp32 or bf16, got ", q.scalar_type());
  return out_step<float>(q, key, value, n, left, scale, residual, o_w, o_b, norm_w, norm_b, norm_eps, gate_w, up_w,
                         up_b, down_w, down_b, parallel);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: fused decode steps on CPU (Mamba-1 and Mamba-2 mixers, pre-norm decoder layers)";
  m.def("mamba_step", &mamba_step, "Mamba-1 mixer decode step (conv and SSM states in place) -> out");
  m.def("mamba2_step", &mamba2_step, "Mamba-2 mixer decode step (conv and SSM states in place) -> out");
  m.def("decoder_qkv_step", &decoder_qkv_step, "decoder layer decode step, first half: norm, q/k/v, rotary -> (q, k, v)");
  m.def("decoder_out_step", &decoder_out_step, "decoder layer decode step, second half: attention, o_proj, MLP -> out");
}
