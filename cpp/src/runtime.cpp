#include "runtime.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>

namespace writescope {
namespace {

struct Variant {
  const char* name;
  bool (*supported)();
  const IsaKernels& (*kernels)();
};

#if defined(__x86_64__)
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma");
}
bool has_avx512bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

// AMX needs the CPU's amx-tile and amx-bf16 (CPUID 7.0 EDX bits 24 and 22), the OS saving tile
// state (XCR0 bits 17-18) and this process's permission to use it (Linux ARCH_REQ_XCOMP_PERM).
bool has_amx() {
  static const bool available = [] {
    if (!has_avx512bf16()) return false;
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 22) & 1u)) return false;
    uint32_t xcr0_low, xcr0_high;
    __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    if ((xcr0_low & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif
bool always() { return true; }

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> variants{
#if defined(__x86_64__)
      {"amx", &has_amx, &amx_kernels},
      {"avx512bf16", &has_avx512bf16, &avx512bf16_kernels},
      {"avx512", &has_avx512, &avx512_kernels},
      {"avx2", &has_avx2, &avx2_kernels},
#endif
      {"scalar", &always, &scalar_kernels},
  };
  return variants;
}

int affinity_cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int count = CPU_COUNT(&set);
  return count > 0 ? count : 1;
}

}  // namespace

Runtime& runtime() {
  static Runtime instance;
  return instance;
}

std::vector<std::string> available_variants() {
  std::vector<std::string> names;
  for (const auto& v : all_variants())
    if (v.supported()) names.emplace_back(v.name);
  return names;
}

namespace {
// Multiply-adds per second of a burst on this thread, best of three ~1 ms runs.
double burst_rate(double (*burst)(int64_t), int64_t flops_per_iteration) {
  constexpr int64_t kIterations = 100000;
  double best = 0.0;
  for (int r = 0; r < 3; ++r) {
    const auto start = std::chrono::steady_clock::now();
    volatile double sink = burst(kIterations);
    (void)sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = static_cast<double>(kIterations * flops_per_iteration) / s;
    best = rate > best ? rate : best;
  }
  return best;
}

// The dot path must win clearly: a near tie would let noise pick different arithmetic per process.
constexpr double kDotMargin = 1.3;
bool dot_is_faster(const IsaKernels& k) {
  if (k.dot_burst == nullptr) return false;
  return burst_rate(k.dot_burst, k.dot_flops_per_iteration) >
         kDotMargin * burst_rate(k.fma_burst, k.fma_flops_per_iteration);
}
}  // namespace

void select_variant(const std::string& name) {
  for (const auto& v : all_variants()) {
    if (name == v.name && v.supported()) {
      const bool dot_faster = dot_is_faster(v.kernels());
      std::lock_guard<std::mutex> lock(runtime().mutex);
      runtime().kernels = &v.kernels();
      runtime().bf16_dot_faster = dot_faster;
      return;
    }
  }
  std::string allowed;
  for (const auto& n : available_variants()) allowed += (allowed.empty() ? "" : ", ") + n;
  throw std::invalid_argument("CPU variant '" + name + "' is not available on this CPU; allowed: " +
                              allowed);
}

void configure_threads(int num_threads, const std::vector<int>& cpus) {
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
  for (int cpu : cpus)
    if (cpu < 0 || cpu >= CPU_SETSIZE)
      throw std::invalid_argument("cpus: " + std::to_string(cpu) + " is not a valid CPU index");
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.pool.reset();
  rt.pool = std::make_unique<ThreadPool>(num_threads, cpus);
  rt.workspaces.assign(num_threads, {});
}

namespace {

// The integer in environment variable `name` (none when unset or empty); std::invalid_argument
// naming the variable and [low, high] when it is anything else.
std::optional<int64_t> env_integer(const char* name, int64_t low, int64_t high) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text, &end, 10);
  if (*end != '\0' || errno == ERANGE || parsed < low || parsed > high)
    throw std::invalid_argument(std::string(name) + " must be an integer in [" + std::to_string(low) + ", " +
                                std::to_string(high) + "], got '" + text + "'");
  return parsed;
}

}  // namespace

void init_runtime_from_env() {
  const char* variant = std::getenv("WRITESCOPE_CPU_VARIANT");
  select_variant(variant && *variant ? variant : available_variants().front());
  const auto threads = env_integer("WRITESCOPE_NUM_THREADS", 1, 4096);
  const auto spin = env_integer("WRITESCOPE_POOL_SPIN_US", 0, ThreadPool::kMaxSpinMicroseconds);
  if (spin) ThreadPool::set_spin_microseconds(*spin);
  const char* pacing = std::getenv("WRITESCOPE_CPU_PACING");
  if (pacing != nullptr && *pacing != '\0') {
    const std::string value = pacing;
    if (value != "auto" && value != "off")
      throw std::invalid_argument("WRITESCOPE_CPU_PACING must be 'auto' or 'off', got '" + value + "'");
    runtime().pace_loops = value == "auto";
  }
  configure_threads(threads ? static_cast<int>(*threads) : affinity_cpu_count(), {});
}

}  // namespace writescope
