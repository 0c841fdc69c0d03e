// Fused multi-tensor Adam / AdamW step for CPU (fastarch.optim.Adam/AdamW with fused=True).
//
// One call updates every (param, grad, m, v) of a param group: it bumps each tensor's step counter, then
// does weight decay (decoupled for AdamW, L2 for Adam), the m/v moving averages, the bias correction and
// the parameter update in a single read-modify-write pass per element. The tensors are treated as one
// virtual concatenation that fastarch::parallel_for splits over threads, so a model of many small tensors
// parallelises as well as one big tensor and pays one parallel region per step, not one per tensor.
//
// The arithmetic mirrors, operation by operation and in the same precision, the foreach path of
// fastarch/optim/__init__.py (torch's _foreach_lerp_/mul_/addcmul_/sqrt/div_/add_/addcdiv_ on CPU), so the
// two trajectories agree to rounding:
//   g  = g + wd * p                       (Adam, L2)      p = p * (1 - lr * wd)   (AdamW, decoupled)
//   m  = lerp(m, g, 1 - b1)               v = v * b2 + (1 - b2) * g * g
//   p  = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
// torch's vectorised kernels use a fused multiply-add for lerp, addcmul and add-with-alpha and round after
// every other operation; the std::fma calls below sit exactly there, and no product is left where the
// compiler could contract it into a neighbouring add, so in fp32/fp64 m and v follow the foreach path bit for
// bit. p differs in the last bit now and then: torch's CPU sqrt is within one ulp, std::sqrt is exact.
// fp16/bf16 params (state of the param dtype or fp32) are computed in fp32 and rounded once per store;
// float64 params are computed in float64.

#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "fastarch_parallel.h"

