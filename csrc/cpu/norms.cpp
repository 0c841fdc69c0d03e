// Fused CPU kernels for layer norm and RMS norm, forward and backward.
// Rows are independent, so work is split over rows with at::parallel_for; inner loops are written so the
// compiler vectorises them (-O3 -march=native), accumulating in fp32 whatever the storage dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "fastarch_tensor.h"

namespace {

using fastarch::check_cpu_contig;
using fastarch::to_f;

// Per-row layer-norm statistics. mode bit 0: unbiased variance; bit 1: eps added to the std.
struct RowStats {
  float mean, rstd, drstd_dvar;
};

inline RowStats finish_stats(float mean, double ss, int64_t n, float eps, int mode) {
  const double c = (mode & 1) ? std::max<int64_t>(n - 1, 1) : n;
  const float var = static_cast<float>(ss / c);
  RowStats st;
  st.mean = mean;
  if (mode & 2) {
    const float sd = std::sqrt(var);
    st.rstd = 1.f / (sd + eps);
    st.drstd_dvar = sd > 0.f ? -st.rstd * st.rstd / (2.f * sd) : 0.f;
  } else {
    st.rstd = 1.f / std::sqrt(var + eps);
    st.drstd_dvar = -0.5f * st.rstd * st.rstd * st.rstd;
  }
  return st;
}

// Two passes over a row kept in a float scratch buffer: exact mean, then centred sum of squares.
template <typename T>
RowStats row_stats(const T* x, float* buf, int64_t n, float eps, int mode) {
  float s = 0.f;
_Pragma("omp simd reduction(+ : s)")
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = to_f(x[i]);
    s += buf[i];
  }
  const float mean = s / n;
  float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
  for (int64_t i = 0; i < n; ++i) {
    const float d = buf[i] - mean;
    ss += d * d;
  }
  return finish_stats(mean, ss, n, eps, mode);
}

std::vector<torch::Tensor> layer_norm_fwd(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                                          const c10::optional<torch::Tensor>& bias, double eps, int64_t mode) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, n)");
  const int64_t rows = x.size(0), n = x.size(1);
  auto y = torch::empty_like(x);
  auto opts = x.options().dtype(torch::kFloat32);
  auto mean = torch::empty({rows}, opts), rstd = torch::empty({rows}, opts);
  // Weights are read as fp32 once, outside the row loop.
  auto wf = weight.has_value() ? weight->to(torch::kFloat32).contiguous() : torch::Tensor();
  auto bf = bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* w = wf.defined() ? wf.data_ptr<float>() : nullptr;
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  float* mp = mean.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(n);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = xp + r * n;
        scalar_t* yr = yp + r * n;
        const RowStats st = row_stats(xr, buf.data(), n, static_cast<float>(eps), static_cast<int>(mode));
        mp[r] = st.mean;
        rp[r] = st.rstd;
        const float m = st.mean, rs = st.rstd;
        if (w && b) {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>((buf[i] - m) * rs * w[i] + b[i]);
        } else if (w) {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>((buf[i] - m) * rs * w[i]);
        } else if (b) {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>((buf[i] - m) * rs + b[i]);
        } else {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>((buf[i] - m) * rs);
        }
      }
    });
  });
  return {y, mean, rstd};
}

