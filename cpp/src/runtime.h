// Process-wide state of the CPU kernels: the selected ISA variant, the persistent thread pool and
// the buffers reused across calls (per-thread workspaces, chunk partials).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "thread_pool.h"
#include "writescope/kernel_args.h"

namespace writescope {

struct Runtime {
  const IsaKernels* kernels = nullptr;
  // The variant's bf16 dot is faster per multiply-add than its float32 FMA on this CPU (measured when
  // the variant is selected): 2x on Zen 5, 0.5x on the Xeons seen, so it cannot be assumed.
  bool bf16_dot_faster = false;
  // The paired kernel's loops paced online to the memory rate (pacing.h); WRITESCOPE_CPU_PACING.
  bool pace_loops = true;
  std::unique_ptr<ThreadPool> pool;
  std::vector<std::vector<char>> workspaces;  // one per pool thread, grow-only
  std::vector<float> chunk_partials;          // grow-only
  std::mutex mutex;                           // one kernel call at a time per process
};

Runtime& runtime();

// Whether the selected variant's kernels round the probabilities of bf16 q and KV to bf16 before PV:
// the bf16 dot path (where it is the faster) and the AMX tiles do.
inline bool rounds_probabilities(const Runtime& rt) {
  return rt.bf16_dot_faster || (rt.kernels != nullptr && rt.kernels->tile_burst != nullptr);
}

// Variants this CPU can run, best first (e.g. {"avx512", "avx2", "scalar"}).
std::vector<std::string> available_variants();
// Selects a variant by name; throws std::invalid_argument naming the allowed ones.
void select_variant(const std::string& name);
// Applies WRITESCOPE_CPU_VARIANT, WRITESCOPE_NUM_THREADS, WRITESCOPE_POOL_SPIN_US and
// WRITESCOPE_CPU_PACING from the environment.
void init_runtime_from_env();
// Rebuilds the pool; cpus may be empty (no pinning).
void configure_threads(int num_threads, const std::vector<int>& cpus);

}  // namespace writescope