namespace {

// Per-tensor coefficients, computed in double (as Python computes them) and rounded to the compute type.
template <typename T>
struct Coeffs {
  T decay;      // AdamW: 1 - lr * wd; Adam: wd
  T w1;         // lerp weight 1 - b1
  T w1_m1;      // w1 - 1, the coefficient of torch's lerp branch for w1 >= 0.5
  T b2, one_m_b2, bc2_sqrt, eps, neg_step;
};

struct Job {
  void* p;
  const void* g;
  void* m;
  void* v;
  int64_t n;
  int kind;          // index into the dispatch table below
  double neg_step;   // -lr / (1 - beta1^t) for this tensor's step count t (after the update)
  double bc2_sqrt;   // sqrt(1 - beta2^t)
};

// The combinations of (param dtype, state dtype) the kernel takes.
enum Kind { kF32 = 0, kF64, kBF16, kBF16_F32, kF16, kF16_F32 };

// Storage types as the kernel sees them: bf16 as raw uint16_t bits and fp16 as the compiler's _Float16, so the
// conversions are plain bit operations / F16C instructions that vectorise (c10's converters do not).
using bf16_bits = uint16_t;

inline float load(float x) { return x; }
inline double load(double x) { return x; }
inline float load(_Float16 x) { return static_cast<float>(x); }
inline float load(bf16_bits x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename S>
inline S store(float x);
template <>
inline float store<float>(float x) { return x; }
template <>
inline _Float16 store<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline bf16_bits store<bf16_bits>(float x) {
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16_bits>(x != x ? 0x7FC0u : r);
}
template <typename S>
inline S store(double x) { return x; }

enum Decay { kNoDecay = 0, kL2, kDecoupled };

template <typename P, typename S, typename T, int DECAY>
void adam_slice(P* __restrict p, const P* __restrict g, S* __restrict m, S* __restrict v, int64_t n,
                const Coeffs<T>& c, bool lerp_low) {
  const T decay = c.decay, b2 = c.b2, omb2 = c.one_m_b2, bc2s = c.bc2_sqrt, eps = c.eps, ns = c.neg_step;
  // torch's vectorised lerp: fma(w, end - self, self) for small w, else fma(w - 1, end - self, end).
  const T lerp_coef = lerp_low ? c.w1 : c.w1_m1;
  // No branch around a call in the body: GCC does not if-convert those and would not vectorise.
  _Pragma("omp simd")
  for (int64_t i = 0; i < n; ++i) {
    T pi = load(p[i]);
    T gi = load(g[i]);
    if constexpr (DECAY == kDecoupled) {
      // fma(p, decay, 0) is p * decay rounded, and keeps the compiler from fusing it into the final add.
      pi = std::fma(pi, decay, static_cast<T>(0));
    } else if constexpr (DECAY == kL2) {
      gi = std::fma(decay, pi, gi);  // add(g, p, alpha=wd)
    }
    T mi = load(m[i]);
    mi = std::fma(lerp_coef, gi - mi, lerp_low ? mi : gi);
    T vi = load(v[i]) * b2;
    vi = std::fma(omb2 * gi, gi, vi);  // addcmul: self + (value * t1) * t2
    const T den = std::sqrt(vi) / bc2s + eps;
    pi = pi + ns * mi / den;
    m[i] = store<S>(mi);
    v[i] = store<S>(vi);
    p[i] = store<P>(pi);
  }
}

struct Hyper {
  double lr, beta1, beta2, eps, wd;
  bool decoupled;
};

template <typename T>
Coeffs<T> coeffs(const Hyper& h, const Job& j) {
  Coeffs<T> c;
  c.decay = static_cast<T>(h.decoupled ? 1.0 - h.lr * h.wd : h.wd);
  c.w1 = static_cast<T>(1.0 - h.beta1);
  c.w1_m1 = c.w1 - static_cast<T>(1);
  c.b2 = static_cast<T>(h.beta2);
  c.one_m_b2 = static_cast<T>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<T>(j.bc2_sqrt);
  c.eps = static_cast<T>(h.eps);
  c.neg_step = static_cast<T>(j.neg_step);
  return c;
}

template <typename P, typename S, typename T>
void run_typed(const Job& j, int64_t off, int64_t len, const Hyper& h) {
  const Coeffs<T> c = coeffs<T>(h, j);
  const bool lerp_low = std::abs(c.w1) < static_cast<T>(0.5);
  P* p = static_cast<P*>(j.p) + off;
  const P* g = static_cast<const P*>(j.g) + off;
  S* m = static_cast<S*>(j.m) + off;
  S* v = static_cast<S*>(j.v) + off;
  if (h.wd == 0.0) {
    adam_slice<P, S, T, kNoDecay>(p, g, m, v, len, c, lerp_low);
  } else if (h.decoupled) {
    adam_slice<P, S, T, kDecoupled>(p, g, m, v, len, c, lerp_low);
  } else {
    adam_slice<P, S, T, kL2>(p, g, m, v, len, c, lerp_low);
  }
}

void run_slice(const Job& j, int64_t off, int64_t len, const Hyper& h) {
  switch (j.kind) {
    case kF32: run_typed<float, float, float>(j, off, len, h); break;
    case kF64: run_typed<double, double, double>(j, off, len, h); break;
    case kBF16: run_typed<bf16_bits, bf16_bits, float>(j, off, len, h); break;
    case kBF16_F32: run_typed<bf16_bits, float, float>(j, off, len, h); break;
    case kF16: run_typed<_Float16, _Float16, float>(j, off, len, h); break;
    case kF16_F32: run_typed<_Float16, float, float>(j, off, len, h); break;
    default: break;
  }
}

// Small tensors live far apart in memory and each starts four cold streams; fetching the start of the next
// tensor's streams while this one is computed hides most of that latency (many-small-tensor models).
void prefetch_head(const Job& j) {
  constexpr int kLines = 8;  // 512 bytes per stream
  const int64_t bytes = std::min<int64_t>(j.n * 4, kLines * 64);
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(static_cast<const char*>(j.p) + o, 1);
    __builtin_prefetch(static_cast<const char*>(j.g) + o, 0);
    __builtin_prefetch(static_cast<const char*>(j.m) + o, 1);
    __builtin_prefetch(static_cast<const char*>(j.v) + o, 1);
  }
}

std::string where(const char* what, size_t i) { return std::string(what) + "[" + std::to_string(i) + "]"; }

int kind_of(const torch::Tensor& p, const torch::Tensor& s, size_t i) {
  const auto pt = p.scalar_type(), st = s.scalar_type();
  if (pt == at::kFloat && st == at::kFloat) return kF32;
  if (pt == at::kDouble && st == at::kDouble) return kF64;
  if (pt == at::kBFloat16 && st == at::kBFloat16) return kBF16;
  if (pt == at::kBFloat16 && st == at::kFloat) return kBF16_F32;
  if (pt == at::kHalf && st == at::kHalf) return kF16;
  if (pt == at::kHalf && st == at::kFloat) return kF16_F32;
  TORCH_CHECK(false, "fused adam: params[", i, "] has dtype ", pt, " with state dtype ", st,
              "; expected float32/float64 params with state of the same dtype, or float16/bfloat16 params with "
              "state of the param dtype or float32");
  return -1;
}

// Same sizes and strides, and the strides describe a dense block without overlap: then the element at
// flat offset k of each tensor's storage is the same logical element in all four.
bool same_dense_layout(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m,
                       const torch::Tensor& v) {
  if (!p.is_non_overlapping_and_dense()) return false;
  const auto st = p.strides();
  return g.strides() == st && m.strides() == st && v.strides() == st;
}

// Updates params, exp_avgs, exp_avg_sqs and steps in place (steps: one float32 scalar tensor per param,
// incremented by one before use). Everything is validated before anything is written.
void adam_step(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
               std::vector<torch::Tensor> exp_avgs, std::vector<torch::Tensor> exp_avg_sqs,
               std::vector<torch::Tensor> steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused adam: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length; got ", n,
              ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ", steps.size());
  std::vector<int> kinds(n);
  for (size_t i = 0; i < n; ++i) {
    const auto &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i], &s = steps[i];
    TORCH_CHECK(p.defined() && g.defined() && m.defined() && v.defined() && s.defined(),
                "fused adam: undefined tensor at index ", i);
    for (const auto* t : {&p, &g, &m, &v, &s}) {
      TORCH_CHECK(t->device().is_cpu(), "fused adam: every tensor must be on the CPU; ", where("params", i),
                  " has a tensor on ", t->device());
      TORCH_CHECK(t->layout() == at::kStrided, "fused adam: sparse tensors are not supported (",
                  where("params", i), ")");
      TORCH_CHECK(t->has_storage(), "fused adam: ", where("params", i),
                  " or its grad/state has no storage (a tensor subclass such as DTensor?); use foreach");
    }
    TORCH_CHECK(g.sizes() == p.sizes(), "fused adam: ", where("grads", i), " has shape ", g.sizes(),
                ", expected the param's shape ", p.sizes());
    TORCH_CHECK(m.sizes() == p.sizes() && v.sizes() == p.sizes(), "fused adam: state of ", where("params", i),
                " has shapes ", m.sizes(), " and ", v.sizes(), ", expected ", p.sizes());
    TORCH_CHECK(g.scalar_type() == p.scalar_type(), "fused adam: ", where("grads", i), " has dtype ",
                g.scalar_type(), ", expected the param's dtype ", p.scalar_type());
    TORCH_CHECK(m.scalar_type() == v.scalar_type(), "fused adam: m and v of ", where("params", i),
                " have different dtypes (", m.scalar_type(), ", ", v.scalar_type(), ")");
    kinds[i] = kind_of(p, m, i);
    TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat, "fused adam: ", where("steps", i),
                " must be a float32 tensor with one element; got dtype ", s.scalar_type(), " and ", s.numel(),
                " elements");
    TORCH_CHECK(at::has_internal_overlap(p) != at::MemOverlap::Yes, "fused adam: ", where("params", i),
                " has overlapping memory (an expanded view?)");
  }

  // Tensors whose layouts differ are updated through contiguous copies, written back afterwards.
  struct Staged {
    size_t i;
    torch::Tensor p, m, v;
  };
  std::vector<Staged> staged;
  std::vector<Job> jobs;
  std::vector<int64_t> offsets;  // start of each job in the virtual concatenation
  jobs.reserve(n);
  offsets.reserve(n + 1);
  int64_t total = 0;
  double cached_t = -1.0, neg_step = 0.0, bc2_sqrt = 1.0;
  for (size_t i = 0; i < n; ++i) {
    float* sp = steps[i].data_ptr<float>();
    *sp += 1.0f;
    const int64_t numel = params[i].numel();
    if (numel == 0) continue;
    torch::Tensor p = params[i], g = grads[i], m = exp_avgs[i], v = exp_avg_sqs[i];
    if (!same_dense_layout(p, g, m, v)) {
      p = p.contiguous();
      g = g.contiguous();
      m = m.contiguous();
      v = v.contiguous();
      staged.push_back({i, p, m, v});
    }
    const double t = static_cast<double>(*sp);
    if (t != cached_t) {  // tensors of a group almost always share their step count: two pow() per group
      cached_t = t;
      neg_step = -(lr / (1.0 - std::pow(beta1, t)));
      bc2_sqrt = std::pow(1.0 - std::pow(beta2, t), 0.5);
    }
    jobs.push_back({p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), numel, kinds[i], neg_step, bc2_sqrt});
    offsets.push_back(total);
    total += numel;
  }
  if (total == 0) return;

  const Hyper h{lr, beta1, beta2, eps, weight_decay, decoupled};
  // Threads are woken only for steps of more than 1M elements (one chunk per 1M): below that a step takes
  // ~1-2 ms on one core, a second thread saves little, and on a loaded machine waking it was measured to
  // cost several ms (0.55M elements in 1000 tensors: 1.0 ms on one thread, 8 ms median on two).
  constexpr int64_t kGrain = 1 << 20;
  fastarch::parallel_for(0, total, kGrain, [&](int64_t b, int64_t e) {
    size_t k = static_cast<size_t>(std::upper_bound(offsets.begin(), offsets.end(), b) - offsets.begin()) - 1;
    while (b < e && k < jobs.size()) {
      const int64_t start = offsets[k];
      const int64_t stop = std::min(e, start + jobs[k].n);
      if (k + 1 < jobs.size()) prefetch_head(jobs[k + 1]);
      run_slice(jobs[k], b - start, stop - b, h);
      b = stop;
      ++k;
    }
  });

  for (const auto& s : staged) {
    params[s.i].copy_(s.p);
    exp_avgs[s.i].copy_(s.m);
    exp_avg_sqs[s.i].copy_(s.v);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step,
        "fused multi-tensor Adam/AdamW step (in place): params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, "
        "beta2, eps, weight_decay, decoupled",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"),
        pybind11::arg("steps"), pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"),
        pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("decoupled"));
}
