// The paired kernel's line prefetcher (paired_kernel.h): the next tile's lines, asked for from
// inside the current tile's compute loops at the rate the loops take their steps. Included by each
// ISA translation unit, in an anonymous namespace (its code is compiled with each unit's ISA flags),
// and by the bindings, which run its schedule on a buffer of their own (simulate_prefetch).
#pragma once

#include <cstdint>

#ifndef WS_INLINE  // as attention_kernel.h defines it
#define WS_INLINE inline __attribute__((always_inline))
#endif

namespace writescope {
namespace {

// One link of the pacing chain: a multiply the compiler keeps and cannot overlap with the last.
WS_INLINE void hold(int64_t& chain) {
#if defined(__x86_64__)
  asm volatile("imul $3, %0, %0" : "+r"(chain));
#else
  chain = *static_cast<volatile int64_t*>(&chain) * 3;
#endif
}

// The lines of the paired kernel's tile kPrefetchTiles ahead, asked for lines_per_fire at a time
// every `period` steps of the compute loops: spread out, the requests stay in flight while the
// current tile computes, where a burst of hundreds at the tile's start would fill the miss buffers
// and stall the compute behind it. A step costs a decrement and a branch; the line bookkeeping runs
// only when lines are due (measured on a 2-vCPU Zen 3: a loop over lines_per_step lines at every
// step kept the score loop at 0.6x its rate without prefetching). The lines are spread over as
// many steps as the previous tile took, exactly: the period alternates between the two whole
// numbers around the exact one (a running remainder, as a line is drawn between pixels). Rounded
// down to one whole period, 512 lines over 384 steps (Qwen3-MoE's FMA loops: 256 score steps of one
// line, 128 value steps of two) went out two a step during the score steps and none during the
// value steps; measured on a 2-vCPU Xeon (AMX host, the avx512bf16 variant forced), 8K from DRAM,
// interleaved: Qwen3-MoE 1.08x, Mixtral 1.03x, MHA 1.05x.
// Compute loops copy it into a local so its fields live in registers (a member is reloaded after
// every store the compiler cannot prove does not alias it).
struct LinePrefetcher {
  // At least this many lines a fire, so the bookkeeping of a fire (its period, the holds, the
  // range walk) is paid per four lines, not per line: one or two lines a step of the FMA loops made
  // it ~15% of their samples in cache. Measured on a 2-vCPU Xeon (AMX host, avx512bf16 forced),
  // interleaved: 1.02-1.03x with the KV in L3 (one thread), 1.03-1.08x at 8K from DRAM for
  // Qwen3-MoE, Mixtral and MHA; AVX2 1.01-1.02x; the tile products ask for 16 a step already.
  static constexpr int64_t kMinLinesPerFire = 4;
  const char* const* ranges = nullptr;  // K, V of each block
  const char* line = nullptr;           // the next line to ask for, in range `range`
  const char* range_end = nullptr;
  int64_t k_bytes = 0, v_bytes = 0, num_ranges = 0, range = 0;
  int64_t countdown = 1, period = 1, lines_per_fire = 1;
  // The exact period is whole_period + fraction / tile_lines steps; `remainder` carries the
  // fractions the whole periods so far left over.
  int64_t whole_period = 1, fraction = 0, tile_lines = 0, remainder = 0;
  int64_t steps = 0;  // steps during the tile, to pace the next tile's lines
  int64_t delay = 0;  // dependent multiplies a step: the loops' pace (pacing.h)
  int64_t chain = 1;  // what they multiply
  // The next tile's ranges are set; its total_lines are spread over as many steps as this tile took.
  void reset(int64_t total_lines, int64_t count) {
    const int64_t expected = steps > 0 ? steps : total_lines;
    const int64_t per_step = expected > 0 ? (total_lines + expected - 1) / expected : 1;
    lines_per_fire = per_step > kMinLinesPerFire ? per_step : kMinLinesPerFire;
    const int64_t fire_steps = expected * lines_per_fire;  // >= total_lines: a period is at least 1
    tile_lines = total_lines;
    whole_period = total_lines > 0 ? fire_steps / total_lines : fire_steps + 1;  // none: no fire in the tile
    fraction = total_lines > 0 ? fire_steps % total_lines : 0;
    remainder = 0;
    countdown = next_period();
    num_ranges = count;
    range = 0;
    line = count > 0 ? ranges[0] : nullptr;
    range_end = count > 0 ? line + k_bytes : nullptr;
    steps = 0;
  }
  // Steps to the next fire: the exact period rounded down, or up where the fractions left over
  // make a whole step.
  int64_t next_period() {
    period = whole_period;
    if (fraction != 0 && (remainder += fraction) >= tile_lines) remainder -= tile_lines, ++period;
    return period;
  }
  WS_INLINE void step() {
    ++steps;
    if (--countdown == 0) fire(lines_per_fire);
  }
  WS_INLINE void fire(int64_t lines) {
    for (int64_t i = delay * period; i > 0; --i) hold(chain);
    countdown = next_period();
    for (int64_t i = 0; i < lines && range < num_ranges; ++i) {
      __builtin_prefetch(line, 0, 2);
      line += 64;
      if (line >= range_end && ++range < num_ranges) {
        line = ranges[range];
        range_end = line + ((range & 1) ? v_bytes : k_bytes);
      }
    }
  }
  // Whatever the tile's steps left unasked, at its end.
  void finish() { fire(int64_t{1} << 40); }
};

}  // namespace
}  // namespace writescope
