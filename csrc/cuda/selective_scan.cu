// Mamba's selective scan on CUDA: forward and backward, same bindings as csrc/cpu/selective_scan.cpp.
//
// One thread owns one (batch, channel) pair and keeps its N-vector state in registers (N <= 64). Threads of
// a block are consecutive channels of one batch row, so a variable B_t / C_t row is shared by the whole
// block (broadcast reads through the cache). The forward writes the state every `chunk` steps (ckpt).
// The backward walks chunks from last to first: it re-runs a chunk forward from its checkpoint into a
// per-thread scratch (chunk+1 states, independent of L), then walks it backward; variable dB/dC rows are
// accumulated with atomicAdd, per-channel gradients are written as per-batch rows and summed afterwards.
// Layouts (fp32, contiguous): u/delta/z (B, D, L); A (D, N); B/C constant (D, N) or (B, G, L, N).
#include <torch/extension.h>
#include <cuda_runtime.h>

namespace {

constexpr int kMaxN = 64;
constexpr int kThreads = 128;

struct Args {
  const float *u, *delta, *A, *B, *C, *Dp, *z, *bias;
  int gB, gC;
  bool softplus;
  int batch, dim, L, N, chunk, nck;
};

__device__ __forceinline__ float softplus_f(float x) { return x <= 20.f ? log1pf(expf(x)) : x; }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ const float* bc_row(const float* M, int g, int b, int d, int dim, int L, int N) {
  // Start of the time-major rows of channel d's group, or the constant row of d.
  return g ? M + ((long)(b * g + d / (dim / g)) * L) * N : M + (long)d * N;
}

__global__ void fwd_kernel(Args a, float* out, float* last, float* ckpt) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int b = blockIdx.y;
  if (d >= a.dim) return;
  const int N = a.N;
  float h[kMaxN], Ad[kMaxN];
#pragma unroll
  for (int n = 0; n < kMaxN; ++n) {
    h[n] = 0.f;
    Ad[n] = n < N ? a.A[d * N + n] : 0.f;
  }
  const float* Bb = bc_row(a.B, a.gB, b, d, a.dim, a.L, N);
  const float* Cb = bc_row(a.C, a.gC, b, d, a.dim, a.L, N);
  const long row = ((long)b * a.dim + d) * a.L;
  const float Dv = a.Dp ? a.Dp[d] : 0.f;
  const float bv = a.bias ? a.bias[d] : 0.f;
  for (int t = 0; t < a.L; ++t) {
    if (ckpt && t % a.chunk == 0) {
      float* ck = ckpt + (((long)b * a.dim + d) * a.nck + t / a.chunk) * N;
      for (int n = 0; n < N; ++n) ck[n] = h[n];
    }
    const float uv = a.u[row + t];
    float dt = a.delta[row + t] + bv;
    if (a.softplus) dt = softplus_f(dt);
    const float* Bt = a.gB ? Bb + (long)t * N : Bb;
    const float* Ct = a.gC ? Cb + (long)t * N : Cb;
    float y = 0.f;
#pragma unroll
    for (int n = 0; n < kMaxN; ++n) {
      if (n < N) {
        h[n] = __expf(dt * Ad[n]) * h[n] + dt * uv * Bt[n];
        y += h[n] * Ct[n];
      }
    }
    y += Dv * uv;
    if (a.z) {
      const float zv = a.z[row + t];
      y *= zv * sigmoid_f(zv);
    }
    out[row + t] = y;
  }
  for (int n = 0; n < N; ++n) last[((long)b * a.dim + d) * N + n] = h[n];
}

