// S4D kernel generation: K[h, l] = 2 Re(sum_n w[h, n] z[h, n]^l) with z = exp(a), fused.
//
// The (H, N, L) Vandermonde matrix is never stored: positions split into blocks of BLOCK, and the powers
// factor as z^(b BLOCK + t) = z^(b BLOCK) z^t, which turns the sum over states into a batched GEMM of
// (H, L/BLOCK, 2N) block-start coefficients by (H, 2N, BLOCK) in-block powers. The tables are built in
// double precision (block starts advance by an exact z^BLOCK), so error does not grow with L.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>
#include "fastarch_parallel.h"

namespace {

constexpr int64_t BLOCK = 64;

void check2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous(),
              "s4_kernel (cpp): ", name, " must be a contiguous float32 CPU matrix, got ", t.sizes());
}

// Powers are tabulated in double and flushed to zero below this magnitude: a decayed mode contributes
// nothing in fp32, and denormal operands would slow the GEMM down by orders of magnitude.
constexpr double TINY = 1e-30;

inline float flush(double x) { return std::abs(x) < TINY ? 0.f : static_cast<float>(x); }

// Per channel: z^t for t < BLOCK (double recurrence from the exact z; error ~ BLOCK ulps) and the block
// step z^BLOCK computed exactly.
struct Powers {
  std::vector<double> pr, pi;  // (N, BLOCK)
  std::vector<double> str, sti;  // (N)
  Powers(const float* ar, const float* ai, int64_t n) : pr(n * BLOCK), pi(n * BLOCK), str(n), sti(n) {
    for (int64_t j = 0; j < n; ++j) {
      const double zr = std::exp(double(ar[j])) * std::cos(double(ai[j]));
      const double zi = std::exp(double(ar[j])) * std::sin(double(ai[j]));
      double xr = 1.0, xi = 0.0;
      for (int64_t t = 0; t < BLOCK; ++t) {
        pr[j * BLOCK + t] = xr;
        pi[j * BLOCK + t] = xi;
        const double r = xr * zr - xi * zi;
        xi = xr * zi + xi * zr;
        xr = r;
      }
      const double mag = std::exp(double(ar[j]) * BLOCK), ph = double(ai[j]) * BLOCK;
      str[j] = mag * std::cos(ph);
      sti[j] = mag * std::sin(ph);
    }
  }
};

// The Vandermonde product as one GEMM per channel: with l = b * BLOCK + t,
//   K[h, l] = 2 Re sum_n (w_n z_n^(b BLOCK)) z_n^t = sum_n' A[h, b, n'] P[h, n', t],
// A = [2 Re(w z^(b BLOCK)), -2 Im(w z^(b BLOCK))] (nb x 2N) and P = [Re z^t; Im z^t] (2N x BLOCK).
// The (H, N, L) Vandermonde matrix is never formed; the work is an (H, L, 2N) batched GEMM.
torch::Tensor kernel_fwd(torch::Tensor ar, torch::Tensor ai, torch::Tensor wr, torch::Tensor wi, int64_t L) {
  for (auto* p : {&ar, &ai, &wr, &wi}) check2d(*p, "input");
  TORCH_CHECK(L >= 1, "s4_kernel (cpp): L must be >= 1");
  const int64_t H = ar.size(0), N = ar.size(1), nb = (L + BLOCK - 1) / BLOCK;
  auto A = torch::empty({H, nb, 2 * N}, ar.options());
  auto P = torch::empty({H, 2 * N, BLOCK}, ar.options());
  const float *par = ar.data_ptr<float>(), *pai = ai.data_ptr<float>();
  const float *pwr = wr.data_ptr<float>(), *pwi = wi.data_ptr<float>();
  float *pa = A.data_ptr<float>(), *pp = P.data_ptr<float>();
  fastarch::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<double> sr(N), si(N);
    for (int64_t h = h0; h < h1; ++h) {
      const Powers z(par + h * N, pai + h * N, N);
      float* p = pp + h * 2 * N * BLOCK;
      for (int64_t j = 0; j < N; ++j)
        for (int64_t t = 0; t < BLOCK; ++t) {
          p[j * BLOCK + t] = flush(z.pr[j * BLOCK + t]);
          p[(N + j) * BLOCK + t] = flush(z.pi[j * BLOCK + t]);
        }
      std::fill(sr.begin(), sr.end(), 1.0);
      std::fill(si.begin(), si.end(), 0.0);
      const float *w_r = pwr + h * N, *w_i = pwi + h * N;
      for (int64_t b = 0; b < nb; ++b) {
        float* a = pa + (h * nb + b) * 2 * N;
        for (int64_t j = 0; j < N; ++j) {
          a[j] = flush(2.0 * (w_r[j] * sr[j] - w_i[j] * si[j]));
          a[N + j] = flush(-2.0 * (w_r[j] * si[j] + w_i[j] * sr[j]));
          const double r = sr[j] * z.str[j] - si[j] * z.sti[j];
          si[j] = sr[j] * z.sti[j] + si[j] * z.str[j];
          sr[j] = std::abs(r) < TINY ? 0.0 : r;
          if (std::abs(si[j]) < TINY) si[j] = 0.0;
        }
      }
    }
  });
  auto K = at::bmm(A, P).view({H, nb * BLOCK});
  return nb * BLOCK == L ? K : K.narrow(1, 0, L).contiguous();
}