// Per-thread partial sums for dweight/dbias avoid races; they are added up at the end.
std::vector<torch::Tensor> layer_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                          const c10::optional<torch::Tensor>& weight, const torch::Tensor& mean,
                                          double eps, int64_t mode) {
  check_cpu_contig(x, "x");
  check_cpu_contig(dy, "dy");
  const int64_t rows = x.size(0), n = x.size(1);
  auto dx = torch::empty_like(x);
  auto wf = weight.has_value() ? weight->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* w = wf.defined() ? wf.data_ptr<float>() : nullptr;
  const float* mp = mean.contiguous().data_ptr<float>();
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, (rows + 15) / 16));
  const int64_t chunk = (rows + nchunks - 1) / nchunks;
  auto part = torch::zeros({nchunks, 2, n}, x.options().dtype(torch::kFloat32));
  float* pp = part.data_ptr<float>();
  const int imode = static_cast<int>(mode);
  const double c = (imode & 1) ? std::max<int64_t>(n - 1, 1) : n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> xc(n), g(n);
      for (int64_t ci = c0; ci < c1; ++ci) {
        float* dw = pp + ci * 2 * n;
        float* db = dw + n;
        const int64_t rbeg = ci * chunk, rend = std::min(rows, rbeg + chunk);
        for (int64_t r = rbeg; r < rend; ++r) {
          const scalar_t* xr = xp + r * n;
          const scalar_t* gr = gp + r * n;
          const float m = mp[r];
          float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
          for (int64_t i = 0; i < n; ++i) {
            xc[i] = to_f(xr[i]) - m;
            ss += xc[i] * xc[i];
          }
          const RowStats st = finish_stats(m, ss, n, static_cast<float>(eps), imode);
          const float rs = st.rstd;
          float sg = 0.f, sgx = 0.f;
_Pragma("omp simd reduction(+ : sg, sgx)")
          for (int64_t i = 0; i < n; ++i) {
            const float gi = to_f(gr[i]);
            dw[i] += gi * xc[i] * rs;
            db[i] += gi;
            g[i] = w ? gi * w[i] : gi;
            sg += g[i];
            sgx += g[i] * xc[i];
          }
          const float gmean = sg / n;
          const float k = sgx * st.drstd_dvar * static_cast<float>(2.0 / c);
          scalar_t* dxr = dxp + r * n;
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) dxr[i] = static_cast<scalar_t>(rs * (g[i] - gmean) + xc[i] * k);
        }
      }
    });
  });
  // Separate reductions: the outputs must not alias one another.
  return {dx, part.select(1, 0).sum(0), part.select(1, 1).sum(0)};
}

std::vector<torch::Tensor> rms_norm_fwd(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                                        double eps) {
  check_cpu_contig(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
  auto wf = weight.has_value() ? weight->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* w = wf.defined() ? wf.data_ptr<float>() : nullptr;
  float* rp = rstd.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = xp + r * n;
        scalar_t* yr = yp + r * n;
        float ss = 0.f;
_Pragma("omp simd reduction(+ : ss)")
        for (int64_t i = 0; i < n; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
        const float rs = 1.f / std::sqrt(ss / n + static_cast<float>(eps));
        rp[r] = rs;
        if (w) {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>(to_f(xr[i]) * rs * w[i]);
        } else {
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) yr[i] = static_cast<scalar_t>(to_f(xr[i]) * rs);
        }
      }
    });
  });
  return {y, rstd};
}

std::vector<torch::Tensor> rms_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                        const c10::optional<torch::Tensor>& weight, const torch::Tensor& rstd) {
  check_cpu_contig(x, "x");
  check_cpu_contig(dy, "dy");
  const int64_t rows = x.size(0), n = x.size(1);
  auto dx = torch::empty_like(x);
  auto wf = weight.has_value() ? weight->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* w = wf.defined() ? wf.data_ptr<float>() : nullptr;
  const float* rp = rstd.contiguous().data_ptr<float>();
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, (rows + 15) / 16));
  const int64_t chunk = (rows + nchunks - 1) / nchunks;
  auto part = torch::zeros({nchunks, n}, x.options().dtype(torch::kFloat32));
  float* pp = part.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> g(n);
      for (int64_t ci = c0; ci < c1; ++ci) {
        float* dw = pp + ci * n;
        const int64_t rbeg = ci * chunk, rend = std::min(rows, rbeg + chunk);
        for (int64_t r = rbeg; r < rend; ++r) {
          const scalar_t* xr = xp + r * n;
          const scalar_t* gr = gp + r * n;
          const float rs = rp[r];
          float sgx = 0.f;
_Pragma("omp simd reduction(+ : sgx)")
          for (int64_t i = 0; i < n; ++i) {
            const float gi = to_f(gr[i]), xi = to_f(xr[i]);
            dw[i] += gi * xi * rs;
            g[i] = w ? gi * w[i] : gi;
            sgx += g[i] * xi;
          }
          const float k = rs * rs * rs * sgx / n;
          scalar_t* dxr = dxp + r * n;
_Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i) dxr[i] = static_cast<scalar_t>(rs * g[i] - to_f(xr[i]) * k);
        }
      }
    });
  });
  return {dx, part.sum(0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm_fwd", &layer_norm_fwd, "layer norm forward: (y, mean, rstd)");
  m.def("layer_norm_bwd", &layer_norm_bwd, "layer norm backward: (dx, dweight, dbias)");
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMS norm forward: (y, rstd)");
  m.def("rms_norm_bwd", &rms_norm_bwd, "RMS norm backward: (dx, dweight)");
}