__global__ void bwd_kernel(Args a, const float* dout, const float* dlast, const float* ckpt, float* scratch,
                           float* du, float* ddelta, float* dz, float* dA, float* dB, float* dC, float* dD,
                           float* dbias) {
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int b = blockIdx.y;
  if (d >= a.dim) return;
  const int N = a.N;
  const long bd = (long)b * a.dim + d;
  float dh[kMaxN], Ad[kMaxN], dAacc[kMaxN];
#pragma unroll
  for (int n = 0; n < kMaxN; ++n) {
    dh[n] = (dlast && n < N) ? dlast[bd * N + n] : 0.f;
    Ad[n] = n < N ? a.A[d * N + n] : 0.f;
    dAacc[n] = 0.f;
  }
  const float* Bb = bc_row(a.B, a.gB, b, d, a.dim, a.L, N);
  const float* Cb = bc_row(a.C, a.gC, b, d, a.dim, a.L, N);
  // Gradient rows: variable -> the group's time-major rows (atomics); constant -> this (batch, channel) row.
  float* dBb = a.gB ? dB + ((long)(b * a.gB + d / (a.dim / a.gB)) * a.L) * N : dB + bd * N;
  float* dCb = a.gC ? dC + ((long)(b * a.gC + d / (a.dim / a.gC)) * a.L) * N : dC + bd * N;
  float* hs = scratch + bd * (long)(a.chunk + 1) * N;
  const long row = bd * a.L;
  const float Dv = a.Dp ? a.Dp[d] : 0.f;
  const float bv = a.bias ? a.bias[d] : 0.f;
  float dDacc = 0.f, dbacc = 0.f;
  if (!a.gB)
    for (int n = 0; n < N; ++n) dBb[n] = 0.f;
  if (!a.gC)
    for (int n = 0; n < N; ++n) dCb[n] = 0.f;
  for (int k = a.nck - 1; k >= 0; --k) {
    const int t0 = k * a.chunk;
    const int tl = min(a.chunk, a.L - t0);
    for (int n = 0; n < N; ++n) hs[n] = ckpt[(bd * a.nck + k) * N + n];
    for (int i = 0; i < tl; ++i) {
      const int t = t0 + i;
      float dt = a.delta[row + t] + bv;
      if (a.softplus) dt = softplus_f(dt);
      const float uv = a.u[row + t];
      const float* Bt = a.gB ? Bb + (long)t * N : Bb;
      for (int n = 0; n < N; ++n) hs[(i + 1) * N + n] = __expf(dt * Ad[n]) * hs[i * N + n] + dt * uv * Bt[n];
    }
    for (int i = tl - 1; i >= 0; --i) {
      const int t = t0 + i;
      const float pre = a.delta[row + t] + bv;
      const float dt = a.softplus ? softplus_f(pre) : pre;
      const float dsp = (a.softplus && pre <= 20.f) ? sigmoid_f(pre) : 1.f;
      const float uv = a.u[row + t];
      const float* Bt = a.gB ? Bb + (long)t * N : Bb;
      const float* Ct = a.gC ? Cb + (long)t * N : Cb;
      const float* hc = hs + (i + 1) * N;
      const float* hp = hs + i * N;
      float g = dout[row + t];
      if (a.z) {
        float y = Dv * uv;
        for (int n = 0; n < N; ++n) y += hc[n] * Ct[n];
        const float zv = a.z[row + t];
        const float sz = sigmoid_f(zv);
        dz[row + t] = g * y * sz * (1.f + zv * (1.f - sz));
        g *= zv * sz;
      }
      dDacc += g * uv;
      float duv = g * Dv, ddt = 0.f;
#pragma unroll
      for (int n = 0; n < kMaxN; ++n) {
        if (n < N) {
          const float gc = g * hc[n];
          if (a.gC) atomicAdd(dCb + (long)t * N + n, gc); else dCb[n] += gc;
          const float dhn = dh[n] + g * Ct[n];
          const float e = __expf(dt * Ad[n]);
          const float hpe = hp[n] * e;
          dAacc[n] += dhn * hpe * dt;
          ddt += dhn * (hpe * Ad[n] + uv * Bt[n]);
          duv += dt * dhn * Bt[n];
          const float gb = dhn * dt * uv;
          if (a.gB) atomicAdd(dBb + (long)t * N + n, gb); else dBb[n] += gb;
          dh[n] = dhn * e;
        }
      }
      du[row + t] = duv;
      ddelta[row + t] = ddt * dsp;
      dbacc += ddt * dsp;
    }
  }
  for (int n = 0; n < N; ++n) dA[bd * N + n] = dAacc[n];
  dD[bd] = dDacc;
  dbias[bd] = dbacc;
}

// Launches go to the legacy default stream (torch's default stream); c10/cuda headers are avoided so that
// this file compile-checks against a CPU build of torch's headers too.
void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "selective_scan cuda: kernel launch failed: ", cudaGetErrorString(err));
}

