// Small kernels that measure this machine's roofline with the same ISA as the attention kernel:
// a streaming read (memory bandwidth) and independent FMA chains (peak float32 FMA rate).
#pragma once

#include <cstdint>

namespace writescope {
namespace {

template <class S>
double read_sum(const float* data, int64_t count) {
  using V = typename S::V;
  constexpr int W = S::kWidth;
  V a0 = S::zero(), a1 = S::zero(), a2 = S::zero(), a3 = S::zero();
  int64_t i = 0;
  for (; i + 4 * W <= count; i += 4 * W) {
    a0 = S::add(a0, S::load(data + i));
    a1 = S::add(a1, S::load(data + i + W));
    a2 = S::add(a2, S::load(data + i + 2 * W));
    a3 = S::add(a3, S::load(data + i + 3 * W));
  }
  double total = S::reduce_add(S::add(S::add(a0, a1), S::add(a2, a3)));
  for (; i < count; ++i) total += data[i];
  return total;
}

// kChains independent accumulators hide the FMA latency (4-5 cycles x 2 pipes). The loops over them
// are unrolled by pragma: GCC 12 otherwise keeps the array in memory and stores every accumulator on
// every iteration, which a core with one 512-bit store a cycle and two FMA pipes would time as half
// its peak.
template <class S>
struct FmaBurst {
  static constexpr int kChains = S::kRegisters >= 32 ? 16 : 12;
  static constexpr int64_t kFlopsPerIteration = int64_t{2} * kChains * S::kWidth;

  static double run(int64_t iterations) {
    using V = typename S::V;
    volatile float seed = 1.0f;
    const V mul = S::set1(0.999999f * seed);
    const V add = S::set1(1e-7f * seed);
    V acc[kChains];
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = S::set1(seed + c);
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 32
      for (int c = 0; c < kChains; ++c) acc[c] = S::fma(acc[c], mul, add);
    }
    V total = S::zero();
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) total = S::add(total, acc[c]);
    return S::reduce_add(total);
  }
};

// The same with the bf16 dot product: each instruction is 2 multiply-adds per float lane.
template <class S>
struct DotBurst {
  static constexpr int kChains = 16;
  static constexpr int64_t kFlopsPerIteration = int64_t{4} * kChains * S::kWidth;

  static double run(int64_t iterations) {
    using V = typename S::V;
    volatile uint32_t seed = 0x3F803F80u;  // two bf16 1.0078125
    const typename S::Raw a = S::raw_set1(seed), b = S::raw_set1(seed ^ 0x00010001u);
    V acc[kChains];
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) acc[c] = S::set1(static_cast<float>(c));
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 32
      for (int c = 0; c < kChains; ++c) acc[c] = S::dot_bf16(acc[c], a, b);
    }
    V total = S::zero();
#pragma GCC unroll 32
    for (int c = 0; c < kChains; ++c) total = S::add(total, acc[c]);
    return S::reduce_add(total);
  }
};


}  // namespace
}  // namespace writescope
