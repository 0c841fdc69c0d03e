// Fused CPU kernel for rotary embedding; one kernel serves the forward and, rotating backwards, the backward.
// Work is split over tokens with fastarch::parallel_for, computing in fp32 whatever the storage dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "fastarch_tensor.h"
#include "fastarch_parallel.h"

namespace {

using fastarch::check_cpu_contig;
using fastarch::to_f;

// Rotary embedding on x (B, L, H, D): the first 2*R features of each head are rotated by angle theta[l, r]
// (cos/sin are (L, R)); the rest pass through. conj=true rotates by -theta, which is the backward.
// interleaved: pairs (2r, 2r+1) (GPT-J); otherwise halves (r, r+R) (GPT-NeoX).
torch::Tensor rotary_apply(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           bool interleaved, bool conj, int64_t offset) {
  check_cpu_contig(x, "x");
  TORCH_CHECK(x.dim() == 4, "x must be (B, L, H, D)");
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3);
  auto cf = cos.to(torch::kFloat32).contiguous();
  auto sf = sin.to(torch::kFloat32).contiguous();
  const int64_t R = cf.size(1);
  const float* cp = cf.data_ptr<float>();
  const float* sp = sf.data_ptr<float>();
  const float sgn = conj ? -1.f : 1.f;
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rotary_apply", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    fastarch::parallel_for(0, B * L, 4, [&](int64_t t0, int64_t t1) {
      std::vector<float> c(R), s(R);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t l = t % L + offset;
        for (int64_t r = 0; r < R; ++r) {
          c[r] = cp[l * R + r];
          s[r] = sgn * sp[l * R + r];
        }
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* xr = xp + (t * H + h) * D;
          scalar_t* orow = op + (t * H + h) * D;
          if (interleaved) {
            for (int64_t r = 0; r < R; ++r) {
              const float a = to_f(xr[2 * r]), b = to_f(xr[2 * r + 1]);
              orow[2 * r] = static_cast<scalar_t>(a * c[r] - b * s[r]);
              orow[2 * r + 1] = static_cast<scalar_t>(a * s[r] + b * c[r]);
            }
          } else {
_Pragma("omp simd")
            for (int64_t r = 0; r < R; ++r) {
              const float a = to_f(xr[r]), b = to_f(xr[r + R]);
              orow[r] = static_cast<scalar_t>(a * c[r] - b * s[r]);
              orow[r + R] = static_cast<scalar_t>(a * s[r] + b * c[r]);
            }
          }
          for (int64_t i = 2 * R; i < D; ++i) orow[i] = xr[i];
        }
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_apply", &rotary_apply, "rotary embedding (conj=true rotates backwards: the backward)");
}
