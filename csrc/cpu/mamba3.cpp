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


// d(x) of a rotated pair given d(rotated): x -> (x_a c - x_b s, x_a s + x_b c); dtheta += -dq_a q_b + dq_b q_a.
inline void rotate_back(float* dx, const float* rq, const float* c, const float* s, float* dth, int64_t S, int64_t N,
                        bool pairwise) {
  for (int64_t i = 0; i < S; ++i) {
    const int64_t a = pairwise ? 2 * i : i, b = pairwise ? 2 * i + 1 : i + N / 2;
    const float ga = dx[a], gb = dx[b];
    dth[i] += -ga * rq[b] + gb * rq[a];
    dx[a] = ga * c[i] + gb * s[i];
    dx[b] = -ga * s[i] + gb * c[i];
  }
}

// The gradients of mamba3_scan_fwd for the output gradients (each optional). Per (batch, head): one forward
// pass keeps the angles of every step and the state at every chunk start; then chunk by chunk in reverse the
// chunk's states are recomputed and the steps reversed. Parameters shared between batch rows or heads come back
// per (batch, head) (Q, K per head: (B, L, R, H, N)); the caller sums them.
std::vector<torch::Tensor> mamba3_scan_bwd(const OptT& dout, const OptT& dangle, const OptT& dssm, const OptT& dkf,
                                           const OptT& dvf, const torch::Tensor& Q, const torch::Tensor& K,
                                           const torch::Tensor& V, const torch::Tensor& ADT, const torch::Tensor& DT,
                                           const torch::Tensor& Trap, const torch::Tensor& Q_bias,
                                           const torch::Tensor& K_bias, const torch::Tensor& Angles, const OptT& D,
                                           const OptT& Z, const OptT& angle0, const OptT& ssm0, const OptT& k0,
                                           const OptT& v0, const OptT& mimo_v, const OptT& mimo_z,
                                           const OptT& mimo_o, bool pairwise) {
  for (const auto* t : {&Q, &K, &V, &ADT, &DT, &Trap, &Q_bias, &K_bias, &Angles}) {
    check_cpu_contig(*t, "input");
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "mamba3_scan_bwd: inputs must be float32");
  }
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
  const float *gout = ptr_or_null(dout, "dout"), *gang = ptr_or_null(dangle, "dangle");
  const float *gssm = ptr_or_null(dssm, "dssm"), *gk = ptr_or_null(dkf, "dk"), *gv = ptr_or_null(dvf, "dv");
  const bool ranks_out = mv != nullptr && mo == nullptr;
  auto opts = V.options();
  auto dQ = torch::zeros({B, L, R, H, N}, opts), dK = torch::zeros({B, L, R, H, N}, opts);
  auto dV = torch::zeros({B, L, H, P}, opts), dZ = torch::zeros({B, L, H, P}, opts);
  auto dADT = torch::zeros({B, H, L}, opts), dDT = torch::zeros({B, H, L}, opts), dTrap = torch::zeros({B, H, L}, opts);
  auto dAng = torch::zeros({B, L, H, S}, opts);
  auto dQb = torch::zeros({B, H, R, N}, opts), dKb = torch::zeros({B, H, R, N}, opts), dD = torch::zeros({B, H}, opts);
  auto da0 = torch::zeros({B, H, S}, opts), ds0 = torch::zeros({B, H, P, N}, opts);
  auto dk0 = torch::zeros({B, R, H, N}, opts), dv0 = torch::zeros({B, H, P}, opts);
  auto dmv = torch::zeros({B, H, R, P}, opts), dmz = torch::zeros({B, H, R, P}, opts);
  auto dmo = torch::zeros({B, H, R, P}, opts);
  float *dQp = dQ.data_ptr<float>(), *dKp = dK.data_ptr<float>(), *dVp = dV.data_ptr<float>();
  float *dZp = dZ.data_ptr<float>(), *dAp = dADT.data_ptr<float>(), *dDTp = dDT.data_ptr<float>();
  float *dTp = dTrap.data_ptr<float>(), *dAngp = dAng.data_ptr<float>(), *dQbp = dQb.data_ptr<float>();
  float *dKbp = dKb.data_ptr<float>(), *dDp = dD.data_ptr<float>(), *da0p = da0.data_ptr<float>();
  float *ds0p = ds0.data_ptr<float>(), *dk0p = dk0.data_ptr<float>(), *dv0p = dv0.data_ptr<float>();
  float *dmvp = dmv.data_ptr<float>(), *dmzp = dmz.data_ptr<float>(), *dmop = dmo.data_ptr<float>();
  const int64_t C = 32;  // steps per recomputed chunk
  const int64_t NC = (L + C - 1) / C;

  fastarch::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    const int64_t PN = P * N;
    std::vector<float> theta_all((L + 1) * S), ckpt(std::max<int64_t>(NC, 1) * PN), states((C + 1) * PN);
    std::vector<float> c(S), s(S), cp(S), sp(S), qr(R * N), kr(R * N), kp(R * N), vr(R * P), vp(R * P);
    std::vector<float> dS(PN), dth(S), dkc(R * N), dvc(R * P), dkn(R * N), dvn(R * P), dq(R * N), dk(R * N);
    std::vector<float> o(R * P), dov(R * P), qt(R * N), kt(R * N);
    for (int64_t bh = i0; bh < i1; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / rep;
      auto x_idx = [&](int64_t t) { return (b * L + t) * H + h; };  // V, Z, Angles rows
      auto qk_row = [&](const float* base, int64_t t, int64_t r) { return base + (((b * L + t) * R + r) * G + g) * N; };
      auto load_vr = [&](int64_t t, float* dst) {  // v_{t,r}
        const float* vrow = v + x_idx(t) * P;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t p = 0; p < P; ++p) dst[r * P + p] = mv ? vrow[p] * mv[(h * R + r) * P + p] : vrow[p];
      };
      auto load_prev0 = [&](float* kdst, float* vdst) {  // k_{-1}, v_{-1, r}
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t n = 0; n < N; ++n) kdst[r * N + n] = k0p ? k0p[((b * R + r) * H + h) * N + n] : 0.f;
          for (int64_t p = 0; p < P; ++p) {
            const float x = v0p ? v0p[bh * P + p] : 0.f;
            vdst[r * P + p] = mv ? x * mv[(h * R + r) * P + p] : x;
          }
        }
      };
      // rotated q (or k) of step t with the angles th: (R, N)
      auto load_rot = [&](const float* base, const float* bias, int64_t t, const float* th, float* dst, float* tmp_c,
                          float* tmp_s) {
        for (int64_t j = 0; j < S; ++j) {
          tmp_c[j] = std::cos(th[j]);
          tmp_s[j] = std::sin(th[j]);
        }
        for (int64_t r = 0; r < R; ++r) {
          const float* row = qk_row(base, t, r);
          for (int64_t n = 0; n < N; ++n) dst[r * N + n] = row[n] + bias[(h * R + r) * N + n];
          rotate(&dst[r * N], tmp_c, tmp_s, S, N, pairwise);
        }
      };
      auto coefs = [&](int64_t t, float& lam, float& alpha, float& beta, float& gamma) {
        const int64_t hl = bh * L + t;
        lam = 1.f / (1.f + std::exp(-trap[hl]));
        alpha = std::exp(adt[hl]);
        beta = (1.f - lam) * dtp[hl] * alpha;
        gamma = lam * dtp[hl];
      };
      // S_t from S_{t-1} (in place into dst)
      auto advance = [&](int64_t t, const float* prev, float* dst, const float* kpv, const float* vpv,
                         const float* kcv, const float* vcv) {
        float lam, alpha, beta, gamma;
        coefs(t, lam, alpha, beta, gamma);
        for (int64_t p = 0; p < P; ++p)
          for (int64_t n = 0; n < N; ++n) {
            float x = alpha * prev[p * N + n];
            for (int64_t r = 0; r < R; ++r)
              x += beta * vpv[r * P + p] * kpv[r * N + n] + gamma * vcv[r * P + p] * kcv[r * N + n];
            dst[p * N + n] = x;
          }
      };
      // 1. angles of every step, states at chunk starts (the state entering the chunk)
      float* th0 = theta_all.data();  // theta_all[(t + 1) * S]: the angles after step t; [0]: the input
      for (int64_t j = 0; j < S; ++j) th0[j] = a0 ? a0[bh * S + j] : 0.f;
      for (int64_t t = 0; t < L; ++t)
        for (int64_t j = 0; j < S; ++j) {
          float x = theta_all[t * S + j] + kPi * std::tanh(ang[x_idx(t) * S + j]) * dtp[bh * L + t];
          x -= kTwoPi * std::floor(x / kTwoPi);
          theta_all[(t + 1) * S + j] = x;
        }
      std::vector<float> cur(PN);
      for (int64_t j = 0; j < PN; ++j) cur[j] = s0 ? s0[bh * PN + j] : 0.f;
      load_prev0(kp.data(), vp.data());
      for (int64_t t = 0; t < L; ++t) {
        if (t % C == 0) std::copy(cur.begin(), cur.end(), ckpt.begin() + (t / C) * PN);
        load_rot(k, kb, t, &theta_all[(t + 1) * S], kr.data(), c.data(), s.data());
        load_vr(t, vr.data());
        advance(t, cur.data(), cur.data(), kp.data(), vp.data(), kr.data(), vr.data());
        std::swap(kp, kr);
        std::swap(vp, vr);
      }
      // 2. reverse
      for (int64_t j = 0; j < PN; ++j) dS[j] = gssm ? gssm[bh * PN + j] : 0.f;
      for (int64_t j = 0; j < S; ++j) dth[j] = gang ? gang[bh * S + j] : 0.f;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = 0; n < N; ++n) dkn[r * N + n] = gk ? gk[((b * R + r) * H + h) * N + n] : 0.f;
      std::fill(dvn.begin(), dvn.end(), 0.f);
      if (gv && L > 0)
        for (int64_t p = 0; p < P; ++p) dVp[x_idx(L - 1) * P + p] += gv[bh * P + p];
      for (int64_t ci = NC - 1; ci >= 0; --ci) {
        const int64_t t0 = ci * C, t1 = std::min(L, t0 + C);
        std::copy(ckpt.begin() + ci * PN, ckpt.begin() + (ci + 1) * PN, states.begin());
        for (int64_t t = t0; t < t1; ++t) {  // states[(t - t0 + 1) * PN] = S_t
          if (t == 0) load_prev0(kp.data(), vp.data());
          else {
            load_rot(k, kb, t - 1, &theta_all[t * S], kp.data(), c.data(), s.data());
            load_vr(t - 1, vp.data());
          }
          load_rot(k, kb, t, &theta_all[(t + 1) * S], kr.data(), c.data(), s.data());
          load_vr(t, vr.data());
          advance(t, &states[(t - t0) * PN], &states[(t - t0 + 1) * PN], kp.data(), vp.data(), kr.data(), vr.data());
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
          const float* St = &states[(t - t0 + 1) * PN];
          const float* Sp = &states[(t - t0) * PN];
          const float* th = &theta_all[(t + 1) * S];
          load_rot(q, qb, t, th, qr.data(), c.data(), s.data());
          load_rot(k, kb, t, th, kr.data(), c.data(), s.data());
          load_vr(t, vr.data());
          if (t == 0) load_prev0(kp.data(), vp.data());
          else {
            load_rot(k, kb, t - 1, &theta_all[t * S], kp.data(), cp.data(), sp.data());
            load_vr(t - 1, vp.data());
          }
          float lam, alpha, beta, gamma;
          coefs(t, lam, alpha, beta, gamma);
          const int64_t hl = bh * L + t;
          // the output: o = S q + D v; gate; rank contraction
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) {
              float acc = 0.f;
              for (int64_t n = 0; n < N; ++n) acc += St[p * N + n] * qr[r * N + n];
              o[r * P + p] = acc + (d ? d[h] * vr[r * P + p] : 0.f);
            }
          std::copy(dvn.begin(), dvn.end(), dvc.begin());  // d v_t from step t + 1's beta term
          std::copy(dkn.begin(), dkn.end(), dkc.begin());
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) {
              float dg = 0.f;
              if (gout) {
                if (ranks_out) dg = gout[(((b * L + t) * R + r) * H + h) * P + p];
                else dg = gout[x_idx(t) * P + p] * (mo ? mo[(h * R + r) * P + p] : 1.f);
              }
              float gate = 1.f;
              if (z) {
                const float zv = z[x_idx(t) * P + p], zr = mz ? zv * mz[(h * R + r) * P + p] : zv;
                const float sg = 1.f / (1.f + std::exp(-zr));
                gate = zr * sg;
                const float dzr = dg * o[r * P + p] * sg * (1.f + zr * (1.f - sg));
                dZp[x_idx(t) * P + p] += mz ? dzr * mz[(h * R + r) * P + p] : dzr;
                if (mz) dmzp[(bh * R + r) * P + p] += dzr * zv;
              }
              if (mo && gout) dmop[(bh * R + r) * P + p] += gout[x_idx(t) * P + p] * o[r * P + p] * gate;
              dov[r * P + p] = dg * gate;
              if (d) {
                dDp[bh] += dov[r * P + p] * vr[r * P + p];
                dvc[r * P + p] += d[h] * dov[r * P + p];
              }
            }
          // readout: dS += do q^T, dq = S^T do
          std::fill(dq.begin(), dq.end(), 0.f);
          std::fill(dk.begin(), dk.end(), 0.f);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) {
              const float w = dov[r * P + p];
              for (int64_t n = 0; n < N; ++n) {
                dS[p * N + n] += w * qr[r * N + n];
                dq[r * N + n] += w * St[p * N + n];
              }
            }
          // the update S_t = alpha S_{t-1} + beta sum_r vp kp^T + gamma sum_r v k^T
          float dalpha = 0.f, dbeta = 0.f, dgamma = 0.f;
          std::fill(dkn.begin(), dkn.end(), 0.f);
          std::fill(dvn.begin(), dvn.end(), 0.f);
          for (int64_t p = 0; p < P; ++p)
            for (int64_t n = 0; n < N; ++n) {
              const float gS = dS[p * N + n];
              dalpha += gS * Sp[p * N + n];
              for (int64_t r = 0; r < R; ++r) {
                dbeta += gS * vp[r * P + p] * kp[r * N + n];
                dgamma += gS * vr[r * P + p] * kr[r * N + n];
                dk[r * N + n] += gamma * gS * vr[r * P + p];
                dvc[r * P + p] += gamma * gS * kr[r * N + n];
                dkn[r * N + n] += beta * gS * vp[r * P + p];
                dvn[r * P + p] += beta * gS * kp[r * N + n];
              }
            }
          for (int64_t j = 0; j < PN; ++j) dS[j] *= alpha;
          for (int64_t j = 0; j < R * N; ++j) dk[j] += dkc[j];
          // v_{t,r} = V_t mimo_v[:, r]
          for (int64_t r = 0; r < R; ++r)
            for (int64_t p = 0; p < P; ++p) {
              const float vv = v[x_idx(t) * P + p];
              dVp[x_idx(t) * P + p] += mv ? dvc[r * P + p] * mv[(h * R + r) * P + p] : dvc[r * P + p];
              if (mv) dmvp[(bh * R + r) * P + p] += dvc[r * P + p] * vv;
            }
          // the rotations (angles of step t), the biases, Q and K per head
          for (int64_t j = 0; j < S; ++j) {
            c[j] = std::cos(th[j]);
            s[j] = std::sin(th[j]);
          }
          for (int64_t r = 0; r < R; ++r) {
            rotate_back(&dq[r * N], &qr[r * N], c.data(), s.data(), dth.data(), S, N, pairwise);
            rotate_back(&dk[r * N], &kr[r * N], c.data(), s.data(), dth.data(), S, N, pairwise);
            for (int64_t n = 0; n < N; ++n) {
              dQp[(((b * L + t) * R + r) * H + h) * N + n] = dq[r * N + n];
              dKp[(((b * L + t) * R + r) * H + h) * N + n] = dk[r * N + n];
              dQbp[(bh * R + r) * N + n] += dq[r * N + n];
              dKbp[(bh * R + r) * N + n] += dk[r * N + n];
            }
          }
          // the coefficients
          const float dt = dtp[hl];
          const float dlam = -dbeta * dt * alpha + dgamma * dt;
          dAp[hl] = dalpha * alpha + dbeta * beta;
          float ddt = dbeta * (1.f - lam) * alpha + dgamma * lam;
          dTp[hl] = dlam * lam * (1.f - lam);
          // the angles: theta_t = theta_{t-1} + pi tanh(Angles_t) dt
          for (int64_t j = 0; j < S; ++j) {
            const float th_ = std::tanh(ang[x_idx(t) * S + j]);
            ddt += dth[j] * kPi * th_;
            dAngp[x_idx(t) * S + j] = dth[j] * kPi * (1.f - th_ * th_) * dt;
          }
          dDTp[hl] = ddt;
        }
      }
      // 3. the input states
      for (int64_t j = 0; j < S; ++j) da0p[bh * S + j] = dth[j];
      for (int64_t j = 0; j < PN; ++j) ds0p[bh * PN + j] = dS[j];
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t n = 0; n < N; ++n) dk0p[((b * R + r) * H + h) * N + n] = dkn[r * N + n];
        for (int64_t p = 0; p < P; ++p) {
          dv0p[bh * P + p] += mv ? dvn[r * P + p] * mv[(h * R + r) * P + p] : dvn[r * P + p];
          if (mv) dmvp[(bh * R + r) * P + p] += dvn[r * P + p] * (v0p ? v0p[bh * P + p] : 0.f);
        }
      }
    }
  });
  return {dQ, dK, dV, dADT, dDT, dTrap, dQb, dKb, dAng, dD, dZ, da0, ds0, dk0, dv0, dmv, dmz, dmo};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba3_scan_fwd", &mamba3_scan_fwd,
        "Mamba-3 recurrence, forward: (out, angle, ssm, k, v); with L = 1 the decode step");
  m.def("mamba3_scan_bwd", &mamba3_scan_bwd,
        "Mamba-3 recurrence, backward: the gradients of the 18 inputs, shared parameters per (batch, head)");
}
