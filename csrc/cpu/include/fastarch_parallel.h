// Parallel loops for the CPU kernels, on a task pool that never waits for a thread that is not running.
//
// at::parallel_for is an OpenMP fork-join: the caller returns only when every thread of the team has
// arrived at the region's closing barrier. When a core is busy with another process, one of those threads
// may not be scheduled for a whole time slice (tens of milliseconds), and the call waits for it even when
// the running threads have done all the work. Here the work is cut into tasks that threads claim from one
// atomic counter; the caller runs tasks too and waits only for tasks that another thread has claimed, so a
// thread that wakes late finds nothing left and the call has already returned.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace fastarch {
namespace detail {

// Index of the calling thread inside a pool run: 0 for the caller, 1.. for the workers; -1 outside a run.
inline int& pool_thread_index() {
  static thread_local int index = -1;
  return index;
}

class TaskPool {
 public:
  static TaskPool& instance() {
    static TaskPool* pool = new TaskPool();  // never destroyed: workers may still sleep at process exit
    return *pool;
  }

  // Runs task(i) for every i in [0, n) on the calling thread and up to threads - 1 workers; returns when
  // every task has finished. A call made while another run is in progress (nested, or from another thread)
  // runs its tasks serially on its own thread.
  template <class Task>
  void run(int64_t n, int threads, const Task& task) {
    std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
    if (!job.owns_lock() || threads <= 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) task(i);
      return;
    }
    start_workers(threads - 1);
    task_ = &task;
    call_ = [](const void* t, int64_t i) { (*static_cast<const Task*>(t))(i); };
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++generation_;
    next_.store(gen << 32, std::memory_order_release);  // (generation, next task index)
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_generation_ = gen;
      wake_limit_ = threads - 1;
    }
    wake_.notify_all();
    const int previous = pool_thread_index();
    pool_thread_index() = 0;
    work(gen);
    pool_thread_index() = previous;
    // Only tasks that a worker has claimed are left: wait for those, yielding the core to whoever needs it.
    while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
  }

 private:
  TaskPool() = default;

  void start_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size()) + 1;
      workers_.emplace_back([this, index] { loop(index); });
      workers_.back().detach();
    }
  }

  // Claims and runs tasks of generation gen until none is left.
  void work(uint64_t gen) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      if ((v >> 32) != gen || static_cast<int64_t>(v & 0xffffffffu) >= n_.load(std::memory_order_relaxed)) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      // The run of generation gen cannot end before this claimed task is done, so task_ is still its task.
      call_(task_, static_cast<int64_t>(v & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(int index) {
    pool_thread_index() = index;
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen;
      {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        wake_.wait(lock, [&] { return wake_generation_ != seen && index <= wake_limit_; });
        gen = wake_generation_;
      }
      seen = gen;
      work(gen);
    }
  }

  std::mutex job_mutex_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  uint64_t generation_ = 0;
  std::atomic<int64_t> n_{0};
  const void* task_ = nullptr;
  void (*call_)(const void*, int64_t) = nullptr;
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  uint64_t wake_generation_ = 0;
  int wake_limit_ = 0;
};

}  // namespace detail

// The index of the calling thread among those running a parallel loop's tasks, in [0, at::get_num_threads()):
// for per-thread scratch buffers. 0 outside a loop.
inline int thread_index() { return std::max(detail::pool_thread_index(), 0); }

// at::parallel_for's contract (f(b, e) over consecutive ranges covering [begin, end), each of at least
// grain items but the last, serial when the range is within one grain), run on the task pool: about four
// tasks per thread, claimed dynamically, so uneven work and a descheduled thread cost little.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || range <= grain || detail::pool_thread_index() >= 0 || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = std::max<int64_t>(grain, (range + 4 * threads - 1) / (4 * threads));
  const int64_t tasks = (range + chunk - 1) / chunk;
  detail::TaskPool::instance().run(tasks, static_cast<int>(std::min<int64_t>(threads, tasks)),
                                   [&](int64_t t) {
                                     const int64_t b = begin + t * chunk;
                                     f(b, std::min(end, b + chunk));
                                   });
}

// Runs body(i, i + 1) for every task i in [0, n), last task first (the heaviest tasks of causal or banded
// attention are the last query blocks, so they start first).
template <class Body>
void run_tasks(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int threads = at::get_num_threads();
  if (threads <= 1 || n == 1 || detail::pool_thread_index() >= 0 || at::in_parallel_region()) {
    for (int64_t i = n - 1; i >= 0; --i) body(i, i + 1);
    return;
  }
  detail::TaskPool::instance().run(n, static_cast<int>(std::min<int64_t>(threads, n)),
                                   [&](int64_t t) { body(n - 1 - t, n - t); });
}

}  // namespace fastarch
