// Causal linear attention, chunked: y = tril(q k^T) va, and its backward.
//
// Inputs are fp32 contiguous (N, L, m), (N, L, m), (N, L, Da) (N = batch * heads; Da = D + 1 when the op
// appends the normaliser's ones column). One OpenMP thread owns one row n at a time and walks its
// sequence in chunks of C rows: the masked C x C product handles pairs inside a chunk, and a running
// (m, Da) state carries everything before it. Time O(L (C m + C Da + m Da)); extra memory per thread is
// the state plus a C x C scratch -- the (L, m, Da) prefix tensor is never formed. Chunk matmuls go to
// ATen's BLAS (single-threaded inside the parallel region).
#include <torch/extension.h>

#include <algorithm>
#include <vector>
#include "fastarch_parallel.h"

namespace {

void check_input(const torch::Tensor& t, const char* name, int64_t n, int64_t L) {
  TORCH_CHECK(t.device().is_cpu(), "linear_attention (cpp): ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, "linear_attention (cpp): ", name, " must be float32");
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous(), "linear_attention (cpp): ", name,
              " must be a contiguous 3-D tensor");
  TORCH_CHECK(t.size(0) == n && t.size(1) == L, "linear_attention (cpp): ", name, " has shape ",
              t.sizes(), ", expected (", n, ", ", L, ", *)");
}

// Zero the strict upper triangle of a contiguous (rows, cols) block.
inline void tril_(torch::Tensor& a) {
  const int64_t r = a.size(0), c = a.size(1);
  float* p = a.data_ptr<float>();
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = i + 1; j < c; ++j) p[i * c + j] = 0.f;
}

torch::Tensor causal_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor va, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "linear_attention (cpp): chunk must be positive");
  const int64_t n = q.size(0), L = q.size(1), m = q.size(2), da = va.size(2);
  check_input(q, "q", n, L);
  check_input(k, "k", n, L);
  check_input(va, "va", n, L);
  TORCH_CHECK(k.size(2) == m, "linear_attention (cpp): k feature size ", k.size(2), " != q's ", m);
  auto y = torch::empty({n, L, da}, q.options());
  fastarch::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    at::NoGradGuard ng;
    auto state = torch::empty({m, da}, q.options());
    auto a = torch::empty({chunk * chunk}, q.options());
    for (int64_t b = b0; b < b1; ++b) {
      state.zero_();
      auto qb = q[b], kb = k[b], vb = va[b], yb = y[b];
      for (int64_t s = 0; s < L; s += chunk) {
        const int64_t c = std::min(chunk, L - s);
        auto qc = qb.narrow(0, s, c), kc = kb.narrow(0, s, c), vc = vb.narrow(0, s, c);
        auto yc = yb.narrow(0, s, c);
        auto ac = a.narrow(0, 0, c * c).view({c, c});
        at::mm_out(ac, qc, kc.t());
        tril_(ac);
        at::mm_out(yc, ac, vc);
        yc.addmm_(qc, state);
        state.addmm_(kc.t(), vc);
      }
    }
  });
  return y;
}

std::vector<torch::Tensor> causal_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor va, torch::Tensor ga,
                                      int64_t chunk) {
  TORCH_CHECK(chunk > 0, "linear_attention (cpp): chunk must be positive");
  const int64_t n = q.size(0), L = q.size(1), m = q.size(2), da = va.size(2);
  check_input(q, "q", n, L);
  check_input(k, "k", n, L);
  check_input(va, "va", n, L);
  check_input(ga, "ga", n, L);
  TORCH_CHECK(ga.size(2) == da, "linear_attention (cpp): ga width ", ga.size(2), " != va's ", da);
  auto dq = torch::empty_like(q), dk = torch::empty_like(k), dva = torch::empty_like(va);
  fastarch::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    at::NoGradGuard ng;
    auto state = torch::empty({m, da}, q.options());
    auto p = torch::empty({chunk * chunk}, q.options());
    auto a = torch::empty({chunk * chunk}, q.options());
    for (int64_t b = b0; b < b1; ++b) {
      auto qb = q[b], kb = k[b], vb = va[b], gb = ga[b];
      auto dqb = dq[b], dkb = dk[b], dvb = dva[b];
      // dQ_c = tril(G_c V_c^T) K_c + G_c S^T with S = sum of earlier k v^T (forward sweep).
      state.zero_();
      for (int64_t s = 0; s < L; s += chunk) {
        const int64_t c = std::min(chunk, L - s);
        auto kc = kb.narrow(0, s, c), vc = vb.narrow(0, s, c), gc = gb.narrow(0, s, c);
        auto pc = p.narrow(0, 0, c * c).view({c, c});
        at::mm_out(pc, gc, vc.t());
        tril_(pc);
        auto dqc = dqb.narrow(0, s, c);
        at::mm_out(dqc, pc, kc);
        dqc.addmm_(gc, state.t());
        state.addmm_(kc.t(), vc);
      }
      // dK_c = tril(G V^T)^T Q_c + V_c R^T, dV_c = tril(Q K^T)^T G_c + K_c R with
      // R = sum of later q g^T (reverse sweep).
      state.zero_();
      const int64_t last = ((L - 1) / chunk) * chunk;
      for (int64_t s = last; s >= 0; s -= chunk) {
        const int64_t c = std::min(chunk, L - s);
        auto qc = qb.narrow(0, s, c), kc = kb.narrow(0, s, c), vc = vb.narrow(0, s, c);
        auto gc = gb.narrow(0, s, c);
        auto pc = p.narrow(0, 0, c * c).view({c, c});
        auto ac = a.narrow(0, 0, c * c).view({c, c});
        at::mm_out(pc, gc, vc.t());
        tril_(pc);
        at::mm_out(ac, qc, kc.t());
        tril_(ac);
        auto dkc = dkb.narrow(0, s, c), dvc = dvb.narrow(0, s, c);
        at::mm_out(dkc, pc.t(), qc);
        dkc.addmm_(vc, state.t());
        at::mm_out(dvc, ac.t(), gc);
        dvc.addmm_(kc, state);
        state.addmm_(qc.t(), gc);
      }
    }
  });
  return {dq, dk, dva};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_attention_causal_fwd", &causal_fwd,
        "chunked causal linear attention forward: tril(q k^T) va",
        py::arg("q"), py::arg("k"), py::arg("va"), py::arg("chunk") = 64);
  m.def("linear_attention_causal_bwd", &causal_bwd,
        "chunked causal linear attention backward -> (dq, dk, dva)",
        py::arg("q"), py::arg("k"), py::arg("va"), py::arg("ga"), py::arg("chunk") = 64);
}