// S0 = sum_l g_l z^l and S1 = sum_l g_l l z^l, each (H, N) real and imaginary parts. With l = b BLOCK + t,
// one batched GEMM gives M[h, b, .] = sum_t g[b, t] [Re z^t, Im z^t, t Re z^t, t Im z^t]; then
// S0 = sum_b z^(b BLOCK) M0_b and S1 = sum_b z^(b BLOCK) (b BLOCK M0_b + M1_b), accumulated in double.
std::vector<torch::Tensor> kernel_bwd_sums(torch::Tensor dk, torch::Tensor ar, torch::Tensor ai) {
  check2d(dk, "dk");
  check2d(ar, "ar");
  check2d(ai, "ai");
  const int64_t H = ar.size(0), N = ar.size(1), L = dk.size(1), nb = (L + BLOCK - 1) / BLOCK;
  TORCH_CHECK(dk.size(0) == H, "s4_kernel (cpp): dk has ", dk.size(0), " channels, expected ", H);
  auto G = nb * BLOCK == L ? dk.view({H, nb, BLOCK})
                           : at::constant_pad_nd(dk, {0, nb * BLOCK - L}).view({H, nb, BLOCK});
  auto Q = torch::empty({H, BLOCK, 4 * N}, ar.options());
  const float *par = ar.data_ptr<float>(), *pai = ai.data_ptr<float>();
  float* pq = Q.data_ptr<float>();
  fastarch::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const Powers z(par + h * N, pai + h * N, N);
      float* q = pq + h * BLOCK * 4 * N;
      for (int64_t t = 0; t < BLOCK; ++t)
        for (int64_t j = 0; j < N; ++j) {
          const double xr = z.pr[j * BLOCK + t], xi = z.pi[j * BLOCK + t];
          q[t * 4 * N + j] = flush(xr);
          q[t * 4 * N + N + j] = flush(xi);
          q[t * 4 * N + 2 * N + j] = flush(t * xr);
          q[t * 4 * N + 3 * N + j] = flush(t * xi);
        }
    }
  });
  auto M = at::bmm(G, Q);  // (H, nb, 4N)
  const float* pm = M.data_ptr<float>();
  auto s0r = torch::empty({H, N}, ar.options()), s0i = torch::empty_like(s0r);
  auto s1r = torch::empty_like(s0r), s1i = torch::empty_like(s0r);
  fastarch::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const Powers z(par + h * N, pai + h * N, N);  // only the block step is needed here
      for (int64_t j = 0; j < N; ++j) {
        double sr = 1.0, si = 0.0, a0r = 0, a0i = 0, a1r = 0, a1i = 0;
        for (int64_t b = 0; b < nb; ++b) {
          const float* m = pm + (h * nb + b) * 4 * N;
          const double m0r = m[j], m0i = m[N + j];
          const double m1r = m[2 * N + j] + double(b * BLOCK) * m0r, m1i = m[3 * N + j] + double(b * BLOCK) * m0i;
          a0r += sr * m0r - si * m0i;
          a0i += sr * m0i + si * m0r;
          a1r += sr * m1r - si * m1i;
          a1i += sr * m1i + si * m1r;
          const double r = sr * z.str[j] - si * z.sti[j];
          si = sr * z.sti[j] + si * z.str[j];
          sr = r;
          if (std::abs(sr) < TINY && std::abs(si) < TINY) break;  // every later block is zero
        }
        s0r.data_ptr<float>()[h * N + j] = static_cast<float>(a0r);
        s0i.data_ptr<float>()[h * N + j] = static_cast<float>(a0i);
        s1r.data_ptr<float>()[h * N + j] = static_cast<float>(a1r);
        s1i.data_ptr<float>()[h * N + j] = static_cast<float>(a1i);
      }
    }
  });
  return {s0r, s0i, s1r, s1i};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("s4_kernel_fwd", &kernel_fwd, "S4D Vandermonde kernel K (H, L)", py::arg("ar"), py::arg("ai"),
        py::arg("wr"), py::arg("wi"), py::arg("L"));
  m.def("s4_kernel_bwd_sums", &kernel_bwd_sums, "sums S0, S1 (re, im) for the S4D kernel backward",
        py::arg("dk"), py::arg("ar"), py::arg("ai"));
}
