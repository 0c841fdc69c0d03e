// Mamba-3's recurrence on the CPU: one pass over the steps per (batch, head), the (P, N) state in fp32 scratch.
// Serves the scan's forward (any L) and the decode step (L = 1). Inputs are fp32 and contiguous, in the
// canonical shapes of fastarch/ops/mamba3_scan.py: Q, K (B, L, R, G, N); V, Z (B, L, H, P); ADT, DT, Trap
// (B, H, L); biases (H, R, N); Angles (B, L, H, S); D (H,); states angle (B, H, S), ssm (B, H, P, N),
// k (B, R, H, N), v (B, H, P); mimo_v, mimo_z, mimo_o (H, R, P).

#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "fastarch_parallel.h"
#include "fastarch_tensor.h"

namespace {

using fastarch::check_cpu_contig;
using OptT = c10::optional<torch::Tensor>;

constexpr float kPi = 3.14159265358979323846f;
constexpr float kTwoPi = 6.28318530717958647692f;

const float* ptr_or_null(const OptT& t, const char* name) {
  if (!t.has_value()) return nullptr;
  check_cpu_contig(*t, name);
  TORCH_CHECK(t->scalar_type() == torch::kFloat32, name, " must be float32");
  return t->data_ptr<float>();
}

// Turn S channel pairs of x (N) by theta (S): pairs (2i, 2i+1) when pairwise, else (i, i + N/2).
inline void rotate(float* x, const float* c, const float* s, int64_t S, int64_t N, bool pairwise) {
  for (int64_t i = 0; i < S; ++i) {
    const int64_t a = pairwise ? 2 * i : i, b = pairwise ? 2 * i + 1 : i + N / 2;
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * c[i] - x1 * s[i];
    x[b] = x0 * s[i] + x1 * c[i];
  }
}

// Returns (out, angle, ssm, k, v); out is (B, L, H, P), or (B, L, R, H, P) with mimo_v and without mimo_o.
std::vector<torch::Tensor> mamba3_scan_fwd(const torch::Tensor& Q, const torch::Tensor& K, const torch::Tensor& V,
                                           const torch::Tensor& ADT, const torch::Tensor& DT,
                                           const torch::Tensor& Trap, const torch::Tensor& Q_bias,
                                           const torch::Tensor& K_bias, const torch::Tensor& Angles, const OptT& D,
                                           const OptT& Z, const OptT& angle0, const OptT& ssm0, const OptT& k0,
                                           const OptT& v0, const OptT& mimo_v, const OptT& mimo_z,
                                           const OptT& mimo_o, bool pairwise) {
  for (const auto* t : {&Q, &K, &V, &ADT, &DT, &Trap, &Q_bias, &K_bias, &Angles}) {
    check_cpu_contig(*t, "input");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "mamba3_scan_fwd: inputs must be float32");
  }
  TORCH_CHECK(Q.dim() == 5 && V.dim() == 4, "mamba3_scan_fwd: Q must be (B, L, R, G, N) and V (B, L, H, P)");
  const int64_t B = Q.size(0), L = Q.size(1), R = Q.size(2), G = Q.size(3), N = Q.size(4);
  const int64_t H = V.size(2), P = V.size(3), S = Angles.size(3), rep = H / G;
  const float *q = Q.data_ptr<float>(), *k = K.data_ptr<float>(), *v = V.data_ptr<float>();
  const float *adt = ADT.data_ptr<float>(), *dtp = DT.data_ptr<float>(), *trap = Trap.data_ptr<float>();
  const float *qb = Q_bias.data_ptr<float>(), *kb = K_bias.data_ptr<float>(), *ang = Angles.data_ptr<float>();
  const float *d = ptr_or_null(D, "D"), *z = ptr_or_null(Z, "Z");
  const float *a0 = ptr_or_null(angle0, "angle_state"), *s0 = ptr_or_null(ssm0, "ssm_state");
  const float *k0p = ptr_or_null(k0, "k_state"), *v0p = ptr_or_null(v0, "v_state");
  const float *mv = ptr_or_null(mimo_v, "mimo_v"), *mz = ptr_or_null(mimo_z, "mimo_z");
  const float* mo = ptr_or_null(mimo_o, "mimo_o");
  const bool ranks_out = mv != nullptr && mo == nullptr;
  auto opts = V.options();
  auto out = ranks_out ? torch::empty({B, L, R, H, P}, opts) : torch::empty({B, L, H, P}, opts);
  auto angle = torch::empty({B, H, S}, opts), ssm = torch::empty({B, H, P, N}, opts);
  auto kout = torch::empty({B, R, H, N}, opts), vout = torch::empty({B, H, P}, opts);
  float *op = out.data_ptr<float>(), *ap = angle.data_ptr<float>(), *sp = ssm.data_ptr<float>();
  float *kop = kout.data_ptr<float>(), *vop = vout.data_ptr<float>();

