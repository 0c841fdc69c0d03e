// Depthwise causal conv1d on CPU: forward, backward and the decode step (causal_conv1d_update).
//
// Layout the Python glue hands us (all fp32, contiguous unless said otherwise):
//   x, out, dout, dx: (batch, D, L)   w: (D, K)   bias: (D,)
//   x and dout may also be channel-last: unit stride over D, any strides over batch and L (e.g. a transposed
//   slice of a (batch, L, D') projection); the forward then writes out channel-last, (batch, L, D) dense
//   transposed, so the caller's transpose back is free.
//   initial_states, dinitial_states: (batch, D, K - 1)   seq_idx: (batch, L) int32
//
// Each row (b, d) is convolved over its virtual sequence v = [initial_states (K - 1, zeros when absent), x (L)]:
//   out[t] = bias + sum_k w[k] v[t + k]
// With seq_idx a tap reads x[t - (K - 1) + k] only when that position lies in the same sequence as t
// (seq_idx equal), never before the start of the row; initial states are then not allowed (checked in
// Python), so the padding taps are zero either way.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fastarch_math.h"
#include "fastarch_parallel.h"

namespace {

using fastarch::sigmoid_f;

struct Conv {
  const float* x;
  const float* w;
  const float* bias;
  const int32_t* seq;
  const float* init;
  int64_t batch, dim, L, K;
  bool channel_last;  // x(b, d, t) at x[b * xs_b + t * xs_t + d]; else contiguous
  int64_t xs_b, xs_t;
};

// Contiguous -> false; unit stride over dim (and not contiguous) -> true; anything else is refused.
bool is_channel_last(const torch::Tensor& t, const char* name) {
  if (t.is_contiguous()) return false;
  TORCH_CHECK(t.dim() == 3 && t.stride(1) == 1,
              "causal_conv1d cpp: ", name, " must be contiguous or channel-last (unit stride over dim)");
  return true;
}

// Row r = (b, d) of a (batch, dim, L) tensor, contiguous or channel-last: a pointer to it, gathered into buf
// when channel-last.
const float* read_row(const torch::Tensor& t, bool channel_last, int64_t r, float* buf) {
  const int64_t dim = t.size(1), L = t.size(2), b = r / dim, d = r % dim;
  const float* p = t.data_ptr<float>();
  if (!channel_last) return p + r * L;
  const float* src = p + b * t.stride(0) + d;
  const int64_t st = t.stride(2);
  for (int64_t i = 0; i < L; ++i) buf[i] = src[i * st];
  return buf;
}

Conv make_conv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
               const c10::optional<torch::Tensor>& seq_idx, const c10::optional<torch::Tensor>& init) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3,
              "causal_conv1d cpp: x must be fp32 (batch, dim, seqlen)");
  const bool channel_last = is_channel_last(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat && w.size(0) == x.size(1),
              "causal_conv1d cpp: weight must be fp32 contiguous (dim, width)");
  Conv c{x.data_ptr<float>(), w.data_ptr<float>(), nullptr, nullptr, nullptr,
         x.size(0), x.size(1), x.size(2), w.size(1), channel_last, x.stride(0), x.stride(2)};
  if (bias) c.bias = bias->data_ptr<float>();
  if (seq_idx) {
    TORCH_CHECK(seq_idx->scalar_type() == torch::kInt && seq_idx->is_contiguous() &&
                    seq_idx->numel() == c.batch * c.L,
                "causal_conv1d cpp: seq_idx must be int32 contiguous (batch, seqlen)");
    c.seq = seq_idx->data_ptr<int32_t>();
  }
  if (init) {
    TORCH_CHECK(init->is_contiguous() && init->scalar_type() == torch::kFloat &&
                    init->numel() == c.batch * c.dim * (c.K - 1),
                "causal_conv1d cpp: initial_states must be fp32 contiguous (batch, dim, width - 1)");
    c.init = init->data_ptr<float>();
  }
  return c;
}

// v = [initial_states row (or zeros), x row]: K - 1 + L floats.
void load_row(const Conv& c, int64_t r, float* v) {
  const int64_t pad = c.K - 1;
  if (c.init)
    std::copy(c.init + r * pad, c.init + (r + 1) * pad, v);
  else
    std::fill(v, v + pad, 0.f);
  if (c.channel_last) {
    const float* src = c.x + (r / c.dim) * c.xs_b + r % c.dim;
    for (int64_t t = 0; t < c.L; ++t) v[pad + t] = src[t * c.xs_t];
  } else {
    std::copy(c.x + r * c.L, c.x + (r + 1) * c.L, v + pad);
  }
}

