#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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

namespace {

std::atomic<int64_t> spin_us{ThreadPool::kDefaultSpinMicroseconds};

// A poll's pause: tells the core this is a spin loop (it frees the sibling hyperthread's share).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Polls done() for up to spin_microseconds(); true when it turned true meanwhile. For the first
// kPauseMicroseconds the poll only pauses the core; after that it yields it at every poll, so a
// runnable thread waiting for this core runs first.
template <class Done>
bool spin_until(Done done) {
  const int64_t spin = spin_us.load(std::memory_order_relaxed);
  if (spin == 0) return done();
  const auto start = std::chrono::steady_clock::now();
  const auto yield_from = start + std::chrono::microseconds(ThreadPool::kPauseMicroseconds);
  const auto deadline = start + std::chrono::microseconds(spin);
  for (auto now = start; now < deadline; now = std::chrono::steady_clock::now()) {
    const bool yielding = now >= yield_from;
    for (int i = 0; i < 16; ++i) {  // a clock read per 16 polls
      if (done()) return true;
      if (yielding) sched_yield();
      else cpu_relax();
    }
  }
  return done();
}

}  // namespace

int64_t ThreadPool::spin_microseconds() { return spin_us.load(std::memory_order_relaxed); }

void ThreadPool::set_spin_microseconds(int64_t microseconds) {
  if (microseconds < 0 || microseconds > kMaxSpinMicroseconds)
    throw std::invalid_argument("pool spin must be in [0, " + std::to_string(kMaxSpinMicroseconds) +
                                "] microseconds, got " + std::to_string(microseconds));
  spin_us.store(microseconds, std::memory_order_relaxed);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    stopping_.store(true, std::memory_order_release);
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
  // No worker reads these now: the previous run returned only once every worker was done with it.
  fn_ = fn;
  context_ = context;
  num_items_ = num_items;
  next_item_.store(0, std::memory_order_relaxed);
  if (use_workers) {
    busy_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();  // no system call when every worker is spinning (no waiters)
  }
  drain(0);
  if (use_workers) await_workers();
}

void ThreadPool::await_workers() {
  const auto done = [this] { return busy_workers_.load(std::memory_order_acquire) == 0; };
  if (spin_until(done)) return;
  std::unique_lock<std::mutex> lock(state_mutex_);
  done_.wait(lock, done);
}

bool ThreadPool::await_job(uint64_t seen) {
  const auto posted = [&] {
    return stopping_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
  };
  if (!spin_until(posted)) {
    std::unique_lock<std::mutex> lock(state_mutex_);
    wake_.wait(lock, posted);
  }
  return !stopping_.load(std::memory_order_acquire);
}

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  while (await_job(seen)) {
    // One generation at a time: run() waits for every worker before it posts the next.
    seen = generation_.load(std::memory_order_acquire);
    drain(thread_index);
    if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Under the lock: a caller that found workers busy and is about to sleep checks under it too.
      std::lock_guard<std::mutex> lock(state_mutex_);
      done_.notify_one();
    }
  }
}

}  // namespace writescope
