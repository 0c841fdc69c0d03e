// S4D kernel generation: K[h, l] = 2 Re(sum_n w[h, n] z[h, n]^l) with z = exp(a), fused.
//
// The (H, N, L) Vandermonde matrix is never stored. Per channel h (OpenMP), positions go in blocks of
// BLOCK: the block's first power exp(a * l0) is kept in double precision, then each later position in the
// block costs one float complex multiply per state,
// vectorised across the state dimension (structure-of-arrays real/imag buffers). Block starts advance in
// double precision, so error does not grow with L.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;

void check2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous(),
              "s4_kernel (cpp): ", name, " must be a contiguous float32 CPU matrix, got ", t.sizes());
}

// z^l0 for every state, exactly, into (zr, zi).
inline void exact_power(const float* ar, const float* ai, int64_t n, int64_t l0, float* zr, float* zi) {
  for (int64_t j = 0; j < n; ++j) {
    const double mag = std::exp(static_cast<double>(ar[j]) * l0);
    const double ph = static_cast<double>(ai[j]) * l0;
    zr[j] = static_cast<float>(mag * std::cos(ph));
    zi[j] = static_cast<float>(mag * std::sin(ph));
  }
}

// Block starts z^(k * BLOCK) in double: one exact exp/sincos per state, then a double-precision
// multiply per block (rounding ~1e-16 per block, negligible), cast to float for the block's sweep.
struct BlockStarts {
  std::vector<double> sr, si, str, sti;
  BlockStarts(const float* ar, const float* ai, int64_t n) : sr(n, 1.0), si(n, 0.0), str(n), sti(n) {
    for (int64_t j = 0; j < n; ++j) {
      const double mag = std::exp(static_cast<double>(ar[j]) * BLOCK);
      const double ph = static_cast<double>(ai[j]) * BLOCK;
      str[j] = mag * std::cos(ph);
      sti[j] = mag * std::sin(ph);
    }
  }
  // Write the current start into (zr, zi) and advance by one block.
  void next(float* zr, float* zi) {
    for (size_t j = 0; j < sr.size(); ++j) {
      zr[j] = static_cast<float>(sr[j]);
      zi[j] = static_cast<float>(si[j]);
      const double r = sr[j] * str[j] - si[j] * sti[j];
      si[j] = sr[j] * sti[j] + si[j] * str[j];
      sr[j] = r;
    }
  }
};

torch::Tensor kernel_fwd(torch::Tensor ar, torch::Tensor ai, torch::Tensor wr, torch::Tensor wi, int64_t L) {
  for (auto* p : {&ar, &ai, &wr, &wi}) check2d(*p, "input");
  TORCH_CHECK(L >= 1, "s4_kernel (cpp): L must be >= 1");
  const int64_t H = ar.size(0), N = ar.size(1);
  auto out = torch::empty({H, L}, ar.options());
  const float *par = ar.data_ptr<float>(), *pai = ai.data_ptr<float>();
  const float *pwr = wr.data_ptr<float>(), *pwi = wi.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> zr(N), zi(N), br(N), bi(N);
    for (int64_t h = h0; h < h1; ++h) {
      const float *a_r = par + h * N, *a_i = pai + h * N;
      const float* __restrict__ w_r = pwr + h * N;
      const float* __restrict__ w_i = pwi + h * N;
      exact_power(a_r, a_i, N, 1, br.data(), bi.data());  // one step: z = exp(a)
      float* o = po + h * L;
      BlockStarts starts(a_r, a_i, N);
      for (int64_t l0 = 0; l0 < L; l0 += BLOCK) {
        starts.next(zr.data(), zi.data());
        const int64_t l1 = std::min(L, l0 + BLOCK);
        float* __restrict__ pzr = zr.data();
        float* __restrict__ pzi = zi.data();
        const float* __restrict__ pbr = br.data();
        const float* __restrict__ pbi = bi.data();
        for (int64_t l = l0; l < l1; ++l) {
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < N; ++j) {
            const float xr = pzr[j], xi = pzi[j];
            acc += w_r[j] * xr - w_i[j] * xi;
            pzr[j] = xr * pbr[j] - xi * pbi[j];
            pzi[j] = xr * pbi[j] + xi * pbr[j];
          }
          o[l] = 2.f * acc;
        }
      }
    }
  });
  return out;
}

