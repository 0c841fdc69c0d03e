// Tensor helpers shared by the CPU kernels: input checks and fp32 reads of any storage dtype.
#pragma once

#include <torch/extension.h>

namespace fastarch {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

inline void check_cpu_contig(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace fastarch
