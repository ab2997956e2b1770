#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

namespace writescope {

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus) : cpus_(std::move(cpus)) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
    if (!cpus_.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus_[(i - 1) % cpus_.size()], &set);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::drain(int thread_index) {
  for (;;) {
    const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
    if (item >= num_items_) return;
    fn_(context_, item, thread_index);
  }
}

void ThreadPool::run(int64_t num_items, ItemFn fn, void* context, bool parallel) {
  if (num_items <= 0) return;
  std::lock_guard<std::mutex> job(job_mutex_);
  const bool use_workers = parallel && num_items > 1 && !workers_.empty();
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    fn_ = fn;
    context_ = context;
    num_items_ = num_items;
    next_item_.store(0, std::memory_order_relaxed);
    if (use_workers) {
      busy_workers_ = static_cast<int>(workers_.size());
      ++generation_;
    }
  }
  if (use_workers) wake_.notify_all();
  drain(0);
  if (use_workers) {
    std::unique_lock<std::mutex> lock(state_mutex_);
    done_.wait(lock, [this] { return busy_workers_ == 0; });
  }
}

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(state_mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    drain(thread_index);
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (--busy_workers_ == 0) done_.notify_one();
  }
}

}  // namespace writescope