// Does tap k of output t read a position of t's own sequence (and not the padding before the row)?
inline bool same_seq(const int32_t* seq, int64_t t, int64_t k, int64_t K) {
  const int64_t src = t + k - (K - 1);
  return src >= 0 && seq[src] == seq[t];
}

void silu_inplace(float* o, int64_t L) {
#pragma omp simd
  for (int64_t t = 0; t < L; ++t) o[t] = o[t] * sigmoid_f(o[t]);
}

// Pre-activation (or activated) output of row r into o (L floats), from its virtual row v.
void conv_row(const Conv& c, int64_t r, const float* v, float* o, bool silu) {
  const int64_t d = r % c.dim, b = r / c.dim, L = c.L, K = c.K;
  const float bv = c.bias ? c.bias[d] : 0.f;
  const float* wr = c.w + d * K;
  std::fill(o, o + L, bv);
  if (!c.seq) {
    for (int64_t k = 0; k < K; ++k) {
      const float wk = wr[k];
#pragma omp simd
      for (int64_t t = 0; t < L; ++t) o[t] += wk * v[t + k];
    }
  } else {
    const int32_t* seq = c.seq + b * L;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t t = 0; t < L; ++t)
        if (same_seq(seq, t, k, K)) o[t] += wr[k] * v[t + k];
  }
  if (silu) silu_inplace(o, L);
}

// The same without initial states or seq_idx: the taps read x directly (skipping the zero padding), so the
// row is never copied.
void conv_row_plain(const Conv& c, int64_t r, float* o, bool silu) {
  const int64_t d = r % c.dim, L = c.L, K = c.K;
  const float* xr = c.x + r * L;
  const float* wr = c.w + d * K;
  std::fill(o, o + L, c.bias ? c.bias[d] : 0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float wk = wr[k];
    const int64_t shift = K - 1 - k;
#pragma omp simd
    for (int64_t t = shift; t < L; ++t) o[t] += wk * xr[t - shift];
  }
  if (silu) silu_inplace(o, L);
}

// Channel-last: one step (b, t) at a time, vectorised over the channels, reading x in its own layout and
// writing out as (batch, L, D). The taps are added in the same order as the row paths (bias, then k = 0..K-1,
// padding taps skipped), so both layouts give the same sums.
torch::Tensor conv_fwd_channel_last(const Conv& c, bool silu) {
  const int64_t batch = c.batch, dim = c.dim, L = c.L, K = c.K, pad = K - 1;
  auto out = torch::empty({batch, L, dim}, torch::dtype(torch::kFloat)).transpose(1, 2);
  float* po = out.data_ptr<float>();
  std::vector<float> wt(K * dim);  // (K, D): tap k's weights contiguous over channels
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t k = 0; k < K; ++k) wt[k * dim + d] = c.w[d * K + k];
  fastarch::parallel_for(0, batch * L, std::max<int64_t>(1, 16384 / std::max<int64_t>(dim * K, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t bt = begin; bt < end; ++bt) {
                       const int64_t b = bt / L, t = bt % L;
                       float* o = po + bt * dim;
                       if (c.bias)
                         std::copy(c.bias, c.bias + dim, o);
                       else
                         std::fill(o, o + dim, 0.f);
                       const float* xb = c.x + b * c.xs_b;
                       const int32_t* seq = c.seq ? c.seq + b * L : nullptr;
                       for (int64_t k = 0; k < K; ++k) {
                         const int64_t src = t + k - pad;
                         if (seq && !same_seq(seq, t, k, K)) continue;
                         const float* wk = wt.data() + k * dim;
                         if (src >= 0) {
                           const float* xs = xb + src * c.xs_t;
#pragma omp simd
                           for (int64_t d = 0; d < dim; ++d) o[d] += wk[d] * xs[d];
                         } else if (c.init) {
                           const float* is = c.init + b * dim * pad + (pad + src);
                           for (int64_t d = 0; d < dim; ++d) o[d] += wk[d] * is[d * pad];
                         }
                       }
                       if (silu) silu_inplace(o, dim);
                     }
                   });
  return out;
}

