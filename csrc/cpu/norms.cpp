// Fused CPU kernels for layer norm, RMS norm and gated grouped RMS norm, forward and backward.
// Rows are independent, so work is split over rows with fastarch::parallel_for; inner loops are written so the
// compiler vectorises them (-O3 -march=native), accumulating in fp32 whatever the storage dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "fastarch_math.h"
#include "fastarch_tensor.h"
#include "fastarch_parallel.h"

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

// The backward kernels split rows into chunks, each summing its rows' parameter gradients into its own
// zeroed slice of `width` floats (no races); the caller adds the slices up. body(slice, row_begin, row_end).
template <class Body>
torch::Tensor row_chunk_partials(int64_t rows, int64_t width, const torch::Tensor& like, const Body& body) {
  const int64_t nchunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, (rows + 15) / 16));
  const int64_t chunk = (rows + nchunks - 1) / nchunks;
  auto part = torch::zeros({nchunks, width}, like.options().dtype(torch::kFloat32));
  float* pp = part.data_ptr<float>();
  fastarch::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ci = c0; ci < c1; ++ci) body(pp + ci * width, ci * chunk, std::min(rows, ci * chunk + chunk));
  });
  return part;
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
    fastarch::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
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
  const int imode = static_cast<int>(mode);
  const double c = (imode & 1) ? std::max<int64_t>(n - 1, 1) : n;
  torch::Tensor part;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "layer_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    part = row_chunk_partials(rows, 2 * n, x, [&](float* dw, int64_t rbeg, int64_t rend) {
      std::vector<float> xc(n), g(n);
      float* db = dw + n;
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
    });
  });
  // Separate reductions: the outputs must not alias one another.
  return {dx, part.narrow(1, 0, n).sum(0), part.narrow(1, n, n).sum(0)};
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
    fastarch::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
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
  torch::Tensor part;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    part = row_chunk_partials(rows, n, x, [&](float* dw, int64_t rbeg, int64_t rend) {
      std::vector<float> g(n);
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
    });
  });
  return {dx, part.sum(0)};
}

// -- gated, grouped RMS norm --------------------------------------------------------------------------------
// Per group of gs channels, with u the normalised input (x, or x * silu(z) when the gate comes first):
//   n_hat = u * rstd, y = n_hat * w + b, times silu(z) when the norm comes first.
// x, z, dy are (rows, n) with a contiguous last dimension and any row stride; outputs are contiguous.

enum GateMode { kNoGate = 0, kNormThenGate = 1, kGateThenNorm = 2 };

// sigmoid(z) = 1 / (1 + fast_exp(-z)) without a division: a vector division after the exp polynomial stalls
// these loops, so the reciprocal is three Newton steps from a bit-trick estimate (relative error ~1e-7, as
// the division's). The clamp keeps the estimate a normal float (sigmoid below -86 reads ~2e-38, not 0).
inline float gate_sigmoid(float z) {
  const float d = std::min(1.f + fastarch::fast_exp(-z), 4.2e37f);
  float r = __builtin_bit_cast(float, 0x7EF311C7 - __builtin_bit_cast(int32_t, d));
  r = r * (2.f - d * r);
  r = r * (2.f - d * r);
  return r * (2.f - d * r);
}

inline GateMode gate_mode(bool has_z, bool norm_before_gate) {
  return !has_z ? kNoGate : (norm_before_gate ? kNormThenGate : kGateThenNorm);
}

