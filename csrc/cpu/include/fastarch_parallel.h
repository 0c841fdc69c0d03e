// Dynamic scheduling for the CPU kernels.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace fastarch {

// Runs body(i, i + 1) for every task i in [0, n), last task first: threads pull task indices from an atomic
// counter. A static split leaves one thread idle when tasks are uneven (causal or banded attention, whose
// later query blocks see more keys, are heaviest last) or when a core is shared with other processes.
template <class Body>
void run_tasks(int64_t n, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, std::max<int64_t>(nt, 1), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(n - 1 - i, n - i);
    }
  });
}

}  // namespace fastarch