Args make_args(const torch::Tensor& u, const torch::Tensor& delta, const torch::Tensor& A, const torch::Tensor& B,
               int64_t gB, const torch::Tensor& C, int64_t gC, const c10::optional<torch::Tensor>& Dp,
               const c10::optional<torch::Tensor>& z, const c10::optional<torch::Tensor>& bias, bool softplus,
               int64_t chunk) {
  TORCH_CHECK(u.is_cuda() && u.is_contiguous() && u.scalar_type() == torch::kFloat,
              "selective_scan cuda: u must be a contiguous fp32 CUDA tensor");
  TORCH_CHECK(A.size(1) <= kMaxN, "selective_scan cuda: d_state must be <= ", kMaxN, ", got ", A.size(1));
  Args a;
  a.u = u.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  a.A = A.data_ptr<float>();
  a.B = B.data_ptr<float>();
  a.C = C.data_ptr<float>();
  a.Dp = Dp ? Dp->data_ptr<float>() : nullptr;
  a.z = z ? z->data_ptr<float>() : nullptr;
  a.bias = bias ? bias->data_ptr<float>() : nullptr;
  a.gB = static_cast<int>(gB);
  a.gC = static_cast<int>(gC);
  a.softplus = softplus;
  a.batch = static_cast<int>(u.size(0));
  a.dim = static_cast<int>(u.size(1));
  a.L = static_cast<int>(u.size(2));
  a.N = static_cast<int>(A.size(1));
  a.chunk = static_cast<int>(chunk);
  a.nck = (a.L + a.chunk - 1) / a.chunk;
  return a;
}

std::vector<torch::Tensor> scan_fwd(torch::Tensor u, torch::Tensor delta, torch::Tensor A, torch::Tensor B,
                                    int64_t gB, torch::Tensor C, int64_t gC, c10::optional<torch::Tensor> Dp,
                                    c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> bias, bool softplus,
                                    bool need_ckpt, int64_t chunk) {
  Args a = make_args(u, delta, A, B, gB, C, gC, Dp, z, bias, softplus, chunk);
  auto out = torch::empty_like(u);
  auto last = torch::empty({a.batch, a.dim, a.N}, u.options());
  auto ckpt = need_ckpt ? torch::empty({a.batch, a.dim, a.nck, a.N}, u.options()) : torch::empty({0}, u.options());
  dim3 grid((a.dim + kThreads - 1) / kThreads, a.batch);
  fwd_kernel<<<grid, kThreads>>>(
      a, out.data_ptr<float>(), last.data_ptr<float>(), need_ckpt ? ckpt.data_ptr<float>() : nullptr);
  check_launch();
  return {out, last, ckpt};
}

std::vector<torch::Tensor> scan_bwd(torch::Tensor dout, c10::optional<torch::Tensor> dlast, torch::Tensor u,
                                    torch::Tensor delta, torch::Tensor A, torch::Tensor B, int64_t gB, torch::Tensor C,
                                    int64_t gC, c10::optional<torch::Tensor> Dp, c10::optional<torch::Tensor> z,
                                    c10::optional<torch::Tensor> bias, torch::Tensor ckpt, bool softplus,
                                    int64_t chunk) {
  Args a = make_args(u, delta, A, B, gB, C, gC, Dp, z, bias, softplus, chunk);
  const auto opt = u.options();
  auto du = torch::empty_like(u);
  auto ddelta = torch::empty_like(u);
  auto dz = z ? torch::empty_like(u) : torch::empty({0}, opt);
  auto dA = torch::empty({a.batch, a.dim, a.N}, opt);
  auto dB = gB ? torch::zeros_like(B) : torch::empty({a.batch, a.dim, a.N}, opt);
  auto dC = gC ? torch::zeros_like(C) : torch::empty({a.batch, a.dim, a.N}, opt);
  auto dD = torch::empty({a.batch, a.dim}, opt);
  auto dbias = torch::empty({a.batch, a.dim}, opt);
  auto scratch = torch::empty({(int64_t)a.batch * a.dim * (a.chunk + 1) * a.N}, opt);
  dim3 grid((a.dim + kThreads - 1) / kThreads, a.batch);
  bwd_kernel<<<grid, kThreads>>>(
      a, dout.data_ptr<float>(), dlast ? dlast->data_ptr<float>() : nullptr, ckpt.data_ptr<float>(),
      scratch.data_ptr<float>(), du.data_ptr<float>(), ddelta.data_ptr<float>(), z ? dz.data_ptr<float>() : nullptr,
      dA.data_ptr<float>(), dB.data_ptr<float>(), dC.data_ptr<float>(), dD.data_ptr<float>(),
      dbias.data_ptr<float>());
  check_launch();
  return {du, ddelta, dA.sum(0), gB ? dB : dB.sum(0), gC ? dC : dC.sum(0), dD.sum(0), dz, dbias.sum(0)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastarch: selective scan (Mamba) on CUDA";
  m.def("selective_scan_fwd", &scan_fwd, "selective scan forward -> (out, last_state, ckpt)");
  m.def("selective_scan_bwd", &scan_bwd,
        "selective scan backward -> (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias)");
}