inline void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& x) {
  TORCH_CHECK(t.device().is_cpu(), "rms_norm_gated: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 2, "rms_norm_gated: ", name, " must be 2-D (rows, n), got ", t.dim(), "-D");
  TORCH_CHECK(t.sizes() == x.sizes(), "rms_norm_gated: ", name, " must have x's shape ", x.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "rms_norm_gated: ", name, " must have x's dtype ",
              x.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "rms_norm_gated: ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

// weight/bias as contiguous fp32 (n,); an absent bias reads as zeros.
inline torch::Tensor channel_param(const c10::optional<torch::Tensor>& t, const char* name, int64_t n,
                                   const torch::Tensor& x) {
  if (!t.has_value()) return torch::zeros({n}, x.options().dtype(torch::kFloat32));
  TORCH_CHECK(t->device().is_cpu(), "rms_norm_gated: ", name, " must be a CPU tensor, got ", t->device());
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n, "rms_norm_gated: ", name, " must have shape (", n, "), got ",
              t->sizes());
  TORCH_CHECK(at::isFloatingType(t->scalar_type()), "rms_norm_gated: ", name,
              " must be floating point, got ", t->scalar_type());
  return t->to(torch::kFloat32).contiguous();
}

inline int64_t check_gated_args(const torch::Tensor& x, const c10::optional<torch::Tensor>& z, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu(), "rms_norm_gated: x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 2, "rms_norm_gated: x must be 2-D (rows, n), got ", x.dim(), "-D");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "rms_norm_gated: x must be float32, bfloat16 or float16, got ", dt);
  check_rows(x, "x", x);
  if (z.has_value()) check_rows(*z, "z", x);
  const int64_t n = x.size(1);
  TORCH_CHECK(group_size >= 1 && n % group_size == 0, "rms_norm_gated: group_size must be a positive divisor of ",
              "the last dimension ", n, ", got ", group_size);
  return n / group_size;
}

std::vector<torch::Tensor> rms_norm_gated_fwd(const torch::Tensor& x, const c10::optional<torch::Tensor>& z,
                                              const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                                              double eps, int64_t group_size, bool norm_before_gate) {
  const int64_t groups = check_gated_args(x, z, group_size);
  const int64_t rows = x.size(0), n = x.size(1), gs = group_size;
  const auto wf = channel_param(weight, "weight", n, x), bf = channel_param(bias, "bias", n, x);
  auto y = torch::empty({rows, n}, x.options());
  auto rstd = torch::empty({rows, groups}, x.options().dtype(torch::kFloat32));
  if (rows == 0 || n == 0) return {y, rstd};
  const float* w = wf.data_ptr<float>();
  const float* b = bf.data_ptr<float>();
  float* rp = rstd.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const GateMode mode = gate_mode(z.has_value(), norm_before_gate);
  const int64_t xs = x.stride(0), zs = z.has_value() ? z->stride(0) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_gated_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* zp = z.has_value() ? z->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    constexpr bool f32 = std::is_same<scalar_t, float>::value;
    fastarch::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      // fp32 storage: the gated value goes into the output row itself; otherwise into an fp32 row buffer.
      std::vector<float> tmp(f32 ? 0 : n);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* xr = xp + r * xs;
        const scalar_t* zr = zp ? zp + r * zs : nullptr;
        scalar_t* yr = yp + r * n;
        float* u = f32 ? reinterpret_cast<float*>(yr) : tmp.data();
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t o = g * gs;
          float ss = 0.f;
          if (mode == kGateThenNorm) {
_Pragma("omp simd reduction(+ : ss)")
            for (int64_t i = o; i < o + gs; ++i) {
              const float zi = to_f(zr[i]);
              const float ui = to_f(xr[i]) * zi * gate_sigmoid(zi);
              u[i] = ui;
              ss += ui * ui;
            }
          } else {
_Pragma("omp simd reduction(+ : ss)")
            for (int64_t i = o; i < o + gs; ++i) {
              const float ui = to_f(xr[i]);
              u[i] = ui;
              ss += ui * ui;
            }
          }
          const float rs = 1.f / std::sqrt(ss / gs + feps);
          rp[r * groups + g] = rs;
          if (mode == kNormThenGate) {
_Pragma("omp simd")
            for (int64_t i = o; i < o + gs; ++i) {
              const float zi = to_f(zr[i]);
              yr[i] = static_cast<scalar_t>((u[i] * rs * w[i] + b[i]) * (zi * gate_sigmoid(zi)));
            }
          } else {
_Pragma("omp simd")
            for (int64_t i = o; i < o + gs; ++i) yr[i] = static_cast<scalar_t>(u[i] * rs * w[i] + b[i]);
          }
        }
      }
    });
  });
  return {y, rstd};
}

