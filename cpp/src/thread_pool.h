// A persistent pool of worker threads. The calling thread works too; items are claimed from an
// atomic counter so uneven items balance themselves. One job runs at a time.
//
// Between jobs a worker polls the job counter for spin_microseconds() before it sleeps on a
// condition variable, and the caller polls as long for the workers to finish: a decode step calls
// the pool several times a layer (projections, attention, experts) microseconds apart, and waking
// a sleeping thread costs a futex round trip, 20-40 us on a 2-vCPU KVM guest (a halted vCPU woken
// by an interrupt). The same spin-then-block scheme as OpenMP runtimes (KMP_BLOCKTIME,
// GOMP_SPINCOUNT). A process whose cores other busy processes share (Ray's workers on one node)
// sets it to 0: a polling thread there takes a core another process needs.
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

  // How long an idle worker, or a caller waiting for the workers, polls before it sleeps: process-
  // wide, read at every wait (WRITESCOPE_POOL_SPIN_US sets it at import).
  static constexpr int64_t kDefaultSpinMicroseconds = 200;
  static constexpr int64_t kMaxSpinMicroseconds = 1000000;
  static constexpr int64_t kPauseMicroseconds = 30;  // of the poll, the first without yielding the core
  static int64_t spin_microseconds();
  // Throws std::invalid_argument outside [0, kMaxSpinMicroseconds].
  static void set_spin_microseconds(int64_t microseconds);

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  const std::vector<int>& cpus() const { return cpus_; }

  // Calls fn(context, item, thread_index) for every item in [0, num_items); returns when all ran.
  // parallel = false runs them all on the caller: for a job smaller than waking the workers costs.
  void run(int64_t num_items, ItemFn fn, void* context, bool parallel = true);

 private:
  void worker_loop(int thread_index);
  void drain(int thread_index);
  // Waits until a job newer than `seen` is posted (true) or the pool stops (false).
  bool await_job(uint64_t seen);
  void await_workers();

  std::vector<std::thread> workers_;
  std::vector<int> cpus_;
  std::mutex job_mutex_;  // serialises callers
  std::mutex state_mutex_;
  std::condition_variable wake_;  // sleeping workers: a job was posted (or the pool stops)
  std::condition_variable done_;  // a sleeping caller: the last worker finished
  // Polled without state_mutex_. generation_ and stopping_ change under it, so a sleeping worker
  // cannot miss them; the last worker's decrement of busy_workers_ is followed by done_'s notify
  // under it, so a sleeping caller cannot either. generation_'s release store publishes the job's
  // fn_, context_ and num_items_.
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
  std::atomic<int> busy_workers_{0};
  ItemFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_item_{0};
};

}  // namespace writescope
