// A persistent pool of worker threads. The calling thread works too; items are claimed from an
// atomic counter so uneven items balance themselves. One job runs at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace writescope {

class ThreadPool {
 public:
  using ItemFn = void (*)(void* context, int64_t item, int thread_index);

  // num_threads counts the caller; cpus (may be empty) pins worker i to cpus[i % cpus.size()].
  ThreadPool(int num_threads, std::vector<int> cpus);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  const std::vector<int>& cpus() const { return cpus_; }

  // Calls fn(context, item, thread_index) for every item in [0, num_items); returns when all ran.
  // parallel = false runs them all on the caller: for a job smaller than waking the workers costs.
  void run(int64_t num_items, ItemFn fn, void* context, bool parallel = true);

 private:
  void worker_loop(int thread_index);
  void drain(int thread_index);

  std::vector<std::thread> workers_;
  std::vector<int> cpus_;
  std::mutex job_mutex_;  // serialises callers
  std::mutex state_mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  int busy_workers_ = 0;
  ItemFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_item_{0};
};

}  // namespace writescope