  fastarch::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> theta(S);
    std::vector<float> c(S), s(S), qr(R * N), kr(R * N), kp(R * N), vr(R * P), vp(R * P), y(R * P);
    for (int64_t bh = i0; bh < i1; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / rep;
      float* st = sp + bh * P * N;  // the state lives in the output
      for (int64_t j = 0; j < S; ++j) theta[j] = a0 ? a0[bh * S + j] : 0.0;
      for (int64_t j = 0; j < P * N; ++j) st[j] = s0 ? s0[bh * P * N + j] : 0.f;
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < N; ++n) kp[r * N + n] = k0p ? k0p[((b * R + r) * H + h) * N + n] : 0.f;
        for (int64_t p = 0; p < P; ++p) {
          const float x = v0p ? v0p[bh * P + p] : 0.f;
          vp[r * P + p] = mv ? x * mv[(h * R + r) * P + p] : x;
        }
      }
      for (int64_t t = 0; t < L; ++t) {
        const int64_t hl = bh * L + t;
        const float dt = dtp[hl];
        for (int64_t j = 0; j < S; ++j) {  // in fp32, in the oracle's order
          float th = theta[j] + kPi * std::tanh(ang[((b * L + t) * H + h) * S + j]) * dt;
          th -= kTwoPi * std::floor(th / kTwoPi);
          theta[j] = th;
          c[j] = std::cos(th);
          s[j] = std::sin(th);
        }
        for (int64_t r = 0; r < R; ++r) {
          const float* qrow = q + (((b * L + t) * R + r) * G + g) * N;
          const float* krow = k + (((b * L + t) * R + r) * G + g) * N;
          for (int64_t n = 0; n < N; ++n) {
            qr[r * N + n] = qrow[n] + qb[(h * R + r) * N + n];
            kr[r * N + n] = krow[n] + kb[(h * R + r) * N + n];
          }
          rotate(&qr[r * N], c.data(), s.data(), S, N, pairwise);
          rotate(&kr[r * N], c.data(), s.data(), S, N, pairwise);
          const float* vrow = v + ((b * L + t) * H + h) * P;
          for (int64_t p = 0; p < P; ++p) vr[r * P + p] = mv ? vrow[p] * mv[(h * R + r) * P + p] : vrow[p];
        }
        const float lam = 1.f / (1.f + std::exp(-trap[hl]));
        const float alpha = std::exp(adt[hl]), beta = (1.f - lam) * dt * alpha, gamma = lam * dt;
        if (R == 1) {  // SISO (and rank 1): decay, both rank-1 terms and the readout in one pass over each row
          const float *kpr = kp.data(), *kcr = kr.data(), *qq = qr.data();
          for (int64_t p = 0; p < P; ++p) {
            float* row = st + p * N;
            const float wp = beta * vp[p], wc = gamma * vr[p];
            float acc = 0.f;
            _Pragma("omp simd reduction(+ : acc)") for (int64_t n = 0; n < N; ++n) {
              const float x = alpha * row[n] + wp * kpr[n] + wc * kcr[n];
              row[n] = x;
              acc += x * qq[n];
            }
            y[p] = acc + (d ? d[h] * vr[p] : 0.f);
          }
        }
        for (int64_t p = 0; p < P && R > 1; ++p) {
          float* row = st + p * N;
          for (int64_t n = 0; n < N; ++n) row[n] *= alpha;
          for (int64_t r = 0; r < R; ++r) {
            const float wp = beta * vp[r * P + p], wc = gamma * vr[r * P + p];
            const float *kpr = &kp[r * N], *kcr = &kr[r * N];
            _Pragma("omp simd") for (int64_t n = 0; n < N; ++n) row[n] += wp * kpr[n] + wc * kcr[n];
          }
          for (int64_t r = 0; r < R; ++r) {
            const float* qq = &qr[r * N];
            float acc = 0.f;
            _Pragma("omp simd reduction(+ : acc)") for (int64_t n = 0; n < N; ++n) acc += row[n] * qq[n];
            y[r * P + p] = acc + (d ? d[h] * vr[r * P + p] : 0.f);
          }
        }
        if (z) {
          const float* zrow = z + ((b * L + t) * H + h) * P;
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) {
              const float zz = (mz ? zrow[p] * mz[(h * R + r) * P + p] : zrow[p]);
              y[r * P + p] *= zz / (1.f + std::exp(-zz));
            }
        }
        if (ranks_out) {
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) op[(((b * L + t) * R + r) * H + h) * P + p] = y[r * P + p];
        } else {
          float* orow = op + ((b * L + t) * H + h) * P;
          for (int64_t p = 0; p < P; ++p) {
            float acc = 0.f;
            for (int64_t r = 0; r < R; ++r) acc += mo ? y[r * P + p] * mo[(h * R + r) * P + p] : y[r * P + p];
            orow[p] = acc;
          }
        }
        std::swap(kp, kr);
        std::swap(vp, vr);
      }
      for (int64_t j = 0; j < S; ++j) ap[bh * S + j] = theta[j];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = 0; n < N; ++n) kop[((b * R + r) * H + h) * N + n] = kp[r * N + n];
      for (int64_t p = 0; p < P; ++p)
        vop[bh * P + p] = L > 0 ? v[((b * L + L - 1) * H + h) * P + p] : (v0p ? v0p[bh * P + p] : 0.f);
    }
  });
  return {out, angle, ssm, kout, vout};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba3_scan_fwd", &mamba3_scan_fwd,
        "Mamba-3 recurrence, forward: (out, angle, ssm, k, v); with L = 1 the decode step");
}