// Returns (dx, dz, dweight, dbias); dz is empty without z, dbias empty without bias; dweight/dbias are fp32.
std::vector<torch::Tensor> rms_norm_gated_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                              const c10::optional<torch::Tensor>& z, const torch::Tensor& weight,
                                              const c10::optional<torch::Tensor>& bias, const torch::Tensor& rstd,
                                              int64_t group_size, bool norm_before_gate) {
  const int64_t groups = check_gated_args(x, z, group_size);
  check_rows(dy, "dy", x);
  const int64_t rows = x.size(0), n = x.size(1), gs = group_size;
  TORCH_CHECK(rstd.device().is_cpu() && rstd.scalar_type() == at::kFloat && rstd.dim() == 2 &&
                  rstd.size(0) == rows && rstd.size(1) == groups,
              "rms_norm_gated: rstd must be a CPU float32 tensor of shape (", rows, ", ", groups, "), got ",
              rstd.scalar_type(), " ", rstd.sizes(), " on ", rstd.device());
  const auto wf = channel_param(weight, "weight", n, x), bf = channel_param(bias, "bias", n, x);
  const auto rc = rstd.contiguous();
  auto dx = torch::empty({rows, n}, x.options());
  auto dz = z.has_value() ? torch::empty({rows, n}, x.options()) : torch::empty({0}, x.options());
  const float* w = wf.data_ptr<float>();
  const float* b = bf.data_ptr<float>();
  const float* rp = rc.data_ptr<float>();
  const GateMode mode = gate_mode(z.has_value(), norm_before_gate);
  const int64_t xs = x.stride(0), zs = z.has_value() ? z->stride(0) : 0, gst = dy.stride(0);
  torch::Tensor part;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_gated_bwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* zp = z.has_value() ? z->data_ptr<scalar_t>() : nullptr;
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    scalar_t* dzp = z.has_value() ? dz.data_ptr<scalar_t>() : nullptr;
    part = row_chunk_partials(rows, 2 * n, x, [&](float* dw, int64_t rbeg, int64_t rend) {
      // n_hat, dn = d(loss)/d(n_hat), and sigmoid(z) where the gate comes first (reused for dx, dz)
      std::vector<float> nh(n), dn(n), sg(mode == kGateThenNorm ? n : 0);
      float* db = dw + n;
      for (int64_t r = rbeg; r < rend; ++r) {
        const scalar_t* xr = xp + r * xs;
        const scalar_t* zr = zp ? zp + r * zs : nullptr;
        const scalar_t* gr = gp + r * gst;
        scalar_t* dxr = dxp + r * n;
        scalar_t* dzr = dzp ? dzp + r * n : nullptr;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t o = g * gs;
          const float rs = rp[r * groups + g];
          float sdn = 0.f;
          if (mode == kGateThenNorm) {
_Pragma("omp simd reduction(+ : sdn)")
            for (int64_t i = o; i < o + gs; ++i) {
              const float zi = to_f(zr[i]), si = gate_sigmoid(zi), gi = to_f(gr[i]);
              const float ni = to_f(xr[i]) * zi * si * rs;
              sg[i] = si;
              nh[i] = ni;
              dw[i] += gi * ni;
              db[i] += gi;
              dn[i] = gi * w[i];
              sdn += dn[i] * ni;
            }
          } else if (mode == kNormThenGate) {
_Pragma("omp simd reduction(+ : sdn)")
            for (int64_t i = o; i < o + gs; ++i) {
              const float zi = to_f(zr[i]), si = gate_sigmoid(zi), gi = to_f(gr[i]);
              const float ni = to_f(xr[i]) * rs;
              dzr[i] = static_cast<scalar_t>(gi * (ni * w[i] + b[i]) * si * (1.f + zi * (1.f - si)));
              const float pi = gi * zi * si;  // d(loss)/d(n_hat * w + b)
              nh[i] = ni;
              dw[i] += pi * ni;
              db[i] += pi;
              dn[i] = pi * w[i];
              sdn += dn[i] * ni;
            }
          } else {
_Pragma("omp simd reduction(+ : sdn)")
            for (int64_t i = o; i < o + gs; ++i) {
              const float gi = to_f(gr[i]);
              const float ni = to_f(xr[i]) * rs;
              nh[i] = ni;
              dw[i] += gi * ni;
              db[i] += gi;
              dn[i] = gi * w[i];
              sdn += dn[i] * ni;
            }
          }
          const float m = sdn / gs;
          if (mode == kGateThenNorm) {
_Pragma("omp simd")
            for (int64_t i = o; i < o + gs; ++i) {
              const float du = rs * (dn[i] - nh[i] * m);
              const float zi = to_f(zr[i]), si = sg[i];
              dxr[i] = static_cast<scalar_t>(du * zi * si);
              dzr[i] = static_cast<scalar_t>(du * to_f(xr[i]) * si * (1.f + zi * (1.f - si)));
            }
          } else {
_Pragma("omp simd")
            for (int64_t i = o; i < o + gs; ++i) dxr[i] = static_cast<scalar_t>(rs * (dn[i] - nh[i] * m));
          }
        }
      }
    });
  });
  // Separate reductions: the outputs must not alias one another.
  auto dbias = bias.has_value() ? part.narrow(1, n, n).sum(0) : torch::empty({0}, x.options().dtype(torch::kFloat32));
  return {dx, dz, part.narrow(1, 0, n).sum(0), dbias};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm_fwd", &layer_norm_fwd, "layer norm forward: (y, mean, rstd)");
  m.def("layer_norm_bwd", &layer_norm_bwd, "layer norm backward: (dx, dweight, dbias)");
  m.def("rms_norm_fwd", &rms_norm_fwd, "RMS norm forward: (y, rstd)");
  m.def("rms_norm_bwd", &rms_norm_bwd, "RMS norm backward: (dx, dweight)");
  m.def("rms_norm_gated_fwd", &rms_norm_gated_fwd, "gated grouped RMS norm forward: (y, rstd)");
  m.def("rms_norm_gated_bwd", &rms_norm_gated_bwd, "gated grouped RMS norm backward: (dx, dz, dweight, dbias)");
}