torch::Tensor conv_fwd(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                       c10::optional<torch::Tensor> seq_idx, c10::optional<torch::Tensor> init, bool silu) {
  const Conv c = make_conv(x, w, bias, seq_idx, init);
  if (c.channel_last) return conv_fwd_channel_last(c, silu);
  auto out = torch::empty_like(x);
  float* po = out.data_ptr<float>();
  // Fork only when each task gets >= ~16K outputs: waking a thread team costs more than small rows.
  fastarch::parallel_for(0, c.batch * c.dim, std::max<int64_t>(1, 16384 / std::max<int64_t>(c.L, 1)),
                   [&](int64_t begin, int64_t end) {
                     const bool plain = !c.init && !c.seq;
                     std::vector<float> v(plain ? 0 : c.K - 1 + c.L);
                     for (int64_t r = begin; r < end; ++r) {
                       if (plain) {
                         conv_row_plain(c, r, po + r * c.L, silu);
                       } else {
                         load_row(c, r, v.data());
                         conv_row(c, r, v.data(), po + r * c.L, silu);
                       }
                     }
                   });
  return out;
}

// -> (dx, dweight, dbias, dinitial_states); dinitial_states is (batch, dim, K - 1) (the gradient of the
// zero padding when no initial states were given).
std::vector<torch::Tensor> conv_bwd(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                    torch::Tensor dout, c10::optional<torch::Tensor> seq_idx,
                                    c10::optional<torch::Tensor> init, bool silu) {
  const Conv c = make_conv(x, w, bias, seq_idx, init);
  TORCH_CHECK(dout.scalar_type() == torch::kFloat && dout.sizes() == x.sizes(),
              "causal_conv1d cpp: dout must be fp32 with x's shape");
  const bool dout_channel_last = is_channel_last(dout, "dout");
  const int64_t batch = c.batch, dim = c.dim, L = c.L, K = c.K, pad = K - 1;
  auto dx = torch::empty(x.sizes(), x.options());
  auto dinit = torch::empty({batch, dim, pad}, x.options());
  auto dw = torch::zeros({dim, K}, x.options());
  auto db = torch::zeros({dim}, x.options());
  float* pdx = dx.data_ptr<float>();
  float* pdi = dinit.data_ptr<float>();
  float* pdw = dw.data_ptr<float>();
  float* pdb = db.data_ptr<float>();
  // Parallel over channels: dw/db of a channel sum over batch inside one task.
  fastarch::parallel_for(0, dim, std::max<int64_t>(1, 16384 / std::max<int64_t>(batch * L, 1)), [&](int64_t begin,
                                                                                                int64_t end) {
    std::vector<float> v(pad + L), dv(pad + L), g(L), drow(dout_channel_last ? L : 0);
    for (int64_t d = begin; d < end; ++d) {
      const float* wr = w.data_ptr<float>() + d * K;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t r = b * dim + d;
        load_row(c, r, v.data());
        const float* gr = read_row(dout, dout_channel_last, r, drow.data());
        if (silu) {
          conv_row(c, r, v.data(), g.data(), false);
#pragma omp simd
          for (int64_t t = 0; t < L; ++t) {
            const float sg = sigmoid_f(g[t]);
            g[t] = gr[t] * sg * (1.f + g[t] * (1.f - sg));
          }
          gr = g.data();
        }
        std::fill(dv.begin(), dv.end(), 0.f);
        float sb = 0.f;
        for (int64_t t = 0; t < L; ++t) sb += gr[t];
        pdb[d] += sb;
        const int32_t* seq = c.seq ? c.seq + b * L : nullptr;
        for (int64_t k = 0; k < K; ++k) {
          const float wk = wr[k];
          float sw = 0.f;
          if (!seq) {
#pragma omp simd reduction(+ : sw)
            for (int64_t t = 0; t < L; ++t) {
              sw += gr[t] * v[t + k];
              dv[t + k] += wk * gr[t];
            }
          } else {
            for (int64_t t = 0; t < L; ++t)
              if (same_seq(seq, t, k, K)) {
                sw += gr[t] * v[t + k];
                dv[t + k] += wk * gr[t];
              }
          }
          pdw[d * K + k] += sw;
        }
        std::copy(dv.begin(), dv.begin() + pad, pdi + r * pad);
        std::copy(dv.begin() + pad, dv.end(), pdx + r * L);
      }
    }
  });
  return {dx, dw, db, dinit};
}