// S0 = sum_l g_l z^l and S1 = sum_l g_l l z^l, each (H, N) real and imaginary parts.
std::vector<torch::Tensor> kernel_bwd_sums(torch::Tensor dk, torch::Tensor ar, torch::Tensor ai) {
  check2d(dk, "dk");
  check2d(ar, "ar");
  check2d(ai, "ai");
  const int64_t H = ar.size(0), N = ar.size(1), L = dk.size(1);
  TORCH_CHECK(dk.size(0) == H, "s4_kernel (cpp): dk has ", dk.size(0), " channels, expected ", H);
  auto s0r = torch::empty({H, N}, ar.options()), s0i = torch::empty_like(s0r);
  auto s1r = torch::empty_like(s0r), s1i = torch::empty_like(s0r);
  const float *par = ar.data_ptr<float>(), *pai = ai.data_ptr<float>(), *pg = dk.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> zr(N), zi(N), br(N), bi(N);
    // Accumulate per block in float, fold into double totals between blocks.
    std::vector<float> a0r(N), a0i(N), a1r(N), a1i(N);
    std::vector<double> t0r(N), t0i(N), t1r(N), t1i(N);
    for (int64_t h = h0; h < h1; ++h) {
      const float *a_r = par + h * N, *a_i = pai + h * N, *g = pg + h * L;
      exact_power(a_r, a_i, N, 1, br.data(), bi.data());
      std::fill(t0r.begin(), t0r.end(), 0.0);
      std::fill(t0i.begin(), t0i.end(), 0.0);
      std::fill(t1r.begin(), t1r.end(), 0.0);
      std::fill(t1i.begin(), t1i.end(), 0.0);
      BlockStarts starts(a_r, a_i, N);
      for (int64_t l0 = 0; l0 < L; l0 += BLOCK) {
        starts.next(zr.data(), zi.data());
        std::fill(a0r.begin(), a0r.end(), 0.f);
        std::fill(a0i.begin(), a0i.end(), 0.f);
        std::fill(a1r.begin(), a1r.end(), 0.f);
        std::fill(a1i.begin(), a1i.end(), 0.f);
        const int64_t l1 = std::min(L, l0 + BLOCK);
        float* __restrict__ pzr = zr.data();
        float* __restrict__ pzi = zi.data();
        const float* __restrict__ pbr = br.data();
        const float* __restrict__ pbi = bi.data();
        float* __restrict__ q0r = a0r.data();
        float* __restrict__ q0i = a0i.data();
        float* __restrict__ q1r = a1r.data();
        float* __restrict__ q1i = a1i.data();
        for (int64_t l = l0; l < l1; ++l) {
          const float gl = g[l], gll = g[l] * static_cast<float>(l - l0);
#pragma omp simd
          for (int64_t j = 0; j < N; ++j) {
            const float xr = pzr[j], xi = pzi[j];
            q0r[j] += gl * xr;
            q0i[j] += gl * xi;
            q1r[j] += gll * xr;  // offsets within the block; the l0 * S0 part is added below
            q1i[j] += gll * xi;
            pzr[j] = xr * pbr[j] - xi * pbi[j];
            pzi[j] = xr * pbi[j] + xi * pbr[j];
          }
        }
        for (int64_t j = 0; j < N; ++j) {
          t0r[j] += a0r[j];
          t0i[j] += a0i[j];
          t1r[j] += a1r[j] + static_cast<double>(l0) * a0r[j];
          t1i[j] += a1i[j] + static_cast<double>(l0) * a0i[j];
        }
      }
      float *o0r = s0r.data_ptr<float>() + h * N, *o0i = s0i.data_ptr<float>() + h * N;
      float *o1r = s1r.data_ptr<float>() + h * N, *o1i = s1i.data_ptr<float>() + h * N;
      for (int64_t j = 0; j < N; ++j) {
        o0r[j] = static_cast<float>(t0r[j]);
        o0i[j] = static_cast<float>(t0i[j]);
        o1r[j] = static_cast<float>(t1r[j]);
        o1i[j] = static_cast<float>(t1i[j]);
      }
    }
  });
  return {s0r, s0i, s1r, s1i};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kernel_fwd", &kernel_fwd, "S4D Vandermonde kernel K (H, L)", py::arg("ar"), py::arg("ai"),
        py::arg("wr"), py::arg("wi"), py::arg("L"));
  m.def("kernel_bwd_sums", &kernel_bwd_sums, "sums S0, S1 (re, im) for the S4D kernel backward",
        py::arg("dk"), py::arg("ar"), py::arg("ai"));
}