// ---- causal_conv1d_update: T decode steps, in place on conv_state --------------------------------------
// Row b reads and writes conv_state[conv_state_indices[b]] (or [b]), S entries per channel. Each output t
// reads the window v = [the K - 1 inputs before x, x (T)]:
//   - linear state (no cache_seqlens): the state holds the last S inputs in order; afterwards it is shifted
//     left by T with x appended;
//   - circular state (cache_seqlens): input number i of the sequence lives at i % S; x goes to positions
//     (cache_seqlens[b] + i) % S and the K - 1 inputs before it are read from just below.
// The Python glue has validated the indices (in range, distinct) and cache_seqlens (>= 0).
torch::Tensor conv_update(torch::Tensor x, torch::Tensor conv_state, torch::Tensor w, c10::optional<torch::Tensor> bias,
                          bool silu, c10::optional<torch::Tensor> cache_seqlens,
                          c10::optional<torch::Tensor> conv_state_indices) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && conv_state.is_contiguous() &&
                  conv_state.scalar_type() == torch::kFloat,
              "causal_conv1d_update cpp: x and conv_state must be fp32 contiguous");
  const int64_t batch = x.size(0), dim = x.size(1), T = x.size(2), S = conv_state.size(2), K = w.size(1);
  TORCH_CHECK(S >= K - 1, "causal_conv1d_update cpp: conv_state shorter than width - 1");
  const int32_t* pcs = cache_seqlens ? cache_seqlens->data_ptr<int32_t>() : nullptr;
  const int32_t* pidx = conv_state_indices ? conv_state_indices->data_ptr<int32_t>() : nullptr;
  auto out = torch::empty_like(x);
  const float* px = x.data_ptr<float>();
  float* pst = conv_state.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  const float* pb = bias ? bias->data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t pad = K - 1;
  // Tiny per row (T outputs of K taps): fork only when a task gets ~16K multiply-adds.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(T * K + S, 1));
  fastarch::parallel_for(0, batch * dim, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> v(pad + T), shifted(S);
    // One decode step is a few multiply-adds per row: the row's (b, d) advance without divisions, and the
    // linear state's window needs no modulo.
    int64_t b = begin / dim, d = begin % dim;
    for (int64_t r = begin; r < end; ++r, ++d) {
      if (d == dim) d = 0, ++b;
      const int64_t sb = pidx ? pidx[b] : b;
      float* st = pst + (sb * dim + d) * S;
      const float* xr = px + r * T;
      const int64_t next = pcs ? pcs[b] : S;  // where input T's first step is (or would be) stored
      if (pcs) {
        for (int64_t j = 0; j < pad; ++j) v[j] = st[((next - pad + j) % S + S) % S];
      } else {
        std::copy(st + S - pad, st + S, v.begin());
      }
      std::copy(xr, xr + T, v.begin() + pad);
      const float* wr = pw + d * K;
      for (int64_t t = 0; t < T; ++t) {
        float acc = pb ? pb[d] : 0.f;
        for (int64_t k = 0; k < K; ++k) acc += wr[k] * v[t + k];
        po[r * T + t] = silu ? acc * sigmoid_f(acc) : acc;
      }
      if (S == 0) continue;
      if (pcs) {
        for (int64_t i = std::max<int64_t>(0, T - S); i < T; ++i) st[(next + i) % S] = xr[i];
      } else {
        // New state j = old sequence [state (S), x (T)] at T + j.
        for (int64_t j = 0; j < S; ++j) shifted[j] = T + j < S ? st[T + j] : xr[T + j - S];
        std::copy(shifted.begin(), shifted.end(), st);
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: depthwise causal conv1d on CPU";
  m.def("causal_conv1d_fwd", &conv_fwd, "causal conv1d forward (seq_idx, initial_states optional) -> out");
  m.def("causal_conv1d_bwd", &conv_bwd, "causal conv1d backward -> (dx, dweight, dbias, dinitial_states)");
  m.def("causal_conv1d_update", &conv_update,
        "causal_conv1d_update (in place on conv_state; circular with cache_seqlens) -> out");
}
